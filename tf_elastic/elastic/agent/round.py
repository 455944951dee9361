"""A rendezvous round as it lives in the store (one JSON record at `/JOB/round`), and the timeouts
that govern rounds."""
import dataclasses
import enum
import json
from typing import Dict, List, Optional

from tf_elastic.elastic.store import StoreError

SCHEMA_VERSION = 1


class Phase(str, enum.Enum):
    JOINING = "joining"  # agents add themselves
    FROZEN = "frozen"  # ranks and cluster are fixed; the group trains


@dataclasses.dataclass(frozen=True)
class Timeouts:
    rendezvous: float = 300.0  # wait this long for min_workers before failing the job
    last_call: float = 2.0  # after enough workers joined, wait this long for stragglers unless all survivors are in
    survivor_wait: float = 30.0  # how long a round waits for a live survivor that is still stopping its workers
    host_ttl: float = 1.0  # a host whose lease is older is gone; agents renew it every monitor_interval
    poll: float = 0.1  # longest wait between store reads while joining; a notifying store wakes sooner


@dataclasses.dataclass
class Round:
    """Opens `joining`; agents add themselves; freezes with ranks (`assignment`) and a TF cluster spec."""
    number: int
    phase: str  # a `Phase` value (plain text in the record)
    reason: str
    restarts: int
    opened: float
    participants: Dict[str, Dict]
    expected: List[str]
    assignment: Optional[Dict[str, List[int]]] = None
    cluster: Optional[List[str]] = None

    @property
    def world_size(self) -> int:
        return len(self.cluster or [])

    def to_json(self) -> str:
        return json.dumps({"version": SCHEMA_VERSION, **dataclasses.asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Round":
        try:
            record = json.loads(text)
            if record.get("version") != SCHEMA_VERSION:
                raise ValueError(f"schema version {record.get('version')!r}, expected {SCHEMA_VERSION}")
            record.pop("version")
            round_ = cls(**record)
            if round_.phase not in tuple(Phase) or not isinstance(round_.participants, dict):
                raise ValueError("bad phase or participants")
            return round_
        except (ValueError, TypeError, AttributeError) as error:
            raise StoreError(f"malformed rendezvous round record ({error}): {text[:200]!r}") from None
