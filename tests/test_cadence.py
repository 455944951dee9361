"""When a group agrees: every `fewest` steps, or about every `seconds` where steps are quicker, the same step on
every rank (the chief's proposal is the only one in the sum)."""
import pytest

from tf_elastic import elastic
from tf_elastic.elastic.worker.cadence import MOST_STEPS, AgreementCadence, steps_between
from tf_elastic.elastic.worker.errors import ConfigurationError


def test_quick_steps_space_agreements_by_time_and_slow_ones_by_steps():
    assert steps_between(5, 0.5, elapsed=0.3, steps=20) == 33  # 15 ms steps: about 0.5 s apart
    assert steps_between(5, 0.5, elapsed=2.0, steps=10) == 5  # 200 ms steps: every 5 steps, as before
    assert steps_between(5, 0.5, elapsed=0.001, steps=MOST_STEPS) == MOST_STEPS  # however quick, this often
    # At most twice the last interval: a stop waits for the next agreement, and one window of quick steps
    # (or a slowdown after it) must not stretch that wait at once.
    assert steps_between(5, 0.5, elapsed=0.075, steps=5) == 10
    assert [steps_between(5, 0.5, 0.015 * n, n) for n in (5, 10, 20)] == [10, 20, 33]
    # Nothing measured (no step since the last agreement, a clock that did not move), or no seconds: `fewest`.
    assert steps_between(5, 0.5, elapsed=1.0, steps=0) == 5
    assert steps_between(5, 0.5, elapsed=0.0, steps=10) == 5
    assert steps_between(5, None, elapsed=0.15, steps=10) == 5


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_every_rank_agrees_at_the_step_the_chiefs_proposal_names():
    clock = _Clock()
    chief, other = (AgreementCadence(5, 0.5, proposes, clock) for proposes in (True, False))
    for cadence in (chief, other):
        cadence.start(17)  # a restored round: the first agreement 5 steps on, whatever the multiples
    assert not chief.due(21) and chief.due(22) and other.due(22)
    clock.now += 0.075  # 5 steps of 15 ms
    total = chief.proposal(22) + other.proposal(22)  # the agreement's sum: the chief's alone
    assert (chief.proposal(22), other.proposal(22)) == (10.0, 0.0)  # twice the last interval, at most
    for cadence in (chief, other):
        cadence.agreed(22, total)
    assert chief.next == other.next == 32
    clock.now += 0.15  # 10 more steps of 15 ms
    chief.agreed(32, chief.proposal(32))
    assert chief.next == 32 + 20
    # Steps counted several at a time (steps_per_execution) agree at the first call past the step named.
    assert not chief.due(51) and chief.due(53)
    # A sum that names no interval (the chief proposes none: seconds None) keeps `fewest`.
    chief.agreed(53, 0.0)
    assert chief.next == 58


def test_a_sync_interval_that_is_not_positive_is_refused_naming_it():
    with pytest.raises(ConfigurationError, match=r"sync_every_seconds must be > 0 \(or None\); got 0"):
        elastic.FitConfig(sync_every_seconds=0)
    assert elastic.FitConfig(sync_every_seconds=None).sync_every_seconds is None
