"""The main job: an elastic run on this machine in which a host is lost and another joins.

Two agents ("host-a", "host-b") train a CNN with LARS on scikit-learn's digits (shipped offline) with
the file store. After the first commit host-b is killed (SIGKILL of its agent and worker: a lost
spot instance); host-a re-forms the group alone; then "host-c" joins and the group grows back to two.
At the end: a summary table from `events.jsonl` and `RUN_DIR/run.png` (loss and learning rate against
samples seen, with failures and resizes marked).

    python -m launch.main_job                      # about 1-2 minutes on 2 cores
"""
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from absl import app, flags

from launch.local_job import LocalJob

flags.DEFINE_string("run_dir", None, "Where the store, checkpoints, events and plot go (default: a new temp dir).")
flags.DEFINE_integer("epochs", 10, "Epochs to train.", lower_bound=2)
flags.DEFINE_integer("commit_every_steps", 20, "Workers commit every N steps.", lower_bound=1)
flags.DEFINE_bool("faults", True, "Kill host-b part-way and let host-c join (False: a plain two-host run).")
FLAGS = flags.FLAGS

DATASET_SIZE = 1437  # digits' training split in launch/data.py


def run_job(root: Path) -> LocalJob:
    job = LocalJob(root, ["--dataset=digits", f"--epochs={FLAGS.epochs}", "--per_replica_batch_size=16",
                          f"--commit_every_steps={FLAGS.commit_every_steps}", "--threads=1"],
                   ["--min_workers=1", "--max_workers=2", "--index_log", "--last_call=1"], job_id="main")
    say = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)
    try:
        say(f"starting host-a and host-b (run dir {job.run_dir})")
        job.start_agent("host-a")
        job.start_agent("host-b")
        first = job.first_step_after(0, world_size=2)
        say(f"round {first['round']}: training at world size 2")
        if FLAGS.faults:
            job.wait_for(lambda: [e for e in job.events("commit") if e["time"] > first["time"]], what="a commit")
            killed = time.time()
            job.kill_host("host-b")
            say("host-b killed (SIGKILL of its agent and worker)")
            alone = job.first_step_after(killed, world_size=1)
            say(f"round {alone['round']}: host-a trains alone, {alone['time'] - killed:.1f}s after the kill")
            joining = time.time()
            job.start_agent("host-c")
            say("host-c starting")
            grown = job.first_step_after(joining, world_size=2)
            say(f"round {grown['round']}: world size 2 again, {grown['time'] - joining:.1f}s after host-c started")
        codes = job.wait_agents(timeout=600)
        say(f"agents finished: {codes}")
        return job
    except BaseException:
        job.cleanup()
        raise


def summary(job: LocalJob) -> str:
    events = job.events()
    restores = {e["round"]: e for e in events if e["event"] == "restore" and e["rank"] == 0}
    firsts = {e["round"]: e for e in events if e["event"] == "first_step" and e["rank"] == 0}
    rounds = {e["round"]: e for e in events if e["event"] == "rendezvous" and e["round"] in restores}
    lines = ["| round | world size | why | restarts | restored at step | first step at |",
             "|---:|---:|---|---:|---:|---:|"]
    start = events[0]["time"]
    for number, rendezvous in sorted(rounds.items()):
        first = firsts.get(number)
        first_at = "-" if first is None else f"{first['time'] - start:.1f}s"
        lines.append(f"| {number} | {rendezvous['world_size']} | {rendezvous['reason']} | {rendezvous['restarts']} | "
                     f"{restores[number]['step']} | {first_at} |")
    failures = [e for e in events if e["event"] == "failure"]
    evaluation = [e for e in events if e["event"] == "evaluation"]
    commits = [e for e in events if e["event"] == "commit"]
    lines += ["", f"- failures detected: {len(failures)} ({', '.join(sorted({f['kind'] for f in failures})) or 'none'})",
              f"- final commit: epoch {commits[-1]['epoch']}, step {commits[-1]['step']}",
              f"- test accuracy: {evaluation[-1]['test_accuracy']:.4f}" if evaluation else "- test accuracy: n/a",
              f"- examples used more than once in an epoch (committed work): {_repeats(job, restores)}"]
    return "\n".join(lines)


def _repeats(job: LocalJob, restores: Dict[int, Dict]) -> int:
    import json

    counts = collections.defaultdict(collections.Counter)
    for path in (job.run_dir / "indices").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            later = [r["step"] for n, r in restores.items() if n > record["round"]]
            if not later or record["step"] <= min(later):
                counts[record["epoch"]].update(record["indices"])
    return sum(c - 1 for epoch in counts.values() for c in epoch.values() if c > 1)


def plot(job: LocalJob, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = lambda e: e["epoch"] * DATASET_SIZE + e["samples"]
    commits = [e for e in job.events("commit") if e.get("loss") is not None]
    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    loss_ax.plot([seen(e) for e in commits], [e["loss"] for e in commits], marker=".")
    lr_ax.step([seen(e) for e in commits], [e["learning_rate"] for e in commits], where="post", marker=".")
    restores = {e["round"]: e for e in job.events("restore", rank=0)}
    for rendezvous in job.events("rendezvous"):
        restore = restores.get(rendezvous["round"])
        if restore is None or rendezvous["round"] == 0:
            continue
        failure = rendezvous["restarts"] > 0 and "join" not in rendezvous["reason"]
        for ax in (loss_ax, lr_ax):
            ax.axvline(seen(restore), color="red" if failure else "grey", linestyle="--", linewidth=0.9)
        loss_ax.annotate(f"world {rendezvous['world_size']}: {rendezvous['reason'].split(' ')[0]}",
                         (seen(restore), loss_ax.get_ylim()[1]), fontsize=7, rotation=90, va="top")
    loss_ax.set_ylabel("training loss (at commits)")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("samples seen")
    loss_ax.set_title("tf_elastic main job (red: failure, grey: membership change)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: List[str]) -> int:
    del argv
    root = Path(FLAGS.run_dir or tempfile.mkdtemp(prefix="tf_elastic-main-"))
    root.mkdir(parents=True, exist_ok=True)
    job = run_job(root)
    print("\n" + summary(job))
    plot(job, job.run_dir / "run.png")
    print(f"\nplot: {job.run_dir / 'run.png'}\nevents: {job.run_dir / 'events.jsonl'}")
    return 0 if all(code == 0 for host, code in job.wait_agents().items() if host != "host-b") else 1


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
