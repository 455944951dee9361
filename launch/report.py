"""A run's story from `RUN_DIR/events.jsonl`: a summary table and `run.png`.

    tf-elastic-report --run_dir=RUN_DIR                                 # python -m launch.report in a checkout
    tf-elastic-report --run_dir=HOST_A_RUN_DIR,HOST_B_RUN_DIR           # host-local run dirs
"""
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from absl import app, flags

from tf_elastic.elastic.agent.round import why_round_began
from tf_elastic.elastic.events import RunDirs, read_events, run_dirs, straggler_key
from tf_elastic.elastic.flag_checks import run_program
from tf_elastic.elastic.protocol import Event, RunDir
from tf_elastic.elastic import audit


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
        why = why_round_began(rendezvous["reason"], rendezvous.get("lost"))
        lines.append(f"| {number} | {rendezvous['world_size']} | {why} | {rendezvous['restarts']} | "
                     f"{restores[number]['step']} | {first_at} |")
    # One failure, one line: a lost host is recorded by the host that watched its lease and by rank 0's agent.
    failures = list({(e["round"], e["kind"], e.get("host"), e.get("rank")): e for e in events
                     if e["event"] == Event.FAILURE}.values())
    exits = [e for e in events if e["event"] == Event.EXIT]
    evaluation = [e for e in events if e["event"] == Event.EVALUATION]
    commits = [e for e in events if e["event"] == Event.COMMIT]
    kinds = ", ".join(sorted({f["kind"] for f in failures})) or "none"
    lines += ["", f"- failures detected: {len(failures)} ({kinds})",
              f"- final commit: epoch {commits[-1]['epoch']}, step {commits[-1]['step']}" if commits else "- no commit",
              f"- test accuracy: {evaluation[-1]['test_accuracy']:.4f}" if evaluation else "- test accuracy: n/a",
              f"- last agent exit: {exits[-1]['host']}, code {exits[-1]['code']}: {exits[-1]['reason']}" if exits
              else "- no agent has exited"]
    starts = [e for e in events if e["event"] == Event.FIRST_STEP]
    if starts and any(RunDir(d).indices.is_dir() for d in run_dirs(run_dir)):
        counts = audit.exactly_once(run_dir, starts[-1]["examples"], max(e["global_batch"] for e in starts))
        lines.append(f"- examples trained more than once in an epoch (committed work, as the steps consumed them): "
                     f"{counts['repeated']}; missed beyond an epoch's remainder: {counts['skipped']}; steps that "
                     f"trained other than planned: {counts['off_plan']}")
    return "\n".join(lines)


CAUSES = ("training", "commits on the training path", "redone after a failure", "waiting for a straggler",
          "evaluation", "start-up", "rendezvous and restarts", "standby", "finishing")


def time_split(run_dir: RunDirs) -> Dict[str, Dict[str, float]]:
    """Each host's wall time (its agent's start to its exit) by cause, the pieces tiling it: from each of the
    host's events to the next, the host is in the state that event began (`_STATE_AFTER`); its first worker's
    evaluations (`evaluation_begin` to `_end`, fit's validation included) are carved out of whatever state
    they fall in. Training time then gives up the commits that fall in it (the chief's blocked time and the
    group check: in lockstep training every host waits for them at the next all-reduce), in a round a
    failure ended, the time of the steps the next round trained again (`_redone`), and while another
    host's worker is a straggler `s` times slower than the median (by compute; by input: the group would go
    `s` times faster if its input kept up), 1 - 1/s of the time for the slowest (`_straggler_spans`)."""
    events = read_events(run_dir)
    hosts = _host_of_worker_events(events)
    commits = [e for e in events if e["event"] == Event.COMMIT]
    failed_rounds = set(_failed_rounds(events))
    resumed, reached = _resumed_and_reached(events)
    slow = _straggler_spans(events)
    by_host: Dict[str, List[Dict]] = {}
    for e in events:
        # A failure event belongs to the host it names, whoever wrote it: a killed host's ends its timeline.
        host = e.get("host") if e["event"] == Event.FAILURE else hosts.get(id(e))
        if host is not None and (e["event"] in _STATE_AFTER or e["event"] in _EVALUATION):
            by_host.setdefault(host, []).append(e)
    split = {}
    for host, mine in sorted(by_host.items()):
        states = [e for e in mine if e["event"] in _STATE_AFTER]
        if states[0]["event"] != Event.AGENT_START:
            continue
        evaluations = _evaluations(mine, states[-1]["time"])
        causes = dict.fromkeys(CAUSES, 0.0)
        for event, following in zip(states, states[1:]):
            state = _STATE_AFTER[event["event"]]
            evaluating = _overlap(evaluations, event["time"], following["time"])
            length = following["time"] - event["time"] - evaluating
            causes["evaluation"] += evaluating
            if state == "training":
                within = [c for c in commits if c["round"] == event["round"] and event["time"] <= c["time"]
                          < following["time"]]
                failed = event["round"] in failed_rounds
                lost = min(length, max(0.0, _redone(event, following["time"] - evaluating, within, reached.get(
                    event["round"]), resumed.get(event["round"] + 1)))) if failed else 0.0
                paid = min(length - lost, sum(c.get("seconds", 0.0) + c.get("check_seconds", 0.0) for c in within))
                others = [(span, s) for span, other, s in slow if other != host]
                waited = min(length - paid - lost, _waited(others, event["time"], following["time"]))
                causes["commits on the training path"] += paid
                causes["redone after a failure"] += lost
                causes["waiting for a straggler"] += waited
                length -= paid + lost + waited
            causes[state] += length
        causes["wall"] = states[-1]["time"] - states[0]["time"]
        split[host] = causes
    return split


_STATE_AFTER = {
    Event.AGENT_START: "start-up", Event.RENDEZVOUS: "start-up", Event.STANDBY: "standby", Event.FIRST_STEP: "training",
    Event.FAILURE: "rendezvous and restarts", Event.MEMBERSHIP_CHANGE: "rendezvous and restarts",
    Event.COLLECTIVE_FAILURE: "rendezvous and restarts", Event.WORKERS_DONE: "finishing", Event.EXIT: "finishing",
}
_EVALUATION = (Event.EVALUATION_BEGIN, Event.EVALUATION_END)


def _resumed_and_reached(events: List[Dict]) -> Tuple[Dict[int, int], Dict[int, int]]:
    """Round -> the step its chief restored from; round -> the last step its workers reached before a
    collective failed (their `collective_failure` events)."""
    resumed = {e["round"]: e["step"] for e in events if e["event"] == Event.RESTORE and e["rank"] == 0}
    reached: Dict[int, int] = {}
    for e in (e for e in events if e["event"] == Event.COLLECTIVE_FAILURE):
        reached[e["round"]] = max(reached.get(e["round"], 0), e["step"])
    return resumed, reached


def samples_redone(run_dir: RunDirs) -> Tuple[int, int, int]:
    """(steps, samples, unknown): what rounds a failure ended trained and the next round trained again, the
    steps past the one it resumed from at the failed round's global batch, where a worker saw the collective
    fail at a known step; `unknown`: failed rounds without such a step (no collective failed: say, every
    worker was killed), whose time after their last commit `time_split` counts as redone."""
    events = read_events(run_dir)
    resumed, reached = _resumed_and_reached(events)
    batch = {e["round"]: e["global_batch"] for e in events if e["event"] == Event.FIRST_STEP and "global_batch" in e}
    steps = {r: max(0, step - resumed[r + 1]) for r, step in reached.items() if r + 1 in resumed}
    unknown = [r for r in _failed_rounds(events) if r not in reached and r in batch]
    return sum(steps.values()), sum(n * batch.get(r, 0) for r, n in steps.items()), len(unknown)


def _straggler_spans(events: List[Dict]) -> List[Tuple[Tuple[float, float], str, float]]:
    """((begin, end), host, slowness) of each straggler its agent reported: until it recovered, its host was
    evicted, or the round ended (the next round's rendezvous)."""
    spans = []
    for index, e in enumerate(events):
        if e["event"] != Event.STRAGGLER:
            continue
        end = next((later["time"] for later in events[index + 1:] if (
            later["event"] == Event.STRAGGLER_RECOVERED and straggler_key(later) == straggler_key(e))
            or (later["event"] == Event.EVICTED and later["host"] == e["host"])
            or (later["event"] == Event.RENDEZVOUS and later["round"] > e["round"])), events[-1]["time"])
        spans.append(((e["time"], end), e["host"], max(1.0, float(e["slowness"]))))
    return spans


def _failed_rounds(events: List[Dict]) -> List[int]:
    """Rounds that a counted failure ended (the next round's restart count is higher)."""
    restarts = {e["round"]: e["restarts"] for e in events if e["event"] == Event.RENDEZVOUS}
    return [r for r in sorted(restarts) if restarts.get(r + 1, 0) > restarts[r]]


def _evaluations(events: List[Dict], end: float) -> List[Tuple[float, float]]:
    """(begin, end) of each evaluation; one cut short (its worker died) ends at the host's next state."""
    spans, begun = [], None
    for e in events:
        if e["event"] == Event.EVALUATION_BEGIN:
            begun = e["time"]
        elif begun is not None and (e["event"] == Event.EVALUATION_END or e["event"] in _STATE_AFTER):
            spans.append((begun, e["time"]))
            begun = None
    return spans + ([(begun, end)] if begun is not None else [])


def _waited(spans: List[Tuple[Tuple[float, float], float]], begin: float, end: float) -> float:
    """Seconds of [begin, end) the group waited for stragglers, `spans` ((from, to), slowness): at each
    moment 1 - 1/s of the time for the slowest straggler s then (the group goes at the slowest's pace, so
    two at once cost what the slower costs, not their sum)."""
    cuts = sorted({begin, end, *(t for (a, b), _ in spans for t in (a, b) if begin < t < end)})
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        slowest = max((s for (first, last), s in spans if first <= a and b <= last), default=1.0)
        total += (1.0 - 1.0 / slowest) * (b - a)
    return total


def _overlap(spans: List[Tuple[float, float]], begin: float, end: float) -> float:
    return sum(max(0.0, min(end, b) - max(begin, a)) for a, b in spans)


def _host_of_worker_events(events: List[Dict]) -> Dict[int, str]:
    """id(event) -> host, for the agents' events and their first worker's (the lowest rank a host has in the
    round) first step, evaluations and collective failure (the host's round is over from then on)."""
    ranks = {(e["round"], e["rank"]): e["source"].split(":", 1)[1] for e in events
             if e["event"] == Event.WORKER_START and e["source"].startswith("agent:")}
    first_rank: Dict[Tuple[str, int], int] = {}
    for (round_, rank), host in ranks.items():
        first_rank[host, round_] = min(rank, first_rank.get((host, round_), rank))
    hosts, stepped = {}, set()
    for e in events:
        if e["source"].startswith("agent:"):
            hosts[id(e)] = e["source"].split(":", 1)[1]
            continue
        host = ranks.get((e.get("round"), e.get("rank")))
        if host is None or first_rank[host, e["round"]] != e["rank"]:
            continue
        if e["event"] in _EVALUATION or e["event"] == Event.COLLECTIVE_FAILURE:
            hosts[id(e)] = host
        elif e["event"] == Event.FIRST_STEP and (host, e["round"]) not in stepped:
            stepped.add((host, e["round"]))
            hosts[id(e)] = host
    return hosts


def _redone(first_step: Dict, end: float, commits: List[Dict], reached: Optional[int],
            resumed_at: Optional[int]) -> float:
    """Seconds of a failed round spent on steps the next round trained again: the steps past the one it
    resumed from, up to the last the round reached (its workers' `collective_failure` events), at the
    round's average pace (`end` leaves out its evaluations). Where a step is unknown: all that came after
    the round's last announced commit."""
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
    steps, samples, unknown = samples_redone(dirs)
    print(f"\nredone after failures: {steps} steps, {samples} samples, in the failed rounds whose last step a "
          f"worker saw" + (f"; {unknown} failed round(s) without a known last step, whose time after their last "
                           f"commit the time split counts as redone" if unknown else ""))
    if any(RunDir(d).indices.is_dir() for d in run_dirs(dirs)):
        print(f"steps trained again after a restart (from the index logs): {audit.steps_redone(dirs)}")
    plot(dirs, dirs[0] / "run.png", size)
    print(f"\nplot: {dirs[0] / 'run.png'}")


SYNOPSIS = """usage: tf-elastic-report --run_dir=DIR[,DIR...] [--dataset_size=N]
       (python -m launch.report in a checkout)

Prints a job's rounds and each host's time split by cause with its goodput, from the run dirs' events
(every host's, comma-separated), and writes run.png into the first run dir.
"""


def run() -> None:
    """The entry point of `tf-elastic-report` and `python -m launch.report`. Its flags are defined here, not
    at import, because the main job imports this module beside a `--run_dir` flag of its own."""
    flags.DEFINE_list("run_dir", None, "The run directory (holding events.jsonl), or several, comma-separated "
                      "(hosts with run dirs of their own).", required=True)
    flags.DEFINE_integer("dataset_size", None, "Training examples an epoch, to place commits on the samples axis "
                         "(default: what the workers' events say).", lower_bound=1)
    run_program(main, "tf-elastic-report", SYNOPSIS, __name__)


if __name__ == "__main__":
    run()
