"""Runs elastic agents (and their TensorFlow workers) on this machine and reads what they did.

Shared by the tests, the benchmarks and the demo: agents are real processes sharing a file store;
faults are real signals, sent by PID to processes this job started. Each agent is the library's own
(`python -m tf_elastic.elastic.agent.cli`); the workers run the trainer module the caller names
(`LocalJob(..., trainer="launch.train")`), so that this harness names no script of the checkout.
"""
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set

from tf_elastic.elastic import proc as procfs
from tf_elastic.elastic.agent.job_record import JobKeys
from tf_elastic.elastic.agent.worker_output import logs_dir
from tf_elastic.elastic.events import read_events
from tf_elastic.elastic.protocol import Env, Event
from tf_elastic.elastic.store import open_store
from tf_elastic.testing.faults import command as faults_command

REPO = Path(__file__).resolve().parents[2]  # the checkout: agents and workers run from it, with it on the path
AGENT_COMMAND = [sys.executable, "-m", "tf_elastic.elastic.agent.cli"]  # the agent's command line, up to its flags


def repo_env(**extra: str) -> Dict[str, str]:
    """The environment for a module of this checkout run as a script (the agent, a trainer such as
    `launch.train`), TensorFlow's log quieted."""
    return dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", **extra)


def graceful_exits(events: List[Dict]) -> Set[str]:
    """The hosts whose agent's `exit` event says it left the job gracefully: after its own `leave`, or while
    waiting for a round that another host's leave had opened (it writes no `leave` event then)."""
    return {e["host"] for e in events if e["event"] == Event.EXIT and "left the job gracefully" in e["reason"]}


class LocalJob:
    def __init__(self, tmp: Path, train_args: List[str], agent_args: List[str] = (), job_id: Optional[str] = None,
                 rdzv: Optional[str] = None, host_run_dirs: bool = False, *, trainer: str):
        """`trainer`: the module the workers run, `python -m TRAINER TRAIN_ARGS...` (e.g. "launch.train");
        `rdzv`: the store URL (default: a file store in `tmp`); `job_id`: default unique, so that jobs
        can share one etcd; `host_run_dirs`: each agent gets a run dir of its own (`tmp/hosts/HOST`), as
        hosts that share no filesystem would, instead of all sharing `tmp/run`."""
        self.trainer = trainer
        self.tmp, self.run_dir = tmp, tmp / "run"
        self.host_run_dirs = host_run_dirs
        self.rdzv = rdzv or f"file://{tmp / 'rdzv'}"
        self.train_args, self.agent_args = list(train_args), list(agent_args)
        self.job_id = job_id or f"job-{uuid.uuid4().hex[:8]}"
        self.agents: Dict[str, subprocess.Popen] = {}

    def start_agent(self, host: str, command: Optional[List[str]] = None, env: Optional[Dict[str, str]] = None,
                    faults: bool = False, cwd: Optional[Path] = None, **flags) -> subprocess.Popen:
        """Starts `host`'s agent with `flags` beside the job's, running `command` (default: the job's trainer
        module with the job's arguments, with `tf_elastic.testing.faults` installed if `faults`), in `cwd`
        (default: the checkout; its workers' relative paths resolve there: a host's own data)."""
        trainer = faults_command(self.trainer) if faults else [sys.executable, "-m", self.trainer]
        args = [*AGENT_COMMAND, f"--rdzv={self.rdzv}", f"--job_id={self.job_id}",
                f"--run_dir={self.run_dir_of(host)}", f"--host_id={host}", *self.agent_args,
                *[f"--{k}={v}" for k, v in flags.items()], "--", *(command or [*trainer, *self.train_args])]
        log = open(self.tmp / f"agent-{host}.log", "ab")
        env = repo_env(**(env or {}))
        self.agents[host] = subprocess.Popen(args, cwd=cwd or REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self.agents[host]

    def in_rendezvous(self, host: str) -> bool:
        """Whether `host`'s agent holds its lease (it has done its imports and takes part in rounds)."""
        store = open_store(self.rdzv)
        try:
            return store.get(JobKeys(self.job_id).host(host)) is not None
        finally:
            store.close()

    def worker_log(self, host: str, round_: int) -> str:
        """What `host`'s workers wrote in round `round_` (their per-rank log files)."""
        folder = logs_dir(str(self.run_dir_of(host)), host) / f"round-{round_}"
        return "".join(path.read_text(errors="replace") for path in sorted(folder.glob("rank-*.log")))

    def run_dir_of(self, host: str) -> Path:
        return self.tmp / "hosts" / host if self.host_run_dirs else self.run_dir

    @property
    def run_dirs(self) -> List[Path]:
        """Every run dir of the job: one, or one per agent started."""
        return [self.run_dir_of(host) for host in self.agents] if self.host_run_dirs else [self.run_dir]

    def events(self, name: Optional[Event] = None, **match) -> List[Dict]:
        return [e for e in read_events(self.run_dirs) if (name is None or e["event"] == name)
                and all(e.get(k) == v for k, v in match.items())]

    def wait_for(self, predicate: Callable[[], object], timeout: float = 180, what: str = "") -> object:
        """Polls `predicate` until it holds; gives up at `timeout`, or at once when every agent has exited
        (nothing can change any more: their reasons say why)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            result = predicate()
            if result:
                return result
            if self.agents and all(proc.poll() is not None for proc in self.agents.values()):
                result = predicate()  # a last look: the agents may have written it as they ended
                if result:
                    return result
                raise AssertionError(f"every agent exited while waiting for {what}: {self.exit_reasons()}\n"
                                     f"{self.describe()}")
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.describe()}")

    def left_gracefully(self) -> List[str]:
        """The hosts whose agents left the job gracefully (`graceful_exits`), sorted."""
        return sorted(graceful_exits(self.events()))

    def exit_reasons(self) -> Dict[str, str]:
        """Each agent's exit code and the reason it logged."""
        reasons = {e["host"]: e["reason"] for e in self.events(Event.EXIT)}
        return {host: f"{proc.poll()}: {reasons.get(host, 'no exit event (see its log)')}"
                for host, proc in self.agents.items()}

    def wait_agents(self, timeout: float = 300) -> Dict[str, int]:
        deadline = time.time() + timeout
        for host, proc in self.agents.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"agent {host} did not finish in {timeout}s\n{self.describe()}") from None
        return {host: proc.returncode for host, proc in self.agents.items()}

    def first_step_after(self, moment: float, world_size: Optional[int] = None, timeout: float = 180) -> Dict:
        """The chief's first training step of a group that started after `moment`."""
        return self.wait_for(lambda: [e for e in self.events(Event.FIRST_STEP, rank=0) if e["time"] > moment and
                                      (world_size is None or e["world_size"] == world_size)],
                             timeout, what=f"a first step after {moment:.2f} at world size {world_size}")[0]

    def worker_pid(self, host: str, round_: Optional[int] = None) -> int:
        starts = self.events(Event.WORKER_START, source=f"agent:{host}")
        if round_ is not None:
            starts = [e for e in starts if e["round"] == round_]
        return starts[-1]["worker_pid"]

    def kill_worker(self, host: str, round_: Optional[int] = None) -> None:
        """SIGKILL the host's worker (of `round_`); its agent goes on."""
        signal_pid(self.worker_pid(host, round_), signal.SIGKILL)

    def kill_host(self, host: str) -> None:
        """SIGKILL the agent and its worker: the whole host is gone."""
        worker = self.worker_pid(host)
        self.agents[host].kill()
        signal_pid(worker, signal.SIGKILL)

    def describe(self) -> str:
        hidden = ("time", "event", "source", "pid")
        lines = [f"{e['event']} {e['source']} " + str({k: v for k, v in e.items() if k not in hidden})
                 for e in read_events(self.run_dirs)]
        logs = "".join(f"\n--- {p.name} (tail)\n" + p.read_text(errors="replace")[-3000:]
                       for p in self.tmp.glob("agent-*.log"))
        return "\n".join(lines[-60:]) + logs

    def worker_pids_alive(self) -> List[int]:
        """The job's workers still running: by the events' PIDs, each checked to be a worker of one of
        this job's agents (a PID long gone may be another process's now)."""
        marks = {f"{Env.AGENT_PID}={proc.pid}".encode() for proc in self.agents.values()}
        return [pid for pid in {e["worker_pid"] for e in self.events() if "worker_pid" in e}
                if running(pid) and marks & set(procfs.environment(pid))]

    def cleanup(self) -> None:
        workers = self.worker_pids_alive()
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in workers:
            signal_pid(pid, signal.SIGKILL)


def stop_jobs_on_sigterm() -> None:
    """Makes SIGTERM end a script that runs jobs as Ctrl-C does, through the `finally` that stops what it
    started: by default SIGTERM ends the script at once and its agents and workers train on."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupt)


def running(pid: int) -> bool:
    """Is `pid` running (not gone, not a zombie waiting to be reaped)?"""
    return bool(procfs.running(pid))


def signal_pid(pid: int, sig: int) -> None:
    """Sends `sig` to a process this job started, if it still exists."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def lose_the_chief_to_a_standby(job: LocalJob, command: Optional[List[str]] = None, round_seconds: float = 0.0,
                                **flags) -> Dict[str, object]:
    """Agents a and b train while host c waits as a standby (the world is full; with an empty disk when the
    job has a run dir per host); once a and b committed at world size 2 (and the round ran
    `round_seconds`), the chief's host is SIGKILLed and the next round is the survivor and c, who receives
    the state. Returns the rounds and hosts involved: `first`, `joined` (the chiefs' first steps at world
    size 2), `chief`, `survivor` and `killed_at`."""
    job.start_agent("a", command=command, **flags)
    job.start_agent("b", command=command, **flags)
    first = job.wait_for(lambda: [e for e in job.events(Event.COMMIT) if e["world_size"] == 2],
                         what="a commit at world size 2")[0]
    job.start_agent("c", command=command, **flags)
    began = job.events(Event.FIRST_STEP, round=first["round"], rank=0)[0]["time"]
    job.wait_for(lambda: time.time() > began + round_seconds and job.in_rendezvous("c"),
                 what=f"a round of {round_seconds}s and c in the rendezvous")
    chief = job.events(Event.WORKER_START, round=first["round"], rank=0)[-1]["source"].split(":", 1)[1]
    killed_at = time.time()
    job.kill_host(chief)
    joined = job.wait_for(lambda: [e for e in job.events(Event.FIRST_STEP, rank=0)
                                   if e["round"] > first["round"] and e["world_size"] == 2],
                          what="a first step of the survivor and c")[0]
    return {"first": first["round"], "joined": joined["round"], "chief": chief, "killed_at": killed_at,
            "survivor": "b" if chief == "a" else "a"}


def assert_replicas_identical(job: LocalJob, round_: int, size: int = 2) -> None:
    """Every rank of `round_` started from the same bits of every committed variable and, if the round
    ended, ended with them."""
    for name in (Event.RESTORE, Event.WORKER_EXIT):
        digests = {e["rank"]: e["state_digest"] for e in job.events(name, round=round_)}
        if name is Event.RESTORE or digests:
            assert len(digests) == size and len(set(digests.values())) == 1, (name, round_, digests)
