"""`tf-elastic-run` / `python -m launch.elastic_run`: the elastic agent's command line.

    tf-elastic-run --nproc=1 --min_workers=1 --max_workers=2 --rdzv=file:///tmp/rdzv --job_id=demo \\
        --run_dir=/tmp/run -- python -m launch.train --dataset=digits
"""
import sys
from typing import List

from absl import app, flags

from tf_elastic.elastic.agent import AgentConfig, ElasticAgent
from tf_elastic.elastic.rendezvous import Timeouts
from tf_elastic.elastic.store import open_store

flags.DEFINE_integer("nproc", 1, "Workers on this host.", lower_bound=1)
flags.DEFINE_integer("min_workers", 1, "Fewest workers the job trains with.", lower_bound=1)
flags.DEFINE_integer("max_workers", 1, "Most workers the job trains with.", lower_bound=1)
flags.DEFINE_string("rdzv", None, "Rendezvous store URL, e.g. file:///shared/rdzv.")
flags.DEFINE_string("job_id", None, "Job id: every store key lives under it.")
flags.DEFINE_string("run_dir", None, "Run directory (checkpoints, events.jsonl); shared by all hosts.")
flags.DEFINE_integer("max_restarts", 3, "Failures tolerated before the job fails (joins and leaves are free).",
                     lower_bound=0)
flags.DEFINE_float("heartbeat_timeout", 5.0, "Seconds of silence from a training worker that count as a hang.",
                   lower_bound=0.5)
flags.DEFINE_float("startup_timeout", 120.0, "Seconds a new worker may take to reach its first step.", lower_bound=1.0)
flags.DEFINE_float("monitor_interval", 0.2, "Seconds between checks of workers and store.", lower_bound=0.01)
flags.DEFINE_float("rendezvous_timeout", 300.0, "Seconds to wait for min_workers before failing.", lower_bound=0.1)
flags.DEFINE_float("last_call", 2.0, "Seconds a round stays open for stragglers once min_workers joined.",
                   lower_bound=0.0)
flags.DEFINE_float("survivor_wait", 30.0, "Seconds a round waits for a live survivor still stopping its workers.",
                   lower_bound=0.0)
flags.DEFINE_float("host_ttl", 1.0, "Seconds after its last keepalive that a host counts as lost.", lower_bound=0.2)
flags.DEFINE_float("stop_grace", 15.0, "Seconds between SIGTERM and SIGKILL when stopping workers.", lower_bound=0.0)
flags.DEFINE_string("advertise_addr", "127.0.0.1", "Address other hosts use to reach this host's workers.")
flags.DEFINE_string("host_id", None, "This host's id in the job (default: hostname-pid).")
flags.DEFINE_bool("warm_start", True, "Start each next worker ahead of its round (imports done before a restart).")
flags.DEFINE_bool("index_log", False, "Test mode: workers log the example indices they train on.")
FLAGS = flags.FLAGS


def _validate() -> None:
    for name in ("rdzv", "job_id", "run_dir"):
        if not getattr(FLAGS, name):
            raise app.UsageError(f"--{name} is required.")
    if FLAGS.min_workers > FLAGS.max_workers:
        raise app.UsageError(f"--min_workers={FLAGS.min_workers} must be <= --max_workers={FLAGS.max_workers}.")
    if FLAGS.monitor_interval >= FLAGS.heartbeat_timeout:
        raise app.UsageError(f"--monitor_interval={FLAGS.monitor_interval} must be < "
                             f"--heartbeat_timeout={FLAGS.heartbeat_timeout}.")
    if 2 * FLAGS.monitor_interval > FLAGS.host_ttl:
        raise app.UsageError(f"--monitor_interval={FLAGS.monitor_interval} must be at most half of "
                             f"--host_ttl={FLAGS.host_ttl}: the host lease is renewed every monitor interval.")


def main(argv: List[str]) -> int:
    command = argv[1:]
    if not command:
        raise app.UsageError("give the worker command after '--', e.g. -- python -m launch.train")
    _validate()
    try:
        store = open_store(FLAGS.rdzv)
    except ValueError as error:
        raise app.UsageError(str(error))
    config = AgentConfig(
        command=command, job_id=FLAGS.job_id, run_dir=FLAGS.run_dir, nproc=FLAGS.nproc,
        min_workers=FLAGS.min_workers, max_workers=FLAGS.max_workers, max_restarts=FLAGS.max_restarts,
        heartbeat_timeout=FLAGS.heartbeat_timeout, startup_timeout=FLAGS.startup_timeout,
        monitor_interval=FLAGS.monitor_interval, stop_grace=FLAGS.stop_grace, advertise_addr=FLAGS.advertise_addr,
        host_id=FLAGS.host_id or "",  # empty: the agent uses hostname-pid
        timeouts=Timeouts(rendezvous=FLAGS.rendezvous_timeout, last_call=FLAGS.last_call,
                          survivor_wait=FLAGS.survivor_wait, host_ttl=FLAGS.host_ttl),
        index_log=FLAGS.index_log, warm_start=FLAGS.warm_start)
    code = ElasticAgent(config, store).run()
    store.close()
    return code


def run() -> None:
    """Console-script entry point."""
    app.run(lambda argv: sys.exit(main(argv)))
