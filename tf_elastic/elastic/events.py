"""`RUN_DIR/events.jsonl`: one JSON object per line, appended by agents and workers alike."""
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Union

from tf_elastic.elastic.protocol import Event, RunDir


class EventLog:
    """Appends events under an exclusive lock, so lines from several processes never interleave."""

    def __init__(self, run_dir: Union[str, Path], source: str):
        self.path = RunDir(run_dir).events
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.source = source

    def write(self, event: Event, **fields: Any) -> None:
        record = {"time": time.time(), "event": Event(event).value, "source": self.source, "pid": os.getpid(), **fields}
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(line)
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)


RunDirs = Union[str, Path, Sequence[Union[str, Path]]]


def run_dirs(run_dir: RunDirs) -> List[Path]:
    """One run dir, or several (host-local run dirs: each host keeps its own events), as a list."""
    return [Path(run_dir)] if isinstance(run_dir, (str, Path)) else [Path(d) for d in run_dir]


def read_events(run_dir: RunDirs) -> List[Dict[str, Any]]:
    """All events of a run, in file order (of several run dirs: merged by time); a torn last line (a
    process killed mid-write) is skipped."""
    dirs = run_dirs(run_dir)
    if len(dirs) == 1:
        return list(_parse(RunDir(dirs[0]).events))
    return sorted((e for d in dirs for e in _parse(RunDir(d).events)), key=lambda e: e["time"])


def straggler_key(record: Dict[str, Any]) -> tuple:
    """(host, rank, cause) of a `straggler` or `straggler_recovered` record: which recovery ends which
    straggler (a record written before causes were recorded is a compute straggler's)."""
    return record.get("host"), record.get("rank"), record.get("cause", "compute")


def _parse(path: Path) -> Iterator[Dict[str, Any]]:
    if not path.exists():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue
