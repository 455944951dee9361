"""What a finished elastic job did, checked from its own records: events, index logs, checkpoints.

Read by `launch.report`, `launch.chaos` and the tests. Committed work is what survived: a round's steps up to the step
the next round restored from; steps after it were redone.
"""
import collections
import json
from typing import Dict, List

from tf_elastic.elastic.events import RunDirs, read_events, run_dirs
from tf_elastic.elastic.protocol import Event, RunDir


def index_records(run_dir: RunDirs) -> List[Dict]:
    """Every step's example indices, as the workers logged them in test mode (`--index_log`), from one
    run dir or several (host-local run dirs)."""
    records = []
    for path in sorted(p for d in run_dirs(run_dir) for p in RunDir(d).indices.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass  # a worker killed mid-line: that step was never committed either
    return records


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
    """Epoch -> how often committed work used each example."""
    by_epoch = collections.defaultdict(collections.Counter)
    for record in committed_records(run_dir):
        by_epoch[record["epoch"]].update(record["indices"])
    return by_epoch


def _extra_uses(by_epoch: Dict[int, collections.Counter]) -> int:
    return sum(c - 1 for counts in by_epoch.values() for c in counts.values() if c > 1)


def repeats(run_dir: RunDirs) -> int:
    """Extra uses of examples within an epoch among committed work."""
    return _extra_uses(uses_by_epoch(run_dir))


def exactly_once(run_dir: RunDirs, num_examples: int, largest_global_batch: int) -> Dict[str, int]:
    """Counts, over committed work, examples used more than once in an epoch and examples an epoch
    missed beyond its final remainder (each smaller than one global batch is allowed)."""
    by_epoch = uses_by_epoch(run_dir)
    repeated = _extra_uses(by_epoch)
    skipped = sum(max(0, num_examples - len(counts) - (largest_global_batch - 1)) for counts in by_epoch.values())
    return {"epochs": len(by_epoch), "repeated": repeated, "skipped": skipped}


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
