"""A run's story from `RUN_DIR/events.jsonl`: a summary table and `run.png`.

    python -m launch.report --run_dir=RUN_DIR
    python -m launch.report --run_dir=HOST_A_RUN_DIR,HOST_B_RUN_DIR   # host-local run dirs
"""
from pathlib import Path
from typing import Dict, List, Optional

from absl import app, flags

from tf_elastic.elastic.events import RunDirs, read_events, run_dirs
from tf_elastic.elastic.protocol import Event, RunDir
from tf_elastic.testing import audit


def _by_round(events: List[Dict], name: str) -> Dict[int, Dict]:
    return {e["round"]: e for e in events if e["event"] == name and e.get("rank", 0) == 0}


def summary(run_dir: RunDirs) -> str:
    """Rounds that trained (world size, why, restarts, restore point, first step), then the outcome."""
    events = read_events(run_dir)
    restores, firsts = _by_round(events, Event.RESTORE), _by_round(events, Event.FIRST_STEP)
    rounds = {e["round"]: e for e in events if e["event"] == Event.RENDEZVOUS and e["round"] in restores}
    start = events[0]["time"]
    lines = ["| round | world size | why | restarts | restored at step | first step at |",
             "|---:|---:|---|---:|---:|---:|"]
    for number, rendezvous in sorted(rounds.items()):
        first = firsts.get(number)
        first_at = "-" if first is None else f"{first['time'] - start:.1f}s"
        # The reason is what the host that opened the round saw (a survivor's collective failing); `lost`
        # names the hosts whose lease was gone when the round froze: the failure's culprit.
        why = rendezvous["reason"] + (f"; lost: {', '.join(rendezvous['lost'])}" if rendezvous.get("lost") else "")
        lines.append(f"| {number} | {rendezvous['world_size']} | {why} | {rendezvous['restarts']} | "
                     f"{restores[number]['step']} | {first_at} |")
    failures = [e for e in events if e["event"] == Event.FAILURE]
    evaluation = [e for e in events if e["event"] == Event.EVALUATION]
    commits = [e for e in events if e["event"] == Event.COMMIT]
    kinds = ", ".join(sorted({f["kind"] for f in failures})) or "none"
    lines += ["", f"- failures detected: {len(failures)} ({kinds})",
              f"- final commit: epoch {commits[-1]['epoch']}, step {commits[-1]['step']}" if commits else "- no commit",
              f"- test accuracy: {evaluation[-1]['test_accuracy']:.4f}" if evaluation else "- test accuracy: n/a"]
    if any(RunDir(d).indices.is_dir() for d in run_dirs(run_dir)):
        lines.append(f"- examples used more than once in an epoch (committed work): {audit.repeats(run_dir)}")
    return "\n".join(lines)


def plot(run_dir: RunDirs, path: Path, dataset_size: int) -> None:
    """Loss and learning rate at each commit against samples seen; failures red, membership changes grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = read_events(run_dir)
    seen = lambda e: e["epoch"] * dataset_size + e["samples"]
    commits = [e for e in events if e["event"] == Event.COMMIT and e.get("loss") is not None]
    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    loss_ax.plot([seen(e) for e in commits], [e["loss"] for e in commits], marker=".")
    lr_ax.step([seen(e) for e in commits], [e["learning_rate"] for e in commits], where="post", marker=".")
    restores = _by_round(events, Event.RESTORE)
    previous = 0
    for rendezvous in (e for e in events if e["event"] == Event.RENDEZVOUS and e["source"].startswith("agent:")):
        restore = restores.get(rendezvous["round"])
        if restore is None or rendezvous["round"] == 0 or rendezvous["round"] <= previous:
            continue
        previous = rendezvous["round"]
        failure = rendezvous["restarts"] > max((r["restarts"] for r in events if r["event"] == Event.RENDEZVOUS
                                                and r["round"] < rendezvous["round"]), default=0)
        for ax in (loss_ax, lr_ax):
            ax.axvline(seen(restore), color="red" if failure else "grey", linestyle="--", linewidth=0.9)
        loss_ax.annotate(f"world {rendezvous['world_size']}: {rendezvous['reason'].split(' ')[0]}",
                         (seen(restore), max(e["loss"] for e in commits)), fontsize=7, rotation=90, va="top")
    loss_ax.set_ylabel("training loss (at commits)")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("samples seen")
    loss_ax.set_title("tf_elastic run (red: failure, grey: membership change)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def dataset_size(run_dir: RunDirs) -> Optional[int]:
    """Training examples an epoch, as the workers' `first_step` events say (None: events from before they did)."""
    sizes = [e["examples"] for e in read_events(run_dir) if e["event"] == Event.FIRST_STEP and e.get("examples")]
    return max(sizes) if sizes else None


def main(argv: List[str]) -> None:
    del argv
    dirs = [Path(d) for d in flags.FLAGS.run_dir]
    size = flags.FLAGS.dataset_size or dataset_size(dirs)
    if size is None:
        raise app.UsageError("--dataset_size: these events do not say how many examples an epoch has; give it")
    print(summary(dirs))
    plot(dirs, dirs[0] / "run.png", size)
    print(f"\nplot: {dirs[0] / 'run.png'}")


if __name__ == "__main__":
    flags.DEFINE_list("run_dir", None, "The run directory (holding events.jsonl), or several, comma-separated "
                      "(hosts with run dirs of their own).", required=True)
    flags.DEFINE_integer("dataset_size", None, "Training examples an epoch, to place commits on the samples axis "
                         "(default: what the workers' events say).", lower_bound=1)
    app.run(main)
