"""The agent's decisions, as pure functions of what it observed: no store, no processes, no clock.

Like torch elastic's dynamic rendezvous, the code that reads the store and signals processes
(`rendezvous.py`, `agent.py`) only gathers facts, asks here what they mean, and carries it out, so
every rule below is tested without a process (tests/test_decisions.py).
"""
import dataclasses
import enum
from typing import Dict, List, Optional, Set

from tf_elastic.elastic.agent.round import Phase, Round, Timeouts
from tf_elastic.elastic.protocol import ExitCode, Failure, JobStatus


# Joining a round ---------------------------------------------------------------------------------
class JoinAction(enum.Enum):
    CREATE_FIRST = "create_first"  # no round yet: open round 0
    OPEN_NEXT = "open_next"  # a frozen round we are not part of: open the next one
    ADD_SELF = "add_self"  # a round still joining, without us: announce it in our lease
    TRY_FREEZE = "try_freeze"  # a round still joining, with us, that we opened: freeze it once `ready_to_freeze`
    WAIT = "wait"  # a round still joining, with us, that another agent opened: wait for it to freeze it
    TAKE = "take"  # a frozen round newer than our last, that we joined and that gives us ranks: train in it
    # A frozen round that ranks our host id but that this agent never joined: its dead predecessor's (this
    # agent restarted). Its workers are gone and our lease hides that from the ring: open the next round as
    # that host's failure.
    REPLACE_PREDECESSOR = "replace_predecessor"
    STANDBY = "standby"  # a frozen round at max_workers: wait, without disturbing it, for a place to free up


def next_join_action(round_: Optional[Round], host_id: str, joined: Optional[int], after: int,
                     max_workers: int) -> JoinAction:
    """What a host that last trained in round `after`, and last joined round `joined`, does next, given the
    current round.

    A frozen round that already trains `max_workers` workers is left alone: joining it would open a
    round that again has no place for us (measured before: 25 rounds in 30 s with three hosts for two
    places). We wait as a standby and join the next round that opens (a failure, a leave)."""
    if round_ is None:
        return JoinAction.CREATE_FIRST
    if round_.phase == Phase.FROZEN.value:
        assignment = round_.assignment or {}
        if round_.number > after and assignment.get(host_id):
            return JoinAction.TAKE if joined == round_.number else JoinAction.REPLACE_PREDECESSOR
        # Considered and left out (the world was full, or a smaller size divides the global batch).
        if round_.number > after and (host_id in assignment or round_.world_size >= max_workers):
            return JoinAction.STANDBY
        return JoinAction.OPEN_NEXT
    if joined != round_.number:
        return JoinAction.ADD_SELF
    return JoinAction.TRY_FREEZE if round_.opener == host_id else JoinAction.WAIT


def ready_to_freeze(round_: Round, participants: Dict[str, Dict], min_workers: int, max_workers: int,
                    alive: Set[str], waited: float, timeouts: Timeouts) -> bool:
    """Freeze once enough workers are in and no live survivor is still on its way.

    A survivor whose host lease is alive is stopping its workers and will join; freezing without it
    would only make it open yet another round. `survivor_wait` bounds that wait; with no survivors
    expected (a fresh job), `last_call` gives stragglers a moment. A full round waits for survivors too:
    ranks go to survivors first, so a newcomer must not take the place of one still on its way."""
    joined = sum(p["nproc"] for h, p in participants.items() if h in alive)
    if joined < min_workers:
        return False
    missing = [h for h in round_.expected if h in alive and h not in participants]
    if missing:
        return waited > timeouts.survivor_wait
    return joined >= max_workers or bool(round_.expected) or waited > timeouts.last_call


def world_size(offered: int, max_workers: int, divides: Optional[int] = None) -> int:
    """The largest world of at most `max_workers` of the `offered` workers whose size divides `divides`
    (a constant global batch needs equal per-worker shares)."""
    size = min(offered, max_workers)
    while divides and size > 1 and divides % size:
        size -= 1
    return size


def freeze(round_: Round, participants: Dict[str, Dict], max_workers: int, alive: Optional[Set[str]] = None,
           divides: Optional[int] = None, arrival: Optional[Dict[str, int]] = None) -> Round:
    """Ranks for the participants: survivors first, in their previous order (so rank 0 held fresh state),
    then newcomers in `arrival` order (when the freezing agent first saw each one joined: its own
    observations, never two hosts' clocks compared), then by host id. Workers beyond `world_size` get
    none (standby), nor does a participant whose lease expired since it joined (ranking it would only cost
    a counted restart at once). Expected hosts without a live lease are recorded as `lost`: the host a
    failure was about, where the survivors that noticed it only saw a collective fail."""
    arrival = arrival or {}
    order = sorted(((h, p) for h, p in participants.items() if alive is None or h in alive),
                   key=lambda item: (item[1]["previous_rank"] is None, item[1]["previous_rank"] or 0,
                                     arrival.get(item[0], len(arrival)), item[0]))
    size = world_size(sum(p["nproc"] for _, p in order), max_workers, divides)
    assignment, cluster = {}, []
    for host, info in order:
        take = max(0, min(info["nproc"], size - len(cluster)))
        assignment[host] = list(range(len(cluster), len(cluster) + take))
        cluster += [f"{info['addr']}:{port}" for port in info["ports"][:take]]
    present = alive if alive is not None else set(participants)
    return dataclasses.replace(round_, phase=Phase.FROZEN.value, assignment=assignment, cluster=cluster,
                               lost=[host for host in round_.expected if host not in present])


def next_round(seen: Round, reason: str, failure: bool, opened: float, opener: str,
               leaving_host: Optional[str] = None) -> Round:
    """The round after `seen`, opened (and to be frozen) by `opener`: it expects `seen`'s ranked hosts back
    (but one that leaves) and counts a failure as a restart. A host that opens it as it leaves hands the
    freezing to the first survivor (waiting out its lease first would delay every graceful leave)."""
    expected = [h for h, ranks in (seen.assignment or {}).items() if ranks and h != leaving_host]
    if opener == leaving_host and expected:
        opener = expected[0]
    return Round(seen.number + 1, Phase.JOINING.value, reason, seen.restarts + int(failure), opened, expected,
                 opener)


def without_leaving_host(round_: Round, host: str) -> Optional[Round]:
    """`round_`, still joining, no longer expecting `host`, which leaves gracefully as it opened: freezing it
    then neither waits for the host nor records it lost (a leave counted as a lost host). A leaving opener
    hands the freezing to the first host still expected. None when nothing changes (frozen, not expected)."""
    if round_.phase != Phase.JOINING.value or host not in round_.expected:
        return None
    expected = [h for h in round_.expected if h != host]
    opener = expected[0] if round_.opener == host and expected else round_.opener
    return dataclasses.replace(round_, expected=expected, opener=opener)


# Watching a round --------------------------------------------------------------------------------
class GroupChange(enum.Enum):
    NONE = "none"
    JOB_FAILED = "job_failed"  # the job's outcome is `failed`: stop
    JOB_DONE = "job_done"  # another host's workers finished: ours are finishing too
    RESTARTED = "restarted"  # a newer round counts a failure (or the round vanished): the group is broken
    RESIZED = "resized"  # a newer round without a failure (a join or a leave): commit, then stop


def judge_group(round_: Round, outcome: Optional[JobStatus], current: Optional[Round]) -> GroupChange:
    """What the store says about the round this host trains in."""
    if outcome is JobStatus.FAILED:
        return GroupChange.JOB_FAILED
    if outcome is JobStatus.DONE:
        return GroupChange.JOB_DONE
    if current is None or current.number != round_.number:
        failed = current is None or current.restarts > round_.restarts
        return GroupChange.RESTARTED if failed else GroupChange.RESIZED
    return GroupChange.NONE


class WorkersState(enum.Enum):
    RUNNING = "running"
    DONE = "done"  # every local worker finished training
    STOPPED = "stopped"  # a worker stopped on its own after committing (a notice sent straight to it)
    CONFIG_ERROR = "config_error"  # a worker refused its input: a restart cannot help
    FAILED = "failed"  # a worker hung or failed: a counted restart


@dataclasses.dataclass(frozen=True)
class WorkersVerdict:
    state: WorkersState
    rank: Optional[int] = None
    code: Optional[int] = None
    failure: Optional[Failure] = None


def judge_workers(codes: Dict[int, Optional[int]], silent: Set[int], stalled: Set[int] = frozenset()
                  ) -> WorkersVerdict:
    """What this host's workers' exit codes (None: running), silent heartbeats and stalled main threads
    mean, in that order: all done; a hang; no progress; the first worker (by rank) that exited otherwise."""
    if codes and all(code == ExitCode.DONE for code in codes.values()):
        return WorkersVerdict(WorkersState.DONE)
    for kind, ranks in ((Failure.HANG, silent), (Failure.NO_PROGRESS, stalled)):
        for rank in sorted(codes):
            if codes[rank] is None and rank in ranks:
                return WorkersVerdict(WorkersState.FAILED, rank, None, kind)
    for rank in sorted(codes):
        code = codes[rank]
        if code in (None, ExitCode.DONE):
            continue
        if code == ExitCode.STOPPED:
            return WorkersVerdict(WorkersState.STOPPED, rank, code)
        if code == ExitCode.CONFIG_ERROR:
            return WorkersVerdict(WorkersState.CONFIG_ERROR, rank, code, Failure.CONFIG_ERROR)
        kind = Failure.PEER_FAILURE if code == ExitCode.PEER_FAILURE else Failure.WORKER_EXIT
        return WorkersVerdict(WorkersState.FAILED, rank, code, kind)
    return WorkersVerdict(WorkersState.RUNNING)


def own_failure(codes: Dict[int, Optional[int]]) -> bool:
    """Did a worker of this host fail by itself (not stopped, done, or broken by a peer)?"""
    return any(code not in (None, ExitCode.DONE, ExitCode.STOPPED, ExitCode.PEER_FAILURE) for code in codes.values())


def repeated_start_failure(failures: List[Optional[str]], tries: int = 2) -> Optional[str]:
    """The error that ended this host's workers before their first step on the last `tries` starts in a
    row, the same each time (`failures`: each such start's last stderr line, oldest first; a start that
    reached a step clears the list). An import error or a bad flag fails every restart alike: the job
    should end at once, naming it, instead of after `max_restarts` and a blacklisted host."""
    last = failures[-tries:]
    return last[0] if len(last) == tries and last[0] and all(line == last[0] for line in last) else None


def watched_host(round_: Round, me: str) -> Optional[str]:
    """The host whose lease this host watches while `round_` trains: the next ranked host after it, in
    rank order, around a ring. Every ranked host is watched by one other, so a lost host is noticed by one
    agent (which opens the next round; the rest see that round) and no agent lists every lease."""
    ranked = sorted((ranks[0], h) for h, ranks in (round_.assignment or {}).items() if ranks)
    hosts = [h for _, h in ranked]
    if me not in hosts or len(hosts) < 2:
        return None
    return hosts[(hosts.index(me) + 1) % len(hosts)]


def standby_watch(round_: Round) -> Optional[str]:
    """The ranked host a standby beside `round_` watches: rank 0's. Ring watchers notice one lost host; a
    lost rank 0 that nobody else noticed means the ring is gone too (one ranked host, or all died)."""
    ranked = [(ranks[0], h) for h, ranks in (round_.assignment or {}).items() if ranks]
    return min(ranked)[1] if ranked else None


def request_timeout_limit(host_ttl: float, endpoints: int) -> float:
    """The longest store request timeout that keeps every lease renewal inside its lease: a renewal falls
    due a third into `host_ttl`, may wait behind one request of the agent's loop and sends up to two, each
    trying every one of `endpoints` for the timeout; with a sixth of the TTL per endpoint that ends by
    five sixths of it."""
    return host_ttl / (6 * endpoints)


def progress_timeout(configured: Optional[float], floor: float, longest_gap: float, factor: float = 10.0) -> float:
    """Seconds without progress that count as a hang: `configured` if given, else `factor` times the
    longest wait for progress seen so far (a commit, an epoch end and an evaluation included), never
    below `floor`."""
    if configured:
        return configured
    return max(floor, factor * longest_gap)


def assign_devices(visible: List[str], nproc: int) -> Optional[List[str]]:
    """Each local worker's CUDA_VISIBLE_DEVICES: the visible GPUs split evenly and in order among `nproc`
    workers (one each with `--nproc=gpu`, all to one worker with `--nproc=1`). None without GPUs (leave
    the environment alone). More workers than GPUs is an error: they would share devices silently."""
    if not visible:
        return None
    if nproc > len(visible):
        raise ValueError(f"--nproc={nproc} but only {len(visible)} GPUs are visible ({','.join(visible)}): "
                         f"use --nproc=gpu for one worker per GPU, or hide the GPUs (CUDA_VISIBLE_DEVICES=)")
    share = len(visible) // nproc
    return [",".join(visible[slot * share:(slot + 1) * share]) for slot in range(nproc)]
