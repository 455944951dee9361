"""The CPU quota a worker runs under (a container's CPU limit: the cgroup `cpu` controller's CFS quota).

A quota gives a cgroup `quota` of CPU time in every `period` (100 ms by default) and stops it for the rest of
the period once spent. A straggler probe shorter than the period can end before the stop and time the host as
fast as any (a pod at a third of a core still runs a 50 ms probe unstopped when it began with its quota
unspent), so where a quota is set the probe times a period and a half (`probe.probe_seconds`): it ends
before its time rather than after, and a window of a whole period shows the stop for any quota under half
a core a thread. Read at each probe:
a limit can change while the worker runs (a resized pod, an operator's `cpu.max`). Both cgroup versions:
v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`, v2's `cpu.max` ("QUOTA PERIOD", or "max PERIOD" for none); the
cgroup of this process and every one above it, up to the hierarchy's mount (a container sees its own as the
root).
"""
from pathlib import Path
from typing import Iterator, List


def quota_period_seconds(proc: str = "/proc/self") -> float:
    """The longest CFS period of a quota set on this process's cgroup or on one above it, in seconds; 0.0
    where none is set or none can be read."""
    try:
        mounts = Path(proc, "mountinfo").read_text().splitlines()
        groups = Path(proc, "cgroup").read_text().splitlines()
        return max((_period(directory) for directory in _cpu_cgroups(mounts, groups)), default=0.0)
    except (OSError, ValueError, IndexError):  # a layout not the kernel's: no quota known, the probe as set
        return 0.0


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
