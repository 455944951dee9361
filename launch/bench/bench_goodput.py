"""Goodput on spot capacity: one preemption trace replayed against the elastic runtime and against a
fixed-size job that checkpoints and is requeued, beside the ideal.

    python -m launch.bench.bench_goodput                   # 4 hosts, seeds 0,1,2: ~50 minutes on 2 cores
    python -m launch.bench.bench_goodput --quick           # 2 hosts, one short run of each
    python -m launch.bench.bench_goodput --trace_csv=spot.csv --compression=1   # your own trace (preemption_trace.py)

For each trace (`launch/bench/preemption_trace.py`: generated from a seed, or a CSV), the same worker trains the
same samples three ways:

- elastic: an agent per host (`launch.elastic_run`, warm spares, file store, a run dir per host). A notice
  is SIGTERM to the host's agent (its preemption signal); the preemption itself SIGKILLs the agent, whose
  workers end at once (their heartbeat thread watches it). A host that comes back is a new machine: a new
  agent, host id and empty run dir; it receives the state from the group (the chief copies every commit to a
  shared `durable` directory for the case that no host is left).
- checkpoint-restart: the same worker at the trace's full size without the agent (`TF_CONFIG`, a shared
  run dir: what `BackupAndRestore` or `--cluster_resolver` users run). A notice is SIGTERM to that host's
  worker (the group commits and stops at its next agreed step, exit 3); a preemption kills every worker
  still running, as a scheduler ends a job that lost a node; once every host is back the job is relaunched
  (no queueing delay) and resumes from the last commit.
- ideal: the same samples at the capacity the trace offers, with no start-up, recovery or lost work: at each
  moment the fastest world the hosts up allow (more workers are not always faster), at the steady-state
  throughput measured first for each world size the way the methods train (a fixed-size run of each method,
  the same worker and commit cadence, its first third left out as warm-up; the faster of the two). It is an
  upper bound: the table flags a method whose samples-committed curve rises above it beyond noise.

The trace's clock starts at each job's first training step at full size (the elastic workers wait at a gate
until all hosts are in one round), so no method is ahead at time 0; what comes before is start-up that
every method pays once. The worker is the users' own path: a Keras script under `elastic.run` with
`elastic.fit`, a small MLP on scikit-learn's digits, a per-worker batch (the global batch follows the world:
the same samples, not the same steps) and a sleep of `--device_seconds` per step standing in for an
accelerator's compute, beside the real all-reduce: several workers on 2 cores then scale as on GPUs.
Unlike real hardware, the sleep uses no CPU and does not overlap with the all-reduce, the gradients are
tiny (the all-reduce costs little), and start-up, rendezvous and commit costs are real seconds while the
trace is compressed, so they weigh `--compression` times more than on a real cluster.

Time lost by cause is host-seconds from each host's start to its exit: `launch.report`'s time split of the
elastic run's event logs, and the same causes for the restart baseline from its segments (`_restart_split`),
plus the time hosts were up while the fixed-size job waited for the others.
"""
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from absl import app, flags

from launch import report
from launch.bench import preemption_trace
from launch.bench.preemption_trace import NOTICE, PREEMPT, RETURN, Trace
from tf_elastic.elastic.agent.ports import free_ports
from tf_elastic.elastic.events import read_events
from tf_elastic.elastic.flag_checks import require_finite_floats
from tf_elastic.elastic.protocol import Event
from tf_elastic.testing.local_job import REPO, repo_env

flags.DEFINE_list("seeds", ["0", "1", "2"], "Trace seeds (with --trace_csv: repeats of that trace).")
flags.DEFINE_integer("hosts", 4, "Hosts in the pool, one worker each: the trace's full size.", lower_bound=1)
flags.DEFINE_string("trace_csv", None, "Replay this trace instead of generated ones (columns: launch/"
                    "preemption_trace.py); its times are divided by --compression.")
flags.DEFINE_float("preemptions_per_host_hour", 0.5, "Generated traces: real-world preemptions per host-hour.",
                   lower_bound=0.0)
flags.DEFINE_float("notice_fraction", 0.5, "Generated traces: share of preemptions that come with a notice.",
                   lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_float("notice_seconds", 120.0, "Generated traces: real seconds of notice (AWS spot 120, GCE 30).",
                   lower_bound=0.0)
flags.DEFINE_float("return_seconds", 1800.0, "Generated traces: mean real seconds until a preempted host is back.",
                   lower_bound=1e-3)
flags.DEFINE_float("compression", 30.0, "Real seconds per trace second (1: the CSV is in trace seconds).",
                   lower_bound=1e-3)
flags.DEFINE_float("device_seconds", 0.2, "Seconds each worker sleeps per step: the accelerator's compute.",
                   lower_bound=0.0)
flags.DEFINE_integer("per_worker_batch", 16, "Examples per worker per step.", lower_bound=1)
flags.DEFINE_integer("epochs", 20, "Epochs of the 1536 digits every method trains.", lower_bound=1)
flags.DEFINE_integer("commit_every_steps", 20, "Workers commit every N steps (and at each epoch's end).",
                     lower_bound=1)
flags.DEFINE_integer("calibration_steps", 160, "Steps of each fixed-size run (one per method and world size) that "
                     "measures the steady-state throughput for the ideal.", lower_bound=10)
flags.DEFINE_float("max_seconds", 1800.0, "A run still training this long after its clock started is stopped and "
                   "reported as unfinished.", lower_bound=1.0)
flags.DEFINE_string("root", None, "Directory for the runs, results.json and goodput.png (default: a temp dir).")
flags.DEFINE_bool("quick", False, "2 hosts, 2 epochs, one seed, 30 calibration steps, a commit every 5 steps, "
                  "0.05 s of device time a step, "
                  "traces 4x more compressed (flags given explicitly win): checks the design, measures nothing "
                  "worth quoting.")
flags.DEFINE_enum("role", "bench", ["bench", "worker"], "worker: one training worker (internal).")
flags.DEFINE_string("worker_run_dir", None, "worker: its run dir without an agent (internal).")
flags.DEFINE_string("gate", None, "worker: wait for this file before training (internal).")
flags.DEFINE_string("checkpoint_dir", None, "worker: the durable copies (internal).")
FLAGS = flags.FLAGS
require_finite_floats(__name__)

DATASET_SIZE = 1536  # digits: a multiple of 16 x 1, 2, 3, 4 workers, so no epoch has a remainder at those sizes
QUICK = {"hosts": 2, "epochs": 2, "seeds": ["0"], "calibration_steps": 30, "commit_every_steps": 5,
         "device_seconds": 0.05}
ELASTIC, RESTART, IDEAL = "elastic", "checkpoint-restart", "ideal"
WAITING = "waiting for all hosts"
CAUSES = report.CAUSES + (WAITING,)
POLL = 0.2


# The worker: a user's own Keras script under elastic.run ---------------------------------------------------
def worker() -> None:
    """Trains the MLP with `elastic.fit`; each step sleeps `--device_seconds` before its real all-reduce."""
    from tf_elastic import elastic

    def prepare():
        import tensorflow as tf
        from sklearn.datasets import load_digits

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        digits = load_digits()
        return digits.images[:DATASET_SIZE, ..., None].astype("float32") / 16.0, digits.target[:DATASET_SIZE]

    def main(data):
        import keras

        class DeviceTime(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                time.sleep(FLAGS.device_seconds)

        while FLAGS.gate and not os.path.exists(FLAGS.gate):
            time.sleep(0.05)
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        config = elastic.FitConfig(commit_every_steps=FLAGS.commit_every_steps, durable_every_commits=1,
                                   checkpoint_dir=FLAGS.checkpoint_dir)
        elastic.fit(model, *data, per_replica_batch_size=FLAGS.per_worker_batch, epochs=FLAGS.epochs, verbose=0,
                    callbacks=[DeviceTime()], config=config)

    elastic.run(main, prepare=prepare, run_dir=FLAGS.worker_run_dir or "runs/train")


def worker_command(epochs: int, checkpoint_dir: Path, *extra: str) -> List[str]:
    return [sys.executable, "-m", "launch.bench.bench_goodput", "--role=worker",
            f"--device_seconds={FLAGS.device_seconds}",
            f"--per_worker_batch={FLAGS.per_worker_batch}", f"--epochs={epochs}",
            f"--commit_every_steps={FLAGS.commit_every_steps}", f"--checkpoint_dir={checkpoint_dir}", *extra]


def _wait(predicate: Callable[[], object], timeout: float, what: str, alive: Callable[[], bool]) -> object:
    deadline = time.time() + timeout
    while time.time() < deadline:
        result = predicate()
        if result:
            return result
        if not alive():
            raise RuntimeError(f"every process ended while waiting for {what}")
        time.sleep(POLL)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


# The methods: each replays notices, preemptions and returns on processes it started ---------------------
class ElasticMethod:
    """An agent per host; a returning host is a new machine (agent, host id, run dir)."""
    name = ELASTIC

    def __init__(self, root: Path, hosts: int, epochs: int):
        self.root, self.hosts, self.gate = root, hosts, root / "gate"
        root.mkdir(parents=True)
        self.command = worker_command(epochs, root / "durable", f"--gate={self.gate}")
        self.agents: Dict[int, subprocess.Popen] = {}
        self.run_dirs: List[Path] = []
        self.started: List[subprocess.Popen] = []

    def start(self) -> float:
        for host in range(self.hosts):
            self.back(host)
        alive = lambda: any(p.poll() is None for p in self.started)  # noqa: E731
        _wait(lambda: [e for e in self.events(Event.RENDEZVOUS) if e["world_size"] == self.hosts], 600,
              "a round of every host", alive)
        self.gate.touch()
        return _wait(lambda: [e["time"] for e in self.events(Event.FIRST_STEP)
                              if e["rank"] == 0 and e["world_size"] == self.hosts], 300, "a first step", alive)[0]

    def events(self, name: Event) -> List[Dict]:
        return [e for e in read_events(self.run_dirs) if e["event"] == name]

    def back(self, host: int) -> None:
        host_id = f"h{host}-{sum(d.name.startswith(f'h{host}-') for d in self.run_dirs)}"
        run_dir = self.root / "hosts" / host_id
        self.run_dirs.append(run_dir)
        args = [sys.executable, "-m", "launch.elastic_run", f"--rdzv=file://{self.root / 'rdzv'}", "--job_id=goodput",
                f"--run_dir={run_dir}", f"--host_id={host_id}", "--min_workers=1", f"--max_workers={self.hosts}",
                "--last_call=1", "--max_restarts=1000", "--echo_ranks=none", "--", *self.command]
        with open(self.root / f"agent-{host_id}.log", "ab") as log:
            self.agents[host] = subprocess.Popen(args, cwd=REPO, env=repo_env(), stdout=log, stderr=subprocess.STDOUT)
        self.started.append(self.agents[host])

    def notice(self, host: int) -> None:
        if self.agents[host].poll() is None:
            self.agents[host].send_signal(signal.SIGTERM)

    def preempt(self, host: int) -> None:
        if self.agents[host].poll() is None:
            self.agents[host].kill()
        self.agents[host].wait()

    def poll(self) -> None:
        pass

    def finished(self) -> Optional[float]:
        done = [e["time"] for e in self.events(Event.WORKER_EXIT) if e["rank"] == 0 and e["code"] == 0]
        return done[0] if done else None

    def close(self, kill: bool = False) -> None:
        """Waits for the agents to end (the job is done), killing what is left after a minute or at once."""
        for proc in self.started:
            try:
                proc.wait(timeout=0 if kill else 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def split(self, clock0: float, trace: Trace) -> Dict[str, float]:
        del clock0, trace
        total = dict.fromkeys(CAUSES + ("wall",), 0.0)
        for causes in report.time_split(self.run_dirs).values():
            for cause, seconds in causes.items():
                total[cause] += seconds
        return total


class RestartMethod:
    """The same worker at the full size without an agent: stopped by every preemption, relaunched from the
    last commit once every host is up."""
    name = RESTART

    def __init__(self, root: Path, hosts: int, epochs: int):
        self.root, self.hosts, self.run_dir = root, hosts, root / "run"
        self.command = worker_command(epochs, root / "durable", f"--worker_run_dir={self.run_dir}")
        self.up = [True] * hosts
        self.procs: List[subprocess.Popen] = []
        self.segments: List[Dict] = []  # launch, pids, stop, codes, graceful

    def start(self) -> float:
        self._launch()
        return _wait(lambda: self._first_step(self.segments[0]), 300, "a first step",
                     lambda: any(p.poll() is None for p in self.procs))["time"]

    def events(self, name: Event) -> List[Dict]:
        return [e for e in read_events(self.run_dir) if e["event"] == name]

    def _launch(self) -> None:
        cluster = [f"127.0.0.1:{port}" for port in free_ports(self.hosts)]
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.procs = []
        for rank in range(self.hosts):
            config = json.dumps({"cluster": {"worker": cluster}, "task": {"type": "worker", "index": rank}})
            with open(logs / f"launch-{len(self.segments)}-rank-{rank}.log", "ab") as log:
                self.procs.append(subprocess.Popen(self.command, cwd=REPO, env=repo_env(TF_CONFIG=config), stdout=log,
                                                   stderr=subprocess.STDOUT))
        self.segments.append({"launch": time.time(), "pids": [p.pid for p in self.procs]})

    def _first_step(self, segment: Dict) -> Optional[Dict]:
        firsts = [e for e in self.events(Event.FIRST_STEP) if e["pid"] == segment["pids"][0]]
        return firsts[0] if firsts else None

    def notice(self, host: int) -> None:
        """The job commits and stops; the host is draining: the job is not relaunched until it is back."""
        self.up[host] = False
        if self.procs and self.procs[host].poll() is None:
            self.procs[host].send_signal(signal.SIGTERM)

    def preempt(self, host: int) -> None:
        self.up[host] = False
        if self.procs:
            self._end()

    def back(self, host: int) -> None:
        self.up[host] = True
        self.poll()

    def poll(self) -> None:
        """Ends the job when a worker failed (a scheduler ends it all) or every worker ended; relaunches it
        once every host is up, unless it finished."""
        codes = [p.poll() for p in self.procs]
        if self.procs and (all(c is not None for c in codes) or any(c not in (None, 0, 3) for c in codes)):
            self._end()
        if not self.procs and all(self.up) and self.finished() is None:
            self._launch()

    def _end(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.segments[-1].update(stop=time.time(), codes=[p.returncode for p in self.procs])
        self.procs = []

    def finished(self) -> Optional[float]:
        if not self.segments or self.segments[-1].get("codes") != [0] * self.hosts:
            return None
        return [e["time"] for e in self.events(Event.WORKER_EXIT) if e["pid"] == self.segments[-1]["pids"][0]][0]

    def close(self, kill: bool = False) -> None:
        del kill  # its workers have ended when it finished; an interrupted run's are killed
        if self.procs:
            self._end()

    def split(self, clock0: float, trace: Trace) -> Dict[str, float]:
        return _restart_split(self, trace, clock0)


def _restart_split(method: RestartMethod, trace: Trace, clock0: float) -> Dict[str, float]:
    """Host-seconds by cause: each segment's start-up, training, commits and redone steps on every host
    (all are in the job), and the time hosts were up while the job waited for all of them."""
    total = dict.fromkeys(CAUSES + ("wall",), 0.0)
    commits = method.events(Event.COMMIT)
    restores = {e["pid"]: e["step"] for e in method.events(Event.RESTORE) if e["rank"] == 0}
    segments = method.segments
    for number, segment in enumerate(segments):
        first, stop = method._first_step(segment), segment["stop"]
        if first is None:
            total["start-up"] += method.hosts * (stop - segment["launch"])
            continue
        mine = [c for c in commits if c["pid"] == segment["pids"][0]]
        paid = sum(c.get("seconds", 0.0) for c in mine)
        following = segments[number + 1]["pids"][0] if number + 1 < len(segments) else None
        redone = 0.0
        if segment["codes"] != [0] * method.hosts and following in restores:
            # When the step the next launch resumed from was reached (at a commit's start), the rest was lost.
            reached = [c["time"] - c.get("everywhere_seconds", 0.0) for c in mine if c["step"] == restores[following]]
            redone = max(0.0, stop - (reached[0] if reached else first["time"]))
        for cause, seconds in (("start-up", first["time"] - segment["launch"]), ("redone after a failure", redone),
                               ("commits on the training path", paid),
                               ("training", stop - first["time"] - redone - paid)):
            total[cause] += method.hosts * seconds
    for stop, relaunch in zip([s["stop"] for s in segments], [s["launch"] for s in segments[1:]]):
        total[WAITING] += trace.host_seconds(stop - clock0, relaunch - clock0)
    total["wall"] = sum(total[c] for c in CAUSES)
    return total


# Replaying a trace and reading what a run did -------------------------------------------------------
def replay(method, trace: Trace, max_seconds: float) -> Dict:
    """Starts the method, then applies the trace's actions at their times from its first full-size step,
    until it finished (or ran `max_seconds`); returns what was replayed and when."""
    actions, applied = trace.actions(), []
    handlers = {NOTICE: method.notice, PREEMPT: method.preempt, RETURN: method.back}
    end = None
    try:
        clock0 = method.start()
        while method.finished() is None and time.time() - clock0 < max_seconds:
            while len(applied) < len(actions) and actions[len(applied)][0] <= time.time() - clock0:
                at, host, kind = actions[len(applied)]
                handlers[kind](host)
                applied.append({"time": at, "host": host, "action": kind, "late": time.time() - clock0 - at})
            method.poll()
            time.sleep(POLL)
        end = method.finished()
    finally:
        method.close(kill=end is None)
    return {"clock0": clock0, "end": end, "seconds": (end or time.time()) - clock0, "replayed": applied}


def progress(method, clock0: float) -> List[List[float]]:
    """(trace seconds, samples committed): `preemption_trace.committed`."""
    restores = [e for e in method.events(Event.RESTORE) if e["rank"] == 0]
    records = sorted(method.events(Event.COMMIT) + restores, key=lambda e: e["time"])
    return preemption_trace.committed(records, clock0, DATASET_SIZE)


def skipped(method) -> int:
    """Samples of epoch remainders the world size left out (per epoch, as its last round skipped them)."""
    last = {e["epoch"]: e["samples"] for e in method.events(Event.REMAINDER_SKIPPED) if e["rank"] == 0}
    return sum(last.values())


def calibrate(root: Path, hosts: int) -> Dict[str, Dict[int, float]]:
    """Steady-state samples/s at each world size 1..hosts, by method, from a fixed-size run of each (as it
    trains in a trace: the same worker, commit cadence and clock start), and the faster of the two as the
    ideal's."""
    rates = {ELASTIC: {}, RESTART: {}, IDEAL: {}}
    for size in range(1, hosts + 1):
        epochs = max(1, math.ceil(FLAGS.calibration_steps * FLAGS.per_worker_batch * size / DATASET_SIZE))
        for kind in (ElasticMethod, RestartMethod):
            method = kind(root / kind.name / f"size-{size}", size, epochs)
            run = replay(method, Trace(size, ()), FLAGS.max_seconds)
            # The commits not yet announced when training ends are announced as the workers end, after a
            # teardown that took 6.4 and 6.7 s beside the whole suite on 2 cores (0.05 s alone), not always at
            # one instant: their time is no step's pace, so the rate is taken over the commits announced by
            # the last epoch's end.
            ended = max((e["time"] - run["clock0"] for e in method.events(Event.EPOCH_END)), default=0.0)
            rate = preemption_trace.steady_rate([p for p in progress(method, run["clock0"]) if p[0] <= ended])
            if run["end"] is None or rate is None:
                raise RuntimeError(f"the {kind.name} calibration run of {size} workers did not finish with three "
                                   f"commits past its first third: {root}")
            rates[kind.name][size] = rate
        rates[IDEAL][size] = max(rates[ELASTIC][size], rates[RESTART][size])
    return rates


def run_trace(root: Path, trace: Trace, rates: Dict[int, float]) -> Dict:
    """The trace against each method; the same target samples for all three (`rates`: the ideal's)."""
    target = FLAGS.epochs * DATASET_SIZE
    slack = FLAGS.commit_every_steps * FLAGS.per_worker_batch * trace.hosts
    result = {"trace": [e.__dict__ for e in trace.events], "target": target,
              IDEAL: {"seconds": trace.ideal_time(rates, target), "samples": target, "finished": True}}
    for kind in (ElasticMethod, RestartMethod):
        method = kind(root / kind.name, trace.hosts, FLAGS.epochs)
        run = replay(method, trace, FLAGS.max_seconds)
        points = progress(method, run["clock0"])
        result[kind.name] = dict(run, samples=target - skipped(method), finished=run["end"] is not None,
                                 split=method.split(run["clock0"], trace), progress=points,
                                 above_ideal=preemption_trace.above_ideal(points, trace, rates, slack))
        print(f"  {kind.name}: {run['seconds']:.1f}s{'' if run['end'] else ' (unfinished)'}, "
              f"{len(run['replayed'])} trace actions replayed", flush=True)
    for name in (ELASTIC, RESTART, IDEAL):
        result[name]["goodput"] = (result[name]["samples"] / result[name]["seconds"]) / (
            target / result[IDEAL]["seconds"])
    return result


def _interval(values: Sequence[float], form: str = "{:.1f}") -> str:
    """Mean ± the half-width of a 95% t-interval over the seeds."""
    if len(values) < 2:
        return form.format(values[0])
    from scipy import stats

    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{form.format(statistics.mean(values))} ± {form.format(half)}"


def summary_table(results: List[Dict]) -> str:
    lines = ["| method | finished | time to train, s | goodput (of ideal) | speed-up over checkpoint-restart | "
             "runs above the ideal | " + " | ".join(f"{c} %" for c in CAUSES) + " |",
             "|---|---:|---:|---:|---:|---:|" + "---:|" * len(CAUSES)]
    for name in (ELASTIC, RESTART, IDEAL):
        runs = [r[name] for r in results]
        speedup = _interval([r[RESTART]["seconds"] / r[name]["seconds"] for r in results], "{:.2f}")
        shares = [" | ".join(_interval([100 * r["split"][c] / r["split"]["wall"] for r in runs]) for c in CAUSES)
                  if name != IDEAL else " | ".join(["-"] * len(CAUSES))]
        unfinished = "" if all(r["finished"] for r in runs) else " (a lower bound)"
        lines.append(f"| {name} | {sum(r['finished'] for r in runs)}/{len(runs)} | "
                     f"{_interval([r['seconds'] for r in runs])}{unfinished} | "
                     f"{_interval([r['goodput'] for r in runs], '{:.3f}')} | {speedup} | "
                     f"{sum(bool(r.get('above_ideal')) for r in runs) if name != IDEAL else '-'} | {shares[0]} |")
    return "\n".join(lines)


def seed_table(seeds: Sequence[str], results: List[Dict]) -> str:
    lines = ["| seed | preemptions (with notice) | returns | actions replayed | latest action, s late | "
             "ideal s | elastic s | checkpoint-restart s | elastic goodput | checkpoint-restart goodput | "
             "above the ideal |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for seed, r in zip(seeds, results):
        preempts = [e for e in r["trace"] if e["kind"] == PREEMPT]
        replayed = [a for name in (ELASTIC, RESTART) for a in r[name]["replayed"]]
        lines.append(f"| {seed} | {len(preempts)} ({sum(e['notice'] > 0 for e in preempts)}) | "
                     f"{len(r['trace']) - len(preempts)} | {len(r[ELASTIC]['replayed'])}, "
                     f"{len(r[RESTART]['replayed'])} | {max([a['late'] for a in replayed], default=0.0):.2f} | "
                     f"{r[IDEAL]['seconds']:.1f} | {r[ELASTIC]['seconds']:.1f} | {r[RESTART]['seconds']:.1f} | "
                     f"{r[ELASTIC]['goodput']:.3f} | {r[RESTART]['goodput']:.3f} | {_above(r)} |")
    return "\n".join(lines)


def _above(result: Dict) -> str:
    """The methods whose curve rose above the ideal's beyond noise (`above_ideal`), flagged with where."""
    flagged = [f"FLAGGED: {name} at {result[name]['above_ideal'][0]:.0f} s ({result[name]['above_ideal'][1]:.0f} "
               f"samples)" for name in (ELASTIC, RESTART) if result[name].get("above_ideal")]
    return "; ".join(flagged) or "none"


def throughput_table(rates: Dict[str, Dict[int, float]]) -> str:
    """Steady-state samples/s by world size and method, and what the ideal gets with that many hosts up."""
    best = preemption_trace.fastest(rates[IDEAL])
    lines = [f"| world size | {ELASTIC} samples/s | {RESTART} samples/s | ideal's samples/s with that many hosts up "
             "| x one worker |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {size} | {rates[ELASTIC][size]:.1f} | {rates[RESTART][size]:.1f} | {best[size]:.1f} | "
              f"{best[size] / best[1]:.2f} |" for size in sorted(best)]
    return "\n".join(lines)


def plot(result: Dict, trace: Trace, rates: Dict[int, float], path: Path) -> None:
    """Hosts up over trace time, and samples committed by each method beside the ideal's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(result[name]["seconds"] for name in (ELASTIC, RESTART, IDEAL))
    steps = [s for s in trace.capacity() if s[0] <= end] + [(end, None)]
    fig, (hosts_ax, samples_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=[1, 2])
    hosts_ax.step([t for t, _ in steps], [up for _, up in steps[:-1]] + [steps[-2][1]], where="post")
    for event in trace.events:
        if event.kind == PREEMPT and event.notice and event.time <= end:
            hosts_ax.axvspan(event.time - event.notice, event.time, color="orange", alpha=0.3, linewidth=0)
    hosts_ax.set_ylabel("hosts up (orange: notice)")
    hosts_ax.set_ylim(-0.2, trace.hosts + 0.2)
    times = sorted({t for t, _ in steps} | {result[IDEAL]["seconds"]})
    ideal = [min(result["target"], trace.ideal_samples(rates, t)) for t in times]
    samples_ax.plot(times, ideal, color="black", linestyle=":", label=IDEAL)
    for name in (ELASTIC, RESTART):
        points = result[name]["progress"]
        samples_ax.plot([t for t, _ in points], [s for _, s in points], marker=".", markersize=3, label=name)
    samples_ax.set_xlabel("trace seconds from the first step at full size")
    samples_ax.set_ylabel("samples committed")
    samples_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _traces(seeds: Sequence[str]) -> List[Trace]:
    try:
        if FLAGS.trace_csv:
            return [preemption_trace.read_csv(Path(FLAGS.trace_csv), FLAGS.hosts, FLAGS.compression)] * len(seeds)
        return [preemption_trace.generate(int(seed), FLAGS.hosts, FLAGS.preemptions_per_host_hour,
                                          FLAGS.notice_fraction, FLAGS.notice_seconds, FLAGS.return_seconds,
                                          FLAGS.compression, FLAGS.max_seconds) for seed in seeds]
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    except OSError as error:
        raise app.UsageError(f"--trace_csv={FLAGS.trace_csv}: cannot read it ({error.strerror}).") from None


def _apply_flags() -> None:
    """--quick's sizes (where not given), and a check of --seeds."""
    if FLAGS.quick:
        for name, value in QUICK.items():
            if not FLAGS[name].present:
                setattr(FLAGS, name, value)
        if not FLAGS["compression"].present:
            FLAGS.compression *= 4
    if not FLAGS.seeds or not all(seed.lstrip("-").isdigit() for seed in FLAGS.seeds):
        raise app.UsageError(f"--seeds must be whole numbers, comma-separated; got {','.join(FLAGS.seeds)!r}.")


def main(argv: List[str]) -> None:
    del argv
    if FLAGS.role == "worker":
        return worker()
    _stop_on_sigterm()
    _apply_flags()
    traces = _traces(FLAGS.seeds)
    root = Path(FLAGS.root or tempfile.mkdtemp(prefix="tf_elastic-goodput-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    print(f"{FLAGS.hosts} hosts x 1 worker; per step: {FLAGS.device_seconds}s of device time (a sleep, declared) "
          f"beside the real all-reduce, {FLAGS.per_worker_batch} examples per worker; {FLAGS.epochs} epochs of "
          f"{DATASET_SIZE} digits; commits every {FLAGS.commit_every_steps} steps; traces compressed "
          f"{FLAGS.compression:g}x; runs in {root}", flush=True)
    measured = calibrate(root / "calibration", FLAGS.hosts)
    print("steady-state throughput per world size (fixed-size runs of each method):\n" + throughput_table(measured),
          flush=True)
    rates = measured[IDEAL]
    results = []
    for seed, trace in zip(FLAGS.seeds, traces):
        print(f"seed {seed}: {len(trace.events)} trace events", flush=True)
        results.append(run_trace(root / f"seed-{seed}", trace, rates))
    (root / "results.json").write_text(json.dumps({"rates": rates, "rates_by_method": measured, "seeds": FLAGS.seeds,
                                                   "runs": results}, indent=1))
    plot(results[0], traces[0], rates, root / "goodput.png")
    print(f"\n## Goodput on a preemption trace ({len(results)} traces; mean ± 95% interval; causes: % of "
          f"host-seconds)\n\n" + summary_table(results) + "\n\n" + seed_table(FLAGS.seeds, results) +
          f"\n\nplot: {root / 'goodput.png'}\nresults: {root / 'results.json'}\nwall time: "
          f"{time.time() - started:.0f}s")


def _stop_on_sigterm() -> None:
    """SIGTERM ends the bench as Ctrl-C does: through the `finally` that ends the processes it started."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupt)


if __name__ == "__main__":
    app.run(main)
