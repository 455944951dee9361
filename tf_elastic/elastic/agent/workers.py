"""This host's worker processes as the agent sees them: started from an argv list in a process group of
their own, watched through their heartbeat file, and signalled as a group.

Heartbeats are timed on the agent's own monotonic clock (when did the content last change?), never by
a file's mtime against the wall clock, and live in the agent's host-local directory.
"""
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from tf_elastic.elastic import proc
from tf_elastic.elastic.agent.worker_output import WorkerOutput
from tf_elastic.elastic.protocol import Heartbeat, HostDir, read_heartbeat


def make_host_dir() -> HostDir:
    """A fresh host-local directory for this agent (see `HostDir`), locked while the agent lives."""
    path = tempfile.mkdtemp(prefix=f"{HostDir.PREFIX}{os.getpid()}-")
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel when this process ends, however it ends
        _held_locks.append(fd)
    except OSError:  # a filesystem without flock (NFS, Lustre): sweepers cannot lock it either, so keep it
        os.close(fd)
    return HostDir(path)


_held_locks: List[int] = []
_SWEEP_AFTER = 60.0  # seconds unchanged: a directory just made may not be locked yet


def sweep_dead_agents_dirs() -> List[str]:
    """Removes the host directories of agents on this host that died without cleaning up (SIGKILL).

    An agent's directory is dead when nobody holds its lock: a PID would not do, since agents in other
    PID namespaces (containers sharing /tmp) have PIDs this one cannot see."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{HostDir.PREFIX}*-*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if time.time() - path.stat().st_mtime > _SWEEP_AFTER:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
        except OSError:
            pass  # locked: its agent lives
        finally:
            os.close(fd)
    return removed


def spawn(command: List[str], env: Dict[str, str], output: WorkerOutput, warm: bool) -> subprocess.Popen:
    """An argv list, never a shell; a session (and process group) of its own, so terminal signals reach
    the agent only and the agent can signal everything the command started (`sh -c ...` included). Its
    stdout and stderr go to `output` (a log file, the agent's streams, the tail that names a failure)."""
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, stdin=subprocess.PIPE if warm else subprocess.DEVNULL)
    if warm:
        output.start_spare(process.pid)
    process.output = output
    process.readers = [threading.Thread(target=output.read, args=(pipe, pipe is process.stderr), daemon=True,
                                        name=f"tf_elastic-output-{process.pid}") for pipe in (process.stdout,
                                                                                              process.stderr)]
    for reader in process.readers:
        reader.start()
    return process


def finish_output(process: subprocess.Popen, wait: float = 2.0) -> None:
    """Reads what the exited worker still had in its pipes (up to `wait` seconds), then closes its log."""
    deadline = time.monotonic() + wait
    for reader in getattr(process, "readers", ()):
        reader.join(max(0.0, deadline - time.monotonic()))
    if hasattr(process, "output"):
        process.output.close()


def last_error_line(process: subprocess.Popen, wait: float = 2.0) -> Optional[str]:
    """The last non-blank line the exited worker wrote to stderr (None: nothing), once read to its end."""
    finish_output(process, wait)
    lines = [line for line in process.output.tail if line.strip()]
    return lines[-1][:500] if lines else None


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """Sends `sig` to the process's whole group (it leads one: `spawn` starts a session)."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def dump_stacks(processes: List[subprocess.Popen], wait: float = 1.0) -> int:
    """SIGQUIT to each process of each one's group that catches it: a worker (`elastic.run`, behind a wrapper
    too) writes every thread's Python stack to its log (`faulthandler`) and goes on, so that one about to be
    killed for a stall or an ignored SIGTERM says where it was. Processes that do not catch it are spared
    SIGQUIT's default action (a core dump). Waits `wait` seconds for the stacks to reach the log; returns how
    many processes were sent it (none without /proc)."""
    sent = 0
    for process in processes:
        for pid in proc.group_members(process.pid) or []:
            if proc.catches(pid, signal.SIGQUIT):
                try:
                    os.kill(pid, signal.SIGQUIT)
                    sent += 1
                except ProcessLookupError:
                    pass  # gone meanwhile
    if sent:
        time.sleep(wait)
    return sent


def group_running(process: subprocess.Popen) -> bool:
    """Whether anything of the process's group still runs, zombies aside: a wrapper (`sh -c`, `conda run`)
    may be gone while the trainer it started still commits."""
    if process.poll() is None:
        return True
    try:
        os.killpg(process.pid, 0)  # the common case: the group is empty
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    live = proc.group_has_live_member(process.pid)
    return True if live is None else live  # no /proc: a member exists, zombie or not


def kill(process: subprocess.Popen) -> None:
    """SIGKILL to the group, then reaps the process."""
    signal_group(process, signal.SIGKILL)
    process.wait()
    finish_output(process)


@dataclasses.dataclass
class Spare:
    """A warm worker: started ahead of its round, blocked until it is handed a world on stdin."""
    process: subprocess.Popen
    ready: Path  # created by the worker once its imports are done
    announced: bool = False
    warm: bool = False  # `ready` was seen (and removed)

    def is_ready(self) -> bool:
        """Its imports are done: its `ready` file seen, once (then removed; a second wait must not wait on it)."""
        if not self.warm and self.ready.exists():
            self.warm = True
            self.ready.unlink(missing_ok=True)
        return self.warm

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
    _gone: bool = False  # the whole group has exited

    @property
    def training(self) -> bool:
        return bool(self.last and self.last.step)

    def observe(self) -> None:
        """Reads the heartbeat and notes, on this clock, when its beat and its progress last moved; notes
        when the group is gone, while that is fresh."""
        if self.process.poll() is not None:
            self.running()
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

    def running(self) -> bool:
        """The worker's process, or anything it started, still runs. Once seen gone, never asked again: the
        group's number could later be another process's."""
        self._gone = self._gone or not group_running(self.process)
        return not self._gone

    def close(self, wait: float = 2.0) -> None:
        """Kills the group if anything of it still runs, and waits up to `wait` seconds for it to go (a
        trainer behind a wrapper must not overlap the next round); removes the heartbeat."""
        if self.running():
            signal_group(self.process, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + wait
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        finish_output(self.process, max(0.0, deadline - time.monotonic()))
        self.heartbeat.unlink(missing_ok=True)
