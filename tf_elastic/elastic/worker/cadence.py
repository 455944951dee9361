"""How often the workers of a group agree (on stops, time-based commits, the straggler probe, the commits in
force everywhere).

An agreement is a collective of its own between two steps, where every worker waits for the slowest. Every
5 steps it cost a 2-worker job of 15 ms steps 4.7 % of its rate here (1.6 % at 4 workers of 33 ms steps,
`bench_input`'s pipeline), and in a job of hundreds of hosts it is one more barrier over all of them. So
where steps are quick the group agrees about every `seconds` instead of every `fewest` steps. No rank's
clock decides alone: the chief measures its own steps since the last agreement and adds the interval it
proposes to the agreement's sum (every other rank adds 0), so every rank learns the same next step.

A stop (SIGTERM) waits for the next agreement: about `seconds` at the pace last measured, longer if steps
then slow down. So the interval at most doubles from one agreement to the next (one window of quick steps,
after a round's start, does not make it jump), and never exceeds MOST_STEPS.
"""
import math
import time
from typing import Callable, Optional

# However quick the steps, the group agrees at least this often (in steps).
MOST_STEPS = 200


def steps_between(fewest: int, seconds: Optional[float], elapsed: float, steps: int) -> int:
    """Steps to the next agreement: `fewest`, or as many as take `seconds` at the pace of `steps` steps in
    `elapsed` seconds where that is more (at most twice `steps`, the last interval, and MOST_STEPS);
    `fewest` when nothing was measured."""
    if not seconds or steps <= 0 or elapsed <= 0:
        return fewest
    return max(fewest, min(MOST_STEPS, 2 * steps, math.floor(seconds * steps / elapsed)))


class AgreementCadence:
    """The next step at which this rank agrees with its group (the same on every rank)."""

    def __init__(self, fewest: int, seconds: Optional[float], proposes: bool,
                 clock: Callable[[], float] = time.monotonic):
        """`proposes`: this rank (the chief) measures the pace; `seconds` None: every `fewest` steps."""
        self.fewest, self.seconds, self.proposes, self.clock = fewest, seconds, proposes, clock
        self.start(0)

    def start(self, step: int) -> None:
        """The round trains from `step` (every rank alike): the first agreement is `fewest` steps on."""
        self.next = step + self.fewest
        self._since = (step, self.clock())

    def due(self, step: int) -> bool:
        return step >= self.next

    def proposal(self, step: int) -> float:
        """What this rank adds to the agreement's sum: the chief's interval to the next one (others: 0)."""
        if not self.proposes:
            return 0.0
        first, began = self._since
        return float(steps_between(self.fewest, self.seconds, self.clock() - began, step - first))

    def agreed(self, step: int, interval: float) -> None:
        """The group agreed at `step`, with `interval` (the sum of the proposals) to the next agreement."""
        self.next = step + max(self.fewest, int(interval))
        self._since = (step, self.clock())
