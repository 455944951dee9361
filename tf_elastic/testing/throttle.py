"""Slows a process and everything it starts, from outside, for the straggler tests and `bench_straggler`:
the cgroup `cpu` controller's CFS quota (v1 `cpu.cfs_quota_us`, v2 `cpu.max`) where this machine lets us
make a cgroup, else a duty cycle of real SIGSTOP and SIGCONT. Nothing in the slowed processes knows.

A process started by a member of the cgroup is a member too: throttling an agent throttles the workers it
starts later; `add` also moves the ones it started already.
"""
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

PERIOD_US = 100_000  # the CFS period: a quota of q cores runs q * 100 ms of every 100 ms


def _cgroup_root() -> Optional[Path]:
    """A writable cgroup directory with the cpu controller (v1 first, then v2), or None."""
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1
    try:
        enabled = "cpu" in (v2 / "cgroup.subtree_control").read_text().split()
    except OSError:
        enabled = False
    return v2 if enabled and os.access(v2, os.W_OK) else None


def children(pid: int) -> List[int]:
    """The processes `pid`'s threads started, from /proc's children lists."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in task.read_text().split()]
        except OSError:
            pass  # the task ended meanwhile
    return found


def move_to_cgroup(cgroup: Path, pid: int) -> bool:
    """Moves process `pid` (all its threads) into `cgroup`; False where it ended meanwhile."""
    try:
        (cgroup / "cgroup.procs").write_text(str(pid))
        return True
    except OSError:
        return False


def descendants(pid: int, visit: Callable[[int], bool] = lambda pid: True) -> List[int]:
    """`pid` and every process below it; `visit(process)` runs before its children are read (False: it ended,
    and is left out)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        if visit(current):
            found.append(current)
            queue += children(current)
    return found


class Throttle:
    """`cores` of CPU time at most for the processes `add`ed (None: no limit), over CFS periods of
    `period_us` (a cgroup's; the duty cycle's is `PERIOD_US`). Use as a context manager; leaving it lifts the
    limit and removes the cgroup."""

    def __init__(self, name: str, period_us: int = PERIOD_US):
        self.period_us = period_us
        self.root = _cgroup_root()
        self.path = self.root / name if self.root else None
        self.roots: List[int] = []
        self._cores: Optional[float] = None
        self._stop = threading.Event()
        self._cycle: Optional[threading.Thread] = None
        if self.path is not None:
            self.path.mkdir(exist_ok=True)

    @property
    def kind(self) -> str:
        return "cgroup" if self.path is not None else "SIGSTOP/SIGCONT duty cycle"

    def add(self, pid: int) -> None:
        """`pid` and every process below it, each moved before its children are read: a child it starts
        after its move is a member already, and one started before is in the list read after. (Listing all
        first and moving them after let a process started in between escape: an agent's warm worker, started
        as a round begins, would time a throttled host's probation at full speed.)"""
        self.roots.append(pid)
        if self.path is not None:
            descendants(pid, lambda member: move_to_cgroup(self.path, member))

    def set(self, cores: Optional[float]) -> None:
        self._cores = cores
        if self.path is None:
            self._start_cycle()
            return
        quota = -1 if cores is None else max(1000, int(cores * self.period_us))
        if (self.path / "cpu.cfs_quota_us").exists():
            (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {self.period_us}")

    def _start_cycle(self) -> None:
        """Without a cgroup: every 100 ms the processes run `cores` of it (as one core's share) and stop the rest."""
        if self._cycle is not None:
            return

        def cycle():
            while not self._stop.is_set():
                cores = self._cores
                running = PERIOD_US / 1e6 * (1.0 if cores is None else min(1.0, cores))
                self._signal(signal.SIGCONT)
                self._stop.wait(running)
                if cores is not None and cores < 1.0:
                    self._signal(signal.SIGSTOP)
                    self._stop.wait(PERIOD_US / 1e6 - running)
            self._signal(signal.SIGCONT)

        self._cycle = threading.Thread(target=cycle, name="throttle", daemon=True)
        self._cycle.start()

    def _signal(self, sig: int) -> None:
        for pid in [member for root in self.roots for member in descendants(root)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "Throttle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._cycle is not None:
            self._cycle.join(timeout=2)
        if self.path is None:
            return
        parent = self.path.parent / "cgroup.procs"
        for _ in range(50):
            try:
                for pid in (self.path / "cgroup.procs").read_text().split():
                    try:
                        parent.write_text(pid)
                    except OSError:
                        pass
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
