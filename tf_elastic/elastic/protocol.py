"""The contract between the agent and its workers, in one place: the run directory's layout, event
names, exit codes, environment variables and the heartbeat format.

Both sides import this module and nothing of each other, so the agent never loads TensorFlow and a
renamed event or directory changes in one line. It imports nothing beyond the standard library.
"""
import dataclasses
import enum
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Optional, Union


class Env:
    """Environment variables the agent sets for its workers (and two secrets it keeps from them)."""
    RUN_DIR = "TF_ELASTIC_RUN_DIR"
    ROUND = "TF_ELASTIC_ROUND"
    HEARTBEAT_FILE = "TF_ELASTIC_HEARTBEAT_FILE"
    HEARTBEAT_TIMEOUT = "TF_ELASTIC_HEARTBEAT_TIMEOUT"
    RESTARTS = "TF_ELASTIC_RESTARTS"
    INDEX_LOG = "TF_ELASTIC_INDEX_LOG"  # test mode: workers log the example indices they train on
    # The worker's slot on its host (0..nproc-1): its devices follow it, and slot 0 keeps the host's commits.
    LOCAL_RANK = "TF_ELASTIC_LOCAL_RANK"
    HOST_ID = "TF_ELASTIC_HOST_ID"  # names the host's commit directory: hosts may share a run dir, or not
    AGENT_PID = "TF_ELASTIC_AGENT_PID"  # a worker ends itself once its agent is gone (even when it was SIGKILLed)
    # The agent's preemption signals (names, comma-separated): a worker that receives one itself (Slurm's
    # --signal reaches every process of a step) commits and stops as on SIGTERM instead of dying of it.
    STOP_SIGNALS = "TF_ELASTIC_STOP_SIGNALS"
    # Where a worker whose main raised writes the exception (type, message, traceback tail) as JSON, so that
    # the agent names the cause of a failure (torchrun's @record error files, without a decorator).
    ERROR_FILE = "TF_ELASTIC_ERROR_FILE"
    # Warm start: the agent starts a worker before its round exists; it imports what it needs, then blocks
    # until the agent writes the round's variables to its stdin as one JSON line.
    WARM = "TF_ELASTIC_WARM"
    WARM_READY = "TF_ELASTIC_WARM_READY"  # a file a warm worker creates once it is ready to be handed a world
    # The straggler probe's cadence and rules (`worker.probe.ProbeSettings.to_text`).
    PROBE = "TF_ELASTIC_PROBE"
    # "1" where the agent evicts stragglers (`--evict_stragglers`): only then do workers read their input alone
    # while another's input holds the group back (what an input straggler's eviction is weighed by).
    EVICT_STRAGGLERS = "TF_ELASTIC_EVICT_STRAGGLERS"
    # A host on probation (evicted as a straggler): "RESULT_FILE,PER_REPLICA_BATCH". The worker times the
    # model's pass alone at that batch and reads its input alone, writes both ("PASS INPUT", seconds per pass
    # and per step) to the file, and again each time the agent removed it, training nothing.
    PROBATION = "TF_ELASTIC_PROBATION"
    # Secrets the agent reads and never passes on.
    JOB_TOKEN = "TF_ELASTIC_JOB_TOKEN"
    RDZV_PASSWORD = "TF_ELASTIC_RDZV_PASSWORD"
    SECRETS = (JOB_TOKEN, RDZV_PASSWORD)


class ExitCode(enum.IntEnum):
    """Worker exit codes the agent understands."""
    DONE = 0
    STOPPED = 3  # stopped on request (preemption notice, membership change) after committing
    PEER_FAILURE = 75  # a collective failed: another worker died or hung
    CONFIG_ERROR = 78  # bad input (flags, data, committed state of another model): a restart cannot help


class AgentExit(enum.IntEnum):
    """The agent's own exit codes."""
    OK = 0  # the job finished, or this host left gracefully
    FAILED = 1  # the job failed (max_restarts, rendezvous timeout, a configuration error, the store)
    REFUSED = 2  # this agent's job token is not the job's


class JobStatus(str, enum.Enum):
    """The job's outcome as every agent reads it from the store."""
    DONE = "done"
    FAILED = "failed"


class Failure(str, enum.Enum):
    """Kinds of failure, as `Event.FAILURE` records them."""
    HANG = "hang"  # a worker's heartbeat went silent
    NO_PROGRESS = "no_progress"  # a worker's heartbeat goes on but its main thread made no progress
    PEER_FAILURE = "peer_failure"  # a worker's collective failed (another worker died or hung)
    WORKER_EXIT = "worker_exit"  # a worker exited with an unexpected code
    HOST_LOST = "host_lost"  # another host's lease expired
    CONFIG_ERROR = "config_error"  # a worker refused its input: the job ends without restarts


class Event(str, enum.Enum):
    """Names of the records in `events.jsonl`; a str, so `record["event"] == Event.COMMIT` works."""
    # Agent.
    AGENT_START = "agent_start"
    BLACKLISTED = "blacklisted"
    RENDEZVOUS = "rendezvous"
    STANDBY = "standby"  # the job's round is full (or its size must divide a number): this host waits
    WORKER_START = "worker_start"
    SPARE_READY = "spare_ready"
    MEMBERSHIP_CHANGE = "membership_change"
    FAILURE = "failure"
    WORKER_STOPPED = "worker_stopped"
    WORKERS_DONE = "workers_done"
    STORE_UNREACHABLE = "store_unreachable"
    STORE_REACHABLE = "store_reachable"
    LEAVE = "leave"
    PREEMPTION_NOTICE = "preemption_notice"
    EXIT = "exit"
    # A worker of this host is a straggler: by `cause` "compute", its probe runs `slowness` times the median's;
    # by "input", the group waits for its input and would go `slowness` times faster if it kept up.
    STRAGGLER = "straggler"
    STRAGGLER_RECOVERED = "straggler_recovered"
    # This host left as a straggler (`--evict_stragglers`) and sits out a hold-off: by `cause` "compute",
    # "input" or "compute and input" (`slowness` its compute's where compute is a cause; `input_slowness` too).
    EVICTED = "evicted"
    PROBATION = "probation"  # an evicted host timed its own pass and input against the group's: `back` or not
    # Worker.
    RESTORE = "restore"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    RESTORE_MISMATCH = "restore_mismatch"
    FIRST_STEP = "first_step"
    COMMIT = "commit"
    COMMIT_FAILED = "commit_failed"  # a host's local write failed (a full disk): the group still holds it
    STATE_TRANSFER = "state_transfer"  # a worker received the agreed commit from a peer
    DURABLE_COPY = "durable_copy"
    EPOCH_END = "epoch_end"
    REMAINDER_SKIPPED = "remainder_skipped"
    COLLECTIVE_FAILURE = "collective_failure"
    WORKER_EXIT = "worker_exit"
    EVALUATION_BEGIN = "evaluation_begin"  # every worker, around each evaluation (fit's validation included)
    EVALUATION_END = "evaluation_end"
    EVALUATION = "evaluation"  # launch.train's test accuracy


# TensorFlow's checkpoint reader matches a commit's path as a pattern: under a directory named `a[1]` it finds
# nothing, and `*` or `?` could match another directory's commit. A run dir holding them is refused.
PATTERN_CHARACTERS = "[]*?"


class RunDir:
    """The layout of a run directory: where each side writes what the other (and `launch.report`) reads."""

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def host_commits(self, host_id: str) -> Path:
        """Under an agent, each host's own commits (written by its first worker): the run dir need not be
        shared, and hosts that do share one never write the same files."""
        return self.path / "commits" / host_id

    @property
    def durable(self) -> Path:
        """The default `--checkpoint_dir`: durable copies of commits, for a restart of the whole job."""
        return self.path / "durable"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def indices(self) -> Path:
        """Test mode: one JSON-lines file of example indices per worker and round."""
        return self.path / "indices"

    def index_log(self, round_: int, rank: int) -> Path:
        """The trainer's record of each step: round, rank, epoch, step and the plan's indices."""
        return self.indices / f"round{round_}-rank{rank}.jsonl"

    def consumed_log(self, round_: int, rank: int) -> Path:
        """What each step's replicas really trained, written by the step (`worker.consumed`)."""
        return self.indices / f"round{round_}-rank{rank}.consumed"



class HostDir:
    """An agent's host-local directory (never shared): its workers' heartbeats and warm-start markers.
    Named `HostDir.PREFIX` + the agent's PID + "-"; the agent holds a lock on it while it lives, so that a
    later agent on the host can remove what a SIGKILLed one left."""

    PREFIX = "tf_elastic-agent"

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)

    def heartbeat(self, round_: int, rank: int) -> Path:
        return self.path / f"heartbeat-round{round_}-rank{rank}"

    def warm_ready(self, number: int) -> Path:
        return self.path / f"warm-{number}.ready"

    def error_file(self, round_: int, rank: int) -> Path:
        return self.path / f"error-round{round_}-rank{rank}.json"


def read_error_file(path: Union[str, Path]) -> Optional[Dict[str, Any]]:
    """What a worker that raised wrote (`Env.ERROR_FILE`): type, message and the traceback's last lines;
    None when there is no such file or it cannot be read (a worker killed while writing it)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("type"), str) else None


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message that says what happened; '' for none. A TensorFlow error
    raised in a `tf.function` opens with "Graph execution error:" and the node's traceback (indented): those
    lines are skipped, and an eager op's `{{function_node ...}}` context prefix is dropped. The one way every module
    shortens an error for a log line, an event or a refusal."""
    text = getattr(error, "message", None) or str(error)
    lines = [line for line in text.splitlines() if line.strip()]
    telling = [line for line in lines if line.strip() != "Graph execution error:" and not line[0].isspace()
               and not line.startswith("Detected at node")]
    line = re.sub(r"^\{\{[^}]*\}\}\s*", "", (telling or lines or [""])[0].strip())
    return line[:limit]


def error_line(error: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, as a traceback's last line reads."""
    line = first_line(error, limit)
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def error_record_line(record: Dict[str, Any]) -> str:
    """`Type: message` on one line, as a traceback's last line reads."""
    message = " ".join(str(record.get("message", "")).split())[:300]
    return f"{record['type']}: {message}" if message else record["type"]


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """What a worker's heartbeat file says. `beat` changes every write (the process is alive); `progress`
    changes with every training step, evaluation batch and commit (its main thread is not stuck);
    `step` is the training step (0 until the first). `slow`: how many times slower than its group's median
    this worker's probe runs while it is a straggler (0: it is not one); `evict`: the straggler rules say
    the group would train more without this host (`stragglers.worth_evicting`); `median`: the group's
    median probe (seconds per pass: the median of the window's probes' medians; 0: no window yet) at `batch`
    rows a replica, what a host on probation is measured against (every rank knows it alike; the chief's
    agent publishes it). `input_slow`: how many
    times faster the group would go if this worker's input kept up, while it is a straggler by its input
    (0: it is not one; `stragglers.input_slowness`). `step_seconds`: the group's wall seconds per step (the
    median of a window's; 0: no window yet), what a host on probation's input read alone is measured
    against."""
    step: int
    progress: int
    beat: int
    slow: float = 0.0
    evict: bool = False
    median: float = 0.0
    batch: int = 0
    input_slow: float = 0.0
    step_seconds: float = 0.0

    def to_text(self) -> str:
        # float(): a NumPy number's repr is "np.float64(...)", which no reader parses (the agent heard silence).
        return (f"{self.step} {self.progress} {self.beat} {self.slow:.3f} {int(self.evict)} {float(self.median)!r} "
                f"{self.batch} {self.input_slow:.3f} {float(self.step_seconds)!r}")

    @classmethod
    def from_text(cls, text: str) -> Optional["Heartbeat"]:
        """The heartbeat `text` says (a worker of an older version writes 3, 5, 7 or 8 fields; fields after
        the 9th, a newer version's, are left unread); None if torn."""
        parts = text.split()
        if len(parts) in (4, 6) or not parts[2:] or not all(p.isdigit() for p in parts[:3] + parts[4:5] + parts[6:7]):
            return None  # torn or foreign content: no news
        try:
            slow, median, input_slow, step_seconds = (float(p) for p in (parts[3:4] or ["0"]) + (parts[5:6] or ["0"])
                                                      + (parts[7:8] or ["0"]) + (parts[8:9] or ["0"]))
        except ValueError:
            return None
        return cls(*map(int, parts[:3]), slow=slow, evict=parts[4:5] == ["1"], median=median,
                   batch=int((parts[6:7] or ["0"])[0]), input_slow=input_slow, step_seconds=step_seconds)


def write_heartbeat(path: Path, heartbeat: Heartbeat) -> None:
    """Atomically: the agent never reads a half-written heartbeat."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(heartbeat.to_text())
    os.replace(temp, path)


def read_heartbeat(path: Path) -> Optional[Heartbeat]:
    """The worker's last heartbeat, or None if there is none (yet)."""
    try:
        return Heartbeat.from_text(path.read_text())
    except FileNotFoundError:
        return None
