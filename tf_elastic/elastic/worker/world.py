"""The worker's reading of the contract: the world the agent describes, the heartbeat it expects, and
how a worker process ends. No TensorFlow here: a warm worker imports this before its round exists.

The heartbeat is a daemon thread writing, every 0.5 s, a beat counter, the training step and a progress
counter that moves with every training step, evaluation batch and commit. The agent times both on its own
clock: no beat for `--heartbeat_timeout` is a stopped or frozen process, no progress for
`--progress_timeout` a live one stuck in a collective or its input pipeline. The same thread ends the
worker once its agent is gone (even SIGKILLed), and the agent's preemption signals, which Slurm also sends
to every process of a step, ask for a commit and a stop instead of killing it.

Without an agent, a worker is a world of one.
"""
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

from absl import logging

from tf_elastic.elastic import proc
from tf_elastic.elastic.protocol import Env, Heartbeat, write_heartbeat
from tf_elastic.elastic.stragglers import ProbeSettings


@dataclasses.dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    round: int = 0
    run_dir: Optional[str] = None
    cluster: Optional[Dict] = None  # the TF_CONFIG cluster spec, when several workers
    heartbeat_file: Optional[str] = None
    heartbeat_timeout: float = 10.0
    restarts: int = 0
    index_log: bool = False
    agent_pid: Optional[int] = None
    local_rank: int = 0
    host_id: Optional[str] = None
    stop_signals: Tuple[int, ...] = (signal.SIGTERM,)  # each asks for a commit and a stop
    probe: Optional[str] = None  # the straggler probe's settings (`stragglers.ProbeSettings.from_text`)
    evicts_stragglers: bool = False  # its agent evicts stragglers (`Env.EVICT_STRAGGLERS`)
    probation: Optional[str] = None  # a host on probation: time the pass alone (`Env.PROBATION`), no training

    @property
    def keeps_commits(self) -> bool:
        """Under an agent, each host's first worker keeps the host's commits; without one, the chief."""
        return self.local_rank == 0 if self.host_id else self.rank == 0

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def probes_stragglers(self) -> bool:
        """Whether the straggler probe runs (`worker/probe.py`): several workers, and a cadence."""
        return self.size > 1 and ProbeSettings.from_text(self.probe).every_seconds > 0

    @property
    def elastic(self) -> bool:
        """True when an agent started this worker."""
        return self.heartbeat_file is not None

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "World":
        """The world the agent (or TF_CONFIG) describes in `env` (default `os.environ`); reads nothing else."""
        env = os.environ if env is None else env
        tf_config = env.get("TF_CONFIG")
        rank, size, cluster = 0, 1, None
        if tf_config:
            try:
                config = json.loads(tf_config)
                cluster = config["cluster"]
                workers = cluster["worker"]
                rank = int(config["task"]["index"])
                if "chief" in cluster or config["task"].get("type") == "chief":
                    raise ValueError("a chief task (a Kubeflow TFJob with a Chief replica) is not supported: "
                                     "use Worker replicas only")
                if config["task"].get("type", "worker") != "worker" or not 0 <= rank < len(workers):
                    raise ValueError("task must be a worker with an index inside cluster.worker")
                size = len(workers)
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"TF_CONFIG is not a valid worker cluster spec ({error}): {tf_config!r}") from None
        return cls(
            rank=rank,
            size=size,
            round=int(env.get(Env.ROUND, 0)),
            run_dir=env.get(Env.RUN_DIR),
            cluster=cluster,
            heartbeat_file=env.get(Env.HEARTBEAT_FILE),
            heartbeat_timeout=float(env.get(Env.HEARTBEAT_TIMEOUT, 10.0)),
            restarts=int(env.get(Env.RESTARTS, 0)),
            index_log=env.get(Env.INDEX_LOG) == "1",
            agent_pid=int(env[Env.AGENT_PID]) if env.get(Env.AGENT_PID) else None,
            local_rank=int(env.get(Env.LOCAL_RANK, 0)),
            host_id=env.get(Env.HOST_ID) or None,
            stop_signals=_signals(env.get(Env.STOP_SIGNALS)),
            probe=env.get(Env.PROBE),
            evicts_stragglers=env.get(Env.EVICT_STRAGGLERS) == "1",
            probation=env.get(Env.PROBATION) or None,
        )


class Pulse:
    """What this process's heartbeat says: the training step (0: still starting up), a progress counter
    the main thread moves and a beat counter the heartbeat thread moves, and the file they go to.

    A process has one heartbeat file, which the main thread (the first step) and the heartbeat thread
    both write: hence the one module-level instance, `PULSE`. The worker side's process-wide state is
    that and three more, each because the process has one of it: `entry.current()` (the process's one
    `elastic.run`), `keras_compat`'s once-per-process flags (a patch of Keras's modules is process-wide by
    nature: installed once, never twice) and `storage.BACKENDS` (the registry of storage schemes, like
    `store`'s of store schemes, which `register_backend` extends)."""

    def __init__(self):
        self.step, self.progress, self.beats = 0, 0, 0
        self.slow, self.evict = 0.0, False  # set by the straggler probe (`probe.GroupProbe`)
        self.input_slow = 0.0  # and by its input (`stragglers.input_slowness`; 0: not a straggler by it)
        self.median, self.batch = 0.0, 0  # the group's median probe (a window's) and its rows a replica
        self.step_seconds = 0.0  # the group's seconds per step (a window's median)
        self.world_at: Optional[float] = None  # when a warm worker received its round (`time.time()`)
        self.path: Optional[Path] = None  # set by `start_heartbeat`
        self._failing = False
        self._lock = threading.Lock()

    def beat(self) -> None:
        with self._lock:
            if self.path is None:
                return
            self.beats += 1
            try:
                write_heartbeat(self.path, Heartbeat(self.step, self.progress, self.beats, self.slow, self.evict,
                                                     self.median, self.batch, self.input_slow, self.step_seconds))
                self._failing = False
            except OSError as error:
                # A full or vanished host-local disk: the agent hears silence and restarts this worker.
                # Neither the training step nor the heartbeat thread (which also watches the agent) dies of it.
                if not self._failing:
                    logging.warning("cannot write the heartbeat file %s: %s", self.path, error)
                self._failing = True


PULSE = Pulse()


def report_progress(step: int) -> None:
    """A training step finished: the step the heartbeat reports (0: still starting up), and progress.

    The first step is written at once, not at the next beat: the agent judges a worker that has not shown
    a step by the long startup timeout, so a stop right after the first step must not fall into it."""
    first = PULSE.step == 0 and step > 0
    PULSE.step = step
    report_activity()
    if first:
        PULSE.beat()


def report_activity() -> None:
    """The main thread moved on (an evaluation batch, a commit): no training step, but no hang either."""
    PULSE.progress += 1


def start_heartbeat(world: World, interval: float = 0.5) -> Optional[threading.Thread]:
    """Writes step, progress and a beat counter to the agent's heartbeat file from a daemon thread.

    A stopped or frozen process goes silent; a live process whose main thread is stuck (a collective,
    the input pipeline) keeps beating without progress, which the agent's progress watchdog sees. Before
    the first step the agent allows `startup_timeout`. The thread also ends the worker once its agent is
    gone: a SIGKILLed agent cannot stop its workers, and a wrapped command (`sh -c ...`) would outlive it.
    """
    if not world.heartbeat_file:
        return None
    PULSE.path = Path(world.heartbeat_file)
    for sig in world.stop_signals:
        if sig != signal.SIGTERM:  # until `fit` handles them: a notice before training must not kill us
            signal.signal(sig, signal.SIG_IGN)

    def beat():
        while True:
            PULSE.beat()
            if world.agent_pid and not _alive(world.agent_pid):
                exit_now(1)
            time.sleep(interval)

    thread = threading.Thread(target=beat, name="tf_elastic-heartbeat", daemon=True)
    thread.start()
    return thread


def wait_for_the_agents_world_on_stdin() -> None:
    """A warm-started worker (`Env.WARM`, started before its round froze): says it is ready, blocks on stdin
    until the agent writes its round's variables, and merges them into `os.environ` (TensorFlow reads
    TF_CONFIG there). End of input: the agent shut down without using it, so the process exits 0. Does
    nothing in a worker started cold."""
    if os.environ.pop(Env.WARM, None) != "1":
        return
    ready = os.environ.pop(Env.WARM_READY, None)
    if ready:
        Path(ready).touch()
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)
    PULSE.world_at = time.time()
    os.environ.update(json.loads(line))


def seconds_in_round() -> float:
    """How long this worker has been in its round: since a warm worker received it, else since the process
    started (/proc; where there is none, since this module loaded)."""
    if PULSE.world_at is not None:
        return time.time() - PULSE.world_at
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - _LOADED


_LOADED = time.time()


def _alive(pid: int) -> bool:
    """Is `pid` running? A killed agent whose parent has not reaped it yet is a zombie: not running."""
    running = proc.running(pid)
    if running is None:  # no /proc (not Linux): ask the kernel whether the PID exists
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return running


def _signals(names: Optional[str]) -> Tuple[int, ...]:
    """SIGTERM always (the agent's own graceful stop), and the agent's preemption signals."""
    try:
        named = [signal.Signals[name.strip()] for name in (names or "").split(",") if name.strip()]
    except KeyError as error:
        raise ValueError(f"{Env.STOP_SIGNALS}={names!r}: unknown signal {error}") from None
    return tuple(dict.fromkeys([signal.SIGTERM, *named]))


def exit_now(code: int) -> None:
    """Ends a worker process at once, after flushing its output.

    A MultiWorkerMirroredStrategy process has no clean shutdown (its gRPC server never stops), and a
    normal interpreter exit can hang for seconds with the heartbeat thread already gone, which the
    agent would take for a hang."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (the agent's pipe): end all the same
            pass
    os._exit(int(code))
