"""`tf-elastic-status`: a job's status from its rendezvous store, without TensorFlow (works on etcd and the file
store): outcome, current round, members with ranks and addresses, standbys, blacklisted hosts and the time
they have left; with `--run_dir` (every host's, comma-separated, where readable) also the last commit, its
age and recent steps per second.

    python -m launch.status --rdzv=etcd://10.0.0.1:2379 --job_id=job1 --run_dir=/shared/run --watch=2
"""
import os
import time
from typing import List

from absl import app, flags

from tf_elastic.elastic.agent.status import read_status, render
from tf_elastic.elastic.flag_checks import require_finite_floats, run_program
from tf_elastic.elastic.protocol import Env
from tf_elastic.elastic.store import StoreError, StoreOptions, open_store

flags.DEFINE_string("rdzv", None, "The job's rendezvous store URL: file:///path or etcd://host:port[,host:port].")
flags.DEFINE_string("job_id", None, "The job's id (the agents' --job_id).")
flags.DEFINE_list("run_dir", [], "Run dirs whose events to read (every host's, where they are readable).")
flags.DEFINE_float("host_ttl", 1.0, "The agents' --host_ttl: on the file store, which times leases on the reader's "
                   "clock, the leases are read twice this far apart to tell a dead host from a live one.",
                   lower_bound=0.0)
flags.DEFINE_float("watch", 0.0, "Print again every this many seconds until interrupted (0: once).", lower_bound=0.0)
flags.DEFINE_string("rdzv_user", None, "etcd user (the password from TF_ELASTIC_RDZV_PASSWORD).")
flags.DEFINE_string("rdzv_ca_cert", None, "etcd TLS: the CA to verify the server against.")
flags.DEFINE_string("rdzv_cert", None, "etcd TLS: client certificate.")
flags.DEFINE_string("rdzv_key", None, "etcd TLS: client key.")
flags.mark_flags_as_required(["rdzv", "job_id"])
FLAGS = flags.FLAGS
require_finite_floats(__name__)


def main(argv: List[str]) -> int:
    del argv
    options = StoreOptions(user=FLAGS.rdzv_user, password=os.environ.get(Env.RDZV_PASSWORD),
                           ca_cert=FLAGS.rdzv_ca_cert, cert=FLAGS.rdzv_cert, key=FLAGS.rdzv_key)
    try:
        store = open_store(FLAGS.rdzv, options)
    except (ValueError, StoreError) as error:
        raise app.UsageError(str(error))
    try:
        while True:
            try:
                wait = 0.0 if store.notifies else FLAGS.host_ttl * 1.1
                text, code = render(read_status(store, FLAGS.job_id, FLAGS.run_dir, lease_wait=wait)), 0
            except StoreError as error:
                text, code = f"job {FLAGS.job_id}: the store cannot be read ({error})", 1
            print(text, flush=True)
            if not FLAGS.watch:
                return code
            time.sleep(FLAGS.watch)
            print(flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        store.close()


SYNOPSIS = """usage: tf-elastic-status --rdzv=URL --job_id=ID [--run_dir=DIR,...] [--watch=SECONDS]
   (or: python -m launch.status ...)

Prints a running job's status from its rendezvous store, and its last commit from the run dirs' events.

example:
  tf-elastic-status --rdzv=file:///tmp/rdzv --job_id=demo --run_dir=/tmp/run-a,/tmp/run-b --watch=2
"""


def run() -> None:
    """The entry point of `tf-elastic-status` (`flag_checks.run_program`)."""
    run_program(main, "tf-elastic-status", SYNOPSIS, __name__)


if __name__ == "__main__":
    run()
