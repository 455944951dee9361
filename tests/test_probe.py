"""`tf_elastic/elastic/worker/probe.py`: the local pass every rank times, on the models users bring."""
import os
import threading
import time
from pathlib import Path

import keras
import numpy as np
import pytest

from tf_elastic.elastic.stragglers import ProbeSettings, StragglerRules
from tf_elastic.elastic.worker.probe import (INPUT_TIMING_SECONDS, PROBATION_READ_SECONDS, GroupProbe,
                                            _forward_and_backward, _taken, time_alone)
from tf_elastic.elastic.worker.world import PULSE, World


def _dict_model():
    image, tokens = keras.Input((8, 8, 1), name="image"), keras.Input((5,), dtype="int32", name="tokens")
    joined = keras.layers.Concatenate()([keras.layers.Flatten()(image),
                                         keras.layers.Flatten()(keras.layers.Embedding(20, 3)(tokens))])
    return keras.Model({"image": image, "tokens": tokens}, {"a": keras.layers.Dense(2)(joined),
                                                           "b": keras.layers.Dense(3)(joined)})


def _group_probe(strategy, model, world: World, every_seconds: float, seconds: float, batch: int = 4,
                 window: int = 2) -> GroupProbe:
    """`world`'s rank's probe (a window of `window` probes), its round begun at `batch` rows a replica."""
    settings = ProbeSettings(every_seconds=every_seconds, seconds=seconds, rules=StragglerRules(1.5, window),
                             min_workers=1)
    probe = GroupProbe(model, strategy, world, settings)
    probe.first_step(batch)
    return probe


def test_the_pass_runs_on_every_local_replica_for_dict_inputs_and_a_sequential_built_by_its_first_batch(
        two_cpu_strategy):
    with two_cpu_strategy.scope():
        sequential = keras.Sequential([keras.layers.Conv2D(4, 3), keras.layers.Flatten(), keras.layers.Dense(10)])
        sequential(np.zeros((2, 8, 8, 1), "float32"))
        # Masked tokens, all zeros: the pooled output is 0/0 (NaN); the next pass's input must not take it up.
        tokens = keras.Input((5,), dtype="int32")
        pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 3, mask_zero=True)(tokens))
        models = [_dict_model(), sequential, keras.Model(tokens, keras.layers.Dense(2)(pooled))]
    for model in models:
        probe = _forward_and_backward(model, two_cpu_strategy, 4)
        per_pass, loop, results = probe(0.01)
        assert len(results) == 2 and np.array_equal(results[0], results[1], equal_nan=True), results
        assert 0 < per_pass <= loop
        assert np.array_equal(probe(0.0)[2], results, equal_nan=True)  # a loop's passes are the same pass


def test_a_model_whose_inputs_are_unknown_is_not_probed(two_cpu_strategy):
    class Subclassed(keras.Model):
        def call(self, x):
            return x

    assert _forward_and_backward(Subclassed(), two_cpu_strategy, 4) is None


def test_the_group_probe_reads_the_groups_times_into_the_heartbeat(two_cpu_strategy):
    """Rank 1 of three probes; the summed slots say rank 1 is 3x the median twice (the window): its heartbeat
    says so, and that its host (alone) is worth evicting; a probe is due once `every_seconds` passed, and
    the next is put off by rank 0's 60 ms probe (halved while rank 1 is suspected, its own probe left out),
    then (rank 1 reported) by the slowest."""
    with two_cpu_strategy.scope():
        model = _dict_model()
    probe = _group_probe(two_cpu_strategy, model, World(rank=1, size=3, host_id="b"), every_seconds=0.01, seconds=0.01)
    assert probe.enabled and probe.slots() == [] and probe.round_seconds is not None
    probe.round_seconds = 1.0  # this test process is old: a round of a fresh worker's cost
    probe.last -= 1.0
    probe.after_agreement(True, [])  # the first probe traces the pass and times nothing
    assert not probe.pending and probe.slots() == []
    spent, traced = probe.take_spent()
    assert spent == 0.0 and traced > 0.0  # a round's fixed cost, apart from the cadence's
    try:
        for reported in (False, True):  # rank 1 is reported at the window's second probe
            probe.last -= 1.0
            assert probe.due() == 1.0
            probe.after_agreement(True, [])
            assert probe.pending
            mine = probe.slots()
            assert len(mine) == 21 and mine[1] == probe.seconds and mine[0] == mine[2] == 0 and mine[7] == 0.0
            assert 0 < mine[1] <= mine[10] == probe.duration  # timing-ok: a pass within its loop, in its slots
            assert mine[13] > 0 and mine[16] == mine[19] == 0.0  # a step time; no input read alone
            probe.after_agreement(False, [0.01, 0.03, 0.01, 1.0, mine[4], 3.0, 0.0, 0.0, 0.0, 0.06, mine[10], 0.005,
                                          0.2, mine[13], 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
            # The slowest probe of the others sets the pace, halved while rank 1 is suspected (short of its
            # window); once it is reported, its own probe paces too.
            basis, halved = (max(0.06, mine[10]), 1.0) if reported else (0.06, 2.0)
            stretch = min(10.0, max(1.0, basis / 0.01))
            assert probe.interval == pytest.approx(stretch * probe.settings.every_seconds / halved)
        assert PULSE.slow == 3.0 and PULSE.evict
        spent, traced = probe.take_spent()  # its own probes, and its waits for rank 0's 0.06 s
        assert spent >= 2 * 0.06 and traced == 0.0 and probe.take_spent() == (0.0, 0.0)
        assert (PULSE.median, PULSE.batch) == (0.01, 4)  # the group's median, for a host on probation
    finally:
        PULSE.slow, PULSE.evict, PULSE.median, PULSE.batch = 0.0, False, 0.0, 0


def _rank_0_of_three(strategy) -> GroupProbe:
    """Rank 0's probe in a group of three hosts (a, b, c): every 10 s, of 10 ms, a window of 3."""
    with strategy.scope():
        model = _dict_model()
    return _group_probe(strategy, model, World(rank=0, size=3, host_id="a"), every_seconds=10.0, seconds=0.01,
                        window=3)


def _read_group(probe: GroupProbe, seconds, waiting=(0.0, 0.0, 0.0), durations=None, step_seconds=(0.2, 0.2, 0.2),
                inputs=(0.0, 0.0, 0.0)) -> None:
    """The times of a group of three (hosts a, b, c) as they ride the agreement after a probe: each rank's
    probe `seconds`, its share of `waiting` for input, its probe's `durations` (default: `seconds`), its
    `step_seconds`, and its input read alone (`inputs`, seconds a step; 0: not read; each read 0.5 s)."""
    probe.pending = True
    probe.after_agreement(False, [*seconds, 1.0, 2.0, 3.0, *waiting, *(durations or seconds), *step_seconds, *inputs,
                                  *(0.5 if read else 0.0 for read in inputs)])


def test_a_host_on_probation_is_judged_against_the_median_of_the_windows_probes(two_cpu_strategy):
    """The heartbeat's group median is the median of the last window's probe medians (its own pass, on
    probation, is the median of a window of probes): one probe's swing does not move it. None until the
    round has had a window of probes (its agent keeps the last round's)."""
    probe = _rank_0_of_three(two_cpu_strategy)
    published = []
    try:
        for group in ([0.010, 0.011, 0.012], [0.006, 0.006, 0.007], [0.011, 0.012, 0.011], [0.012, 0.012, 0.013],
                      [0.0, 0.0, 0.0]):
            _read_group(probe, group)
            published.append(PULSE.median)
        # Medians 0.011, 0.006 (a swing), 0.011, 0.012; a round of probes that timed nothing leaves it.
        assert published == [0.0, 0.0, 0.011, 0.011, 0.011]
    finally:
        PULSE.slow, PULSE.evict, PULSE.median, PULSE.batch = 0.0, False, 0.0, 0


def test_a_host_on_probation_reads_its_input_against_the_groups_step_less_its_waits_for_input(two_cpu_strategy):
    """The heartbeat's group step is the median of the window's steps, each less the longest share of it a rank
    waited for its input: the pace no input held back, known at every probe whoever waited (a step all waited
    for is none). None until a window of them."""
    probe = _rank_0_of_three(two_cpu_strategy)
    published, PULSE.step_seconds = [], 0.0
    try:
        for step, waiting in ((1.0, (0.0, 0.6, 0.1)), (0.5, (0.0, 0.0, 0.0)), (2.0, (1.0, 0.0, 0.0)),
                              (0.8, (0.5, 0.2, 0.0))):
            _read_group(probe, [0.01] * 3, waiting=waiting, step_seconds=(step,) * 3)
            published.append(PULSE.step_seconds)
        assert published == [0.0, 0.0, 0.0, pytest.approx(0.4)]  # the median of 0.4, 0.5 and 0.4
    finally:
        PULSE.slow, PULSE.evict, PULSE.median, PULSE.batch, PULSE.input_slow, PULSE.step_seconds = (
            0.0, False, 0.0, 0, 0.0, 0.0)


def test_a_suspects_probes_are_hurried_at_most_4_intervals_in_16_by_its_compute_or_its_input(two_cpu_strategy):
    """Rank 1 reads 3x the median at every other probe (never a whole window): each such reading halves the
    next interval while the last 16 intervals hold fewer than 4 halved ones. A rank whose input the group waits
    for is hurried alike, within the same budget, until it is reported."""
    probe = _rank_0_of_three(two_cpu_strategy)
    intervals = []
    try:
        for n in range(48):
            _read_group(probe, [0.01, 0.03 if n % 2 == 0 else 0.01, 0.01], durations=[0.01] * 3)
            intervals.append(probe.interval)
        hurried = [interval == pytest.approx(5.0) for interval in intervals]
        assert set(intervals) == {5.0, 10.0} and hurried[0] and not hurried[1]
        assert max(sum(hurried[n:n + 16]) for n in range(len(hurried) - 15)) == 4 and sum(hurried) >= 10
        fresh = _rank_0_of_three(two_cpu_strategy)  # its budget unspent
        input_intervals = []
        for _ in range(4):  # rank 1's step waited 60 % of the time for its input; compute alike
            _read_group(fresh, [0.01] * 3, waiting=[0.0, 0.6, 0.0])
            input_intervals.append(fresh.interval)
        assert input_intervals == [5.0, 5.0, 10.0, 10.0]  # suspected at two probes, reported at the third
        assert fresh.input_watch.stragglers == {1: pytest.approx(2.5)}
    finally:
        PULSE.slow, PULSE.evict, PULSE.median, PULSE.batch, PULSE.input_slow = 0.0, False, 0.0, 0, 0.0


def test_the_rank_whose_input_the_group_waits_for_is_evicted_only_where_the_others_input_keeps_up(
        two_cpu_strategy, caplog):
    """Rank 0's step waited 0.6 s of each second for its own input (its feed says so), its compute the others':
    its slot carries the share, and after `window` probes it is a straggler by its input (2.5x), named once
    by the chief's log, not by compute. Only then, once a window of probes, do the others read their own input
    alone (rank 1 here; rank 0 does not: the group's pace is its input's): at 0.1 s a step against the
    group's 1 s, its host is worth evicting (without it a step takes the rest of the group's, 0.4 s); read
    again at 0.9 s a step (the others' input would hold the group back nearly as much), it is not; between
    reads the newest is weighed against each probe's share of waiting, and the host leaves once two probes
    in a row say so. Where the agent does not evict (`World.evicts_stragglers`), no input is read."""
    with two_cpu_strategy.scope():
        model = _dict_model()
    worlds = [World(rank=rank, size=3, host_id="abc"[rank], evicts_stragglers=True) for rank in (0, 1)]
    worlds.append(World(rank=2, size=3, host_id="c"))  # as rank 2, where evictions are off
    probes = [_group_probe(two_cpu_strategy, model, world, every_seconds=0.01, seconds=0.01, window=3)
              for world in worlds]
    reads = []
    for probe in probes:
        probe.round_seconds = 1.0  # this test process is old: a round of a fresh worker's cost
        probe.input_wait = lambda: 0.6 if probe.world.rank == 0 else 0.0
        probe.time_input = lambda seconds, rank=probe.world.rank: reads.append((rank, seconds)) or 0.05
        probe.after_agreement(True, [])  # traces the pass
    evicted = []
    try:
        with caplog.at_level("INFO", logger="absl"):
            for number, (others_read, share) in enumerate(((0, 0.6), (0, 0.6), (0, 0.6), (0.1, 0.6), (0, 0.6),
                                                            (0, 0.2), (0.9, 0.6)), start=1):
                for probe in probes:
                    probe._waits_since = time.monotonic() - 1.0
                    probe.after_agreement(True, [])
                    assert 0.5 < probe.slots()[6] <= 0.6 if probe.world.rank == 0 else probe.slots()[7] == 0.0
                    _read_group(probe, [0.01, 0.01, 0.01], waiting=(share, 0.0, 0.0), step_seconds=(1.0, 1.0, 1.0),
                                inputs=(0.0, others_read, others_read))
                    if probe.world.rank == 0:
                        evicted.append(PULSE.evict)
                        assert PULSE.slow == 0.0 and PULSE.input_slow == (
                            pytest.approx(1 / (1 - share)) if number >= 3 else 0.0)  # the straggler's newest slowness
        # Weighed at every probe by the newest read, and evicted at two worth it in a row: the read at probe 4 and
        # the same read against probe 5's share; at 6 rank 0 waited 20 % of a step only (still a straggler by its
        # window): without it a step would take 0.8 s; the read at 7 says the others' input takes 0.9 s a step.
        assert evicted == [False, False, False, False, True, False, False]
        # At probes 4 and 7, by rank 1; not by rank 2, whose agent does not evict.
        assert reads == [(1, INPUT_TIMING_SECONDS), (1, INPUT_TIMING_SECONDS)]
        named = [r.getMessage() for r in caplog.records if "waits for the input" in r.getMessage()]
        assert len(named) == 1 and named[0].startswith("the group waits for the input of rank 0 (60% "), named
        # Its verdicts are logged at each read and where they turn: probes 4 (a read), 6 (turned) and 7 (a read).
        said = [r.getMessage() for r in caplog.records if "its host is" in r.getMessage()]
        assert len(said) == 3 and "(at an earlier probe)" in said[1] and "is not worth" in said[1], said
    finally:
        PULSE.slow, PULSE.evict, PULSE.input_slow, PULSE.median, PULSE.step_seconds = 0.0, False, 0.0, 0.0, 0.0


def test_a_read_of_the_others_input_is_forgotten_once_another_host_is_slow_too(two_cpu_strategy):
    """Rank 0 (host a) is a straggler by its input from probe 3 and its host worth evicting by the read at 4
    and again at 5; from probe 5 rank 1 (host b) waits too, and is reported at 7: the read was made beside a
    alone (b's input read then kept up), so from there it is not weighed, and the host stays."""
    with two_cpu_strategy.scope():
        model = _dict_model()
    probe = _group_probe(two_cpu_strategy, model, World(rank=0, size=3, host_id="a", evicts_stragglers=True),
                         every_seconds=0.01, seconds=0.01, window=3)
    probe.round_seconds = 1.0
    probe.after_agreement(True, [])  # traces the pass
    evicted = []
    try:
        for number in range(1, 9):
            _read_group(probe, [0.01, 0.01, 0.01], waiting=(0.6, 0.6 if number >= 5 else 0.0, 0.0),
                        step_seconds=(1.0, 1.0, 1.0), inputs=(0.0, 0.1, 0.1) if number == 4 else (0.0,) * 3)
            evicted.append(PULSE.evict)
        assert evicted == [False, False, False, False, True, True, False, False]
    finally:
        PULSE.slow, PULSE.evict, PULSE.input_slow, PULSE.median, PULSE.step_seconds = 0.0, False, 0.0, 0.0, 0.0


def test_a_pass_longer_than_the_probes_seconds_puts_off_the_next_probe(two_cpu_strategy, caplog):
    """A model whose one pass takes far longer than `seconds`: its loop runs that one pass, the slot says how
    long, and the group's next probe is put off in proportion to the slowest's (the chief says so once)."""
    with two_cpu_strategy.scope():
        model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(2048), keras.layers.Dense(1024)])
    probe = _group_probe(two_cpu_strategy, model, World(rank=0, size=2, host_id="a"), every_seconds=0.5,
                         seconds=0.001, batch=256)
    probe.after_agreement(True, [])  # traces the pass
    probe.after_agreement(True, [])
    mine = probe.slots()
    assert mine[6] == probe.duration >= mine[0] > 0.005, mine  # timing-ok: the case's premise, one long pass
    # absl's own logger: a flags parse earlier in this process (tests/test_flags.py) sets it to WARNING.
    with caplog.at_level("INFO", logger="absl"):  # probes of 3 and 2 ms, as a pass of these 3 and 2x as long
        probe.after_agreement(False, [mine[0], mine[0], mine[2], mine[2], 0.0, 0.0, 0.003, 0.002, *[0.0] * 6])
    assert probe.interval == pytest.approx(1.5)  # 0.5 s stretched by the slower of the two (3x)
    probe.last = time.monotonic() - 1.25
    assert probe.due() == 0.0  # it would be at every_seconds, or at the quicker one's 2x
    said = [r.getMessage() for r in caplog.records if "straggler probes every" in r.getMessage()]
    assert len(said) == 1 and "put off in proportion (up to 10x" in said[0], said


def test_probes_keep_their_beat_however_late_an_agreement_comes(two_cpu_strategy):
    """A probe is due `interval` after the one before was due, not after it ran: the wait for an agreement (a
    second at a straggler's pace) does not add up over the window of probes a report takes. After a gap of
    half an interval, the beat starts again (no two probes closer than half an interval)."""
    with two_cpu_strategy.scope():
        model = _dict_model()
    probe = _group_probe(two_cpu_strategy, model, World(rank=0, size=2, host_id="a"), every_seconds=10.0,
                         seconds=0.001)
    due_at = probe.last = time.monotonic() - 10.7  # due 0.7 s ago
    probe.after_agreement(True, [])  # traces the pass
    assert probe.last == pytest.approx(due_at + 10.0)
    probe.last -= 15.5  # due 5.5 s ago (a commit's pause): no beat to keep
    began = time.monotonic()
    probe.after_agreement(True, [])
    assert probe.last >= began  # the beat starts at this probe


def test_a_host_on_probation_times_its_pass_alone_and_writes_it_down_each_time_it_is_asked(two_cpu_strategy,
                                                                                         tmp_path):
    """The seconds a pass takes at the group's batch go to the file the agent named (0: not measurable), and
    again, with the input's next read, once the agent took the last (removed the file)."""
    class Subclassed(keras.Model):
        def call(self, x):
            return x

    with two_cpu_strategy.scope():
        model = _dict_model()
    settings = ProbeSettings(seconds=0.01, rules=StragglerRules(1.5, 3))
    rows, written = [], []

    def time_input(seconds, rows_a_step, limit):  # a feed's input read alone (its own tests: test_*feed.py)
        rows.append((seconds, rows_a_step, limit))
        return 0.125 * len(rows)

    def asked_again(path):  # the agent takes the first timing and asks for a second, then no more
        written.append(Path(path).read_text())
        os.remove(path)
        return len(written) < 2

    seconds, read = time_alone(model, two_cpu_strategy, f"{tmp_path / 'slot-0'},4", settings, time_input,
                               asked_again)
    assert seconds > 0 and read == 0.25  # timing-ok: measured, and the feed's second read as it gave it
    assert rows == [(INPUT_TIMING_SECONDS, 8, PROBATION_READ_SECONDS)] * 2  # 4 rows on each of 2 replicas
    assert [text.split()[1] for text in written] == ["0.125", "0.25"] and written[1] == f"{seconds!r} 0.25"
    assert float(written[0].split()[0]) > 0  # timing-ok: the first timing measured too
    rows.clear()
    assert time_alone(Subclassed(), two_cpu_strategy, f"{tmp_path / 'slot-1'},4", settings, time_input,
                      lambda path: False) == (0.0, 0.125)
    assert (tmp_path / "slot-1").read_text() == "0.0 0.125" and sorted(p.name for p in tmp_path.iterdir()) == [
        "slot-1"]


def test_a_timing_on_probation_waits_until_the_agent_takes_the_last(tmp_path):
    """The worker's side of asking again: it waits while its result file is there, and goes on once it is
    gone (removed by the agent)."""
    path = tmp_path / "slot-0.seconds"
    path.touch()
    began = time.monotonic()
    threading.Timer(0.3, path.unlink).start()
    assert _taken(str(path), poll=0.01) and time.monotonic() - began >= 0.3  # timing-ok: a timer's lower bound
