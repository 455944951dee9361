"""The job's record in the store, beside its rounds: the token digest, the outcome and the blacklist.

Every key of a job lives under `/JOB_ID`; `JobKeys` is the one place that spells them.
"""
import dataclasses
import hashlib
import hmac
import json
import time
from typing import Dict, Optional, Tuple

from tf_elastic.elastic.agent.round import is_finite_number
from tf_elastic.elastic.protocol import JobStatus
from tf_elastic.elastic.store import Store, StoreError


class TokenRefused(RuntimeError):
    """This agent's job token is not the job's: it belongs to another job or an old incarnation."""


class JobEnded(RuntimeError):
    """The job finished or failed while we waited; `status` says which."""

    def __init__(self, status: JobStatus, reason: str, at: Optional[float] = None):
        super().__init__(reason)
        self.status, self.reason, self.at = status, reason, at


@dataclasses.dataclass(frozen=True)
class JobKeys:
    job_id: str

    @property
    def group(self) -> str:
        """The prefix of what every agent watches: the round and the outcome (and nothing that changes with
        each host's join, so that a join wakes no one but the round's opener)."""
        return f"/{self.job_id}/group/"

    @property
    def round(self) -> str:
        return f"/{self.job_id}/group/round"

    @property
    def outcome(self) -> str:
        return f"/{self.job_id}/group/outcome"

    @property
    def hosts(self) -> str:
        return f"/{self.job_id}/hosts/"

    def host(self, host_id: str) -> str:
        return f"/{self.job_id}/hosts/{host_id}"

    @property
    def token(self) -> str:
        return f"/{self.job_id}/token"

    def blacklist(self, host_id: str) -> str:
        return f"/{self.job_id}/blacklist/{host_id}"

    @property
    def probe(self) -> str:
        """The group's median straggler probe (outside `group`: a new value wakes no one)."""
        return f"/{self.job_id}/probe"


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    status: JobStatus
    reason: str
    # When it was recorded (Unix time; None in a record of an older version): not part of what the outcome is.
    at: Optional[float] = dataclasses.field(default=None, compare=False)


class JobRecord:
    """What one agent reads and writes of the job as a whole; rounds live in `Rendezvous`."""

    def __init__(self, store: Store, job_id: str, host_id: str, token: Optional[str] = None):
        self.store, self.job_id, self.host_id = store, job_id, host_id
        self.keys = JobKeys(job_id)
        # Only a digest is stored: the token itself never reaches the store.
        self._token_digest = hashlib.sha256(f"{job_id}:{token or ''}".encode()).hexdigest()
        self._token_checked = False
        self._blacklist: Optional[Dict] = None

    def check_token(self) -> None:
        """The first agent sets the job's token; any other must present the same one (one read, for all
        but the first)."""
        if self._token_checked:
            return
        held = self.store.get(self.keys.token)
        if held is None:
            if self.store.compare_and_set(self.keys.token, None, self._token_digest):
                held = self._token_digest
            else:
                held = self.store.get(self.keys.token)  # another agent set it first
        self._token_checked = hmac.compare_digest(held or "", self._token_digest)
        if not self._token_checked:
            raise TokenRefused(f"refused to join job {self.job_id!r}: this agent's --job_token (or "
                               f"TF_ELASTIC_JOB_TOKEN) is not the job's; it belongs to another job or an old "
                               f"incarnation of this one")

    # Outcome --------------------------------------------------------------------------------------
    def finish(self, status: JobStatus, reason: str) -> None:
        """Records the job's outcome once; later calls keep the first."""
        record = json.dumps({"status": JobStatus(status).value, "reason": reason, "at": time.time()})
        self.store.compare_and_set(self.keys.outcome, None, record)

    def outcome(self) -> Optional[JobOutcome]:
        return self.parse_outcome(self.store.get(self.keys.outcome))

    def parse_outcome(self, raw: Optional[str]) -> Optional[JobOutcome]:
        """The outcome record's meaning (None: the job goes on); a malformed one is a `StoreError`."""
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            if isinstance(record.get("reason"), str):
                at = record.get("at")
                return JobOutcome(JobStatus(record.get("status")), record["reason"],
                                  float(at) if isinstance(at, (int, float)) else None)
        except (ValueError, AttributeError):
            pass
        raise StoreError(f"malformed job outcome record at {self.keys.outcome}: {raw[:200]!r}")

    @staticmethod
    def raise_if_ended(outcome: Optional[JobOutcome]) -> None:
        if outcome is not None:
            raise JobEnded(outcome.status, outcome.reason, outcome.at)

    # The group's probe ----------------------------------------------------------------------------
    def publish_probe(self, median: float, batch: int, step_seconds: float = 0.0) -> None:
        """The group's median probe (a window's; seconds per pass at `batch` rows a replica) and its seconds
        per step (0: not known), for a host on probation."""
        self.store.set(self.keys.probe, json.dumps({"median": median, "batch": batch, "step_seconds": step_seconds,
                                                    "at": time.time()}))

    def group_probe(self) -> Optional[Tuple[float, int, float]]:
        """The newest published (median, batch, step seconds: 0 where not known or not readable); None when
        there is none or it is not readable."""
        try:
            record = json.loads(self.store.get(self.keys.probe) or "{}")
            median, batch, step = record.get("median"), record.get("batch"), record.get("step_seconds")
        except (ValueError, AttributeError):
            return None
        if is_finite_number(median) and median > 0 and isinstance(batch, int) and batch > 0:
            return float(median), batch, float(step) if is_finite_number(step) and step > 0 else 0.0
        return None

    # Blacklist ------------------------------------------------------------------------------------
    def blacklist(self, cooldown: float) -> float:
        """Keeps this host out for `cooldown` x 2^(strikes so far); returns the seconds to stay out."""
        strikes = self._blacklist_record().get("strikes", 0) + 1
        seconds = cooldown * 2 ** (strikes - 1)
        record = {"strikes": strikes, "until": time.time() + seconds}
        self.store.set(self.keys.blacklist(self.host_id), json.dumps(record))
        self._blacklist = record
        return seconds

    def blacklisted_for(self) -> float:
        """Seconds this host must still stay out (0: free to join)."""
        return max(0.0, self._blacklist_record().get("until", 0.0) - time.time())

    def _blacklist_record(self) -> Dict:
        """Read once, then kept: only this host's agent writes its record (`blacklist`), so a read at every
        round would cost the store a request per host and round for nothing."""
        if self._blacklist is not None:
            return self._blacklist
        key = self.keys.blacklist(self.host_id)
        raw = self.store.get(key)
        try:
            record = json.loads(raw) if raw else {}
        except ValueError:
            record = None
        if isinstance(record, dict) and all(is_finite_number(record.get(k, 0)) for k in ("strikes", "until")):
            self._blacklist = record
            return record
        raise StoreError(f"malformed blacklist record at {key}: {raw[:200]!r}")
