"""Keeping a host whose own workers keep failing out of the job for a while (its record lives in the store,
`JobRecord.blacklist`): `blacklist_after` failures of its own workers in a row keep it out for
`blacklist_cooldown` seconds, doubled at each further strike. While out it holds no lease, so no round
waits for it."""
import time
from typing import Callable

from absl import logging

from tf_elastic.elastic.agent.job_record import JobRecord
from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import Event
from tf_elastic.elastic.store import StoreError


class Blacklist:
    def __init__(self, job: JobRecord, host_id: str, events: EventLog, after: int, cooldown: float):
        self.job, self.host_id, self.events = job, host_id, events
        self.after, self.cooldown = after, cooldown
        self._in_a_row = 0  # failures of this host's own workers, in a row
        self._strike_due = False  # a strike the store has not taken yet

    def count(self, own: bool) -> None:
        """Notes how a round ended for this host (`own`: one of its own workers failed); blacklists it
        after `after` of its own failures in a row. Never raises: a strike the store does not take now stays
        due, counted once, and is written at the next `count` or `sit_out` that reaches the store."""
        self._in_a_row = self._in_a_row + 1 if own else 0
        if own and self._in_a_row >= self.after:
            self._in_a_row, self._strike_due = 0, True
        self._record_strike()

    def _record_strike(self) -> None:
        if not self._strike_due:
            return
        try:
            seconds = self.job.blacklist(self.cooldown)
        except StoreError as error:
            logging.warning("host %s: its blacklist strike waits for the store (%s)", self.host_id, error)
            return
        self._strike_due = False
        logging.warning("host %s: %d failures of its own workers in a row; out for %.0fs", self.host_id,
                        self.after, seconds)

    def sit_out(self, leave: Callable[[], None], cancelled: Callable[[], bool]) -> None:
        """While this host is blacklisted: gives up its lease (`leave`) and waits, until the time is up, the
        job ended (the next join reports how) or `cancelled()`."""
        self._record_strike()
        try:
            seconds = self.job.blacklisted_for()
        except StoreError:
            return  # the rendezvous retries the store and reports it
        if not seconds:
            return
        leave()
        self.events.write(Event.BLACKLISTED, host=self.host_id, seconds=round(seconds, 1))
        logging.warning("host %s is blacklisted for %.0fs after repeated worker failures", self.host_id, seconds)
        deadline = time.time() + seconds
        while time.time() < deadline and not cancelled():
            if self.job.outcome() is not None:
                return
            time.sleep(min(1.0, max(0.0, deadline - time.time())))
