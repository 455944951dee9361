"""Rounds of membership agreement between agents, kept in a `Store`.

A round is one JSON record at `/JOB/round`. It opens in the `joining` phase, agents add themselves
(compare-and-set), and once enough workers are in it freezes with an assignment: ranks, survivors
first so that rank 0 is a worker that held fresh state, and a TF cluster spec on fresh ports. Any
change (a failure, a host lost, a join, a graceful leave) opens the next round; only failures count
towards `max_restarts`. Hosts prove they are alive with leases at `/JOB/hosts/HOST`.
"""
import dataclasses
import hashlib
import hmac
import json
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

from absl import logging

from tf_elastic.elastic.store import Store, StoreError

SCHEMA_VERSION = 1


class RendezvousTimeout(RuntimeError):
    """Fewer than `min_workers` joined within the rendezvous timeout."""


class NoFreePorts(RuntimeError):
    """`--port_range` has too few free ports on this host right now."""


class TokenRefused(RuntimeError):
    """This agent's job token is not the job's: it belongs to another job or an old incarnation."""


class JobEnded(RuntimeError):
    """The job finished or failed while we waited; `status` says which."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclasses.dataclass(frozen=True)
class Timeouts:
    rendezvous: float = 300.0  # wait this long for min_workers before failing the job
    last_call: float = 2.0  # after enough workers joined, wait this long for stragglers unless all survivors are in
    survivor_wait: float = 30.0  # how long a round waits for a live survivor that is still stopping its workers
    host_ttl: float = 1.0  # a host whose lease is older is gone; agents renew it every monitor_interval
    poll: float = 0.1  # longest wait between store reads while joining; a notifying store wakes sooner


@dataclasses.dataclass
class Round:
    number: int
    phase: str  # "joining" or "frozen"
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
            if round_.phase not in ("joining", "frozen") or not isinstance(round_.participants, dict):
                raise ValueError("bad phase or participants")
            return round_
        except (ValueError, TypeError, AttributeError) as error:
            raise StoreError(f"malformed rendezvous round record ({error}): {text[:200]!r}") from None


class Rendezvous:
    def __init__(self, store: Store, job_id: str, host_id: str, nproc: int, addr: str, min_workers: int,
                 max_workers: int, max_restarts: int, timeouts: Timeouts = Timeouts(), token: Optional[str] = None,
                 port_range: Optional[Tuple[int, int]] = None):
        self.store, self.job_id, self.host_id, self.nproc, self.addr = store, job_id, host_id, nproc, addr
        self.min_workers, self.max_workers, self.max_restarts = min_workers, max_workers, max_restarts
        self.timeouts, self.port_range = timeouts, port_range
        self._prefix = f"/{job_id}"
        self._round_key = f"/{job_id}/round"
        self._hosts = f"/{job_id}/hosts"
        self._outcome_key = f"/{job_id}/outcome"
        self._token_key = f"/{job_id}/token"
        # Only a digest is stored: the token itself never reaches the store.
        self._token_digest = hashlib.sha256(f"{job_id}:{token or ''}".encode()).hexdigest()
        self._token_checked = False

    def check_token(self) -> None:
        """The first agent sets the job's token; any other must present the same one."""
        if self._token_checked:
            return
        self.store.compare_and_set(self._token_key, None, self._token_digest)
        self._token_checked = hmac.compare_digest(self.store.get(self._token_key) or "", self._token_digest)
        if not self._token_checked:
            raise TokenRefused(f"refused to join job {self.job_id!r}: this agent's --job_token (or "
                               f"TF_ELASTIC_JOB_TOKEN) is not the job's; it belongs to another job or an old "
                               f"incarnation of this one")

    def wait_for_change(self, timeout: float) -> bool:
        """True when the job's keys may have changed within `timeout` (always, for a store that cannot tell)."""
        return self.store.wait(self._prefix, timeout)

    # Leases and outcome -------------------------------------------------------------------------
    def keepalive(self) -> None:
        self.store.set(f"{self._hosts}/{self.host_id}", json.dumps({"addr": self.addr, "nproc": self.nproc}),
                       ttl=self.timeouts.host_ttl)

    def leave(self) -> None:
        self.store.delete(f"{self._hosts}/{self.host_id}")

    def alive_hosts(self) -> List[str]:
        return [key.rsplit("/", 1)[-1] for key in self.store.list(self._hosts)]

    def finish(self, status: str, reason: str) -> None:
        """Records the job's outcome once; later calls keep the first."""
        self.store.compare_and_set(self._outcome_key, None, json.dumps({"status": status, "reason": reason}))

    def outcome(self) -> Optional[Dict[str, str]]:
        raw = self.store.get(self._outcome_key)
        if raw is None:
            return None
        try:
            outcome = json.loads(raw)
            if outcome.get("status") in ("done", "failed") and isinstance(outcome.get("reason"), str):
                return outcome
        except (ValueError, AttributeError):
            pass
        raise StoreError(f"malformed job outcome record at {self._outcome_key}: {raw[:200]!r}")

    # Blacklist ------------------------------------------------------------------------------------
    def blacklist(self, cooldown: float) -> float:
        """Keeps this host out for `cooldown` x 2^(strikes so far); returns the seconds to stay out."""
        key = f"{self._prefix}/blacklist/{self.host_id}"
        strikes = self._blacklist_record(key).get("strikes", 0) + 1
        seconds = cooldown * 2 ** (strikes - 1)
        self.store.set(key, json.dumps({"strikes": strikes, "until": time.time() + seconds}))
        return seconds

    def blacklisted_for(self) -> float:
        """Seconds this host must still stay out (0: free to join)."""
        record = self._blacklist_record(f"{self._prefix}/blacklist/{self.host_id}")
        return max(0.0, record.get("until", 0.0) - time.time())

    def _blacklist_record(self, key: str) -> Dict:
        raw = self.store.get(key)
        try:
            record = json.loads(raw) if raw else {}
            if isinstance(record, dict) and all(isinstance(record.get(k, 0), (int, float)) for k in ("strikes", "until")):
                return record
        except ValueError:
            pass
        raise StoreError(f"malformed blacklist record at {key}: {raw[:200]!r}")

    # Rounds ---------------------------------------------------------------------------------------
    def current(self) -> Optional[Round]:
        raw = self.store.get(self._round_key)
        return None if raw is None else Round.from_json(raw)

    def open_next(self, seen: Round, reason: str, failure: bool, leaving: bool = False) -> bool:
        """Opens round `seen.number + 1` unless someone already moved past `seen`; True if we did.

        Only the agent whose compare-and-set wins counts a failure, so a failure seen by every agent
        is counted once."""
        restarts = seen.restarts + int(failure)
        if restarts > self.max_restarts:
            self.finish("failed", f"max_restarts={self.max_restarts} exceeded ({reason})")
        expected = [h for h, ranks in (seen.assignment or {}).items() if ranks and not (leaving and h == self.host_id)]
        nxt = Round(seen.number + 1, "joining", reason, restarts, time.time(), {}, expected)
        return self.store.compare_and_set(self._round_key, seen.to_json(), nxt.to_json())

    def join(self, previous_ranks: Optional[List[int]] = None, after: int = -1,
             cancelled: Callable[[], bool] = lambda: False) -> Optional[Round]:
        """Blocks until a frozen round numbered above `after` gives this host ranks; returns it, or None
        once `cancelled()` (the agent was asked to leave while waiting)."""
        deadline = time.monotonic() + self.timeouts.rendezvous
        unreachable: Optional[Exception] = None
        while True:
            if cancelled():
                return None
            try:
                joined = self._join_step(previous_ranks, after)
                if unreachable is not None:
                    logging.info("rendezvous store reachable again")
                    unreachable = None
            except (StoreError, NoFreePorts) as error:
                if unreachable is None:
                    logging.warning("rendezvous: %s; retrying until --rendezvous_timeout", error)
                unreachable, joined = error, None
            if isinstance(joined, Round):
                return joined
            if time.monotonic() > deadline:
                if unreachable is not None:
                    raise RendezvousTimeout(f"no rendezvous within --rendezvous_timeout="
                                            f"{self.timeouts.rendezvous:g}s: {unreachable}")
                round_ = self.current()
                joined = sum(p["nproc"] for p in round_.participants.values()) if round_ else 0
                reason = (f"only {joined} of min_workers={self.min_workers} workers joined within "
                          f"--rendezvous_timeout={self.timeouts.rendezvous:g}s")
                self.finish("failed", reason)
                raise RendezvousTimeout(reason)
            if not joined:
                self.wait_for_change(self._poll())

    def _poll(self) -> float:
        # A notifying store wakes us on change; still come back in time to renew our lease.
        return self.timeouts.host_ttl / 3 if self.store.notifies else self.timeouts.poll

    def _join_step(self, previous_ranks: Optional[List[int]], after: int):
        """One look at the round: the frozen round that gives us ranks, True to look again at once (we
        changed it), or False to wait for a change."""
        self.check_token()
        self._raise_if_ended()
        self.keepalive()
        raw = self.store.get(self._round_key)
        if raw is None:
            first = Round(0, "joining", "start", 0, time.time(), {}, [])
            return self.store.compare_and_set(self._round_key, None, first.to_json()) or True
        round_ = Round.from_json(raw)
        if round_.phase == "frozen":
            if round_.number > after and self.host_id in round_.participants:
                # Ranks, or none (standby: more workers than max_workers) until the next round.
                return round_ if (round_.assignment or {}).get(self.host_id) else False
            self.open_next(round_, reason=f"join {self.host_id}", failure=False)
            return True
        if self.host_id not in round_.participants:
            round_.participants[self.host_id] = {
                "nproc": self.nproc, "addr": self.addr, "ports": _free_ports(self.addr, self.nproc, self.port_range),
                "joined": time.time(), "previous_rank": min(previous_ranks) if previous_ranks else None}
            self.store.compare_and_set(self._round_key, raw, round_.to_json())
            return True
        if self._ready(round_):
            self.store.compare_and_set(self._round_key, raw, self._freeze(round_).to_json())
            return True
        return False

    def _ready(self, round_: Round) -> bool:
        """Freeze once enough workers are in and no live survivor is still on its way.

        A survivor whose host lease is alive is stopping its workers and will join; freezing without it
        would only make it open yet another round. `survivor_wait` bounds that wait."""
        joined = sum(p["nproc"] for p in round_.participants.values())
        if joined >= self.max_workers:
            return True
        if joined < self.min_workers:
            return False
        waited = time.time() - round_.opened
        alive = set(self.alive_hosts())
        missing = [h for h in round_.expected if h in alive and h not in round_.participants]
        if missing:
            return waited > self.timeouts.survivor_wait
        return bool(round_.expected) or waited > self.timeouts.last_call

    def _freeze(self, round_: Round) -> Round:
        order = sorted(round_.participants.items(), key=lambda item: (
            item[1]["previous_rank"] is None, item[1]["previous_rank"] or 0, item[1]["joined"], item[0]))
        assignment, cluster = {}, []
        for host, info in order:
            take = max(0, min(info["nproc"], self.max_workers - len(cluster)))
            assignment[host] = list(range(len(cluster), len(cluster) + take))
            cluster += [f"{info['addr']}:{port}" for port in info["ports"][:take]]
        return dataclasses.replace(round_, phase="frozen", assignment=assignment, cluster=cluster)

    def _raise_if_ended(self) -> None:
        outcome = self.outcome()
        if outcome is not None:
            raise JobEnded(outcome["status"], outcome["reason"])


def _free_ports(addr: str, count: int, port_range: Optional[Tuple[int, int]] = None) -> List[int]:
    """Ports free right now on `addr` (within `port_range` if given); fresh every round, so a stale
    process cannot hold one."""
    sockets = []
    try:
        candidates = iter(range(port_range[0], port_range[1] + 1)) if port_range else None
        while len(sockets) < count:
            s = socket.socket()
            try:
                s.bind((addr, next(candidates) if candidates else 0))
            except StopIteration:
                s.close()
                raise NoFreePorts(f"--port_range={port_range[0]}-{port_range[1]} has fewer than {count} free "
                                 f"ports on {addr}") from None
            except OSError:
                s.close()
                continue
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
