"""A fault-injection soak: an elastic job on this machine under random faults, then invariants.

The faults (`tf_elastic.testing.soak`'s docstring lists every kind) come at random moments, each after the
group recovered from the previous one, every kind once before any repeats, paced so that every fault asked
for is injected. Afterwards, from events.jsonl, the index logs and the processes: the job finished with the
accuracy of a fault-free run of the same seed and length, committed progress never went backwards (but to
an older commit when the newer ones were lost or corrupted), every example was used exactly once per epoch
as the steps consumed them, no graceful leave was counted as a lost host, and no process, temp dir or port
was left behind.

    python -m launch.bench.chaos --faults=50 --seed=0 [--rdzv=etcd]
"""
import json
import tempfile
from pathlib import Path
from typing import List

from absl import app, flags

from tf_elastic.elastic.flag_checks import require_finite_floats
from tf_elastic.testing.local_job import stop_jobs_on_sigterm
from tf_elastic.testing.soak import failed_invariants, run_soak, table

flags.DEFINE_integer("faults", 10, "Faults to inject.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed for the faults' kinds, targets and timing (and the training).")
flags.DEFINE_enum("rdzv", "file", ["file", "etcd"], "Store backend (etcd: a throwaway etcd-server on 127.0.0.1).")
flags.DEFINE_integer("epochs", None, "Training epochs (default: enough to outlast the faults).", lower_bound=1)
flags.DEFINE_float("max_gap", 3.0, "Longest pause (s) between a recovery and the next fault.", lower_bound=0.0)
flags.DEFINE_float("accuracy_tolerance", 0.03, "Largest accepted drop of test accuracy against the fault-free run.",
                   lower_bound=0.0)
flags.DEFINE_bool("wait_for_spares", True, "Inject the next fault only once every host has a warm worker again.")
flags.DEFINE_string("out", None, "Directory for the runs (default: a temp dir).")
FLAGS = flags.FLAGS
require_finite_floats(__name__)


def main(argv: List[str]) -> int:
    del argv
    stop_jobs_on_sigterm()
    root = Path(FLAGS.out or tempfile.mkdtemp(prefix="tf_elastic-chaos-"))
    result = run_soak(root, FLAGS.faults, FLAGS.seed, FLAGS.rdzv, FLAGS.epochs, FLAGS.max_gap, FLAGS.wait_for_spares,
                      trainer="launch.train")
    (root / "chaos.json").write_text(json.dumps(result, indent=1))
    print(f"\nChaos soak: {len(result['faults'])} faults, seed {FLAGS.seed}, store {FLAGS.rdzv}, "
          f"{result['epochs']} epochs of digits\n")
    print(table(result))
    failed = failed_invariants(result, FLAGS.accuracy_tolerance)
    print("\ninvariants: " + ("all hold" if not failed else "FAILED: " + "; ".join(failed)))
    print(f"raw results: {root / 'chaos.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    app.run(lambda argv: exit(main(argv)))
