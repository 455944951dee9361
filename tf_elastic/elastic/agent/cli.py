"""`tf-elastic-run` (also `python -m tf_elastic.elastic.agent.cli`): the elastic agent's command line
(`SYNOPSIS`)."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from typing import List, Optional, Tuple

from absl import app, flags, logging

from tf_elastic.elastic.agent import decisions
from tf_elastic.elastic.agent.agent import AgentConfig, ElasticAgent
from tf_elastic.elastic.agent.round import Timeouts
from tf_elastic.elastic.agent.worker_output import ECHO_CHOICES
from tf_elastic.elastic.flag_checks import require_finite_floats, run_program
from tf_elastic.elastic.protocol import PATTERN_CHARACTERS, Env
from tf_elastic.elastic.stragglers import HURRIED_AT_MOST, HURRY_HISTORY, ProbeSettings, StragglerRules
from tf_elastic.elastic.store import BACKENDS, StoreError, StoreOptions, open_store

flags.DEFINE_string("nproc", "1", "Workers on this host: a number, or 'gpu' for one per visible GPU. The visible "
                    "GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi) are split evenly among them.")
flags.DEFINE_integer("min_workers", 1, "Fewest workers the job trains with.", lower_bound=1)
flags.DEFINE_integer("max_workers", 1, "Most workers the job trains with.", lower_bound=1)
flags.DEFINE_string("rdzv", None, "Rendezvous store URL: file:///SHARED/DIR or etcd://HOST:PORT[,HOST:PORT...] "
                    f"(schemes: {', '.join(sorted(BACKENDS))}).")
flags.DEFINE_string("rdzv_user", None, f"etcd user name (with --rdzv_password or {Env.RDZV_PASSWORD}). Without "
                    f"TLS (--rdzv_ca_cert) the password crosses the network in clear text.")
flags.DEFINE_string("rdzv_password", None, f"etcd password; prefer {Env.RDZV_PASSWORD} (argv is visible in ps).")
flags.DEFINE_string("rdzv_ca_cert", None, "TLS: CA certificate to verify etcd with (switches to https).")
flags.DEFINE_string("rdzv_cert", None, "TLS: client certificate for etcd (with --rdzv_key).")
flags.DEFINE_string("rdzv_key", None, "TLS: client key for etcd (with --rdzv_cert).")
flags.DEFINE_float("rdzv_request_timeout", None, "Seconds per store request (and file-store lock wait) before an "
                   "endpoint counts as down; at most --host_ttl / (6 x endpoints), so that a lease renewal ends "
                   "inside the lease (default: that).", lower_bound=0.01)
flags.DEFINE_float("rdzv_login_timeout", StoreOptions.login_timeout, "Seconds for an etcd password login (once per "
                   "token): etcd checks passwords with bcrypt, slow on a busy server.", lower_bound=0.01)
flags.DEFINE_string("job_token", None, f"Shared secret every agent of the job presents; an agent with another "
                    f"token is refused. Prefer {Env.JOB_TOKEN}: a flag's value is visible to every user in ps.")
flags.DEFINE_string("job_id", None, "Job id: every store key lives under it.")
flags.DEFINE_string("run_dir", None, "Run directory (commits, events.jsonl): host-local, or shared by the hosts.")
flags.DEFINE_integer("max_restarts", 3, "Failures tolerated before the job fails (joins and leaves are free).",
                     lower_bound=0)
flags.DEFINE_float("heartbeat_timeout", 3.0,
                   "Seconds of silence from a training worker (it beats every 0.5 s) that count as a hang.",
                   lower_bound=0.5)
flags.DEFINE_float("startup_timeout", 120.0, "Seconds a new worker may take to reach its first step.", lower_bound=1.0)
flags.DEFINE_float("monitor_interval", 0.2, "Seconds between checks of workers and store.", lower_bound=0.01)
flags.DEFINE_float("rendezvous_timeout", Timeouts.rendezvous, "Seconds to wait for min_workers before failing.",
                   lower_bound=0.1)
flags.DEFINE_float("last_call", Timeouts.last_call,
                   "Seconds a round stays open for stragglers once min_workers joined.", lower_bound=0.0)
flags.DEFINE_float("survivor_wait", Timeouts.survivor_wait,
                   "Seconds a round waits for a live survivor still stopping its workers.", lower_bound=0.0)
flags.DEFINE_float("host_ttl", Timeouts.host_ttl,
                   "Seconds after its last renewal that a host counts as lost; renewed every third of it (two etcd "
                   "requests each): at hundreds of hosts, 10. Below 3, an agent that its own busy workers keep off "
                   "the CPU for a second is counted lost.", lower_bound=0.2)
flags.DEFINE_float("stop_grace", 15.0, "Seconds between SIGTERM and SIGKILL when stopping workers (one more for "
                   "one that ignored it to write its threads' stacks to its log).", lower_bound=0.0)
flags.DEFINE_string("advertise_addr", None,
                    "Address other hosts use to reach this host's workers (default: this host name's address).")
flags.DEFINE_string("port_range", None, "LOW-HIGH: the workers' TF server ports come from this range (firewalls).")
flags.DEFINE_integer("blacklist_after", 2, "Failures of this host's own workers in a row that blacklist it.",
                     lower_bound=1)
flags.DEFINE_float("blacklist_cooldown", 60.0, "Seconds a blacklisted host stays out; doubled at each strike.",
                   lower_bound=0.0)
flags.DEFINE_string("host_id", None, "This host's id in the job: 1-128 letters, digits, '_', '.', '-' (default: the "
                    "host name). Stable across restarts (the blacklist is keyed by it); one live agent per id.")
flags.DEFINE_float("progress_timeout", None, "Seconds a worker may go without progress (a training step, an "
                   "evaluation batch, a commit) before it counts as hung (default: 10x the longest wait seen, "
                   "at least --progress_floor).", lower_bound=1.0)
flags.DEFINE_float("progress_floor", 60.0, "The derived --progress_timeout is never shorter.", lower_bound=1.0)
flags.DEFINE_list("preemption_signals", ["SIGTERM"], "Signals that make the agent commit and leave gracefully "
                  "(e.g. SIGTERM,SIGUSR1 for Slurm's --signal=USR1@90).")
flags.DEFINE_string("preemption_notice_url", None, "A metadata URL polled for a preemption notice (GCE "
                    ".../instance/preempted or .../maintenance-event, AWS .../spot/instance-action).")
flags.DEFINE_float("preemption_poll_interval", 1.0, "Seconds between polls of --preemption_notice_url.",
                   lower_bound=0.1)
flags.DEFINE_integer("world_size_divides", None, "Form only worlds whose number of workers divides this number; "
                     "extra workers wait as standby. With --batch_policy=global: the global batch divided by the "
                     "replicas each worker trains (1 a worker unless it drives several devices).", lower_bound=1)
flags.DEFINE_bool("warm_start", True, "Start each next worker ahead of its round (imports done before a restart).")
flags.DEFINE_bool("index_log", False, "Test mode: workers log the example indices they train on.")
flags.DEFINE_enum("echo_ranks", "all", ECHO_CHOICES, "Whose output the agent echoes, each line prefixed "
                  "[round R rank N]: every local worker's, rank 0's only, or none; error lines (tracebacks, E/F "
                  "log lines) always. Every worker's output also goes to RUN_DIR/logs/HOST/round-R/rank-N.log.")
flags.DEFINE_float("probe_every_seconds", ProbeSettings.every_seconds, "Seconds between the workers' straggler "
                   "probes, each a timed local forward and backward pass at a step the group agrees on (0: no "
                   "probes); longer, up to ten times, where the slowest probe of the workers not suspected of "
                   "straggling runs longer than --probe_seconds (a pass longer than it, a CPU quota), so the "
                   "group's probes keep to about --probe_seconds / --probe_every_seconds of its time. A worker over "
                   f"--straggler_factor is confirmed at half the interval (at most {HURRIED_AT_MOST} intervals of "
                   f"{HURRY_HISTORY}): at the "
                   "default, bench_straggler's slowed worker was reported 9-18 s after its slowdown.",
                   lower_bound=0.0)
flags.DEFINE_float("probe_seconds", ProbeSettings.seconds, "How long each probe runs its passes (at least 1.5 "
                   "periods of a CPU quota the worker runs under: a shorter probe can end before the quota stops it).",
                   lower_bound=0.001)
flags.DEFINE_float("straggler_factor", 1.5, "A worker whose probe takes this many times the group's median, "
                   "--straggler_window probes in a row, is a straggler (reported; evicted with --evict_stragglers).")
flags.DEFINE_integer("straggler_window", 3, "Probes in a row that make (and clear) a straggler. After the first "
                     f"over --straggler_factor the probes come at half the interval (at most {HURRIED_AT_MOST} "
                     f"intervals of {HURRY_HISTORY}): "
                     "at the defaults a slowdown of 8 + 4 + 4 s can be reported, and evicted for.", lower_bound=1)
flags.DEFINE_bool("evict_stragglers", False, "Leave gracefully while this host is a straggler (by its compute or "
                  "its input) the group trains faster without (never below --min_workers); after "
                  "--straggler_hold_off, rejoin once this host's own pass and input, timed alone, are within "
                  "--straggler_factor of the group's median pass and step.")
flags.DEFINE_float("straggler_hold_off", 30.0, "Seconds an evicted host sits out before it times its own pass "
                   "and input; doubled at each eviction.", lower_bound=0.0)
flags.DEFINE_float("probation_interval", 10.0, "Seconds between an evicted host's timings of its own pass and "
                   "input while either is still over --straggler_factor (its workers stay up between them).",
                   lower_bound=0.1)
FLAGS = flags.FLAGS

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MIN_REQUEST_TIMEOUT = 0.05  # seconds: below this a request to a healthy store on another machine times out

require_finite_floats(__name__)


def _validate() -> None:
    for name in ("rdzv", "job_id", "run_dir"):
        if not getattr(FLAGS, name):
            raise app.UsageError(f"--{name} is required.")
    for name in ("job_id", "host_id"):
        value = getattr(FLAGS, name)
        if value is not None and (not _NAME.fullmatch(value) or value in (".", "..")):
            raise app.UsageError(f"--{name}={value!r}: use 1-128 letters, digits, '_', '.', '-' "
                                 f"(it names store keys).")
    if FLAGS.min_workers > FLAGS.max_workers:
        raise app.UsageError(f"--min_workers={FLAGS.min_workers} must be <= --max_workers={FLAGS.max_workers}.")
    if FLAGS.monitor_interval >= FLAGS.heartbeat_timeout:
        raise app.UsageError(f"--monitor_interval={FLAGS.monitor_interval} must be < "
                             f"--heartbeat_timeout={FLAGS.heartbeat_timeout}.")
    _check_store_timeouts()
    if 2 * FLAGS.monitor_interval > FLAGS.host_ttl:
        raise app.UsageError(f"--monitor_interval={FLAGS.monitor_interval} must be at most half of "
                             f"--host_ttl={FLAGS.host_ttl}: the host lease is renewed every monitor interval.")


def _check_store_timeouts() -> None:
    """The rule that keeps a lease renewal inside its lease (`decisions.request_timeout_limit`)."""
    endpoints = _endpoints(FLAGS.rdzv)
    named = f"{endpoints} endpoint{'s' if endpoints > 1 else ''}"
    limit = decisions.request_timeout_limit(FLAGS.host_ttl, endpoints)
    if limit < MIN_REQUEST_TIMEOUT - 1e-9:  # (0.3 / 6 is 0.0499... in floating point)
        raise app.UsageError(f"--host_ttl={FLAGS.host_ttl:g} is too short for a store of {named}: a request could "
                             f"take only {limit:.3g}s; give --host_ttl of at least "
                             f"{6 * MIN_REQUEST_TIMEOUT * endpoints:g}")
    if FLAGS.rdzv_request_timeout is not None and FLAGS.rdzv_request_timeout > limit:
        raise app.UsageError(f"--rdzv_request_timeout={FLAGS.rdzv_request_timeout:g} must be at most --host_ttl / "
                             f"(6 x {named}) = {limit:.3g}: a lease renewal (due a third into the lease, two "
                             f"requests, maybe behind one more) must end inside the lease; raise --host_ttl or leave "
                             f"--rdzv_request_timeout out")


def _endpoints(url: str) -> int:
    """How many endpoints a store URL names (comma-separated, as etcd://A:2379,B:2379; a file store: one). A
    URL that does not parse counts one: `open_store` names what is wrong with it."""
    try:
        return max(1, len([e for e in urllib.parse.urlparse(url).netloc.split(",") if e]))
    except ValueError:
        return 1


def _check_command(program: str) -> None:
    """The worker command's program exists (a typo ends here, in one line, not in a traceback per round)."""
    found = shutil.which(program) if os.sep not in program else (program if os.access(program, os.X_OK) else None)
    if found is None:
        raise app.UsageError(f"the worker command {program!r} is not an executable program (not on PATH, or not "
                             f"executable): check its spelling, e.g. -- tf-elastic-train or -- python my_script.py")


def _usable_run_dir(run_dir: str) -> str:
    """`--run_dir` as an absolute path (`~` expanded: the workers may start elsewhere), created and writable;
    checked before anything is created in the store's directory."""
    path = os.path.abspath(os.path.expanduser(run_dir))
    if any(c in path for c in PATTERN_CHARACTERS):  # the workers' commits would be refused: say so before they start
        raise app.UsageError(f"--run_dir={run_dir}: TensorFlow reads a checkpoint's path as a pattern, so commits "
                             f"under a path with any of {' '.join(PATTERN_CHARACTERS)} could not be restored; use "
                             f"a path without them")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise app.UsageError(f"--run_dir={run_dir}: cannot be used ({error.strerror or error}); give a directory "
                             f"this host can create and write") from None
    return path


def _port_range() -> Optional[Tuple[int, int]]:
    if FLAGS.port_range is None:
        return None
    low, _, high = FLAGS.port_range.partition("-")
    if not (low.isdigit() and high.isdigit() and 1024 <= int(low) <= int(high) <= 65535):
        raise app.UsageError(f"--port_range={FLAGS.port_range!r}: expected LOW-HIGH with 1024 <= LOW <= HIGH <= 65535.")
    if int(high) - int(low) + 1 < _nproc():
        raise app.UsageError(f"--port_range={FLAGS.port_range} holds fewer ports than --nproc={FLAGS.nproc}.")
    return int(low), int(high)


def visible_gpus() -> List[str]:
    """This host's GPUs as CUDA numbers them: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]


def _nproc() -> int:
    if FLAGS.nproc == "gpu":
        count = len(visible_gpus())
        if not count:
            raise app.UsageError("--nproc=gpu: no GPU is visible (CUDA_VISIBLE_DEVICES, nvidia-smi).")
        return count
    if not FLAGS.nproc.isdigit() or int(FLAGS.nproc) < 1:
        raise app.UsageError(f"--nproc={FLAGS.nproc!r}: a number >= 1, or gpu.")
    return int(FLAGS.nproc)


def _advertise_addr() -> str:
    """The given address if it resolves (it need not be this host's: NAT), else this host name's."""
    if FLAGS.advertise_addr:
        try:
            socket.getaddrinfo(FLAGS.advertise_addr, None)
        except (OSError, UnicodeError) as error:
            raise app.UsageError(f"--advertise_addr={FLAGS.advertise_addr!r} does not resolve ({error}).") from None
        return FLAGS.advertise_addr
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError as error:
        raise app.UsageError(f"cannot resolve this host's name ({error}); give --advertise_addr.") from None


def _signals() -> Tuple[int, ...]:
    try:
        chosen = tuple(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
                       for name in FLAGS.preemption_signals)
    except KeyError as error:
        raise app.UsageError(f"--preemption_signals: unknown signal {error} (e.g. SIGTERM,SIGUSR1).") from None
    uncatchable = [s.name for s in chosen if s in (signal.SIGKILL, signal.SIGSTOP)]
    if uncatchable:
        raise app.UsageError(f"--preemption_signals: {', '.join(uncatchable)} cannot be caught, so it cannot "
                             f"start a graceful leave; use a catchable signal (e.g. SIGTERM,SIGUSR1).")
    return chosen


def main(argv: List[str]) -> int:
    command = argv[1:]
    if not command:
        raise app.UsageError("give the worker command after '--', e.g. -- tf-elastic-train --dataset=digits")
    _validate()
    _check_command(command[0])
    run_dir = _usable_run_dir(FLAGS.run_dir)
    nproc = _nproc()
    try:
        devices = decisions.assign_devices(visible_gpus(), nproc)
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    if bool(FLAGS.rdzv_cert) != bool(FLAGS.rdzv_key):
        raise app.UsageError("--rdzv_cert and --rdzv_key go together.")
    if FLAGS.rdzv_user and not (FLAGS.rdzv_ca_cert or FLAGS.rdzv_cert):
        logging.warning("--rdzv_user without TLS (--rdzv_ca_cert): the password goes to etcd in clear text")
    options = StoreOptions(user=FLAGS.rdzv_user,
                           password=FLAGS.rdzv_password or os.environ.get(Env.RDZV_PASSWORD),
                           ca_cert=FLAGS.rdzv_ca_cert, cert=FLAGS.rdzv_cert, key=FLAGS.rdzv_key,
                           request_timeout=FLAGS.rdzv_request_timeout or decisions.request_timeout_limit(
                               FLAGS.host_ttl, _endpoints(FLAGS.rdzv)),
                           login_timeout=FLAGS.rdzv_login_timeout)
    try:
        store = open_store(FLAGS.rdzv, options)
    except (ValueError, StoreError) as error:
        raise app.UsageError(str(error))
    config = AgentConfig(
        command=command, job_id=FLAGS.job_id, run_dir=run_dir, nproc=nproc, devices=devices,
        min_workers=FLAGS.min_workers, max_workers=FLAGS.max_workers, max_restarts=FLAGS.max_restarts,
        heartbeat_timeout=FLAGS.heartbeat_timeout, startup_timeout=FLAGS.startup_timeout,
        monitor_interval=FLAGS.monitor_interval, stop_grace=FLAGS.stop_grace, advertise_addr=_advertise_addr(),
        host_id=FLAGS.host_id or "",  # empty: the agent uses the host name
        timeouts=Timeouts(rendezvous=FLAGS.rendezvous_timeout, last_call=FLAGS.last_call,
                          survivor_wait=FLAGS.survivor_wait, host_ttl=FLAGS.host_ttl),
        index_log=FLAGS.index_log, warm_start=FLAGS.warm_start,
        job_token=FLAGS.job_token or os.environ.get(Env.JOB_TOKEN), port_range=_port_range(),
        blacklist_after=FLAGS.blacklist_after, blacklist_cooldown=FLAGS.blacklist_cooldown,
        progress_timeout=FLAGS.progress_timeout, progress_floor=FLAGS.progress_floor,
        preemption_signals=_signals(), preemption_notice_url=FLAGS.preemption_notice_url,
        preemption_poll_interval=FLAGS.preemption_poll_interval, world_size_divides=FLAGS.world_size_divides,
        echo_ranks=FLAGS.echo_ranks, probe=_probe_settings(), evict_stragglers=FLAGS.evict_stragglers,
        straggler_hold_off=FLAGS.straggler_hold_off, probation_interval=FLAGS.probation_interval)
    code = ElasticAgent(config, store).run()
    store.close()
    return code


def _probe_settings() -> ProbeSettings:
    try:
        rules = StragglerRules(FLAGS.straggler_factor, FLAGS.straggler_window)
    except ValueError as error:
        raise app.UsageError(str(error))
    return ProbeSettings(FLAGS.probe_every_seconds, FLAGS.probe_seconds, rules, FLAGS.min_workers)


SYNOPSIS = """usage: tf-elastic-run [FLAGS] -- COMMAND [ARGS...]

Runs COMMAND as this host's workers of an elastic job, one agent per host: joins the job's rounds through the
store, restarts the workers at the new size when a worker dies, hangs or is preempted, or a host joins or leaves.

example (two agents on one machine sharing a file store; on separate hosts --host_id defaults to the host name):
  tf-elastic-run --host_id=a --min_workers=1 --max_workers=2 --rdzv=file:///tmp/rdzv --job_id=demo \\
      --run_dir=/tmp/run -- tf-elastic-train --dataset=digits &
  tf-elastic-run --host_id=b --min_workers=1 --max_workers=2 --rdzv=file:///tmp/rdzv --job_id=demo \\
      --run_dir=/tmp/run -- tf-elastic-train --dataset=digits
"""


def run() -> None:
    """The entry point of `tf-elastic-run`, `python -m tf_elastic.elastic.agent.cli` and `python -m launch.elastic_run`
    (`flag_checks.run_program`)."""
    run_program(main, "tf-elastic-run", SYNOPSIS, __name__,
                arguments=sys.argv[1:sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:])


if __name__ == "__main__":
    run()
