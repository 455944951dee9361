"""This host's worker processes as the agent sees them: started from an argv list in a process group of
their own, watched through their heartbeat file, and signalled as a group.

Heartbeats are timed on the agent's own monotonic clock (when did the content last change?), never by
a file's mtime against the wall clock, and live in the agent's host-local directory.
"""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from tf_elastic.elastic.protocol import Heartbeat, HostDir, read_heartbeat


def make_host_dir() -> HostDir:
    """A fresh host-local directory for this agent (see `HostDir`)."""
    return HostDir(tempfile.mkdtemp(prefix=f"{HostDir.PREFIX}{os.getpid()}-"))


def sweep_dead_agents_dirs() -> List[str]:
    """Removes the host directories of agents on this host that died without cleaning up (SIGKILL)."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{HostDir.PREFIX}*-*"):
        pid = path.name[len(HostDir.PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def spawn(command: List[str], env: Dict[str, str], warm: bool) -> subprocess.Popen:
    """An argv list, never a shell; a session (and process group) of its own, so terminal signals reach
    the agent only and the agent can signal everything the command started (`sh -c ...` included)."""
    return subprocess.Popen(command, env=env, start_new_session=True,
                            stdin=subprocess.PIPE if warm else subprocess.DEVNULL)


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """Sends `sig` to the process's whole group (it leads one: `spawn` starts a session)."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def kill(process: subprocess.Popen) -> None:
    """SIGKILL to the group, then reaps the process."""
    signal_group(process, signal.SIGKILL)
    process.wait()


@dataclasses.dataclass
class Spare:
    """A warm worker: started ahead of its round, blocked until it is handed a world on stdin."""
    process: subprocess.Popen
    ready: Path  # created by the worker once its imports are done
    announced: bool = False

    def hand_world(self, world: Dict[str, str]) -> bool:
        """Gives the spare its round's environment; False if it is gone."""
        if self.process.poll() is not None:
            return False
        try:
            self.process.stdin.write((json.dumps(world) + "\n").encode())
            self.process.stdin.close()
            return True
        except (BrokenPipeError, OSError):
            kill(self.process)
            return False


@dataclasses.dataclass
class Worker:
    rank: int
    process: subprocess.Popen
    heartbeat: Path
    started: float = dataclasses.field(default_factory=time.monotonic)
    last: Optional[Heartbeat] = None
    beat_at: float = 0.0  # when the beat counter last changed (monotonic)
    progress_at: float = 0.0  # when the progress counter last changed
    longest_gap: float = 0.0  # the longest wait for progress seen since the first step

    @property
    def training(self) -> bool:
        return bool(self.last and self.last.step)

    def observe(self) -> None:
        """Reads the heartbeat and notes, on this clock, when its beat and its progress last moved."""
        now, seen = time.monotonic(), read_heartbeat(self.heartbeat)
        if seen is None:
            return
        if self.last is None or seen.beat != self.last.beat:
            self.beat_at = now
        if self.last is None or seen.progress != self.last.progress:
            if self.training:
                self.longest_gap = max(self.longest_gap, now - self.progress_at)
            self.progress_at = now
        self.last = seen

    def silent_for(self) -> float:
        """Seconds since the heartbeat last beat (since the start, before the first beat)."""
        return time.monotonic() - (self.beat_at if self.last else self.started)

    def stalled_for(self) -> float:
        """Seconds since the main thread last made progress (0 before the first step)."""
        return time.monotonic() - self.progress_at if self.training else 0.0

    def close(self) -> None:
        """Kills the group if it still runs; removes the heartbeat."""
        if self.process.poll() is None:
            signal_group(self.process, signal.SIGKILL)
        self.process.wait()
        self.heartbeat.unlink(missing_ok=True)
