"""Rounds of membership agreement between agents, kept in a `Store`.

A round opens in the `joining` phase, agents add themselves (compare-and-set), and once enough workers
are in it freezes with ranks and a TF cluster spec on fresh ports (`decisions.freeze`). Any change (a
failure, a host lost, a join, a graceful leave) opens the next round; only failures count towards
`max_restarts`. Hosts prove they are alive with leases at `/JOB/hosts/HOST`. What to do at each look
is decided in `decisions`; this module only reads and writes the store.
"""
import json
import time
import uuid
from typing import Callable, List, Optional, Tuple

from absl import logging

from tf_elastic.elastic.agent import decisions
from tf_elastic.elastic.agent.decisions import JoinAction
from tf_elastic.elastic.agent.job_record import JobRecord
from tf_elastic.elastic.agent.ports import NoFreePorts, free_ports
from tf_elastic.elastic.agent.round import Phase, Round, Timeouts
from tf_elastic.elastic.protocol import JobStatus
from tf_elastic.elastic.store import Store, StoreError


class RendezvousTimeout(RuntimeError):
    """Fewer than `min_workers` joined within the rendezvous timeout."""


class HostIdTaken(RuntimeError):
    """Another live agent holds this host id (two agents would share ranks and commit to the same files)."""


class Rendezvous:
    def __init__(self, store: Store, job_id: str, host_id: str, nproc: int, addr: str, min_workers: int,
                 max_workers: int, max_restarts: int, timeouts: Timeouts = Timeouts(), token: Optional[str] = None,
                 port_range: Optional[Tuple[int, int]] = None, world_size_divides: Optional[int] = None):
        self.store, self.host_id, self.nproc, self.addr = store, host_id, nproc, addr
        self.world_size_divides = world_size_divides
        self.min_workers, self.max_workers, self.max_restarts = min_workers, max_workers, max_restarts
        self.timeouts, self.port_range = timeouts, port_range
        self.job = JobRecord(store, job_id, host_id, token)
        self.keys = self.job.keys
        self.incarnation = uuid.uuid4().hex  # tells this agent from another one with the same host id
        self._claimed = False

    def wait_for_change(self, timeout: float) -> bool:
        """True when the job's keys may have changed within `timeout` (always, for a store that cannot tell)."""
        return self.store.wait(self.keys.prefix, timeout)

    # Leases ---------------------------------------------------------------------------------------
    def claim_host_id(self) -> None:
        """Takes this host id's lease, or raises `HostIdTaken` if another agent keeps renewing it. A lease
        left by a dead agent (SIGKILL, then a restart) expires within `host_ttl`: we wait that out. The
        lease is taken by compare-and-set: of two agents started together with one id, one wins."""
        key = self.keys.host(self.host_id)
        lease = self.store.lease_seconds(self.timeouts.host_ttl)  # etcd may raise it (to 1.5 election timeouts)
        deadline = time.monotonic() + 3 * lease + 1.0
        while True:
            if (self.store.compare_and_set(key, None, self._lease(), ttl=self.timeouts.host_ttl)
                    or _incarnation(self.store.get(key)) == self.incarnation):
                self._claimed = True
                return
            if time.monotonic() > deadline:
                raise HostIdTaken(f"another live agent already uses --host_id={self.host_id!r} in job "
                                  f"{self.job.job_id!r}; give each agent its own --host_id")
            time.sleep(lease / 4)

    def keepalive(self) -> None:
        """Renews this host's lease, or takes it again if it lapsed and nobody took it; raises `HostIdTaken`
        if another agent took the id meanwhile (ours lapsed while this agent was stopped or cut off).
        Both by compare-and-set: a renewal never overwrites a newcomer's lease."""
        key, lease, ttl = self.keys.host(self.host_id), self._lease(), self.timeouts.host_ttl
        if self.store.compare_and_set(key, lease, lease, ttl=ttl) or self.store.compare_and_set(key, None, lease,
                                                                                                  ttl=ttl):
            return
        raise HostIdTaken(f"another agent took --host_id={self.host_id!r} in job {self.job.job_id!r} while this "
                          f"one's lease had lapsed; this agent stops its workers and exits")

    def _lease(self) -> str:
        return json.dumps({"addr": self.addr, "nproc": self.nproc, "incarnation": self.incarnation})

    def leave(self) -> None:
        """Gives up this host's lease, if it holds it (never another agent's with the same id)."""
        key = self.keys.host(self.host_id)
        if self._claimed and _incarnation(self.store.get(key)) == self.incarnation:
            self.store.delete(key)

    def alive_hosts(self) -> List[str]:
        return [key.rsplit("/", 1)[-1] for key in self.store.list(self.keys.hosts)]

    # Rounds ---------------------------------------------------------------------------------------
    def current(self) -> Optional[Round]:
        raw = self.store.get(self.keys.round)
        return None if raw is None else Round.from_json(raw, self.keys.round)

    def open_next(self, seen: Round, reason: str, failure: bool, leaving: bool = False) -> bool:
        """Opens round `seen.number + 1` unless someone already moved past `seen`; True if we did.

        Only the agent whose compare-and-set wins counts a failure, so a failure seen by every agent
        is counted once."""
        nxt = decisions.next_round(seen, reason, failure, time.time(), self.host_id if leaving else None)
        opened = self.store.compare_and_set(self.keys.round, seen.to_json(), nxt.to_json())
        # Only the winner judges: a lost compare-and-set means another agent moved on, maybe without a failure.
        if opened and nxt.restarts > self.max_restarts:
            self.job.finish(JobStatus.FAILED, f"max_restarts={self.max_restarts} exceeded ({reason})")
        return opened

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
                action, taken, wrote = self._join_step(previous_ranks, after)
                if unreachable is not None:
                    logging.info("rendezvous store reachable again")
                    unreachable = None
            except (StoreError, NoFreePorts) as error:
                if unreachable is None:
                    logging.warning("rendezvous: %s; retrying until --rendezvous_timeout", error)
                unreachable, action, taken, wrote = error, None, None, False
            if taken is not None:
                return taken
            if action is JoinAction.STANDBY:
                deadline = time.monotonic() + self.timeouts.rendezvous  # the job trains: waiting is no failure
            if time.monotonic() > deadline:
                raise self._timed_out(unreachable)
            if not wrote:
                self.wait_for_change(self._poll())

    def _timed_out(self, unreachable: Optional[Exception]) -> RendezvousTimeout:
        if unreachable is not None:
            return RendezvousTimeout(f"no rendezvous within --rendezvous_timeout={self.timeouts.rendezvous:g}s: "
                                     f"{unreachable}")
        round_ = self.current()
        joined = sum(p["nproc"] for p in round_.participants.values()) if round_ else 0
        reason = (f"only {joined} of min_workers={self.min_workers} workers joined within "
                  f"--rendezvous_timeout={self.timeouts.rendezvous:g}s")
        self.job.finish(JobStatus.FAILED, reason)
        return RendezvousTimeout(reason)

    def _poll(self) -> float:
        # A notifying store wakes us on change; still come back in time to renew our lease.
        return self.timeouts.host_ttl / 3 if self.store.notifies else self.timeouts.poll

    def _join_step(self, previous_ranks: Optional[List[int]],
                   after: int) -> Tuple[JoinAction, Optional[Round], bool]:
        """One look at the round and the action `decisions` picks for it, carried out. Returns the action,
        the round to train in (for `TAKE`) and whether the store was written (then look again at once)."""
        self.job.check_token()
        self.job.raise_if_ended()
        if not self._claimed:  # here, so that an unreachable store is retried like any other rendezvous step
            self.claim_host_id()
        self.keepalive()
        raw = self.store.get(self.keys.round)
        round_ = None if raw is None else Round.from_json(raw, self.keys.round)
        action = decisions.next_join_action(round_, self.host_id, after, self.max_workers)
        if action is JoinAction.TAKE:
            return action, round_, False
        if action is JoinAction.STANDBY:
            return action, None, False
        if action is JoinAction.CREATE_FIRST:
            first = Round(0, Phase.JOINING.value, "start", 0, time.time(), {}, [])
            self.store.compare_and_set(self.keys.round, None, first.to_json())
        elif action is JoinAction.OPEN_NEXT:
            self.open_next(round_, reason=f"join {self.host_id}", failure=False)
        elif action is JoinAction.ADD_SELF:
            round_.participants[self.host_id] = {
                "nproc": self.nproc, "addr": self.addr, "ports": self._ports(round_),
                "joined": time.time(), "previous_rank": min(previous_ranks) if previous_ranks else None}
            self.store.compare_and_set(self.keys.round, raw, round_.to_json())
        else:
            alive = set(self.alive_hosts())
            if not decisions.ready_to_freeze(round_, self.min_workers, self.max_workers, alive,
                                             time.time() - round_.opened, self.timeouts):
                return action, None, False
            frozen = decisions.freeze(round_, self.max_workers, alive, self.world_size_divides)
            self.store.compare_and_set(self.keys.round, raw, frozen.to_json())
        return action, None, True

    def _ports(self, round_: Round) -> List[int]:
        """Free ports on this host, none that another agent of this address already claimed in the round:
        two agents on one host probe the same free ports, and TF servers listen on every interface."""
        taken = {p for info in round_.participants.values() if info["addr"] == self.addr for p in info["ports"]}
        return free_ports(self.nproc, self.port_range, exclude=taken)


def _incarnation(raw: Optional[str]) -> Optional[str]:
    try:
        return json.loads(raw).get("incarnation") if raw else None
    except (ValueError, AttributeError):
        return None
