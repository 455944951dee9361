"""The fault-injection soak behind `launch.bench.chaos`: an elastic job under random faults, then invariants.

Faults (each at a random moment, after the group recovered from the previous one): SIGKILL a worker,
SIGKILL a whole host, SIGSTOP a worker, block a worker's main thread while its heartbeat goes on (the
progress watchdog's case), SIGTERM an agent (graceful leave), send an agent and its worker a preemption
notice (SIGUSR1, as Slurm's --signal does), start a new agent, SIGKILL the chief while it commits,
corrupt the newest checkpoint (then kill the chief so the group restores), fill the chief's state file
with NUL bytes (a crash mid-write; then kill the chief), hang the store for a while (etcd: SIGSTOP its
server; the file store: a process holds its lock), send a preemption notice to one host while a round
change (another host's worker killed) is under way, SIGKILL every ranked host at once while a standby
waits (it must notice alone, and carry on from the durable copies: the chief copies every commit), the
same with the newest durable copy damaged as the hosts die (the standby falls back to the one before), and
with etcd, stop and restart the store. Every kind is drawn once before any repeats.

The soak injects every fault it is asked for: faults are paced by the training left at the measured rate
(`short_of_training`), which drops the waits between them when it runs short.

The workers, and the fault-free reference run, run the trainer module the caller names (`trainer`, e.g.
"launch.train"), which takes `launch.train`'s flags (`TRAIN`) and writes its events.
"""
import dataclasses
import fcntl
import glob
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from tf_elastic.elastic.agent import ports
from tf_elastic.elastic.events import read_events
from tf_elastic.elastic.protocol import Event, RunDir
from tf_elastic.elastic.worker import datasets
from tf_elastic.elastic import audit
from tf_elastic.testing.etcd_server import EtcdServer
from tf_elastic.testing.local_job import REPO, LocalJob, graceful_exits, repo_env, running, signal_pid
from tf_elastic.testing.net import bindable


TRAIN = ["--dataset=digits", "--per_replica_batch_size=16", "--threads=1", "--commit_every_steps=10",
         "--optimizer=sgd", "--learning_rate=0.02"]  # 0.05 diverges at world size 3 even without faults (measured)
# SIGUSR1 is a preemption notice (Slurm's --signal=USR1@90); no progress for 8 s is a stuck worker.
AGENT = ["--min_workers=1", "--max_workers=3", "--index_log", "--last_call=1", "--blacklist_after=1000",
         "--stop_grace=10", "--preemption_signals=SIGTERM,SIGUSR1", "--progress_timeout=8"]
KINDS = ("kill_worker", "kill_host", "stop_worker", "stall_worker", "term_agent", "preempt_agent", "start_agent",
         "kill_chief_in_commit", "corrupt_checkpoint", "damage_state_file", "hang_store", "notice_in_round_change",
         "kill_ranked_with_standby", "kill_ranked_damaged_durable", "restart_store")
# Kinds that end a host's part in the job, and need another host to carry on.
_LEAVING = ("kill_host", "term_agent", "preempt_agent", "notice_in_round_change")
# Kinds the workers may train on through (the store away): a restart follows only if leases lapsed meanwhile.
_NO_RESTART = ("restart_store", "hang_store")
TRAINED_ON = "trained on"  # a fault's note when no restart followed
EPOCHS_PER_FAULT = 20  # the default length: a fault, its recovery and a warm spare again take ~14 epochs
# A fault and its recovery with no pause nor wait for spares take up to 15 s (start_agent's p95); twice that,
# as the rate since the first step lags the rate near the end (a 50-fault soak at 15 s: the 50th came late).
HURRIED_FAULT_SECONDS = 30.0


def short_of_training(epochs_left: int, faults_left: int, epochs_per_second: float) -> bool:
    """Whether the epochs left would end before the faults left, each taking `HURRIED_FAULT_SECONDS` (and
    at least 8 epochs) at the rate measured. A count of epochs alone misjudged it once epochs got faster:
    a 50-fault soak injected 49 before training ended."""
    return epochs_left < faults_left * max(8.0, epochs_per_second * HURRIED_FAULT_SECONDS)


@dataclasses.dataclass
class Fault:
    kind: str
    target: str
    time: float
    recovered: Optional[float] = None  # seconds to the next first training step (None: none needed)
    note: str = ""


class Soak:
    def __init__(self, root: Path, epochs: int, faults: int, seed: int, rng: random.Random,
                 etcd: Optional[EtcdServer], max_gap: float, wait_for_spares: bool, trainer: str):
        self.max_gap, self.wait_for_spares = max_gap, wait_for_spares
        self.rng, self.etcd = rng, etcd
        self.durable = root / "durable"
        self.job = LocalJob(root, TRAIN + [f"--epochs={epochs}", f"--seed={seed}", f"--checkpoint_dir={self.durable}",
                                           "--durable_every_commits=1"],
                            AGENT + [f"--max_restarts={10 * faults + 10}"], rdzv=etcd.url if etcd else None,
                            trainer=trainer)
        self.tmp = root / "tmp"
        self.tmp.mkdir(parents=True)
        self.live: List[str] = []
        self.killed: List[str] = []  # hosts SIGKILLed whole
        self.spawned = 0
        self.faults: List[Fault] = []
        # Every kind once, in a seeded order, before any repeats: a short soak still draws them all.
        self.plan = [k for k in KINDS if etcd or k != "restart_store"]
        rng.shuffle(self.plan)

    def start_host(self) -> str:
        host = f"h{self.spawned}"
        self.spawned += 1
        self.job.start_agent(host, env={"TMPDIR": str(self.tmp)}, faults=True)
        self.live.append(host)
        return host

    def running(self) -> bool:
        return any(self.job.agents[h].poll() is None for h in self.live)

    def choose(self) -> str:
        """The next kind of the plan, else a random one that fits the job now (a kind that makes a host leave
        when a second host trains; a host started while fewer than three do)."""
        if self.plan:
            return self.plan.pop(0)
        kinds = ["kill_worker", "stop_worker", "stall_worker", "kill_chief_in_commit", "corrupt_checkpoint",
                 "damage_state_file", "hang_store", "kill_ranked_with_standby", "kill_ranked_damaged_durable"]
        if len(self.live) >= 2:
            kinds += list(_LEAVING)
        if len(self.live) < 3:
            kinds += ["start_agent", "start_agent"]
        if self.etcd:
            kinds.append("restart_store")
        return self.rng.choice(kinds)

    def _grow_to_two(self) -> None:
        """A kind of the plan makes a host leave while one trains alone: a second host joins first, within
        the same fault, so that every kind of the plan is drawn within as many faults as there are kinds."""
        since = time.time()
        self.start_host()
        self.job.wait_for(lambda: [e for e in self.job.events(Event.FIRST_STEP, rank=0)
                                   if e["time"] > since and e["world_size"] >= 2], timeout=300,
                          what="a second host training before it leaves")

    def chief_host(self) -> str:
        rendezvous = self.job.events(Event.RENDEZVOUS)
        latest = max(e["round"] for e in rendezvous)
        return next(e["source"].split(":", 1)[1] for e in rendezvous if e["round"] == latest and 0 in e["ranks"])

    def inject(self, kind: str) -> Fault:
        job = self.job
        if kind in _LEAVING and len(self.live) < 2:
            self._grow_to_two()
        host = self.rng.choice(self.live)
        if kind in ("kill_chief_in_commit", "corrupt_checkpoint", "damage_state_file"):
            host = self.chief_host()
        fault = Fault(kind, host, time.time())
        if kind == "kill_worker":
            signal_pid(job.worker_pid(host), signal.SIGKILL)
        elif kind == "kill_host":
            self._kill_hosts([host])
        elif kind == "stop_worker":
            signal_pid(job.worker_pid(host), signal.SIGSTOP)  # its agent kills it as hung
        elif kind == "stall_worker":
            signal_pid(job.worker_pid(host), signal.SIGUSR2)  # its main thread blocks; its heartbeat goes on
        elif kind == "term_agent":
            job.agents[host].send_signal(signal.SIGTERM)
            self.live.remove(host)
        elif kind == "preempt_agent":  # as Slurm's --signal=USR1@90: every process of the host's step
            job.agents[host].send_signal(signal.SIGUSR1)
            signal_pid(job.worker_pid(host), signal.SIGUSR1)
            self.live.remove(host)
        elif kind == "start_agent":
            fault.target = self.start_host()
        elif kind == "kill_chief_in_commit":
            fault.note = "hit a commit" if _wait_for_commit_in_progress(job.run_dir, 10.0) else "missed"
            signal_pid(job.worker_pid(host), signal.SIGKILL)
        elif kind == "corrupt_checkpoint":
            fault.note = _corrupt_newest(job.run_dir, self.live)
            signal_pid(job.worker_pid(host), signal.SIGKILL)
        elif kind == "damage_state_file":  # as a crash mid-write leaves it: the host's commits must all stay
            fault.note = _damage_state_file(job.run_dir, host, self.rng)
            signal_pid(job.worker_pid(host), signal.SIGKILL)
        elif kind == "notice_in_round_change":  # another host's worker fails; the notice lands as the group regroups
            other = self.rng.choice([h for h in self.live if h != host])
            signal_pid(job.worker_pid(other), signal.SIGKILL)
            time.sleep(self.rng.uniform(0.2, 1.5))
            job.agents[host].send_signal(signal.SIGUSR1)
            fault.note = f"{other}'s worker killed first"
            self.live.remove(host)
        elif kind in ("kill_ranked_with_standby", "kill_ranked_damaged_durable"):
            fault.note = self._kill_ranked_with_standby(damage=kind == "kill_ranked_damaged_durable")
            fault.time = time.time()
        elif kind == "hang_store":
            fault.note = self._hang_store(self.rng.uniform(0.5, 2.0))
        elif kind == "restart_store":
            self.etcd.stop()
            time.sleep(self.rng.uniform(1.0, 4.0))
            self.etcd.start()
        fault.time = time.time() if kind in _NO_RESTART else fault.time  # a restart it causes begins after it
        self.faults.append(fault)
        return fault

    def _kill_hosts(self, hosts: List[str]) -> None:
        for host in hosts:
            self.job.kill_host(host)
            self.live.remove(host)
            self.killed.append(host)

    def _kill_ranked_with_standby(self, damage: bool) -> str:
        """Starts hosts until one waits as a standby (`--max_workers=3`), then SIGKILLs every ranked host at
        once: no ring watcher is left; the standby alone must notice, and go on from the durable copies
        (`damage`: the newest one truncated as the hosts die, so that it falls back to the one before)."""
        since = time.time()
        while len(self.live) < 4:
            self.start_host()
        ranked, standing = self.job.wait_for(lambda: self._ranked_beside_a_standby(since), timeout=300,
                                             what="three ranked hosts and a standby")
        self._kill_hosts(sorted(ranked))
        damaged = f"; truncated the durable {_truncate_newest_copy(self.durable)}" if damage else ""
        return f"{len(ranked)} ranked hosts killed; {standing} stood by{damaged}"

    def _ranked_beside_a_standby(self, since: float) -> Optional[tuple]:
        """(the ranked hosts, a standby) of the newest round, once a host waits beside it as a standby."""
        rounds = self.job.events(Event.RENDEZVOUS)
        latest = max(e["round"] for e in rounds)
        ranked = {e["source"].split(":", 1)[1] for e in rounds if e["round"] == latest}
        standing = [e["source"].split(":", 1)[1] for e in self.job.events(Event.STANDBY)
                    if e["time"] > since and e["round"] == latest]
        return (ranked, standing[0]) if standing and len(ranked) == 3 else None

    def _hang_store(self, seconds: float) -> str:
        """The store answers nothing for `seconds`: etcd's server stopped (SIGSTOP), or the file store's lock
        held by a process that does not let go."""
        if self.etcd:
            os.kill(self.etcd.process.pid, signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                os.kill(self.etcd.process.pid, signal.SIGCONT)
            return f"etcd stopped {seconds:.1f} s"
        with open(Path(self.job.rdzv[len("file://"):]) / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            time.sleep(seconds)
        return f"lock held {seconds:.1f} s"

    def epoch(self) -> int:
        """The newest committed epoch."""
        return max([e["epoch"] for e in self.job.events(Event.COMMIT)] or [0])

    def hurried(self, epochs: int, faults: int, began: float) -> bool:
        """Whether the training left is short for the faults left (`short_of_training`, at the epochs per
        second trained since `began`): then the soak drops its pauses and its wait for warm spares, so that
        every fault asked is injected."""
        rate = self.epoch() / max(time.time() - began, 1e-3)
        return short_of_training(epochs - self.epoch(), faults - len(self.faults), rate)

    def await_recovery(self, fault: Fault, hurried: bool = False) -> None:
        if fault.kind in _NO_RESTART:
            time.sleep(3.0)  # the agents notice a lapsed lease within host_ttl and a monitor interval
            if not [e for e in self.job.events(Event.RENDEZVOUS) if e["time"] > fault.time]:
                fault.note += f"; {TRAINED_ON}"
                return
        try:
            step = self.job.first_step_after(fault.time, timeout=180)
            fault.recovered = step["time"] - fault.time
        except AssertionError:
            if self.running():
                raise
            fault.note += " (the job had finished)"
        if fault.kind in ("term_agent", "preempt_agent", "notice_in_round_change"):
            self.job.agents[fault.target].wait(timeout=60)
        if not self.wait_for_spares or hurried:
            return  # the next fault may meet a group whose workers start cold: harder, and quicker to run
        # The next fault waits for every live host to have a warm spare again, as a user's would.
        since = fault.time
        for host in self.live:
            self.job.wait_for(lambda: not self.running() or [
                e for e in self.job.events(Event.SPARE_READY, source=f"agent:{host}") if e["time"] > since],
                timeout=180, what=f"a warm spare on {host}")


def _wait_for_commit_in_progress(run_dir: Path, timeout: float) -> bool:
    """Polls for TF's temporary shard directory of a checkpoint being written (on any host)."""
    deadline = time.time() + timeout
    pattern = glob.escape(str(RunDir(run_dir).path)) + "/commits/*/*_temp*"
    while time.time() < deadline:
        if glob.glob(pattern):
            return True
        time.sleep(0.0005)
    return False


def _corrupt_newest(run_dir: Path, hosts: List[str]) -> str:
    """Truncates the newest commit of every host in the job (each keeps its own copy), so that the group
    goes back to the previous one. (Hosts that left keep their old commits: those are left alone.)"""
    states = [RunDir(run_dir).host_commits(h) / "checkpoint" for h in hosts]
    states = [state for state in states if state.exists()]
    if not states:
        return "no commit yet"
    names = set()
    for state in states:
        newest = _newest_commit(state)
        names.add(Path(newest).name)
        _cut_in_half(Path(p) for p in glob.glob(glob.escape(newest) + ".data-*"))
    return f"truncated {', '.join(sorted(names))}"


def _cut_in_half(files) -> None:
    """Truncates each file to half its size: a commit's data as a torn write leaves it."""
    for data in files:
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)


def _truncate_newest_copy(durable: Path) -> str:
    """Truncates the data of the newest complete durable copy (`ckpt-GENERATION-STEP-...` folders with a
    `COMPLETE` marker); returns its name."""
    complete = [p for p in durable.glob("ckpt-*") if (p / "COMPLETE").exists()]
    if not complete:
        return "(none yet)"
    newest = max(complete, key=lambda p: tuple(int(n) for n in p.name.split("-")[1:3]))
    _cut_in_half(newest.glob("*.data-*"))
    return newest.name


def _damage_state_file(run_dir: Path, host: str, rng: random.Random) -> str:
    """Damages `host`'s state file as a host crash between its write and its sync can leave it: NUL bytes,
    empty, or cut in half."""
    state = RunDir(run_dir).host_commits(host) / "checkpoint"
    if not state.exists():
        return "no commit yet"
    size = state.stat().st_size
    how = rng.choice(["NUL bytes", "empty", "cut in half"])
    state.write_bytes({"NUL bytes": b"\0" * size, "empty": b"", "cut in half": state.read_bytes()[:size // 2]}[how])
    return f"{host}'s state file: {how}"


def _newest_commit(state: Path) -> str:
    """The newest commit a `checkpoint` state file names (its text format, read without TensorFlow)."""
    first = state.read_text().splitlines()[0]  # model_checkpoint_path: "PATH"
    return first.split('"')[1]


def _start_fault_free(root: Path, epochs: int, seed: int, trainer: str) -> subprocess.Popen:
    """The same training without faults or agent: one process of `trainer`, the global batch of two workers.
    Started with the soak at the lowest CPU priority (nice 19), so that it trains on what the soak leaves
    idle (its waits for rounds, starts and recoveries) and does not slow the soak's processes into false
    hangs; it used to start after the last fault and ran ~35 s past the soak's end."""
    root.mkdir()
    argv = [sys.executable, "-m", trainer, *[a for a in TRAIN if not a.startswith("--per_replica")],
            "--per_replica_batch_size=32", f"--epochs={epochs}", f"--seed={seed}", f"--run_dir={root / 'run'}"]
    with open(root / "train.log", "ab") as log:
        process = subprocess.Popen(argv, cwd=REPO, env=repo_env(), stdout=log, stderr=subprocess.STDOUT)
    os.setpriority(os.PRIO_PROCESS, process.pid, 19)  # (a preexec_fn is unsafe beside a parent's threads)
    return process


def _fault_free_accuracy(root: Path, process: subprocess.Popen) -> float:
    if process.wait(timeout=3600) != 0:
        raise RuntimeError(f"the fault-free run failed ({process.returncode}): see {root / 'train.log'}")
    return [e for e in read_events(root / "run") if e["event"] == Event.EVALUATION][-1]["test_accuracy"]


def _checks(soak: Soak, epochs: int, reference: float) -> Dict[str, object]:
    job, run_dir = soak.job, soak.job.run_dir
    events = job.events()
    largest_batch = 16 * max(e["world_size"] for e in events if e["event"] == Event.RENDEZVOUS)
    data = audit.exactly_once(run_dir, len(datasets.load("digits").y_train), largest_batch)
    # Committed progress: every round restores at least the last commit before it, but for a
    # corrupted newest commit, which sends it back to the previous one, and for every holder of the
    # newest commits killed at once, which sends it back to the newest durable copy.
    backwards, commits, durable = [], [], None
    for e in events:
        if e["event"] == Event.COMMIT:
            commits.append(e["step"])
        elif e["event"] == Event.DURABLE_COPY and e.get("bytes"):
            durable = e["path"]
        elif e["event"] == Event.RESTORE and e["rank"] == 0 and commits and e["step"] < max(commits):
            skipped = [s for s in events if s["event"] == Event.CHECKPOINT_SKIPPED and s["round"] == e["round"]]
            if not skipped and e["path"] != durable:
                backwards.append((e["round"], e["step"], max(commits)))
    orphans = job.worker_pids_alive() + [p.pid for p in job.agents.values() if running(p.pid)]
    # The job's processes have a TMPDIR of their own. A SIGKILLed host cannot clean up (a real dead host
    # takes its /tmp with it); the next agent started on a host sweeps what dead agents left.
    killed = {soak.job.agents[host].pid for host in soak.killed}
    # (TF's autograph leaves files of its own; the hosts' port registries are meant to outlive agents)
    left = sorted(str(p) for p in soak.tmp.glob("tf_elastic-*") if not p.name.startswith(ports.REGISTRY_PREFIX))
    by_killed = [p for p in left if Path(p).name.split("-")[1][len("agent"):] in {str(k) for k in killed}]
    leaked = [p for p in left if p not in by_killed]
    bound = [addr for e in events if e["event"] == Event.RENDEZVOUS for addr in e.get("cluster") or []
             if not bindable(*_host_port(addr))]
    # A host that left gracefully must never be a round's lost host (a counted restart for a leave).
    graceful = graceful_exits(events)
    leaves_lost = sorted({(e["round"], host) for e in events if e["event"] == Event.RENDEZVOUS
                          for host in e.get("lost") or [] if host in graceful})
    accuracy = [e["test_accuracy"] for e in events if e["event"] == Event.EVALUATION]
    final_commit = [e for e in events if e["event"] == Event.COMMIT][-1]
    return {
        "finished": bool(accuracy) and final_commit["epoch"] == epochs,
        "accuracy": accuracy[-1] if accuracy else None, "reference_accuracy": reference,
        "epochs_checked": data["epochs"], "samples_repeated": data["repeated"], "samples_skipped": data["skipped"],
        "steps_off_plan": data["off_plan"],
        "steps_redone": audit.steps_redone(run_dir), "progress_backwards": backwards,
        "checkpoints_skipped": len([e for e in events if e["event"] == Event.CHECKPOINT_SKIPPED and e["rank"] == 0]),
        "leaves_counted_as_lost": leaves_lost, "orphans": orphans, "leaked_temp_dirs": leaked,
        "left_by_killed_hosts": len(by_killed),
        "ports_still_bound": sorted(set(bound)),
        "agent_exits": {e["host"]: f"{e['code']}: {e['reason']}" for e in events if e["event"] == Event.EXIT},
    }


def _host_port(addr: str):
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def run_soak(root: Path, faults: int, seed: int, rdzv: str, epochs: Optional[int] = None,
             max_gap: float = 3.0, wait_for_spares: bool = True, *, trainer: str) -> Dict[str, object]:
    """Runs the soak and its fault-free reference, both running the module `trainer` (e.g. "launch.train");
    returns the faults and the checks."""
    rng = random.Random(seed)
    # digits: about an epoch a second; a fault and its recovery take ~5 s, ~15 s waiting for spares
    epochs = epochs or (EPOCHS_PER_FAULT if wait_for_spares else 10) * faults
    etcd = EtcdServer().start() if rdzv == "etcd" else None
    (root / "soak").mkdir(parents=True)
    soak = reference = None
    try:
        soak = Soak(root / "soak", epochs, faults, seed, rng, etcd, max_gap, wait_for_spares, trainer)
        reference = _start_fault_free(root / "reference", epochs, seed, trainer)
        soak.start_host()
        soak.start_host()
        began = soak.job.first_step_after(0, world_size=2, timeout=300)["time"]
        for host in soak.live:
            soak.job.wait_for(lambda: soak.job.events(Event.SPARE_READY, source=f"agent:{host}"), timeout=180)
        while len(soak.faults) < faults and soak.running():
            hurried = soak.hurried(epochs, faults, began)
            time.sleep(0.0 if hurried else rng.uniform(0.0, soak.max_gap))
            soak.await_recovery(soak.inject(soak.choose()), hurried)
        for host in soak.live:
            soak.job.agents[host].wait(timeout=1800)
        accuracy = _fault_free_accuracy(root / "reference", reference)
    finally:
        if reference is not None and reference.poll() is None:  # first: it trains on alone otherwise
            reference.kill()
            reference.wait()
        if soak is not None:
            soak.job.cleanup()
        if etcd:
            etcd.close()
    return {"faults": [dataclasses.asdict(f) for f in soak.faults], "faults_asked": faults, "epochs": epochs,
            "checks": _checks(soak, epochs, accuracy)}


def failed_invariants(result: Dict[str, object], tolerance: float) -> List[str]:
    c = result["checks"]
    failed = []
    if not c["finished"]:
        failed.append(f"the job did not finish (agents' exits: {c['agent_exits']})")
    elif c["accuracy"] < c["reference_accuracy"] - tolerance:
        failed.append(f"accuracy {c['accuracy']:.4f} < fault-free {c['reference_accuracy']:.4f} - {tolerance}")
    for key in ("samples_repeated", "samples_skipped", "steps_off_plan"):
        if c[key]:
            failed.append(f"{key} = {c[key]}")
    for key in ("progress_backwards", "leaves_counted_as_lost", "orphans", "leaked_temp_dirs", "ports_still_bound"):
        if c[key]:
            failed.append(f"{key}: {c[key]}")
    if c["epochs_checked"] != result["epochs"]:
        failed.append(f"the index logs cover {c['epochs_checked']} of the {result['epochs']} epochs trained")
    injected = [f for f in result["faults"] if "job had finished" not in f["note"]]
    unrecovered = [f"{f['kind']} at {f['time']:.1f}" for f in injected if f["recovered"] is None
                   and TRAINED_ON not in f["note"]]
    if unrecovered:
        failed.append(f"faults without a recovery: {unrecovered}")
    if len(injected) < result["faults_asked"]:  # a soak that ran out of training proves less than it was asked
        failed.append(f"{len(injected)} of the {result['faults_asked']} faults asked were injected before training "
                      "ended: give more --epochs")
    return failed


def table(result: Dict[str, object]) -> str:
    faults, c = result["faults"], result["checks"]
    lines = ["| fault | injected | recovered | recovery p50 | p95 | max | notes |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for kind in KINDS:
        mine = [f for f in faults if f["kind"] == kind]
        if not mine:
            continue
        times = sorted(f["recovered"] for f in mine if f["recovered"] is not None)
        stats = ([f"{statistics.median(times):.2f} s", f"{times[min(len(times) - 1, int(0.95 * len(times)))]:.2f} s",
                  f"{times[-1]:.2f} s"] if times else ["-", "-", "-"])
        notes = sorted({f["note"] for f in mine if f["note"]})
        lines.append(f"| {kind} | {len(mine)} | {len(times)} | " + " | ".join(stats) + f" | {'; '.join(notes)} |")
    every = sorted(f["recovered"] for f in faults if f["recovered"] is not None)
    if every:
        lines.append(f"| all | {len(faults)} | {len(every)} | {statistics.median(every):.2f} s | "
                     f"{every[min(len(every) - 1, int(0.95 * len(every)))]:.2f} s | {every[-1]:.2f} s | |")
    lines += ["", f"- finished: {c['finished']}; test accuracy {c['accuracy']} vs fault-free {c['reference_accuracy']}",
              f"- steps redone: {c['steps_redone']}; samples repeated: {c['samples_repeated']}; samples skipped: "
              f"{c['samples_skipped']} (over {c['epochs_checked']} epochs, as the steps consumed them); steps that "
              f"trained other than planned: {c['steps_off_plan']}",
              f"- corrupted commits detected and skipped: {c['checkpoints_skipped']}; progress backwards otherwise: "
              f"{c['progress_backwards']}; graceful leaves counted as lost hosts: {c['leaves_counted_as_lost']}",
              f"- orphan processes: {c['orphans']}; leaked temp dirs: {c['leaked_temp_dirs']}; ports still bound: "
              f"{c['ports_still_bound']}",
              "- agents' exits: " + "; ".join(f"{h} {r}" for h, r in sorted(c["agent_exits"].items()))]
    return "\n".join(lines)
