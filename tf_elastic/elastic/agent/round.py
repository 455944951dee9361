"""A rendezvous round as it lives in the store (one JSON record at `/JOB/group/round`), the participants
as their hosts' leases announce them, and the timeouts that govern rounds."""
import dataclasses
import enum
import json
import math
from typing import Dict, List, Optional, Tuple

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
    host_ttl: float = 3.0  # a host whose lease is older is gone; agents renew it every third of this
    poll: float = 0.1  # longest wait between store reads while joining; a notifying store wakes sooner


@dataclasses.dataclass
class Round:
    """Opens `joining`; hosts join by announcing the round in their own lease (see `participants_of`), so
    that nothing is contended; the `opener` (the agent that opened it, or took over from a lost opener)
    freezes it with ranks (`assignment`) and a TF cluster spec, in one write."""
    number: int
    phase: str  # a `Phase` value (plain text in the record)
    reason: str
    restarts: int
    opened: float  # the opener's wall clock, for people (`tf-elastic-status`); no decision compares it
    expected: List[str]
    opener: str
    assignment: Optional[Dict[str, List[int]]] = None
    cluster: Optional[List[str]] = None
    lost: Optional[List[str]] = None  # expected hosts whose lease was gone when it froze: what the failure was

    @property
    def why(self) -> str:
        """Why it began, culprit first: `reason` is what the host that opened it saw (a survivor's collective
        failing); `lost` names the hosts whose lease was gone when it froze."""
        return why_round_began(self.reason, self.lost)

    @property
    def world_size(self) -> int:
        return len(self.cluster or [])

    def to_json(self) -> str:
        return json.dumps({"version": SCHEMA_VERSION, **dataclasses.asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, key: str = "the round key") -> "Round":
        """Parses and type-checks a record: anything off is a `StoreError` naming the field, never a
        TypeError deep in the agent (the store is shared; a bad write must not crash every agent)."""
        try:
            record = json.loads(text)
            if not isinstance(record, dict) or record.get("version") != SCHEMA_VERSION:
                version = record.get("version") if isinstance(record, dict) else None
                raise ValueError(f"schema version {version!r}, expected {SCHEMA_VERSION}")
            record.pop("version")
            round_ = cls(**record)
            _check_types(round_)
            return round_
        except (ValueError, TypeError, AttributeError) as error:
            raise StoreError(f"malformed rendezvous round record at {key} ({error}): {text[:200]!r}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, field: str) -> None:
    if not ok:
        raise ValueError(f"bad {field}")


def _check_types(round_: Round) -> None:
    _check(_is_int(round_.number) and round_.number >= 0, "number")
    _check(round_.phase in tuple(Phase), "phase")
    _check(isinstance(round_.reason, str), "reason")
    _check(_is_int(round_.restarts) and round_.restarts >= 0, "restarts")
    _check(is_finite_number(round_.opened), "opened")
    _check(isinstance(round_.expected, list) and all(isinstance(h, str) for h in round_.expected), "expected")
    _check(isinstance(round_.opener, str), "opener")
    if round_.assignment is not None:
        _check(isinstance(round_.assignment, dict) and all(
            isinstance(r, list) and all(_is_int(i) for i in r) for r in round_.assignment.values()), "assignment")
    if round_.cluster is not None:
        _check(isinstance(round_.cluster, list) and all(isinstance(a, str) for a in round_.cluster), "cluster")
    if round_.lost is not None:
        _check(isinstance(round_.lost, list) and all(isinstance(h, str) for h in round_.lost), "lost")


def participants_of(leases: Dict[str, str], number: int) -> Tuple[Dict[str, Dict], List[str]]:
    """The hosts whose lease (`leases`: key -> value, as the store lists them) says they joined round
    `number`, with what they announced (nproc, addr, ports, joined, previous_rank); and the keys of
    leases refused as malformed (a bad write by anyone must not stop every round from freezing)."""
    participants, refused = {}, []
    for key, raw in leases.items():
        try:
            info = json.loads(raw)
        except ValueError:
            refused.append(key)
            continue
        if not isinstance(info, dict) or info.get("round") != number:
            continue  # not (yet) in this round: a standby, a survivor still stopping its workers
        if _is_participant(info):
            participants[key.rsplit("/", 1)[-1]] = info
        else:
            refused.append(key)
    return participants, refused


def _is_participant(info: Dict) -> bool:
    return (_is_int(info.get("nproc")) and info["nproc"] > 0 and isinstance(info.get("addr"), str)
            and is_finite_number(info.get("joined")) and isinstance(info.get("ports"), list)
            and len(info["ports"]) >= info["nproc"] and all(_is_int(p) and 0 < p < 65536 for p in info["ports"])
            and (info.get("previous_rank") is None or _is_int(info["previous_rank"])))


def why_round_began(reason: str, lost: Optional[List[str]]) -> str:
    """`reason`, or with hosts lost: "lost b (lease expired); noticed as <reason, shortened>"."""
    if not lost:
        return reason
    return f"lost {', '.join(lost)} (lease expired); noticed as {reason[:97] + '...' if len(reason) > 100 else reason}"
