"""The one reader of Linux's `/proc`, for the agent, the worker, the harness and the benchmarks (no TensorFlow).

The fields after the command name (which may hold spaces and parentheses: split after its last `)`):
state, parent PID, process group, ... , utime and stime (clock ticks) at 12 and 13; see proc(5)."""
import os
from typing import List, Optional

STATE, GROUP, USER_TICKS, SYSTEM_TICKS = 0, 2, 11, 12


def stat(pid: int) -> List[bytes]:
    """The fields of `/proc/PID/stat` after the command name; OSError when the process is gone (or there
    is no /proc: not Linux)."""
    with open(f"/proc/{pid}/stat", "rb") as file:
        return file.read().rsplit(b")", 1)[1].split()


def running(pid: int) -> Optional[bool]:
    """Whether `pid` exists and is not a zombie (exited, not yet reaped); None without /proc."""
    if not os.path.isdir("/proc"):
        return None
    try:
        return stat(pid)[STATE] != b"Z"
    except (OSError, IndexError):
        return False  # gone


def group_members(group: int) -> Optional[List[int]]:
    """The processes of process group `group` that run, zombies aside; None without /proc."""
    try:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    members = []
    for pid in pids:
        try:
            fields = stat(pid)
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[GROUP]) == group and fields[STATE] != b"Z":
            members.append(pid)
    return members


def group_has_live_member(group: int) -> Optional[bool]:
    """Whether a process of process group `group` runs, zombies aside; None without /proc."""
    members = group_members(group)
    return None if members is None else bool(members)


def catches(pid: int, signum: int) -> bool:
    """Whether `pid` has a handler of its own for `signum` (`SigCgt` in /proc/PID/status), not the default
    action nor ignoring it; False when it is gone (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            caught = next(line for line in status if line.startswith(b"SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def environment(pid: int) -> List[bytes]:
    """`pid`'s environment as `NAME=value` byte strings ([] when it is gone or not ours to read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return environ.read().split(b"\0")
    except OSError:
        return []


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` so far."""
    fields = stat(pid)
    return (int(fields[USER_TICKS]) + int(fields[SYSTEM_TICKS])) / os.sysconf("SC_CLK_TCK")
