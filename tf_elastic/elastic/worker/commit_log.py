"""A commit's life on one worker, from the step it is made at to the chief's `commit` event, in one place.

In order: **made** (numbered alike on every worker: all commit at the same steps; two may share a step, a
cadence commit on an epoch's last step and then the epoch's), **in force on this host** (its state file names
it: `CommittedState` says so from its commit thread), **in force everywhere** (the smallest number every worker
has in force, summed over the workers at the next agreement) and, by the chief, **announced**: its `commit`
event, the promise that the step survives the loss of any host. A worker that keeps no commits (not its
host's first) holds nothing back. What commits a worker has in force is read by the training thread while
the commit thread writes it: a lock keeps the two apart.
"""
import math
import threading
import time
from typing import Dict, List, Optional

from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import Event


class CommitLog:
    def __init__(self, keeps_commits: bool, events: Optional[EventLog] = None):
        """`keeps_commits`: this worker writes its host's commits; `events`: the chief's log, where it
        announces them (None elsewhere)."""
        self.made = 0
        self._in_force = 0.0 if keeps_commits else math.inf
        self._events = events
        self._to_announce: Dict[int, Dict] = {}  # number -> the chief's event fields, with `started`
        self._lock = threading.Lock()

    @property
    def in_force(self) -> float:
        """The newest number this worker has put in force on its host (0: none; inf: it keeps none)."""
        with self._lock:
            return self._in_force

    def make(self, fields: Optional[Dict] = None, started: Optional[float] = None) -> int:
        """A commit is made at this step (training thread); returns its number. The chief gives the fields
        of its `commit` event and when the commit began (`time.perf_counter()`)."""
        self.made += 1
        if fields is not None and self._events is not None:
            with self._lock:
                self._to_announce[self.made] = dict(fields, started=time.perf_counter() if started is None
                                                    else started)
        return self.made

    def kept(self, number: int, blocked: float, in_force_seconds: float) -> None:
        """Commit `number` is in force on this host (the commit thread): `blocked` is what the training step
        paid for its write, `in_force_seconds` the time from its start until the state file named it."""
        with self._lock:
            fields = self._to_announce.get(number)
            if fields is not None:
                fields.update(seconds=round(blocked, 4), in_force_seconds=round(in_force_seconds, 4))
            self._in_force = max(self._in_force, float(number))

    def in_force_everywhere(self, number: float) -> List[int]:
        """Every worker has commit `number` in force (training thread): announces the chief's commits up to it,
        oldest first, and returns their numbers. A commit whose own write failed (`commit_failed`) is not
        announced: a later one covers it."""
        with self._lock:
            due = sorted(n for n in self._to_announce if n <= number)
            announced = [(n, self._to_announce.pop(n)) for n in due]
        for _, fields in announced:
            if "seconds" in fields:
                started = fields.pop("started")
                self._events.write(Event.COMMIT, everywhere_seconds=round(time.perf_counter() - started, 4), **fields)
        return [n for n, fields in announced if "seconds" in fields]
