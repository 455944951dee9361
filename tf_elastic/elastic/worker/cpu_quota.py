"""The CPU quota a worker runs under (a container's CPU limit: the cgroup `cpu` controller's CFS quota).

A quota gives a cgroup `quota` of CPU time in every `period` (100 ms by default) and stops it for the rest of
the period once spent. A straggler probe shorter than the period can end before the stop and time the host as
fast as any (a pod at a third of a core still runs a 50 ms probe unstopped when it began with its quota
unspent), so where a quota stopped the worker since its last probe (`QuotaStops`: a limit it never reaches
cannot slow it) the probe times a period and a half (`probe.probe_seconds`): it ends before its time
rather than after, and a window of a whole period shows the stop for any quota under half a core a thread.
A host on probation, timed once, times the period and a half wherever a quota is set. Read at each probe:
a limit can change while the worker runs (a resized pod, an operator's `cpu.max`). Both cgroup versions:
v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`, v2's `cpu.max` ("QUOTA PERIOD", or "max PERIOD" for none); the
cgroup of this process and every one above it, up to the hierarchy's mount (a container sees its own as the
root).
"""
from pathlib import Path
from typing import Dict, Iterator, List, Tuple


def quota_period_seconds(proc: str = "/proc/self") -> float:
    """The longest CFS period of a quota set on this process's cgroup or on one above it, in seconds; 0.0
    where none is set or none can be read."""
    return max((period for _, period in _quotas(proc)), default=0.0)


class QuotaStops:
    """Whether a quota stopped this worker between two looks: a quota that never stops it (a container's limit
    above what it uses) cannot slow it, and its probe need not outlast a period."""

    def __init__(self, proc: str = "/proc/self"):
        self.proc = proc
        self._stops: Dict[Path, int] = {}  # cgroup -> its count of stopped periods at the last look

    def period_since_last_look(self) -> float:
        """The longest period of a quota, on this process's cgroup or one above it, that stopped it since the
        last call (its `nr_throttled` in `cpu.stat` grew, or cannot be read); 0.0 where none did. The first
        call only looks."""
        stopped, stops = 0.0, {}
        for directory, period in _quotas(self.proc):
            stops[directory] = _stops(directory)
            if directory in self._stops and (stops[directory] > self._stops[directory] or stops[directory] < 0):
                stopped = max(stopped, period)
        self._stops = stops
        return stopped


def _quotas(proc: str) -> List[Tuple[Path, float]]:
    """(cgroup directory, its quota's period in seconds) for each quota set on this process's cgroup or above."""
    try:
        mounts = Path(proc, "mountinfo").read_text().splitlines()
        groups = Path(proc, "cgroup").read_text().splitlines()
        found = [(directory, _period(directory)) for directory in _cpu_cgroups(mounts, groups)]
    except (OSError, ValueError, IndexError):  # a layout not the kernel's: no quota known, the probe as set
        return []
    return [(directory, period) for directory, period in found if period > 0]


def _stops(directory: Path) -> int:
    """How many periods the cgroup's quota stopped it in (`nr_throttled`, both versions); -1: unreadable."""
    try:
        for line in (directory / "cpu.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "nr_throttled":
                return int(value)
    except (OSError, ValueError):
        pass
    return -1


def _cpu_cgroups(mounts: List[str], groups: List[str]) -> Iterator[Path]:
    """The directories of this process's cpu cgroup and of each above it, for every mounted hierarchy that
    has the cpu controller (v1: a `cgroup` mount with option `cpu`; v2: the `cgroup2` mount)."""
    paths = {}  # "v1" / "v2" -> this process's path in that hierarchy
    for line in groups:  # "ID:CONTROLLERS:PATH"; v2's is "0::PATH"
        number, controllers, path = line.split(":", 2)
        if number == "0" and not controllers:
            paths["v2"] = path
        elif "cpu" in controllers.split(","):
            paths["v1"] = path
    for line in mounts:  # "... ROOT MOUNT_POINT OPTIONS ... - FSTYPE SOURCE SUPER_OPTIONS"
        fields, _, tail = line.partition(" - ")
        kind, _, options = (tail.split() + ["", "", ""])[:3]
        version = "v2" if kind == "cgroup2" else "v1" if kind == "cgroup" and "cpu" in options.split(",") else None
        root, mount_point = fields.split()[3:5]
        path = paths.get(version) if version else None
        if path is None or not (path + "/").startswith(root.rstrip("/") + "/"):
            continue
        directory = Path(mount_point, path[len(root.rstrip("/")):].lstrip("/"))
        while True:
            yield directory
            if directory == Path(mount_point):
                break
            directory = directory.parent


def _period(directory: Path) -> float:
    """The period of the quota set on one cgroup, in seconds (0.0: none, or unreadable)."""
    try:
        if (directory / "cpu.max").exists():
            quota, period = (directory / "cpu.max").read_text().split()
        else:
            quota, period = ((directory / name).read_text().strip() for name in ("cpu.cfs_quota_us",
                                                                                  "cpu.cfs_period_us"))
        return int(period) / 1e6 if quota != "max" and int(quota) > 0 else 0.0
    except (OSError, ValueError):
        return 0.0
