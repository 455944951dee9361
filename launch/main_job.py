"""The main job: an elastic run on this machine in which a host is lost and another joins.

Two agents ("host-a", "host-b") train a CNN with LARS on scikit-learn's digits (shipped offline) with
the file store. Hosts share no filesystem: each has a run dir of its own (`ROOT/hosts/HOST`: its
commits and events), and the chief's durable copies go to `ROOT/durable`, standing in for a bucket.
After the first commit host-b is killed (SIGKILL of its agent and worker: a lost spot instance); host-a
re-forms the group alone; then "host-c" joins with an empty disk, receives the state from host-a over
the collectives, and the group grows back to two.
At the end: a summary table from every host's `events.jsonl` and `ROOT/run.png` (loss and learning
rate against samples seen, with failures and resizes marked).

    python -m launch.main_job                      # about 1-2 minutes on 2 cores
    python -m tf_elastic.launch.main_job           # the same, from the installed wheel
"""
import sys
import tempfile
import time
from pathlib import Path
from typing import List

from absl import app, flags

from . import report
from tf_elastic.elastic.protocol import Event, RunDir
from tf_elastic.testing.local_job import LocalJob, stop_jobs_on_sigterm

flags.DEFINE_string("run_dir", None, "Root of the job: the store, each host's run dir, the durable copies and "
                    "the plot (default: a new temp dir).")
flags.DEFINE_integer("epochs", 40, "Epochs to train (long enough for the kill and the join to happen mid-run).",
                     lower_bound=2)
flags.DEFINE_integer("commit_every_steps", 20, "Workers commit every N steps.", lower_bound=1)
flags.DEFINE_bool("faults", True, "Kill host-b part-way and let host-c join (False: a plain two-host run).")
FLAGS = flags.FLAGS


def run_job(root: Path) -> LocalJob:
    # A decaying schedule: a constant LARS learning rate leaves the loss flat at 0.15-0.2 (0.925 accuracy).
    job = LocalJob(root, ["--dataset=digits", f"--epochs={FLAGS.epochs}", "--per_replica_batch_size=16",
                          "--base_schedule=warmup_cosine",
                          f"--commit_every_steps={FLAGS.commit_every_steps}", "--threads=1",
                          f"--checkpoint_dir={root / 'durable'}"],
                   ["--min_workers=1", "--max_workers=2", "--index_log", "--last_call=1"], job_id="main",
                   host_run_dirs=True, trainer=f"{__package__}.train")
    say = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)
    try:
        say(f"starting host-a and host-b (run dirs {job.run_dir_of('HOST')}, durable copies {root / 'durable'})")
        job.start_agent("host-a")
        job.start_agent("host-b")
        first = job.first_step_after(0, world_size=2)
        say(f"round {first['round']}: training at world size 2")
        if FLAGS.faults:
            job.wait_for(lambda: [e for e in job.events(Event.COMMIT) if e["time"] > first["time"]], what="a commit")
            job.wait_for(lambda: job.events(Event.SPARE_READY, source="agent:host-a"), what="host-a's warm spare")
            killed = time.time()
            job.kill_host("host-b")
            say("host-b killed (SIGKILL of its agent and worker)")
            alone = job.first_step_after(killed, world_size=1)
            say(f"round {alone['round']}: host-a trains alone, {alone['time'] - killed:.1f}s after the kill")
            joining = time.time()
            job.start_agent("host-c")
            say("host-c starting")
            grown = job.first_step_after(joining, world_size=2)
            opened = [e["time"] for e in job.events(Event.MEMBERSHIP_CHANGE, source="agent:host-a")
                      if e["time"] > joining]
            say(f"round {grown['round']}: world size 2 again, {grown['time'] - opened[0]:.1f}s after host-c joined "
                f"({grown['time'] - joining:.1f}s after it started, its warm-up included)")
        codes = job.wait_agents(timeout=600)
        say(f"agents finished: {codes}")
        return job
    except BaseException:
        job.cleanup()
        raise


def main(argv: List[str]) -> int:
    del argv
    stop_jobs_on_sigterm()
    root = Path(FLAGS.run_dir or tempfile.mkdtemp(prefix="tf_elastic-main-")).resolve()  # agents run elsewhere
    root.mkdir(parents=True, exist_ok=True)
    job = run_job(root)
    print("\n" + report.summary(job.run_dirs))
    print("\nWhere each host's time went (goodput: training time over wall time):\n")
    print(report.time_table(report.time_split(job.run_dirs)))
    report.plot(job.run_dirs, root / "run.png", dataset_size=report.dataset_size(job.run_dirs))
    print(f"\nplot: {root / 'run.png'}\nevents: " + ", ".join(str(RunDir(d).events) for d in job.run_dirs))
    return 0 if all(code == 0 for host, code in job.wait_agents().items() if host != "host-b") else 1


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
