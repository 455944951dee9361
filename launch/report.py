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


CAUSES = ("training", "commits on the training path", "redone after a failure", "start-up",
          "rendezvous and restarts", "standby", "finishing")


def time_split(run_dir: RunDirs) -> Dict[str, Dict[str, float]]:
    """Each host's wall time (its agent's start to its exit) by cause, the pieces tiling it: from each of the
    host's events to the next, the host is in the state that event began (`_STATE_AFTER`). Training time
    then gives up the chief's commits that fall in it (what the step paid) and, in a round a failure ended,
    the time of the steps the next round trained again (`_redone`)."""
    events = read_events(run_dir)
    hosts = _host_of_worker_events(events)
    commits = [e for e in events if e["event"] == Event.COMMIT]
    restarts = {e["round"]: e["restarts"] for e in events if e["event"] == Event.RENDEZVOUS}
    resumed = {e["round"]: e["step"] for e in events if e["event"] == Event.RESTORE and e["rank"] == 0}
    reached: Dict[int, int] = {}
    for e in (e for e in events if e["event"] == Event.COLLECTIVE_FAILURE):
        reached[e["round"]] = max(reached.get(e["round"], 0), e["step"])
    by_host: Dict[str, List[Dict]] = {}
    for e in events:
        # A failure event belongs to the host it names, whoever wrote it: a killed host's ends its timeline.
        host = e.get("host") if e["event"] == Event.FAILURE else hosts.get(id(e))
        if e["event"] in _STATE_AFTER and host is not None:
            by_host.setdefault(host, []).append(e)
    split = {}
    for host, mine in sorted(by_host.items()):
        if mine[0]["event"] != Event.AGENT_START:
            continue
        causes = dict.fromkeys(CAUSES, 0.0)
        for event, following in zip(mine, mine[1:]):
            state = "standby" if event["event"] == Event.RENDEZVOUS and not event.get("ranks") \
                else _STATE_AFTER[event["event"]]
            length = following["time"] - event["time"]
            if state == "training":
                within = [c for c in commits if c["round"] == event["round"] and event["time"] <= c["time"]
                          < following["time"]]
                failed = restarts.get(event["round"] + 1, 0) > restarts.get(event["round"], 0)
                lost = _redone(event, following["time"], within, reached.get(event["round"]),
                               resumed.get(event["round"] + 1)) if failed else 0.0
                paid = min(length - lost, sum(c.get("seconds", 0.0) for c in within))
                causes["commits on the training path"] += paid
                causes["redone after a failure"] += lost
                length -= paid + lost
            causes[state] += length
        causes["wall"] = mine[-1]["time"] - mine[0]["time"]
        split[host] = causes
    return split


_STATE_AFTER = {  # (a rendezvous that gave the host no ranks begins "standby")
    Event.AGENT_START: "start-up", Event.RENDEZVOUS: "start-up", Event.FIRST_STEP: "training",
    Event.FAILURE: "rendezvous and restarts", Event.MEMBERSHIP_CHANGE: "rendezvous and restarts",
    Event.WORKERS_DONE: "finishing", Event.EXIT: "finishing",
}


def _host_of_worker_events(events: List[Dict]) -> Dict[int, str]:
    """id(event) -> host, for the agents' events and their workers' first steps (by round and rank)."""
    ranks = {(e["round"], e["rank"]): e["source"].split(":", 1)[1] for e in events
             if e["event"] == Event.WORKER_START and e["source"].startswith("agent:")}
    hosts, first = {}, set()
    for e in events:
        if e["source"].startswith("agent:"):
            hosts[id(e)] = e["source"].split(":", 1)[1]
        elif e["event"] == Event.FIRST_STEP and (e["round"], e["rank"]) in ranks:
            host = ranks[(e["round"], e["rank"])]
            if (host, e["round"]) not in first:  # a host's first rank to step starts its training
                first.add((host, e["round"]))
                hosts[id(e)] = host
    return hosts


def _redone(first_step: Dict, end: float, commits: List[Dict], reached: Optional[int],
            resumed_at: Optional[int]) -> float:
    """Seconds of a failed round spent on steps the next round trained again: the steps past the one it
    resumed from, up to the last the round reached (its workers' `collective_failure` events), at the
    round's average pace. Where a step is unknown: all that came after the round's last announced commit."""
    if reached is None or resumed_at is None:
        return end - max([c["time"] for c in commits], default=first_step["time"])
    done = reached - first_step["step"]
    if done <= 0 or reached <= resumed_at:
        return 0.0
    return (end - first_step["time"]) * min(1.0, (reached - resumed_at) / done)


def time_table(split: Dict[str, Dict[str, float]]) -> str:
    lines = ["| host | wall s | " + " | ".join(CAUSES) + " | goodput |", "|---|" + "---:|" * (len(CAUSES) + 2)]
    for host, causes in split.items():
        wall = causes["wall"] or 1.0
        lines.append(f"| {host} | {causes['wall']:.1f} | " + " | ".join(
            f"{causes[c]:.1f} ({causes[c] / wall:.0%})" for c in CAUSES) + f" | {causes['training'] / wall:.1%} |")
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
    print("\nWhere each host's time went (goodput: training time over wall time):\n")
    print(time_table(time_split(dirs)))
    if any(RunDir(d).indices.is_dir() for d in run_dirs(dirs)):
        print(f"\nsteps trained again after a restart (from the index logs): {audit.steps_redone(dirs)}")
    plot(dirs, dirs[0] / "run.png", size)
    print(f"\nplot: {dirs[0] / 'run.png'}")


if __name__ == "__main__":
    flags.DEFINE_list("run_dir", None, "The run directory (holding events.jsonl), or several, comma-separated "
                      "(hosts with run dirs of their own).", required=True)
    flags.DEFINE_integer("dataset_size", None, "Training examples an epoch, to place commits on the samples axis "
                         "(default: what the workers' events say).", lower_bound=1)
    app.run(main)
