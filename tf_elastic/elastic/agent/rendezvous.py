"""Rounds of membership agreement between agents, kept in a `Store`, with store traffic linear in the hosts.

A round opens in the `joining` phase; each host joins by writing the round's number into its own lease
(`/JOB/hosts/HOST`, nothing contended), and the round's opener (the agent whose compare-and-set opened
it; another takes over if its lease goes) lists the leases and freezes the round with ranks and a TF
cluster spec on fresh ports (`decisions.freeze`), in one write. Agents wake on watches of the keys they
need: everyone on `/JOB/group/` (the round and the outcome), a training host also on the lease of one
other host (`decisions.watched_host`); the opener polls the leases until it freezes. Leases are renewed
every third of their TTL. Any change (a failure, a host lost, a join, a graceful leave) opens the next
round; only failures count towards `max_restarts`. What to do at each look is decided in `decisions`;
this module only reads and writes the store.

Requests per round, counted at the client: each host lists the group twice (the round opening, then
frozen) and writes its lease once; the opener lists the leases a few times; and a failure seen by
every host costs each one compare-and-set. In steady state a host renews its lease (two requests per
third of the TTL on etcd) and reads only when a watch fires.
"""
import dataclasses
import json
import time
import uuid
from typing import Callable, Collection, Dict, List, Optional, Set, Tuple

from absl import logging

from tf_elastic.elastic.agent import decisions
from tf_elastic.elastic.agent.decisions import JoinAction
from tf_elastic.elastic.agent.job_record import JobOutcome, JobRecord
from tf_elastic.elastic.agent.ports import NoFreePorts, claim_ports
from tf_elastic.elastic.agent.round import Phase, Round, Timeouts, participants_of
from tf_elastic.elastic.protocol import Failure, JobStatus
from tf_elastic.elastic.store import Store, StoreError


class RendezvousTimeout(RuntimeError):
    """Fewer than `min_workers` joined within the rendezvous timeout."""


class HostIdTaken(RuntimeError):
    """Another live agent holds this host id (two agents would share ranks and commit to the same files)."""


@dataclasses.dataclass(frozen=True)
class GroupLook:
    """One look at the store from a host that trains: the group's change, the current round, and the
    ranked host it looks after if that host's lease is gone."""
    change: decisions.GroupChange
    current: Optional[Round]
    lost: List[str]


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
        self._lease_value = self._lease_record()  # what our lease holds now: renewals compare against it
        self._joined: Optional[int] = None  # the round our lease announces we joined
        self._renewed = float("-inf")  # monotonic time of the last renewal
        self._round_seen = (-1, 0.0)  # (round, monotonic time this agent first saw it joining)
        self._arrivals: Tuple[int, Dict[str, int]] = (-1, {})  # (round, host -> order first seen joined)
        self._refused: set = set()  # malformed leases already reported
        # The group as a look just read it, when it showed a new round: the next join step's first look.
        # Stale by the time the workers stopped, which is safe: every change since wakes the next wait.
        self._seen: Optional[Tuple[Optional[JobOutcome], Optional[Round], Optional[str]]] = None
        self._watching: Tuple[Optional[int], Optional[str]] = (None, None)  # round number, its watched host
        self._opening: Optional[Tuple[Round, str]] = None  # a round this agent tried to open, not yet judged

    def wait_for_change(self, timeout: float, training: Optional[Round] = None) -> Set[str]:
        """The store keys that may have changed within `timeout` (every one named, for a store that
        cannot tell): the group (the round and the outcome) and, while `training` in a round, the lease of
        the host this one looks after (`decisions.watched_host`), when it is gone."""
        return self.store.wait([self.keys.group], timeout, gone=self.watched_keys(training)[1:] if training else [])

    def watched_keys(self, round_: Round) -> List[str]:
        """What a host training in `round_` watches: the group, and the lease of the host it looks after
        (if any). A `look` with these as changed reads everything."""
        watched = self._watched_host(round_)
        return [self.keys.group] + ([self.keys.host(watched)] if watched else [])

    def _watched_host(self, round_: Round) -> Optional[str]:
        """`decisions.watched_host`, worked out once per round (it sorts the whole assignment, and the
        monitor asks every interval)."""
        if self._watching[0] != round_.number:
            self._watching = (round_.number, decisions.watched_host(round_, self.host_id))
        return self._watching[1]

    # Leases ---------------------------------------------------------------------------------------
    def claim_host_id(self, value: Optional[str] = None) -> None:
        """Takes this host id's lease (holding `value`, if given), or raises `HostIdTaken` if another agent
        keeps renewing it. A lease left by a dead agent (SIGKILL, then a restart) expires within
        `host_ttl`: we wait that out. The lease is taken by compare-and-set: of two agents started together
        with one id, one wins."""
        key, value = self.keys.host(self.host_id), value or self._lease_value
        lease = self.store.lease_seconds(self.timeouts.host_ttl)  # etcd may raise it (to 1.5 election timeouts)
        deadline = time.monotonic() + 3 * lease + 1.0
        while True:
            if self.store.compare_and_set(key, None, value, ttl=self.timeouts.host_ttl) or self._ours(key, value):
                break
            if time.monotonic() > deadline:
                raise HostIdTaken(f"another live agent already uses --host_id={self.host_id!r} in job "
                                  f"{self.job.job_id!r}; give each agent its own --host_id")
            time.sleep(lease / 4)
        self._claimed, self._renewed, self._lease_value = True, time.monotonic(), value

    def keepalive(self, value: Optional[str] = None) -> None:
        """Renews this host's lease (writing `value` into it, if given), or takes it again if it lapsed
        and nobody took it; raises `HostIdTaken` if another agent took the id meanwhile (ours lapsed while
        this agent was stopped or cut off). Both by compare-and-set: a renewal never overwrites a
        newcomer's lease."""
        key, ttl, new = self.keys.host(self.host_id), self.timeouts.host_ttl, value or self._lease_value
        if not (self.store.compare_and_set(key, self._lease_value, new, ttl=ttl)
                or self.store.compare_and_set(key, None, new, ttl=ttl) or self._ours(key, new)):
            raise HostIdTaken(f"another agent took --host_id={self.host_id!r} in job {self.job.job_id!r} while "
                              f"this one's lease had lapsed; this agent stops its workers and exits")
        self._lease_value, self._renewed = new, time.monotonic()

    def _ours(self, key: str, value: str) -> bool:
        """Whether the lease at `key` is this agent's own after all, made to hold `value`: a write applied
        whose reply was lost (an error after the write, or etcd re-sending the transaction to the next
        endpoint, whose compare then fails) left our own record there. The caller acts on what the lease
        says (the round it joins), so it is rewritten to `value` if it holds another of ours."""
        held = self.store.get(key)
        return _incarnation(held) == self.incarnation and (
            held == value or self.store.compare_and_set(key, held, value, ttl=self.timeouts.host_ttl))

    def _announces(self, number: int) -> bool:
        """Whether our own lease (this incarnation's) announces that we joined round `number`."""
        held = self.store.get(self.keys.host(self.host_id))
        try:
            return _incarnation(held) == self.incarnation and json.loads(held).get("round") == number
        except (TypeError, ValueError, AttributeError):
            return False

    def renew_if_due(self) -> None:
        """`keepalive`, once a third of the host TTL has passed since the last renewal (the agent's loops
        call this far more often: renewing at each call would cost the store a request per interval)."""
        if time.monotonic() - self._renewed >= self.timeouts.host_ttl / 3:
            self.keepalive()

    def _lease_record(self, **joined) -> str:
        return json.dumps({"addr": self.addr, "nproc": self.nproc, "incarnation": self.incarnation, **joined})

    def leave(self) -> None:
        """Gives up this host's lease, if it holds it (never another agent's with the same id)."""
        key = self.keys.host(self.host_id)
        if self._claimed and _incarnation(self.store.get(key)) == self.incarnation:
            self.store.delete(key)

    def leases(self) -> Dict[str, str]:
        """Every live host lease: key -> value."""
        return self.store.list(self.keys.hosts)

    # Rounds ---------------------------------------------------------------------------------------
    def current(self) -> Optional[Round]:
        raw = self.store.get(self.keys.round)
        return None if raw is None else Round.from_json(raw, self.keys.round)

    def read_group(self) -> Tuple[Optional[JobOutcome], Optional[Round], Optional[str]]:
        """The job's outcome and the current round (and its raw record, for a compare-and-set), in one
        read."""
        group = self.store.list(self.keys.group)
        raw = group.get(self.keys.round)
        outcome = self.job.parse_outcome(group.get(self.keys.outcome))
        return outcome, None if raw is None else Round.from_json(raw, self.keys.round), raw

    def look(self, round_: Round, changed: Collection[str]) -> "GroupLook":
        """What the store says about `round_`, which this host trains in, reading only what `changed`
        names (`wait_for_change`'s answer; `watched_keys` for everything): the round and the outcome in
        one read, and the lease of the host this one looks after."""
        watched = self._watched_host(round_)
        lease_gone = watched is not None and self.keys.host(watched) in changed
        change, current = decisions.GroupChange.NONE, round_
        if self.keys.group in changed:
            outcome, current, raw = self.read_group()
            change = decisions.judge_group(round_, outcome and outcome.status, current)
            if change in (decisions.GroupChange.RESIZED, decisions.GroupChange.RESTARTED):
                self._seen = (outcome, current, raw)  # the next join starts from it instead of reading again
        if change is not decisions.GroupChange.NONE or not lease_gone or self.store.get(self.keys.host(watched)):
            return GroupLook(change, current, [])
        # Its lease is gone. A host whose workers finished records the outcome and then lets its lease go,
        # maybe between the two reads above: read the group again before calling the host lost, or the
        # finished host's exit would kill this host's workers while they end (the chief's last evaluation).
        outcome, current, _ = self.read_group()
        change = decisions.judge_group(round_, outcome and outcome.status, current)
        return GroupLook(change, current, [watched] if change is decisions.GroupChange.NONE else [])

    def open_next(self, seen: Round, reason: str, failure: bool, leaving: bool = False) -> bool:
        """Opens round `seen.number + 1` (this agent then freezes it) unless someone already moved past
        `seen`; True if we did.

        Only the agent whose compare-and-set wins counts a failure, so a failure seen by every agent
        is counted once. A write applied whose reply was lost still counts as ours: the round then holds
        exactly the record we wrote."""
        nxt = decisions.next_round(seen, reason, failure, time.time(), self.host_id,
                                   self.host_id if leaving else None)
        self._opening = (nxt, reason)
        if not (self.store.compare_and_set(self.keys.round, seen.to_json(), nxt.to_json())
                or self._is_opening(self.current())):
            self._opening = None
            return False
        return self._opened()

    def open_after(self, number: int, reason: str, failure: bool, leaving: bool = False) -> bool:
        """`open_next` from round `number`, if the group is still in it (read now); True if this agent
        opened the next round. Safe to call again after a `StoreError`: a round that an earlier call
        wrote (its reply lost) is recognised and counts as opened here. `leaving`: whatever it opened, a
        later round still joining stops expecting this host (`_stop_being_expected`)."""
        current = self.current()
        if self._is_opening(current):
            opened = self._opened()
        else:
            opened = current is not None and current.number == number and self.open_next(
                current, reason, failure, leaving)
        if leaving:  # another host may have opened the next round first, expecting this one back
            self._stop_being_expected(after=number)
        return opened

    def _stop_being_expected(self, after: int) -> None:
        """This host leaves while a round opened after `after` (another host's failure, a join) expects it
        back: takes itself out of that round (`decisions.without_leaving_host`), or its opener, finding the
        lease gone, would record a graceful leave as a lost host. Reads again when another write came first
        (a join, the freeze, another host leaving), for up to a host TTL (then its lease expires as a loss)."""
        deadline = time.monotonic() + self.timeouts.host_ttl
        while True:
            _, round_, raw = self.read_group()
            changed = round_ is not None and round_.number > after and decisions.without_leaving_host(
                round_, self.host_id)
            if not changed or self.store.compare_and_set(self.keys.round, raw, changed.to_json()):
                return
            if time.monotonic() > deadline:
                logging.warning("round %d still expects %s, which leaves: its other writers kept the round busy "
                                "for --host_ttl; it will count this host lost", round_.number, self.host_id)
                return

    def _is_opening(self, round_: Optional[Round]) -> bool:
        """Whether `round_` is the one this agent last tried to open (by its number and opening time: a
        freeze or an opener's takeover since changes neither)."""
        mine = self._opening and self._opening[0]
        return bool(mine and round_ and (round_.number, round_.opened) == (mine.number, mine.opened))

    def _opened(self) -> bool:
        """Judges, once, a round this agent opened. Only the winner judges: a lost compare-and-set means
        another agent moved on, maybe without a failure."""
        nxt, reason = self._opening
        if nxt.restarts > self.max_restarts:
            self.job.finish(JobStatus.FAILED, f"max_restarts={self.max_restarts} exceeded ({reason})")
        self._opening = None
        return True

    def join(self, previous_ranks: Optional[List[int]] = None, after: int = -1,
             cancelled: Callable[[], bool] = lambda: False,
             on_standby: Callable[[Round], None] = lambda round_: None) -> Optional[Round]:
        """Blocks until a frozen round numbered above `after` gives this host ranks; returns it, or None
        once `cancelled()` (the agent was asked to leave while waiting). `on_standby(round)` is called when
        this host begins to wait as a standby beside a round that trains without it."""
        deadline = time.monotonic() + self.timeouts.rendezvous
        unreachable: Optional[Exception] = None
        changed, standing_by = True, False
        while True:
            if cancelled():
                return None
            try:
                action, seen, wrote = self._join_step(previous_ranks, after, changed)
                if unreachable is not None:
                    logging.info("rendezvous store reachable again")
                    unreachable = None
            except (StoreError, NoFreePorts) as error:
                if unreachable is None:
                    logging.warning("rendezvous: %s; retrying until --rendezvous_timeout", error)
                unreachable, action, seen, wrote = error, None, None, False
            if action is JoinAction.TAKE:
                return seen
            if action is JoinAction.STANDBY:
                deadline = time.monotonic() + self.timeouts.rendezvous  # the job trains: waiting is no failure
                if not standing_by:
                    standing_by = True
                    logging.info("round %d trains without %s (max_workers=%d%s): it waits as a standby",
                                 seen.number, self.host_id, self.max_workers,
                                 f", world_size_divides={self.world_size_divides}" if self.world_size_divides else "")
                    on_standby(seen)
            if time.monotonic() > deadline:
                raise self._timed_out(unreachable)
            changed = True
            if action is JoinAction.TRY_FREEZE:
                time.sleep(self.timeouts.poll)  # the opener looks at the leases every poll, whatever woke it
            elif not wrote:
                changed = bool(self.wait_for_change(self.timeouts.host_ttl / 3 if self.store.notifies
                                                    else self.timeouts.poll))

    def _timed_out(self, unreachable: Optional[Exception]) -> RendezvousTimeout:
        if unreachable is not None:
            return RendezvousTimeout(f"no rendezvous within --rendezvous_timeout={self.timeouts.rendezvous:g}s: "
                                     f"{unreachable}")
        round_ = self.current()
        participants = self._participants(self.leases(), round_.number) if round_ else {}
        joined = sum(p["nproc"] for p in participants.values())
        reason = (f"only {joined} of min_workers={self.min_workers} workers joined within "
                  f"--rendezvous_timeout={self.timeouts.rendezvous:g}s")
        self.job.finish(JobStatus.FAILED, reason)
        return RendezvousTimeout(reason)

    def _join_step(self, previous_ranks: Optional[List[int]], after: int,
                   changed: bool) -> Tuple[JoinAction, Optional[Round], bool]:
        """One look at the round and the action `decisions` picks for it, carried out. Returns the action,
        the round it looked at and whether the store was written (then look again at once).
        `changed`: whether a watch fired since the last look (False: the wait timed out)."""
        self.job.check_token()
        outcome, round_, raw = self._seen or self.read_group()
        self._seen = None
        self.job.raise_if_ended(outcome)
        if self._is_opening(round_):  # ours, opened by a write whose reply was lost: judged now
            self._opened()
        action = decisions.next_join_action(round_, self.host_id, self._joined, after, self.max_workers)
        if not self._claimed:  # here, so that an unreachable store is retried like any other rendezvous step
            if self._claim(round_, action, previous_ranks):
                return action, round_, round_.opener == self.host_id
            # The claim may have waited out a dead predecessor's lease, and the round read before it (one
            # that ranks this host id: the predecessor's) replaced meanwhile: decide from a read made since.
            outcome, round_, raw = self.read_group()
            self.job.raise_if_ended(outcome)
            action = decisions.next_join_action(round_, self.host_id, self._joined, after, self.max_workers)
        if action is JoinAction.REPLACE_PREDECESSOR and self._announces(round_.number):
            self._joined, action = round_.number, JoinAction.TAKE  # our join went out; its reply was lost
        self.renew_if_due()
        if action is JoinAction.TAKE:
            return action, round_, False
        if action is JoinAction.STANDBY:
            return action, round_, self._ranked_host_lost(round_, changed)
        if action is JoinAction.CREATE_FIRST:
            first = Round(0, Phase.JOINING.value, "start", 0, time.time(), [], self.host_id)
            self.store.compare_and_set(self.keys.round, None, first.to_json())
        elif action is JoinAction.OPEN_NEXT:
            self.open_next(round_, reason=f"join {self.host_id}", failure=False)
        elif action is JoinAction.REPLACE_PREDECESSOR:
            logging.warning("round %d ranks host %s, whose previous agent is gone: %s opens the next round",
                            round_.number, self.host_id, self.host_id)
            self.open_next(round_, reason=f"{Failure.HOST_LOST.value} host={self.host_id}: its agent restarted",
                           failure=True)
        elif action is JoinAction.ADD_SELF:
            self.keepalive(self._join_record(round_, previous_ranks))
            self._joined = round_.number
            return action, round_, round_.opener == self.host_id  # anyone else waits for the freeze at once
        elif action is JoinAction.WAIT:
            # Look at the opener's lease only when no watch fired for a while: a lost opener is rare.
            if (changed and self.store.notifies) or self.store.get(self.keys.host(round_.opener)) is not None:
                return action, round_, False
            logging.info("round %d: its opener %s is gone; %s freezes it", round_.number, round_.opener,
                         self.host_id)
            self.store.compare_and_set(self.keys.round, raw, dataclasses.replace(round_, opener=self.host_id).to_json())
        elif not self._try_freeze(round_, raw):
            return action, round_, False
        return action, round_, True

    def _claim(self, round_: Optional[Round], action: JoinAction, previous_ranks: Optional[List[int]]) -> bool:
        """Takes this host's lease, with the join in it when `action` adds this host to `round_` (one write
        rather than two); True if it joined."""
        joining = action is JoinAction.ADD_SELF
        self.claim_host_id(self._join_record(round_, previous_ranks) if joining else None)
        if joining:
            self._joined = round_.number
        return joining

    def _try_freeze(self, round_: Round, raw: str) -> bool:
        """The opener's look at the leases: freezes `round_` once `decisions.ready_to_freeze`; True if it
        wrote."""
        leases = self.leases()
        participants = self._participants(leases, round_.number)
        alive = {key.rsplit("/", 1)[-1] for key in leases}
        arrival = self._arrival_order(round_.number, participants)  # at every listing, ready or not
        if not decisions.ready_to_freeze(round_, participants, self.min_workers, self.max_workers, alive,
                                         self._joining_for(round_.number), self.timeouts):
            return False
        frozen = decisions.freeze(round_, participants, self.max_workers, alive, self.world_size_divides, arrival)
        self.store.compare_and_set(self.keys.round, raw, frozen.to_json())
        return True

    def _ranked_host_lost(self, round_: Round, changed: bool) -> bool:
        """A standby's look beside `round_`: when the ranked host it watches (`decisions.standby_watch`) is
        gone and nobody opened the next round (it was the only ranked host, or every ranked host died
        together: no ring watcher is left), opens it as that host's failure. True if it did (look again).
        Looks only when no watch fired for a while, as a lost opener is looked for."""
        watched = decisions.standby_watch(round_)
        if (changed and self.store.notifies) or watched is None or self.store.get(self.keys.host(watched)):
            return False
        # A finished host records the outcome, then lets its lease go: read the group again first.
        outcome, current, _ = self.read_group()
        if outcome is not None or current is None or current.number != round_.number:
            return True
        logging.warning("round %d: ranked host %s is gone and no round follows; standby %s opens the next",
                        round_.number, watched, self.host_id)
        return self.open_next(round_, reason=f"{Failure.HOST_LOST.value} host={watched}", failure=True)

    def withdraw(self, after: int) -> None:
        """Leaves while joining (a notice came). First the lease stops announcing a round, so that no later
        listing ranks this host, but still shows it alive (gone now, a ring watcher or a standby would count
        a lost host if a round froze with it); if a round had frozen with it ranked all the same (its opener
        listed the leases just before), opens the next round as this host's leave, so that the others commit
        and regroup instead of counting a restart; then gives the lease up. A round still joining that expects
        this host back stops expecting it (`_stop_being_expected`)."""
        if not self._claimed:
            return
        joined = self._joined
        try:
            self.keepalive(self._lease_record())
            try:
                self._stop_being_expected(after)
            except StoreError as error:  # the round's own look below still comes
                logging.warning("%s leaves, still expected by the next round: %s", self.host_id, error)
            deadline = time.monotonic() + self.timeouts.host_ttl  # a freeze follows the listing it rests on at once
            while True:
                round_ = self.current()
                if round_ is not None and round_.phase == Phase.FROZEN.value:
                    if round_.number > after and (round_.assignment or {}).get(self.host_id):
                        self.open_next(round_, reason=f"leave {self.host_id}", failure=False, leaving=True)
                    return
                if round_ is None or round_.number != joined or time.monotonic() > deadline:
                    return
                time.sleep(self.timeouts.poll)
                self.renew_if_due()
        finally:
            self.leave()

    def _join_record(self, round_: Round, previous_ranks: Optional[List[int]]) -> str:
        """This host's lease announcing that it joins `round_`, with ports for its workers."""
        ports = claim_ports(self.incarnation, self.addr, self.nproc, self.port_range)
        return self._lease_record(round=round_.number, ports=ports, joined=time.time(),
                                  previous_rank=min(previous_ranks) if previous_ranks else None)

    def _arrival_order(self, number: int, participants: Dict[str, Dict]) -> Dict[str, int]:
        """The order in which this agent first saw each participant joined in round `number`, by its own
        listings (those first seen in one listing by host id): newcomers rank in it, and no host's wall
        clock (`joined`) is compared with another's."""
        if self._arrivals[0] != number:
            self._arrivals = (number, {})
        seen = self._arrivals[1]
        for host in sorted(participants):
            seen.setdefault(host, len(seen))
        return seen

    def _joining_for(self, number: int) -> float:
        """Seconds since this agent first saw round `number` joining, on its own monotonic clock: the round's
        `opened` is another host's wall clock when the opener changed, and clock skew between hosts would
        move `last_call` and `survivor_wait` (a host that takes over a round starts its wait anew)."""
        if self._round_seen[0] != number:
            self._round_seen = (number, time.monotonic())
        return time.monotonic() - self._round_seen[1]

    def _participants(self, leases: Dict[str, str], number: int) -> Dict[str, Dict]:
        participants, refused = participants_of(leases, number)
        for key in set(refused) - self._refused:
            logging.warning("rendezvous: refused the malformed host lease at %s: %r", key, leases[key][:200])
        self._refused.update(refused)
        return participants


def _incarnation(raw: Optional[str]) -> Optional[str]:
    try:
        return json.loads(raw).get("incarnation") if raw else None
    except (ValueError, AttributeError):
        return None
