"""What a finished elastic job did, checked from its own records: events, index logs, checkpoints.

Read by `launch.report`, `launch.bench.chaos` and the tests. Committed work is what survived: a round's steps up to
the step the next round restored from; steps after it were redone.
"""
import collections
import json
from pathlib import Path
from typing import Dict, List, Tuple

from tf_elastic.elastic.events import RunDirs, read_events, run_dirs
from tf_elastic.elastic.protocol import Event, RunDir


def index_records(run_dir: RunDirs) -> List[Dict]:
    """Every step's example indices as its replicas really trained them, in test mode (`--index_log`), from
    one run dir or several (host-local run dirs). Each is the trainer's record of the step (round, rank,
    epoch, step; `planned`: the plan's indices) with `indices`: what the step consumed. A step that trained
    what the trainer never counted gets epoch -1 (`exactly_once` counts it as `off_plan`)."""
    records = []
    for path in sorted(p for d in run_dirs(run_dir) for p in RunDir(d).indices.glob("*.jsonl")):
        counted = {}
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a worker killed mid-line: that step was never committed either
            counted[record["step"]] = dict(record, planned=record["indices"], indices=[])
        round_, rank = (int(n) for n in path.stem[len("round"):].split("-rank"))
        for step, indices in _consumed(path.with_suffix(".consumed")).items():
            record = counted.get(step) or dict(round=round_, rank=rank, epoch=-1, step=step, planned=[])
            counted[step] = dict(record, indices=indices)
        records.extend(counted.values())
    return records


def _consumed(path: Path) -> Dict[int, List[int]]:
    """Step -> the indices its replicas trained, from `worker.consumed`'s lines."""
    steps: Dict[int, List[int]] = {}
    for step, indices in step_lines(path):
        steps.setdefault(step, []).extend(indices)
    return steps


def step_lines(path: Path) -> List[Tuple[int, List[int]]]:
    """(step, indices) of each line `STEP [I I ...]` that `tf.print` wrote (one a replica's step), in order;
    a line cut short by a killed worker is left out (that step was never committed either)."""
    lines = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
        head, _, rest = line.partition(" ")
        if head.isdigit() and rest.startswith("[") and rest.endswith("]"):
            lines.append((int(head), [int(t) for t in rest.strip("[]").split()]))
    return lines


def restores(run_dir: RunDirs) -> Dict[int, int]:
    """Round -> the step its chief restored from."""
    return {e["round"]: e["step"] for e in read_events(run_dir) if e["event"] == Event.RESTORE and e["rank"] == 0}


def committed_records(run_dir: RunDirs) -> List[Dict]:
    """The index records of steps that survived: each round's up to the step the next round restored."""
    restored = restores(run_dir)
    committed = []
    for record in index_records(run_dir):
        later = [step for round_, step in restored.items() if round_ > record["round"]]
        if not later or record["step"] <= min(later):
            committed.append(record)
    return committed


def uses_by_epoch(run_dir: RunDirs) -> Dict[int, collections.Counter]:
    """Epoch -> how often committed work trained each example."""
    return _uses_by_epoch(committed_records(run_dir))


def _uses_by_epoch(records: List[Dict]) -> Dict[int, collections.Counter]:
    by_epoch = collections.defaultdict(collections.Counter)
    for record in records:
        if record["epoch"] >= 0:
            by_epoch[record["epoch"]].update(record["indices"])
    return by_epoch


def _extra_uses(by_epoch: Dict[int, collections.Counter]) -> int:
    return sum(c - 1 for counts in by_epoch.values() for c in counts.values() if c > 1)


def exactly_once(run_dir: RunDirs, num_examples: int, largest_global_batch: int,
                 stopped: bool = False) -> Dict[str, int]:
    """Counts, over committed work, examples trained more than once in an epoch, examples an epoch missed
    beyond its final remainder (each smaller than one global batch is allowed), and `off_plan`: steps
    whose replicas trained other examples than the plan gave them (or that the trainer never counted).
    `stopped`: the job was stopped before its end (every host left), so its last epoch may be partial."""
    committed = committed_records(run_dir)
    by_epoch = _uses_by_epoch(committed)
    repeated = _extra_uses(by_epoch)
    partial = max(by_epoch, default=None) if stopped else None
    whole = [counts for epoch, counts in by_epoch.items() if epoch != partial]
    skipped = sum(max(0, num_examples - len(counts) - (largest_global_batch - 1)) for counts in whole)
    off_plan = sum(sorted(r["indices"]) != sorted(r["planned"]) for r in committed)
    return {"epochs": len(by_epoch), "repeated": repeated, "skipped": skipped, "off_plan": off_plan}


def steps_redone(run_dir: RunDirs) -> int:
    """Steps trained, then thrown away by a restart to an earlier commit."""
    restored = restores(run_dir)
    reached = collections.defaultdict(int)
    for record in index_records(run_dir):
        reached[record["round"]] = max(reached[record["round"]], record["step"])
    redone = 0
    for round_, step in restored.items():
        earlier = [r for r in reached if r < round_]
        if earlier:
            redone += max(0, reached[max(earlier)] - step)
    return redone
