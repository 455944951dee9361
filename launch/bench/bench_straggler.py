"""A straggler, for real: four hosts of one worker (`launch.train` on digits, loopback, one file store); one
host, its agent and its workers, is throttled from outside (`testing/throttle.py`: the cgroup cpu
controller, else a SIGSTOP/SIGCONT duty cycle) to a third of its fair share of the cores, later to 80 % of
it, then not at all. Three runs take turns: no action (no probes), report only, and `--evict_stragglers`;
and the 3- and 4-worker groups alone give the throughput to compare with.

    python -m launch.bench.bench_straggler --phase_seconds=40,90,60,40
    python -m launch.bench.bench_straggler --modes=evict --phase_seconds=60,240,240,60  # ten minutes: flapping?
    python -m launch.bench.bench_straggler --modes="report only" --host_quota  # every host in a container
    python -m launch.bench.bench_straggler --modes=evict --host_quota --quota_period_ms=20  # hosts apart

Prints, per run: steps/s in each phase (from the chief's commits), the group's steps/s from 60 s after the
slowdown to the slow phase's end (the target's window; the baselines leave their rounds' first 15 s out) over the
3-worker group's alone, time from the slowdown to the slowed host's first report (of either cause) and to the
first step of a round without the straggler, time from the mild phase (back within the factor) to its rejoin and
from the unthrottling to it ("in mild" where it rejoined before; none for slow reads), evictions in each phase,
and the evicted host's probations (its own pass timed after its hold-off and every `--probation_interval`: kept
out while slow, let in once back), and the `straggler` events of the slowed host by their cause (its compute, and
its input: the host's tf.data threads are throttled too) and of any other host. Targets (issue 41): report within
30 s; with eviction, >= 0.9x the 3-worker throughput within 60 s of the slowdown; rejoin within 60 s; no eviction
at the mild slowdown. `--host_quota` runs every host under a CPU quota of its fair share from the start (as a
container's limit would; the baselines too), the slowed host's lowered: there every worker's probe times a quota's
period and a half (the speed it keeps up), and the probes come that much further apart
(`stragglers.probe_interval`). With `--host_quota --quota_period_ms=20` the hosts emulate machines of their own:
when one leaves, the others get no more than their share (on shared cores they get more, and a host on probation
at 80 % of its share times its pass 1.67x slower than the three do, though 1.25x slower than it would in a group
of four), and a period and a half (30 ms) is shorter than a probe, so none is put off.

With `--slow_disk_kbps` the host's reads are slowed instead of its CPU: every host trains on its own copy of
the digits as TFRecords (`data`, relative to the host's directory, its agent's cwd), the slowed host's on a disk
of its own (`testing/slow_disk.py`: a loop device, root only), whose reads are capped at that rate in the slow
phase (a blkio cgroup; a thread keeps its files out of the page cache) and not from the mild phase on: a
straggler by its input, whose eviction is weighed by the others' input read alone. (With one copy for all,
the cache eviction of the slowed host's files made every host's reads miss the cache, as no cluster's do.)

    python -m launch.bench.bench_straggler --modes="report only,evict" --slow_disk_kbps=64
"""
import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from absl import app, flags

from tf_elastic.elastic.flag_checks import require_finite_floats
from tf_elastic.elastic.protocol import Event
from tf_elastic.testing import data_files, slow_disk
from tf_elastic.testing.local_job import LocalJob, stop_jobs_on_sigterm
from tf_elastic.testing.soak import TRAIN
from tf_elastic.testing.throttle import Throttle

PHASES = ("before", "slow", "mild", "after")
FLAGS = flags.FLAGS
flags.DEFINE_list("phase_seconds", ["40", "90", "60", "40"], "Seconds of each phase (a slow phase over 60 s for the "
                  "rate in the target's window, 60 s after the slowdown): before the slowdown, at a "
                  "third of the fair share, at 80 % of it, unthrottled.")
flags.DEFINE_integer("hosts", 4, "Hosts of one worker each.", lower_bound=3)
flags.DEFINE_float("cores", float(os.cpu_count() or 1), "Cores the hosts share (the fair share is cores / hosts).",
                   lower_bound=0.1)
flags.DEFINE_float("baseline_seconds", 45.0, "Seconds each of the 3- and 4-worker groups trains alone.",
                   lower_bound=10.0)
flags.DEFINE_string("root", None, "Where the runs' records go (default: a temporary directory).")
flags.DEFINE_list("modes", ["no action", "report only", "evict"], "The runs to make, in this order.")
flags.DEFINE_bool("host_quota", False, "Every host under a CPU quota of its fair share (cgroup only), the slowed "
                  "host's lowered; else only the slowed host's CPU is limited, while it is slowed.")
flags.DEFINE_integer("quota_period_ms", 100, "The CFS period of the bench's quotas (the kernel's default: 100). "
                     "With --host_quota, 20 emulates hosts that share no cores (the group of three gets no more "
                     "than its share when one leaves) whose probes are not put off (a period and a half is 30 ms, "
                     "shorter than --probe_seconds).", lower_bound=1, upper_bound=1000)
flags.DEFINE_integer("slow_disk_kbps", 0, "Slow the host's reads instead of its CPU: the data as TFRecords on a "
                     "disk of which the host's reads are capped at this many KB/s in the slow phase, and not from "
                     "the mild phase on (root only; 0: throttle its CPU).", lower_bound=0)
require_finite_floats(__name__)

MODES = {"no action": ["--probe_every_seconds=0"], "report only": [],
         "evict": ["--evict_stragglers", "--min_workers=2"]}
AGENT = ["--min_workers=1", "--last_call=1", "--straggler_hold_off=30"]
WARM_UP = 15.0  # seconds of a baseline's round that no rate counts: its first steps, and its first probe's trace
TARGET_SECONDS = 60.0  # issue 41: this long after the slowdown, an evicting group trains at >= 0.9x 3 alone


def steps_per_second(job: LocalJob, begin: float, end: float) -> Optional[float]:
    """The chief's committed steps per second between `begin` and `end`."""
    commits = [e for e in job.events(Event.COMMIT) if begin <= e["time"] <= end]
    if len(commits) < 2 or commits[-1]["time"] <= commits[0]["time"]:
        return None
    return (commits[-1]["step"] - commits[0]["step"]) / (commits[-1]["time"] - commits[0]["time"])


def _first(events: List[Dict], after: float) -> Optional[float]:
    later = [e["time"] - after for e in events if e["time"] >= after]
    return min(later) if later else None


def run_mode(root: Path, mode: str, seconds: List[float], hosts: int, cores: float,
             copies: Optional["DataCopies"] = None) -> Dict[str, object]:
    """One job through the four phases (`copies`: the slowed host's reads are capped, not its CPU); returns its
    figures."""
    names = [chr(ord("a") + i) for i in range(hosts)]
    root.mkdir(parents=True)
    job = LocalJob(root, [*_train_args(copies), "--epochs=100000"],
                   [*AGENT, f"--max_workers={hosts}", *MODES[mode]], trainer="launch.train")
    fair = cores / hosts
    with contextlib.ExitStack() as stack:
        throttle = _start_agents(job, names, fair, stack, copies)
        job.first_step_after(0, world_size=hosts, timeout=600)
        moments = [time.time()]
        for phase, cores_of_phase in zip(PHASES, (None, fair / 3, fair * 0.8, None)):
            if phase == "slow" and (copies or not FLAGS.host_quota):
                (copies.slow if copies else throttle).add(job.agents[_slowed()].pid)
            if phase != "before" and copies:
                copies.slow.limit(FLAGS.slow_disk_kbps * 1024 if phase == "slow" else None)
            elif phase != "before":
                throttle.set(fair if cores_of_phase is None and FLAGS.host_quota else cores_of_phase)
            time.sleep(seconds[PHASES.index(phase)])
            moments.append(time.time())
    evicted = job.events(Event.EVICTED)
    rates = {phase: steps_per_second(job, moments[i], moments[i + 1]) for i, phase in enumerate(PHASES)}
    slow_at, mild_at, after_at = moments[1:4]
    without = [e for e in job.events(Event.FIRST_STEP, rank=0) if e["world_size"] == hosts - 1]
    back = [e for e in job.events(Event.FIRST_STEP, rank=0) if e["world_size"] == hosts and e["time"] > slow_at]
    reports = job.events(Event.STRAGGLER)
    return {"mode": mode, "rates": rates, "report": _first([e for e in reports if e["host"] == _slowed()], slow_at),
            "reports": [(e["host"] == _slowed(), e["cause"]) for e in reports],
            "without": _first(without, slow_at), "rejoin": _first(back, mild_at),
            "back_in_mild": not copies and any(mild_at <= e["time"] < after_at for e in back),
            "rejoin_unthrottled": None if copies else _first(back, after_at),  # reads: uncapped from the mild
            "evictions": {phase: len([e for e in evicted if moments[i] <= e["time"] < moments[i + 1]])
                          for i, phase in enumerate(PHASES)},
            "probations": [e["back"] for e in job.events(Event.PROBATION)],
            "throttle": f"reads capped at {FLAGS.slow_disk_kbps} KB/s (blkio)" if copies else throttle.kind,
            "late_in_slow": steps_per_second(job, slow_at + TARGET_SECONDS, mild_at),
            "probe_cost": _probe_cost(job, moments[0], moments[-1])}


def _start_agents(job: LocalJob, names: List[str], fair: float, stack: contextlib.ExitStack,
                  copies: Optional["DataCopies"] = None) -> Throttle:
    """Starts every host's agent (with `copies`, in a directory where `data` is its own copy: the slowed
    host's, `_slowed`, on the slow disk; a baseline of three has none); with `--host_quota` each in a cgroup
    of its own at `fair` cores. Returns the last host's throttle (the one a run slows). Leaving `stack` ends
    the job before it lifts the throttles: a cgroup with processes in it cannot be removed."""
    period_us = FLAGS.quota_period_ms * 1000
    throttles = [stack.enter_context(Throttle(f"tf_elastic-bench-{os.getpid()}-{name}", period_us))
                 for name in (names if FLAGS.host_quota else names[-1:])]
    stack.callback(job.cleanup)
    for name, throttle in zip(names, throttles if FLAGS.host_quota else [None] * len(names)):
        job.start_agent(name, cwd=copies.host_dir(job.tmp, name, name == _slowed()) if copies else None)
        if throttle is not None:
            throttle.add(job.agents[name].pid)
            throttle.set(fair)
    return throttles[-1]


def _slowed() -> str:
    """The host a run slows: the last of `--hosts`."""
    return chr(ord("a") + FLAGS.hosts - 1)


def _probe_cost(job: LocalJob, began: float, ended: float) -> Optional[Tuple[float, float, float]]:
    """The probes' share of the chief's epoch time from `began` to `ended` (its `epoch_end` events say both):
    the timed probes' (the cadence's cost: the chief's own and its wait for the slowest rank's, what the group
    pays), with the tracing of the pass (once a round, the chief's: what a run of a few minutes a round pays
    more than one of hours), and the timed probes' share of the run's time (what its throughput loses: the
    epochs' time leaves out their commits and starts, a third of it here)."""
    ends = [e for e in job.events(Event.EPOCH_END) if began <= e["time"] < ended]
    spent, total = sum(e.get("probe_seconds", 0.0) for e in ends), sum(e["seconds"] for e in ends)
    traced = sum(e.get("probe_trace_seconds", 0.0) for e in ends)
    return (spent / total, (spent + traced) / total, spent / (ended - began)) if total else None


def _train_args(copies: Optional["DataCopies"]) -> List[str]:
    """`launch.train`'s: the digits in memory, or as TFRecords in each host's `data` (16 x 16, as in memory)."""
    if copies is None:
        return list(TRAIN)
    return ["--dataset=tfrecord:data", "--image_size=16", "--index_cache_dir=",
            *[arg for arg in TRAIN if not arg.startswith("--dataset=")]]


def baseline(root: Path, workers: int, seconds: float, copies: Optional["DataCopies"] = None) -> Optional[float]:
    root.mkdir(parents=True)
    job = LocalJob(root, [*_train_args(copies), "--epochs=100000"], [*AGENT, f"--max_workers={workers}"],
                   trainer="launch.train")
    with contextlib.ExitStack() as stack:
        names = [chr(ord("a") + host) for host in range(workers)]
        _start_agents(job, names, FLAGS.cores / FLAGS.hosts, stack, copies)
        began = job.first_step_after(0, world_size=workers, timeout=600)["time"] + WARM_UP
        time.sleep(max(0.0, began + seconds - time.time()))
        return steps_per_second(job, began, time.time())


def _text(value: Optional[float], unit: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def table(results: List[Dict[str, object]], alone: Dict[int, Optional[float]], hosts: int) -> str:
    three = alone.get(hosts - 1)
    lines = [f"3-worker alone: {_text(three)} steps/s; 4-worker alone: {_text(alone.get(hosts))} steps/s",
             "", "| run | " + " | ".join(f"{p} steps/s" for p in PHASES) + " | 60 s after the slowdown / 3 alone | "
             "report | round without | rejoin after mild | rejoin after unthrottled | "
             "evictions (before/slow/mild/after) | "
             "probations (kept out/let in) | probes' cost: of the epochs' time (with each round's trace); of the "
             "run's | "
             "reports of the slowed host by compute/input; of others |",
             "|---|" + "---:|" * 13]
    for r in results:
        rates, ev = r["rates"], r["evictions"]
        ratio = r["late_in_slow"] / three if r["late_in_slow"] and three else None
        cost = "-" if r["probe_cost"] is None else "{:.2f} % ({:.2f} %); {:.2f} %".format(
            *(100 * c for c in r["probe_cost"]))
        lines.append(f"| {r['mode']} | " + " | ".join(_text(rates[p]) for p in PHASES) + f" | {_text(ratio, 'x')} | "
                     f"{_text(r['report'], ' s')} | {_text(r['without'], ' s')} | {_text(r['rejoin'], ' s')} | "
                     f"{'in mild' if r['back_in_mild'] else _text(r['rejoin_unthrottled'], ' s')} | "
                     f"{ev['before']}/{ev['slow']}/{ev['mild']}/{ev['after']} | "
                     f"{r['probations'].count(False)}/{r['probations'].count(True)} | {cost} | "
                     f"{r['reports'].count((True, 'compute'))}/{r['reports'].count((True, 'input'))}; "
                     f"{sum(not slowed for slowed, _ in r['reports'])} |")
    lines.append(f"\nthrottled with: {results[0]['throttle'] if results else '-'}")
    return "\n".join(lines)


def main(argv: List[str]) -> None:
    del argv
    stop_jobs_on_sigterm()
    seconds = [float(s) for s in FLAGS.phase_seconds]
    if len(seconds) != 4 or min(seconds) <= 0:
        raise app.UsageError(f"--phase_seconds takes 4 positive numbers; got {FLAGS.phase_seconds}")
    unknown = [mode for mode in FLAGS.modes if mode not in MODES]
    if unknown or not FLAGS.modes or len(set(FLAGS.modes)) < len(FLAGS.modes):
        raise app.UsageError(f"--modes takes some of {', '.join(MODES)}, each once; got {','.join(FLAGS.modes)}")
    with Throttle(f"tf_elastic-bench-{os.getpid()}-check") as check:
        if FLAGS.host_quota and check.kind != "cgroup":
            raise app.UsageError("--host_quota needs a writable cgroup with the cpu controller")
    root = Path(FLAGS.root or tempfile.mkdtemp(prefix="bench_straggler-")).resolve()  # agents run elsewhere
    with contextlib.ExitStack() as stack:
        copies = stack.enter_context(_disk(root)) if FLAGS.slow_disk_kbps else None
        alone = {n: baseline(root / f"alone-{n}", n, FLAGS.baseline_seconds, copies)
                 for n in (FLAGS.hosts - 1, FLAGS.hosts)}
        results = [run_mode(root / mode.replace(" ", "-"), mode, seconds, FLAGS.hosts, FLAGS.cores, copies)
                   for mode in FLAGS.modes]
    print(table(results, alone, FLAGS.hosts), flush=True)


class DataCopies:
    """The digits as TFRecords twice: in `plain` (the hosts that are not slowed share it, as hosts would read
    the same files from their own disks: their page cache is never evicted) and on the `slow` disk."""

    def __init__(self, plain: Path, slow: slow_disk.SlowDisk):
        self.plain, self.slow = plain, slow

    def host_dir(self, job_dir: Path, host: str, slowed: bool) -> Path:
        """A directory for `host`'s agent to run in, where `data` is its copy."""
        path = job_dir / "cwd" / host
        path.mkdir(parents=True)
        (path / "data").symlink_to(self.slow.path / "tfrecord" if slowed else self.plain)
        return path


@contextlib.contextmanager
def _disk(root: Path):
    """The data's copies, one on the slow disk (or a one-line error where it cannot be made)."""
    why = slow_disk.available()
    if why:
        raise app.UsageError(f"--slow_disk_kbps needs a slow disk: {why}")
    with slow_disk.slow_disk(root / "disk") as disk:
        train, validation = data_files.digits()
        for data in (root / "plain", disk.path / "tfrecord"):
            data_files.write_tfrecords(data, "train", *train, shards=4)
            data_files.write_tfrecords(data, "validation", *validation, shards=2)
        yield DataCopies(root / "plain", disk)


if __name__ == "__main__":
    app.run(main)
