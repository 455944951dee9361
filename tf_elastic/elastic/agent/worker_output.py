"""Where a worker's stdout and stderr go: a file per round and rank on this host, and the agent's own
streams with a `[round R rank N]` prefix on each line (torchrun's `--log-dir`, `--tee` and rank prefixes).

With many ranks per host, echoing every line interleaves them: `echo` chooses the ranks echoed ("all",
"chief": rank 0 only, "none"); error lines (a traceback, an absl/glog E or F line, Python logging's
`ERROR:`/`CRITICAL:`) are echoed whatever it says. A warm spare writes before its round is known:
to `spare-PID.log`, prefixed `[spare PID]`, until the agent hands it a round.
"""
import collections
import re
import sys
import threading
from pathlib import Path
from typing import IO, Optional

ECHO_CHOICES = ("all", "chief", "none")
ERROR_TAIL_LINES = 20
_ERROR_LINE = re.compile(rb"^(?:[EF]\d{4} |ERROR:|CRITICAL:|Traceback \(most recent call last\):)")
_ECHO_LOCK = threading.Lock()  # one line at a time on the agent's streams, whichever worker wrote it


def logs_dir(run_dir: str, host_id: str) -> Path:
    """`RUN_DIR/logs/HOST`: a run dir may be shared by hosts; each writes its own."""
    return Path(run_dir) / "logs" / host_id


class WorkerOutput:
    """One worker's output. `tail` keeps its last stderr lines, to name a failure."""

    def __init__(self, directory: Path, echo: str):
        if echo not in ECHO_CHOICES:
            raise ValueError(f"echo={echo!r}: one of {', '.join(ECHO_CHOICES)}")
        self.directory, self.echo = directory, echo
        self.tail = collections.deque(maxlen=ERROR_TAIL_LINES)
        self._lock = threading.Lock()
        self._file: Optional[IO[bytes]] = None
        self._prefix = b""
        self._rank: Optional[int] = None

    def start_spare(self, pid: int) -> None:
        self._switch(self.directory / f"spare-{pid}.log", f"[spare {pid}] ", None)

    def assign_probation(self, slot: int) -> None:
        """From now on the lines belong to the probation worker of local slot `slot` (`agent/probation.py`)."""
        self._switch(self.directory / f"probation-slot{slot}.log", f"[probation slot {slot}] ", None)

    def assign(self, round_number: int, rank: int) -> None:
        """From now on the lines belong to `rank` of round `round_number`."""
        self._switch(self.directory / f"round-{round_number}" / f"rank-{rank}.log",
                     f"[round {round_number} rank {rank}] ", rank)

    def _switch(self, path: Path, prefix: str, rank: Optional[int]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file, self._prefix, self._rank = open(path, "ab"), prefix.encode(), rank

    def read(self, pipe: IO[bytes], stderr: bool) -> None:
        """Copies one of the worker's streams line by line until it closes (run on a thread of its own)."""
        in_traceback = False
        echo_to = sys.stderr if stderr else sys.stdout
        for line in iter(pipe.readline, b""):
            error = bool(stderr and (_ERROR_LINE.match(line) or in_traceback))
            if stderr:  # a traceback runs from its header through the indented lines to the exception's line
                in_traceback = line.startswith(b"Traceback (") or (in_traceback and line[:1] in (b" ", b"\t"))
                self.tail.append(line.decode(errors="replace").rstrip())
            self._write(line, echo_to, error)
        pipe.close()

    def _write(self, line: bytes, echo_to, error: bool) -> None:
        with self._lock:
            prefix, rank = self._prefix, self._rank
            if self._file is not None:
                try:
                    self._file.write(line)
                    self._file.flush()
                except OSError:
                    pass  # a full disk: the echo and the tail still carry it
        if error or self.echo == "all" or (self.echo == "chief" and rank == 0):
            with _ECHO_LOCK:
                try:
                    echo_to.buffer.write(prefix + line)
                    echo_to.buffer.flush()
                except Exception:  # noqa: BLE001 - no usable stream: keep draining, or the worker blocks
                    pass

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
