"""A trace of spot capacity: when each host of a fixed pool is preempted (with or without a notice) and
when it comes back, for `launch.bench.bench_goodput` to replay.

A trace is generated from a seed, in real-world terms compressed by a stated factor (a 2-hour mean time
between preemptions at 30x is 4 minutes of trace), or read from a CSV. Every host is up at time 0; each
then alternates up (exponential, mean `3600 / preemptions_per_host_hour` s) and down (exponential, mean
`return_seconds`). A preemption comes with a notice with probability `notice_fraction`, `notice_seconds`
before it (GCE gives 30 s, AWS spot 2 minutes), never earlier than the host's return.

The CSV has a header and one row per event (real or already compressed seconds: its times are divided
by the same factor):

    time_s,host,event,notice_s
    300,1,preempt,120        # host 1 goes at 300 s; its notice came at 180 s
    900,1,return,            # host 1 (a new machine with an empty disk) is back at 900 s
    1200,0,preempt,0         # host 0 goes without a notice

`host` is 0..hosts-1; `event` is `preempt` or `return`; `notice_s` (preempt only; empty: 0) is the lead
time. A host is preempted only while up and returns only while down.
"""
import csv
import dataclasses
import math
import random
from pathlib import Path
from typing import Dict, List, Optional, Tuple

PREEMPT, RETURN = "preempt", "return"
NOTICE = "notice"  # an action, not a trace event: the warning before a preemption
COLUMNS = ("time_s", "host", "event", "notice_s")


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    time: float  # trace seconds (compressed) from the job's first training step at full size
    host: int
    kind: str  # PREEMPT or RETURN
    notice: float = 0.0  # PREEMPT: seconds of warning before it (0: none)


@dataclasses.dataclass(frozen=True)
class Trace:
    hosts: int  # the full size: every host is up at time 0
    events: Tuple[TraceEvent, ...]  # by time

    def actions(self) -> List[Tuple[float, int, str]]:
        """What a replay does, by time: (time, host, NOTICE | PREEMPT | RETURN); a notice before its preemption."""
        actions = [(e.time - e.notice, e.host, NOTICE) for e in self.events if e.kind == PREEMPT and e.notice > 0]
        actions += [(e.time, e.host, e.kind) for e in self.events]
        return sorted(actions, key=lambda a: (a[0], a[2] != NOTICE))

    def capacity(self) -> List[Tuple[float, int]]:
        """Hosts up as a step function: (from time, hosts up), starting with (0, hosts)."""
        steps, up = [(0.0, self.hosts)], self.hosts
        for event in self.events:
            up += -1 if event.kind == PREEMPT else 1
            steps.append((event.time, up))
        return steps

    def integral(self, rates: Dict[int, float], begin: float, end: float) -> float:
        """The integral of `rates[hosts up]` from trace time `begin` to `end` (rates {k: k}: host-seconds)."""
        steps = self.capacity() + [(math.inf, self.hosts)]
        return sum(rates.get(up, 0.0) * max(0.0, min(end, t1) - max(begin, t0))
                   for (t0, up), (t1, _) in zip(steps, steps[1:]))

    def host_seconds(self, begin: float, end: float) -> float:
        """Host-seconds the trace offers between trace times `begin` and `end`."""
        return self.integral({up: float(up) for up in range(self.hosts + 1)}, begin, end)

    def ideal_samples(self, rates: Dict[int, float], end: float) -> float:
        """Samples the ideal has trained by trace time `end` (see `ideal_time`)."""
        return self.integral(fastest(rates), 0.0, end)

    def ideal_time(self, rates: Dict[int, float], samples: float) -> float:
        """Trace seconds to train `samples` whenever k hosts are up at the fastest world they allow
        (`fastest(rates)`, from `rates[n]`: samples/s of n workers): the ideal, which uses the best of the hosts
        the moment they are up and loses nothing to start-up, recovery or redone steps; no method can do better
        on this trace with these rates."""
        if not rates.get(self.hosts):
            raise ValueError(f"rates must give a throughput > 0 at the full size {self.hosts}; got {rates}.")
        best = fastest(rates)
        steps = self.capacity() + [(math.inf, self.hosts)]
        for (t0, up), (t1, _) in zip(steps, steps[1:]):
            rate = best.get(up, 0.0)
            if rate and samples <= rate * (t1 - t0):
                return t0 + samples / rate
            samples -= rate * (t1 - t0)
        raise AssertionError("unreachable: every host is up after the last event")


def fastest(rates: Dict[int, float]) -> Dict[int, float]:
    """Samples/s with k hosts up, for each k measured or above: the fastest world of at most k workers
    (more workers are not always faster: on 2 cores, 3 beat 4)."""
    best, found = {}, 0.0
    for size in range(1, max(rates, default=0) + 1):
        found = max(found, rates.get(size, 0.0))
        best[size] = found
    return best


def committed(records: List[Dict], clock0: float, dataset_size: int) -> List[List[float]]:
    """(trace seconds, samples committed) from a run's chief's `commit` and `restore` records (in time order):
    at each commit, and at a restore of more than was announced: workers killed between their last commits and
    the agreement that announces them (as they end) leave those commits in force but never announced; the
    restore shows they survived (a point later than the commit's)."""
    points: List[List[float]] = []
    for record in records:
        samples = record["epoch"] * dataset_size + record["samples"]
        if record["event"] == "commit" or samples > max((p[1] for p in points), default=0):
            points.append([record["time"] - clock0, samples])
    return points


def steady_rate(points: List[List[float]]) -> Optional[float]:
    """Samples/s between the first point (`committed`) past the first third of a run and its last (warm-up
    left out: the first steps trace and compile); None with fewer than three points there."""
    if not points:
        return None
    late = [p for p in points if p[0] >= points[-1][0] / 3]
    if len(late) < 3:
        return None
    return (late[-1][1] - late[0][1]) / (late[-1][0] - late[0][0])


def above_ideal(points: List[List[float]], trace: Trace, rates: Dict[int, float], slack: float,
                tolerance: float = 0.03) -> Optional[List[float]]:
    """The point (trace seconds, samples) at which a method's samples-committed curve is furthest above the
    ideal's, if any is beyond noise: more than `tolerance` of the ideal's samples and `slack` samples (a
    commit's worth: commits come in steps) above it. None when the curve stays under the bound."""
    worst, excess = None, 0.0
    for at, samples in points:
        over = samples - trace.ideal_samples(rates, at) * (1 + tolerance) - slack
        if over > excess:
            worst, excess = [at, samples], over
    return worst


def generate(seed: int, hosts: int, preemptions_per_host_hour: float, notice_fraction: float, notice_seconds: float,
             return_seconds: float, compression: float, horizon: float) -> Trace:
    """A random trace of `hosts` hosts whose preemptions start before `horizon` trace seconds (each is
    followed by its host's return, which may come later): real-world rates and delays, compressed."""
    _require("hosts", hosts, 1, integer=True)
    _require("preemptions_per_host_hour", preemptions_per_host_hour, 0.0)
    _require("notice_fraction", notice_fraction, 0.0, 1.0)
    for name, value in (("notice_seconds", notice_seconds), ("return_seconds", return_seconds),
                        ("compression", compression), ("horizon", horizon)):
        _require(name, value, 0.0, open_low=name != "notice_seconds")
    rng = random.Random(seed)
    events = []
    for host in range(hosts):
        up_since, time = 0.0, 0.0
        while preemptions_per_host_hour > 0:
            time += rng.expovariate(preemptions_per_host_hour / 3600.0) / compression
            if time >= horizon:
                break
            notice = min(notice_seconds / compression, time - up_since) if rng.random() < notice_fraction else 0.0
            events.append(TraceEvent(time, host, PREEMPT, notice))
            time += rng.expovariate(1.0 / return_seconds) / compression
            events.append(TraceEvent(time, host, RETURN))
            up_since = time
    return Trace(hosts, tuple(sorted(events, key=lambda e: (e.time, e.host))))


def read_csv(path: Path, hosts: int, compression: float) -> Trace:
    """The trace in `path` (the module docstring's columns), its times divided by `compression`."""
    _require("hosts", hosts, 1, integer=True)
    _require("compression", compression, 0.0, open_low=True)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and set(COLUMNS) - set(rows[0]):
        raise ValueError(f"--trace_csv {path}: the header must name the columns {', '.join(COLUMNS)}; "
                         f"got {', '.join(rows[0])}.")
    events = [_event(path, number, row, hosts, compression) for number, row in enumerate(rows, start=2)]
    events.sort(key=lambda e: (e.time, e.host))
    _check_sequence(path, hosts, events)
    return Trace(hosts, tuple(events))


def write_csv(trace: Trace, path: Path, compression: float) -> None:
    """`trace` as a CSV that `read_csv(path, trace.hosts, compression)` reads back (times in real seconds)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(COLUMNS)
        for e in trace.events:
            out.writerow([repr(e.time * compression), e.host, e.kind,
                          repr(e.notice * compression) if e.kind == PREEMPT else ""])


def _event(path: Path, number: int, row: dict, hosts: int, compression: float) -> TraceEvent:
    where = f"--trace_csv {path} line {number}"
    try:
        time, host = float(row["time_s"]), int(row["host"])
        notice = float(row["notice_s"] or 0.0)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: time_s and notice_s must be numbers, host a whole number; got {row}.") from None
    if not (math.isfinite(time) and time >= 0 and math.isfinite(notice) and notice >= 0):
        raise ValueError(f"{where}: time_s and notice_s must be finite and >= 0; got {time}, {notice}.")
    if not 0 <= host < hosts:
        raise ValueError(f"{where}: host must be in 0..{hosts - 1} (--hosts={hosts}); got {host}.")
    if row["event"] not in (PREEMPT, RETURN):
        raise ValueError(f"{where}: event must be {PREEMPT} or {RETURN}; got {row['event']!r}.")
    if row["event"] == RETURN and notice:
        raise ValueError(f"{where}: a return has no notice_s; got {notice}.")
    return TraceEvent(time / compression, host, row["event"], notice / compression)


def _check_sequence(path: Path, hosts: int, events: List[TraceEvent]) -> None:
    """Each host alternates preempt and return, starting up; a notice comes after the host's return."""
    up_since: List[Optional[float]] = [0.0] * hosts  # None: down
    for e in events:
        since = up_since[e.host]
        if e.kind == PREEMPT and since is None or e.kind == RETURN and since is not None:
            raise ValueError(f"--trace_csv {path}: host {e.host} has a {e.kind} at {e.time:g} s while "
                             f"{'down' if since is None else 'up'}: each host alternates preempt and return, from up.")
        if e.kind == PREEMPT and e.time - e.notice < since:
            raise ValueError(f"--trace_csv {path}: host {e.host}'s notice before its preemption at {e.time:g} s "
                             f"would come before the host was up (at {since:g} s); shorten notice_s.")
        up_since[e.host] = None if e.kind == PREEMPT else e.time


def _require(name: str, value, low: float, high: float = math.inf, open_low: bool = False,
             integer: bool = False) -> None:
    """A one-line error naming the argument unless `low <= value <= high` (`low < value` if `open_low`)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = number and (value > low if open_low else value >= low) and value <= high
    if not ok or integer and not isinstance(value, int):
        kind = "a whole number" if integer else "a finite number"
        bounds = f"{'>' if open_low else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
        raise ValueError(f"{name} must be {kind} {bounds}; got {value!r}.")
