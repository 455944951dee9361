"""Stragglers: which worker is slow, and whether the group is better off without its host. Pure rules, no
TensorFlow: the worker feeds them its group's probes, and the agent acts on what they decide.

In synchronous training every rank's step takes as long as the slowest's, so step times say nothing. Every
rank instead times the same local forward and backward pass, with no collective, at the same step
(`worker/probe.py`); the group's agreement hands every rank every rank's probe, so every rank reaches the
same verdicts from the same numbers. The agreement also carries the share of the time each rank's step waited
for its own input (`input_slowness`).
A rank `factor` times slower than the median for `window` probes in a row is a straggler, and stays one
until it is back within the factor for `window` probes in a row (hysteresis): a slowdown must last `window`
probes, which come at half the interval (within a budget) once a rank is over the factor (`hurry`): at the
defaults 8 + 4 + 4 s, so a slowdown of 10-16 s can be reported, and evicted for. A slowdown
every rank shares (a slow store, a slow network) moves the median with it and makes no straggler. Eviction
(`worth_evicting`; by input, `worth_evicting_for_input`) weighs the group's throughput without the straggler's
host against its throughput with it over the next window, paying the measured cost of a round, and never goes
below `min_workers`; an evicted
host sits out a hold-off that doubles with each eviction (`hold_off`), so a host that keeps degrading does
not flap, and then rejoins only once its own pass, timed alone, is back within the factor of the group's
median, and its input read alone within the factor of the group's step (`back_within`; `agent/probation.py`).
"""
import dataclasses
import math
import statistics
from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class StragglerRules:
    """`factor`: how many times slower than the median a rank's probe must be; `window`: in how many probes
    in a row (and as many back within the factor to clear it)."""
    factor: float = 1.5
    window: int = 3

    def __post_init__(self):
        if not self.factor > 1.0:
            raise ValueError(f"--straggler_factor must be > 1; got {self.factor}")
        if self.window < 1:
            raise ValueError(f"--straggler_window must be >= 1; got {self.window}")


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """What the agent hands its workers (`Env.PROBE`): probe every `every_seconds` (0: never; further apart
    where a probe takes longer: `probe_interval`) for `seconds`;
    the straggler rules; and the group's `min_workers`, below which no host is evicted. Every 8 s: a
    slowdown's first probe comes within 8 s, and at the default window of three the two more that confirm
    it at half the interval (`hurry`), each a few of the straggler's slow steps late (it waits for an
    agreement): reported after 8.9-17.8 s in nine runs of `bench_straggler` (at whole intervals,
    22.4-34.1 s)."""
    every_seconds: float = 8.0
    seconds: float = 0.05
    rules: StragglerRules = StragglerRules()
    min_workers: int = 1

    def __post_init__(self):
        if not (0 <= self.every_seconds < math.inf and 0 < self.seconds < math.inf):
            raise ValueError(f"the probe's every_seconds (--probe_every_seconds) must be finite and >= 0, and its "
                             f"seconds (--probe_seconds) finite and > 0; got {self.every_seconds} and {self.seconds}")

    def to_text(self) -> str:
        return f"{self.every_seconds},{self.seconds},{self.rules.factor},{self.rules.window},{self.min_workers}"

    @classmethod
    def from_text(cls, text: Optional[str]) -> "ProbeSettings":
        if not text:
            return cls()
        every, seconds, factor, window, min_workers = text.split(",")
        return cls(float(every), float(seconds), StragglerRules(float(factor), int(window)), int(min_workers))


# Probes are put off at most this many times `every_seconds`: an outlier of a probe time cannot stop them.
LONGEST_PROBE_STRETCH = 10.0


def probe_interval(settings: ProbeSettings, durations: Sequence[float], suspects: Collection[int] = ()) -> float:
    """Seconds from one probe to the next: `every_seconds`, stretched where the group's probes take longer
    than `seconds` (a pass longer than it, a CPU quota's period and a half), so that they keep to
    `seconds / every_seconds` of its time (up to `LONGEST_PROBE_STRETCH`): on a large model the reports come
    later and the cost stays put. By the slowest probe (the group waits for each, at every probe: a worker
    under a quota, within the factor, timed 150-240 ms against the others' 50 ms, and cost the group 3.2 %
    of its time at 8 s) of the ranks not `suspects` (`StragglerWatch.suspects`): a slowdown's long probes do
    not put its report off, in a group of two either; reported, the straggler paces them, and only its
    recovery, and another rank's report, come later. A rank's outlier reads over the factor with its long
    probe and moves nothing. Halved while a suspect's window is confirmed (`hurry`)."""
    measured = [d for d in durations if d > 0]
    if not measured:
        return settings.every_seconds
    paced = [d for rank, d in enumerate(durations) if d > 0 and rank not in suspects]
    stretch = max(paced, default=statistics.median_low(measured)) / settings.seconds
    return settings.every_seconds * min(LONGEST_PROBE_STRETCH, max(1.0, stretch))


# At most this many of the last HURRY_HISTORY probe intervals are halved (`hurry`).
HURRIED_AT_MOST, HURRY_HISTORY = 4, 16


def hurry(suspected: bool, hurried_before: Sequence[bool]) -> bool:
    """Whether the next probe comes at half `probe_interval`: a rank is suspected (`StragglerWatch.suspects`:
    over the factor, its window not yet whole), and fewer than HURRIED_AT_MOST of the last HURRY_HISTORY
    intervals were halved. Each probe waits for an agreement, which at a straggler's pace comes only every
    few of its slow steps (seconds): a window of whole 8 s intervals took up to 34 s to report in
    `bench_straggler`. Noise makes suspects too (on 2 shared cores one rank of four read over the factor
    every third probe or so, and at hundreds of ranks some rank may read over it at most probes): the budget
    keeps the probes to 8/7 of the cadence's number, and a real slowdown is confirmed at half the interval
    unless noise spent the budget just before it. A hurried probe costs its suspect's probe time (a suspect
    does not pace the probes: `probe_interval`): 0.76-1.09 % of the training time before the slowdown in
    five runs, where whole intervals cost 0.65 % in one. By either cause's suspects: at whole intervals
    an input straggler was reported after 16.6-33.1 s; an input whose share of waiting hovers at the factor
    spends the budget as compute noise does, and costs no more than it."""
    return suspected and sum(list(hurried_before)[-HURRY_HISTORY:]) < HURRIED_AT_MOST


def input_slowness(waiting: Sequence[float]) -> List[float]:
    """Each rank's share of the time its step waited for its own input (0 to 1), as how many times faster
    the group would go if that input kept up, 1 / (1 - share): what `StragglerWatch(baseline=min)` judges
    for the input cause, against the rank that waited least (in a synchronous group one input does the
    waiting and the others wait in the collective, so the median of two would halve it; a slow store every
    rank waits for makes no straggler). The slowest input does all the waiting, however little slower it
    is, and how much faster the others' input could go is hidden behind the group's pace: its eviction is
    weighed by their input read alone (`worth_evicting_for_input`)."""
    return [1.0 / max(1e-3, 1.0 - min(1.0, max(0.0, share))) for share in waiting]


def slowness(seconds: Sequence[float], baseline: Callable[[List[float]], float] = statistics.median) -> List[float]:
    """Each rank's probe time over the median rank's (1.0: as fast as the median; or over another
    `baseline` of them). Ranks that did not probe (0 or less) count as 1.0 and do not move the baseline."""
    measured = [s for s in seconds if s > 0]
    if not measured:
        return [1.0] * len(seconds)
    base = baseline(measured)
    return [s / base if s > 0 else 1.0 for s in seconds]


class StragglerWatch:
    """The ranks that are stragglers now, from one probe round after another (`observe`)."""

    def __init__(self, rules: StragglerRules, baseline: Callable[[List[float]], float] = statistics.median):
        self.rules, self.baseline = rules, baseline  # what a rank's slowness is judged against
        self.stragglers: Dict[int, float] = {}  # rank -> its slowness at the newest probe
        self._streak: Dict[int, int] = {}  # rank -> probes in a row on the other side of the factor

    @property
    def suspects(self) -> List[int]:
        """The ranks not reported that are over the factor at the newest probes, short of a whole window."""
        return [rank for rank, streak in self._streak.items() if streak and rank not in self.stragglers]

    def observe(self, seconds: Sequence[float]) -> Tuple[List[int], List[int]]:
        """One probe of every rank (seconds, by rank); returns the ranks that became stragglers and those that
        recovered at this probe."""
        began, ended = [], []
        for rank, slow in enumerate(slowness(seconds, self.baseline)):
            flagged = rank in self.stragglers
            crossing = (slow < self.rules.factor) if flagged else (slow >= self.rules.factor)
            self._streak[rank] = self._streak.get(rank, 0) + 1 if crossing else 0
            if flagged:
                self.stragglers[rank] = slow
            if self._streak[rank] >= self.rules.window:
                self._streak[rank] = 0
                if flagged:
                    del self.stragglers[rank]
                    ended.append(rank)
                else:
                    self.stragglers[rank] = slow
                    began.append(rank)
        return began, ended


def worth_evicting(seconds: Sequence[float], leaving: Collection[int], window_seconds: float,
                   round_seconds: float, min_workers: int) -> bool:
    """Whether the group trains more over the next `window_seconds` without the ranks `leaving` (a
    straggler's host) than with them, by their compute. A synchronous step goes at the slowest rank's pace:
    with them at the slowest probe's (`seconds`), without at the slowest of the rest's."""
    staying = [s for rank, s in enumerate(seconds) if rank not in leaving]
    if not all(s > 0 for s in seconds):
        return False
    return _trains_more(len(seconds), len(staying), max(seconds), max(staying, default=0.0), window_seconds,
                        round_seconds, min_workers)


def worth_evicting_for_input(step_seconds: float, waiting: Sequence[float], input_seconds: Sequence[float],
                             leaving: Collection[int], window_seconds: float, round_seconds: float,
                             min_workers: int) -> bool:
    """Whether the group trains more over the next `window_seconds` without the ranks `leaving` (an input
    straggler's host) than with them. With them a step takes `step_seconds`, of which the leaving ranks'
    steps waited the share `waiting` for their input (the others waited for them in the collective); without,
    the step less their wait beyond what every staying rank waited too (a new epoch's pipeline starting), or
    the slowest staying rank's input (`input_seconds`: seconds a step of its own input, read alone by a side
    pipeline while the others wait, `GroupProbe`), whichever is longer: the others' prefetch buffers are
    full, so how fast their input could go is known only from such a read. Never
    where a staying rank's input was not timed (0). Exact where a worker reads its share of each batch (a
    source): its rows a step, compute and input alike, scale as the batch is dealt. Where every worker reads
    the whole global batch (a user's tf.data pipeline), the staying input a step does not grow as the shares
    do, and this evicts later than it could, never where the group would lose."""
    staying = [s for rank, s in enumerate(input_seconds) if rank not in leaving]
    if not leaving or not all(s > 0 for s in staying) or step_seconds <= 0:
        return False
    shared = min(w for rank, w in enumerate(waiting) if rank not in leaving)
    rest = step_seconds * (1.0 - min(1.0, max(0.0, max(waiting[rank] for rank in leaving) - shared)))
    return _trains_more(len(input_seconds), len(staying), step_seconds, max([rest, *staying]), window_seconds,
                        round_seconds, min_workers)


def _trains_more(size: int, staying: int, with_them: float, without: float, window_seconds: float,
                 round_seconds: float, min_workers: int) -> bool:
    """Each rank adds its share of the global work to a step: with the ranks leaving, `size` shares a step of
    `with_them` seconds; without, `staying` shares a step of `without` seconds, after a round change costing
    `round_seconds`. Never below `min_workers`."""
    if staying < max(1, min_workers) or staying == size or with_them <= 0 or without <= 0:
        return False
    return staying / without * max(0.0, window_seconds - round_seconds) > size / with_them * window_seconds


def hold_off(evictions: int, first: float = 30.0, longest: float = 1800.0) -> float:
    """Seconds an evicted host waits before it may rejoin: `first`, doubled with each eviction before it."""
    return min(longest, first * 2.0 ** max(0, evictions - 1))


def back_within(seconds: Optional[float], median: Optional[float], factor: float) -> bool:
    """Whether a host on probation may rejoin: its own pass, timed alone (`seconds`), is within `factor` of
    the group's median probe, as a straggler clears (`StragglerWatch`). Never when `seconds` is infinite (the
    host could not time a pass within the limit a worker's start has); True when either is unknown: with
    nothing to judge by it rejoins, and the group's probes judge it again."""
    if seconds == math.inf:
        return False
    if not seconds or not median or seconds <= 0 or median <= 0:
        return True
    return seconds / median < factor
