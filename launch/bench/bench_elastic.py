"""Recovery times and overheads of the elastic runtime, measured from `events.jsonl`.

Hosts get run dirs of their own (they share no directory: a joiner receives the state over the
collectives). Each repetition runs one elastic job of two agents on this machine and injects, in order: a hung worker
(SIGSTOP), a killed host (SIGKILL of an agent and its worker), and a joining host. Each fault waits
until the survivors' warm spares are ready again (`spare_ready` events): a fault that comes sooner also
pays the rest of a worker's start-up. It times each to the
first training step of the re-formed group and counts the steps a join loses. A fault-free run under
the runtime and a plain MultiWorkerMirroredStrategy `model.fit` of the same model give the steady-state
step-time ratio; commit events give the commit overhead (the training-path part of a commit: the copy to host
memory; the files, the state file and durable copies are written on background threads).

    python -m launch.bench.bench_elastic --repeats=5
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from absl import app, flags

from tf_elastic.elastic.flag_checks import require_finite_floats
from tf_elastic.elastic.protocol import Event
from tf_elastic.testing.local_job import REPO, LocalJob, repo_env, stop_jobs_on_sigterm

flags.DEFINE_integer("repeats", 5, "Repetitions of the fault sequence.", lower_bound=1)
flags.DEFINE_list("rdzv", ["file", "etcd"], "Store backends to run the fault sequence on, side by side (empty: "
                  "the steady state only; etcd: a "
                  "throwaway etcd-server on 127.0.0.1).")
flags.DEFINE_list("round_agents", ["2", "4", "8"], "Agent counts for the rendezvous round time (trivial workers).")
flags.DEFINE_string("rdzv_dir", None, "Parent directory for stores and run dirs (default: a temp dir).")
flags.DEFINE_float("heartbeat_timeout", 3.0, "The agents' --heartbeat_timeout (the default).", lower_bound=0.5)
flags.DEFINE_float("progress_timeout", 10.0, "The agents' --progress_timeout (a stuck main thread); 5 s fired "
                   "falsely on a loaded 2-core machine (an epoch-end evaluation's first trace).", lower_bound=1.0)
flags.DEFINE_integer("commit_every_steps", 100, "The workers' commit interval (launch.train's default).", lower_bound=0)
flags.DEFINE_enum("mode", "bench", ["bench", "plain_worker"], "plain_worker: one plain-MWMS worker (internal).")
flags.DEFINE_list("steady_models", ["mnist_cnn", "resnet20"], "Registry models of the steady-state comparison; for "
                  "one with BatchNorm, plain MWMS also runs with synchronized BN (the alternative to fit's averaging "
                  "of the statistics before each commit).")
flags.DEFINE_string("model", "mnist_cnn", "plain_worker: the registry model (internal).")
flags.DEFINE_float("plain_timeout", 600.0, "Seconds a plain MWMS run may take before it counts as hung.",
                   lower_bound=1.0)
flags.DEFINE_bool("synchronized_bn", False, "plain_worker: BatchNormalization(synchronized=True) (internal).")
flags.DEFINE_string("out", None, "plain_worker: where to write its epoch timings.")
flags.DEFINE_integer("epochs", 8, "Epochs of the fault-free steady-state runs (~2.5 s each; those after the "
                     "warm spares are up count).", lower_bound=2)
FLAGS = flags.FLAGS
require_finite_floats(__name__)

# `synthetic` ships in the code: the benchmark needs no download (28x28 like MNIST, 5000 examples).
TRAIN = ["--dataset=synthetic", "--per_replica_batch_size=16", "--threads=1", "--optimizer=sgd"]


def _job(root: Path, epochs: int, *agent_args: str, rdzv: str = None, model: str = "mnist_cnn") -> LocalJob:
    root.mkdir(parents=True)
    return LocalJob(root, TRAIN + [f"--epochs={epochs}", f"--commit_every_steps={FLAGS.commit_every_steps}",
                                   f"--model={model}"],
                    ["--min_workers=1", "--max_workers=2", f"--heartbeat_timeout={FLAGS.heartbeat_timeout}",
                     f"--progress_timeout={FLAGS.progress_timeout}", "--preemption_signals=SIGTERM,SIGUSR1",
                     "--max_restarts=10",  # three faults count; a spurious one on a loaded machine must not end it
                     *agent_args], rdzv=rdzv, host_run_dirs=True, trainer="launch.train")


def _spares_ready(job: LocalJob, host: str, since: float) -> None:
    """Waits until `host`'s agent has a warm spare ready again, so each fault meets a recovered job."""
    job.wait_for(lambda: [e for e in job.events(Event.SPARE_READY, source=f"agent:{host}") if e["time"] > since],
                 what=f"a warm spare on {host}")


def _fault_sequence(root: Path, rdzv: str = None) -> Dict[str, float]:
    """In order: b's worker hangs (SIGSTOP), b's worker's main thread blocks (its heartbeat goes on), b's
    host is lost (SIGKILL of agent and worker), c joins, c gets a preemption notice (SIGUSR1) and leaves."""
    job = _job(root, 60, rdzv=rdzv)
    try:
        job.start_agent("a", faults=True)
        job.start_agent("b", faults=True)
        started = job.first_step_after(0, world_size=2)
        job.wait_for(lambda: [e for e in job.events(Event.COMMIT) if e["time"] > started["time"]])
        _spares_ready(job, "a", started["time"])
        _spares_ready(job, "b", started["time"])
        t_hang = time.time()
        os.kill(job.worker_pid("b"), signal.SIGSTOP)
        after_hang = job.first_step_after(t_hang, world_size=2)
        _committed_and_ready(job, after_hang, "a", "b")
        t_stall = time.time()
        os.kill(job.worker_pid("b"), signal.SIGUSR2)
        after_stall = job.first_step_after(t_stall, world_size=2)
        _committed_and_ready(job, after_stall, "a")
        t_kill = time.time()
        worker = job.worker_pid("b")
        job.agents["b"].kill()
        os.kill(worker, signal.SIGKILL)
        after_kill = job.first_step_after(t_kill, world_size=1)
        _spares_ready(job, "a", after_kill["time"])
        t_join = time.time()
        job.start_agent("c")
        after_join = job.first_step_after(t_join, world_size=2)
        announced = [e["time"] for e in job.events(Event.MEMBERSHIP_CHANGE, source="agent:a") if e["time"] > t_join][0]
        _committed_and_ready(job, after_join, "a", "c")
        t_notice = time.time()
        job.agents["c"].send_signal(signal.SIGUSR1)
        after_notice = job.first_step_after(t_notice, world_size=1)
        left = job.wait_for(lambda: job.events(Event.LEAVE, host="c"))[0]
        transfer = job.events(Event.STATE_TRANSFER, round=after_join["round"])[0]
        return {"transfer_s": transfer["seconds"], "transfer_mb": transfer["bytes"] / 1e6,
                "join_state_local": after_join["time"] - announced - transfer["seconds"],
                "hang": after_hang["time"] - t_hang, "stall": after_stall["time"] - t_stall,
                "kill": after_kill["time"] - t_kill, "join": after_join["time"] - announced,
                "join_from_agent_start": after_join["time"] - t_join, "join_lost_steps": _lost(job, after_join),
                "notice_leave": left["time"] - t_notice, "notice_first_step": after_notice["time"] - t_notice,
                "notice_lost_steps": _lost(job, after_notice)}
    finally:
        job.cleanup()


def _committed_and_ready(job: LocalJob, after: Dict, *hosts: str) -> None:
    """Waits for a commit of the new group and for warm spares on `hosts`, so the next fault meets a
    recovered job."""
    job.wait_for(lambda: [e for e in job.events(Event.COMMIT) if e["time"] > after["time"]], what="a commit")
    for host in hosts:
        _spares_ready(job, host, after["time"])


def _lost(job: LocalJob, first_step: Dict) -> int:
    """Steps the previous round's chief reached but the round of `first_step` did not restore."""
    reached = max(e["step"] for e in job.events(Event.WORKER_EXIT, rank=0) if e["round"] < first_step["round"])
    return reached - job.events(Event.RESTORE, rank=0, round=first_step["round"])[0]["step"]


def _round_times(root: Path, agents: int, rdzv: str = None, rounds: int = 3) -> List[float]:
    """Seconds from a worker failure to every agent holding the next round, `agents` agents with one
    trivial worker each (so that 8 fit on 2 cores)."""
    root.mkdir(parents=True)
    job = LocalJob(root, [], ["--nowarm_start", f"--min_workers={agents}", f"--max_workers={agents}",
                              f"--max_restarts={rounds + 1}", "--last_call=1"], rdzv=rdzv, trainer="launch.train")
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    times = []
    try:
        for i in range(agents):
            job.start_agent(f"h{i}", command=sleeper)
        for number in range(rounds + 1):
            job.wait_for(lambda: len(job.events(Event.WORKER_START, round=number)) == agents, what=f"round {number}")
            if number == rounds:
                break
            failed = time.time()
            # A different host each time: two failures in a row of one host's workers blacklist it.
            os.kill(job.worker_pid(f"h{number % agents}", round_=number), signal.SIGKILL)
            job.wait_for(lambda: len(job.events(Event.RENDEZVOUS, round=number + 1)) == agents, what="the next round")
            times.append(max(e["time"] for e in job.events(Event.RENDEZVOUS, round=number + 1)) - failed)
    finally:
        job.cleanup()
    return times


def _runtime_steady(root: Path, epochs: int, model: str) -> Dict[str, float]:
    job = _job(root, epochs, "--last_call=30", model=model)
    try:
        job.start_agent("a")
        job.start_agent("b")
        if any(job.wait_agents(timeout=600).values()):
            raise RuntimeError(f"the steady-state job failed: {job.exit_reasons()}")
    finally:
        job.cleanup()
    # Not the first epoch (tracing), nor one that overlapped the agents' warm spares starting up (a TF
    # import each, on the same cores: measured up to 2x the step time).
    ready = max((e["time"] for e in job.events(Event.SPARE_READY)), default=0.0)
    epoch_ends = [e for e in job.events(Event.EPOCH_END)[1:] if e["time"] - e["seconds"] >= ready]
    if not epoch_ends:
        raise RuntimeError(f"no epoch of {epochs} began after the warm spares were ready: raise --epochs")
    commits = sum(e["seconds"] + e.get("check_seconds", 0.0) for e in job.events(Event.COMMIT))
    checks = [e.get("check_seconds", 0.0) for e in job.events(Event.COMMIT)]
    train_time = sum(e["seconds"] for e in job.events(Event.EPOCH_END))
    # The first two commits of a process set up TF's async checkpoint (an eager copy, then the trace of its
    # copy function): once per worker process.
    first = sum(e["seconds"] + e.get("check_seconds", 0.0) for e in job.events(Event.COMMIT)[:2])
    copies = [e["seconds"] for e in job.events(Event.DURABLE_COPY) if "seconds" in e]
    return {"step_ms": statistics.median(1e3 * e["seconds"] / e["steps"] for e in epoch_ends),
            "commit_share": commits / train_time, "commit_share_after_first": (commits - first) / train_time,
            "first_commit_s": first, "durable_copies": len(copies), "durable_copy_s": max(copies, default=0.0),
            "check_ms": 1e3 * statistics.median(checks) if checks else 0.0}


def _plain_steady(root: Path, epochs: int, model: str, synchronized_bn: bool = False) -> Optional[float]:
    """The median step (ms) of a plain MWMS run of two workers; None when it did not end in --plain_timeout."""
    root.mkdir(parents=True)
    ports = []
    import socket

    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for rank in range(2):
        env = repo_env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}}))
        procs.append(subprocess.Popen([sys.executable, "-m", f"{__package__}.bench_elastic", "--mode=plain_worker",
                                       f"--epochs={epochs}", f"--model={model}", f"--synchronized_bn={synchronized_bn}",
                                       f"--out={root / f'plain{rank}.json'}"], cwd=REPO, env=env,
                                      stdout=open(root / f"plain{rank}.log", "ab"), stderr=subprocess.STDOUT))
    deadline = time.time() + FLAGS.plain_timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    if any(proc.poll() is None for proc in procs):  # measured: synchronized BN under MWMS did not finish
        for proc in procs:
            proc.kill()
            proc.wait()
        return None
    epochs_seconds = json.loads((root / "plain0.json").read_text())
    return statistics.median(1e3 * s / n for s, n in epochs_seconds[1:])


def _steady_state(root: Path, model: str) -> Dict:
    """Two fault-free runs of each: the runtime, plain MWMS, and (for a model with BatchNorm) plain MWMS with
    synchronized BatchNorm."""
    with_bn = model != "mnist_cnn"
    return {"runtime": [_runtime_steady(root / f"steady{i}", FLAGS.epochs, model) for i in range(2)],
            "plain": [_plain_steady(root / f"plain{i}", FLAGS.epochs, model) for i in range(2)],
            "plain_sync_bn": [_plain_steady(root / f"sync{i}", FLAGS.epochs, model, True) for i in range(2)]
            if with_bn else []}


def _print_steady(model: str, results: Dict) -> None:
    runtime, plain, sync = results["runtime"], results["plain"], results["plain_sync_bn"]
    step_runtime, step_plain = statistics.median(r["step_ms"] for r in runtime), statistics.median(plain)
    print(f"\nSteady state, {model} (file store, 2 workers): step under the runtime / plain MWMS = "
          f"{step_runtime:.2f} / {step_plain:.2f} ms = {step_runtime / step_plain:.3f} x (target <= 1.03 x)")
    if sync:
        done = [step for step in sync if step is not None]
        step_sync = f"{statistics.median(done):.2f} ms = {statistics.median(done) / step_plain:.3f} x plain BN" \
            if done else f"did not finish in {FLAGS.plain_timeout:g} s"
        print(f"  plain MWMS with BatchNormalization(synchronized=True): {step_sync} ({len(sync) - len(done)} of "
              f"{len(sync)} runs unfinished); the runtime averages plain BN's statistics before each "
              f"commit instead: {statistics.median(r['check_ms'] for r in runtime):.1f} ms a commit, averaging and "
              "the per-variable check included")
    share = [r["commit_share"] for r in runtime]
    first = [r["first_commit_s"] for r in runtime]
    after_first = [r["commit_share_after_first"] for r in runtime]
    print(f"  Commit overhead at commit_every_steps={FLAGS.commit_every_steps}: {100 * statistics.median(share):.2f} % "
          f"median, {100 * max(share):.2f} % max of {FLAGS.epochs} epochs' training time (target <= 1 %). "
          f"The first two commits set up the async checkpoint once per process ({statistics.median(first):.2f} s); "
          f"the commits after them cost {100 * statistics.median(after_first):.2f} % median, "
          f"{100 * max(after_first):.2f} % max")
    print(f"  Durable copies (background, every 10th commit and the last): "
          f"{statistics.median(r['durable_copies'] for r in runtime):.0f} per run, the slowest "
          f"{max(r['durable_copy_s'] for r in runtime):.3f} s")


def plain_worker() -> None:
    """Plain MWMS: the same model, data and per-replica batch, stock `model.fit` (plus the Keras fix); plain
    BatchNorm keeps its statistics per replica, `--synchronized_bn` all-reduces them in every step."""
    import keras
    import tensorflow as tf

    from tf_elastic import models
    from tf_elastic.elastic.worker import datasets
    from tf_elastic import elastic

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    elastic.install_fit_fix()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    data = datasets.load("synthetic")
    x, y = data.x_train[:6000], data.y_train[:6000]
    global_batch = 16 * strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(6000, seed=0).batch(global_batch, drop_remainder=True)
    with strategy.scope():
        model = models.get(FLAGS.model, x.shape[1:], 10)
        for layer in model._flatten_layers():
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.synchronized = FLAGS.synchronized_bn
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    timings = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.steps = time.time(), 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1

        def on_epoch_end(self, epoch, logs=None):
            timings.append((time.time() - self.start, self.steps))

    model.fit(dataset, epochs=FLAGS.epochs, verbose=0, callbacks=[Timer()])
    Path(FLAGS.out).write_text(json.dumps(timings))


def _print_faults(faults: Dict, rounds: Dict) -> None:
    backends = list(faults)
    print(f"\nElastic runtime, 2 agents x 1 worker on this machine, mnist_cnn on synthetic 28x28 data, "
          f"{FLAGS.repeats} repetitions (heartbeat_timeout={FLAGS.heartbeat_timeout:g}s); median | max per store\n")
    print("| measure | " + " | ".join(f"{b} median | {b} max" for b in backends) + " | target |")
    print("|---|" + "---:|---:|" * len(backends) + "---|")
    for name, key, unit, target in (
            ("kill -> first step of the new group", "kill", "s", "<= 5 s"),
            ("hang (SIGSTOP) -> first step", "hang", "s", "<= 8 s"),
            (f"blocked main thread -> first step (progress_timeout={FLAGS.progress_timeout:g}s)", "stall", "s", ""),
            ("preemption notice (SIGUSR1) -> graceful leave", "notice_leave", "s", ""),
            ("preemption notice -> first step without the host", "notice_first_step", "s", ""),
            ("steps lost by a preemption notice", "notice_lost_steps", "", "0"),
            ("join (round opened) -> first step at the new size (joiner's disk empty: state transferred)", "join",
             "s", "<= 8 s"),
            ("  of which: the state transfer (broadcast, verification)", "transfer_s", "s", "<= 1 s"),
            ("  the same join less the transfer (as if the state were local; derived)", "join_state_local", "s", ""),
            ("  state transferred", "transfer_mb", "MB", ""),
            ("new agent started -> first step at the new size (incl. its warm-up)", "join_from_agent_start", "s", ""),
            ("steps lost by a join", "join_lost_steps", "", "0")):
        row = " | ".join(_cells([f[key] for f in faults[b]], unit) for b in backends)
        print(f"| {name} | {row} | {target} |")
    for n in FLAGS.round_agents:
        print(f"| rendezvous round, {n} agents (failure -> all in the next round) | " +
              " | ".join(_cells(rounds[b][n], "s") for b in backends) + " | |")


def _cells(values, unit):
    return f"{statistics.median(values):.2f} {unit} | {max(values):.2f} {unit}"


def main(argv: List[str]) -> None:
    del argv
    if FLAGS.mode == "plain_worker":
        plain_worker()
        return
    stop_jobs_on_sigterm()
    from tf_elastic.testing.etcd_server import EtcdServer

    root = Path(FLAGS.rdzv_dir or tempfile.mkdtemp(prefix="tf_elastic-bench-"))
    faults, rounds = {}, {}
    for backend in FLAGS.rdzv:
        etcd = EtcdServer().start() if backend == "etcd" else None
        url = etcd.url if etcd else None
        try:
            faults[backend] = [_fault_sequence(root / f"{backend}-faults{i}", url) for i in range(FLAGS.repeats)]
            rounds[backend] = {n: _round_times(root / f"{backend}-rounds{n}", int(n), url) for n in FLAGS.round_agents}
        finally:
            if etcd:
                etcd.close()
    steady = {model: _steady_state(root / model, model) for model in FLAGS.steady_models}
    (root / "results.json").write_text(json.dumps({"faults": faults, "rounds": rounds, "steady": steady}))
    if faults:
        _print_faults(faults, rounds)
    for model, results in steady.items():
        _print_steady(model, results)
    print(f"\nraw results: {root / 'results.json'}")


if __name__ == "__main__":
    app.run(main)
