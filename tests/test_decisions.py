"""The agent's rules as pure functions: no store, no process, no clock."""
import json

import pytest

from tf_elastic.elastic.agent import decisions
from tf_elastic.elastic.agent.decisions import GroupChange, JoinAction, WorkersState
from tf_elastic.elastic.agent.round import Round, Timeouts, participants_of
from tf_elastic.elastic.protocol import ExitCode, Failure, JobStatus

TIMEOUTS = Timeouts(last_call=2.0, survivor_wait=30.0)


def _participant(nproc=1, previous_rank=None, joined=0.0, port=1000):
    return {"nproc": nproc, "addr": "127.0.0.1", "ports": list(range(port, port + nproc)), "joined": joined,
            "previous_rank": previous_rank}


def _round(number=0, phase="joining", expected=(), restarts=0, assignment=None, opener="me"):
    return Round(number, phase, "test", restarts, 0.0, list(expected), opener, assignment,
                 [] if assignment is None else ["x"] * sum(len(r) for r in assignment.values()))


@pytest.mark.parametrize("round_, joined, after, action", [
    (None, None, -1, JoinAction.CREATE_FIRST),
    (_round(), None, -1, JoinAction.ADD_SELF),
    (_round(1), 0, -1, JoinAction.ADD_SELF),  # our lease announces an older round
    (_round(), 0, -1, JoinAction.TRY_FREEZE),  # joined the round we opened
    (_round(opener="other"), 0, -1, JoinAction.WAIT),  # joined a round another agent freezes
    (_round(1, "frozen", assignment={"me": [0]}), 1, 0, JoinAction.TAKE),
    # Ranked in a round this agent never joined: a dead predecessor's with our host id (we restarted).
    (_round(1, "frozen", assignment={"me": [0]}), None, -1, JoinAction.REPLACE_PREDECESSOR),
    (_round(2, "frozen", assignment={"me": [0]}), 1, 0, JoinAction.REPLACE_PREDECESSOR),
    (_round(1, "frozen", assignment={"me": [0]}), 1, 1, JoinAction.OPEN_NEXT),  # trained in it
    (_round(1, "frozen", assignment={"other": [0]}), None, -1, JoinAction.OPEN_NEXT),
    (_round(1, "frozen", assignment={"o": [0], "me": []}), 1, 0, JoinAction.STANDBY),  # considered, no place
    (_round(1, "frozen", assignment={"o": [0, 1]}), None, -1, JoinAction.STANDBY),  # full
    (_round(1, "frozen", assignment={"o": [0]}), None, -1, JoinAction.OPEN_NEXT),  # room left
], ids=["no round", "joining without us", "joined an older round", "we opened it", "another opened it",
        "frozen with our ranks", "a predecessor's ranks", "a newer round's ranks we never joined",
        "frozen, already trained", "frozen without us", "left out", "full", "room left"])
def test_next_join_action(round_, joined, after, action):
    assert decisions.next_join_action(round_, "me", joined, after, max_workers=2) is action


def test_freeze_waits_for_min_workers_then_last_call_on_a_fresh_job():
    round_, participants = _round(), {"a": _participant(), "dead": _participant()}
    assert not decisions.ready_to_freeze(round_, participants, 2, 4, {"a"}, 100.0, TIMEOUTS)  # "dead" counts not
    participants["b"] = _participant()
    assert not decisions.ready_to_freeze(round_, participants, 2, 4, {"a", "b"}, 1.0, TIMEOUTS)
    assert decisions.ready_to_freeze(round_, participants, 2, 4, {"a", "b"}, 2.5, TIMEOUTS)


def test_a_full_round_still_waits_for_a_live_survivor():
    """A newcomer must not take the place of a survivor that is still stopping its workers."""
    round_, participants = _round(expected=["a", "b"]), {"a": _participant(), "newcomer": _participant()}
    assert not decisions.ready_to_freeze(round_, participants, 1, 2, {"a", "b", "newcomer"}, 1.0, TIMEOUTS)
    assert decisions.ready_to_freeze(round_, participants, 1, 2, {"a", "b", "newcomer"}, 31.0, TIMEOUTS)


def test_freeze_at_once_when_full_or_when_every_expected_survivor_is_in():
    assert decisions.ready_to_freeze(_round(), {"a": _participant(2)}, 1, 2, {"a"}, 0.0, TIMEOUTS)
    survivors_in = _round(expected=["a", "gone"])
    assert decisions.ready_to_freeze(survivors_in, {"a": _participant()}, 1, 4, {"a"}, 0.0, TIMEOUTS)


def test_freeze_waits_for_a_live_survivor_up_to_survivor_wait():
    round_, participants = _round(expected=["a", "b"]), {"a": _participant()}
    assert not decisions.ready_to_freeze(round_, participants, 1, 4, {"a", "b"}, 10.0, TIMEOUTS)
    assert decisions.ready_to_freeze(round_, participants, 1, 4, {"a", "b"}, 31.0, TIMEOUTS)


def test_freeze_ranks_survivors_first_then_newcomers_in_arrival_order_and_caps_at_max_workers():
    """Newcomers rank in the order the freezing agent saw them arrive, whatever their hosts' clocks wrote
    into `joined` (newcomer_late's clock runs behind)."""
    participants = {
        "newcomer_early": _participant(joined=1.0, port=3000),  # arrived first, but is not a survivor
        "survivor_rank1": _participant(previous_rank=1, joined=5.0, port=2000),
        "survivor_rank0": _participant(previous_rank=0, joined=9.0, port=1000),
        "newcomer_late": _participant(2, joined=0.5, port=4000),
        "newcomer_unseen": _participant(joined=0.1, port=5000)}
    arrival = {"survivor_rank0": 0, "newcomer_early": 1, "survivor_rank1": 2, "newcomer_late": 3}
    frozen = decisions.freeze(_round(), participants, max_workers=4, arrival=arrival)
    assert frozen.phase == "frozen"
    assert frozen.assignment == {"survivor_rank0": [0], "survivor_rank1": [1], "newcomer_early": [2],
                                 "newcomer_late": [3], "newcomer_unseen": []}
    assert frozen.cluster == ["127.0.0.1:1000", "127.0.0.1:2000", "127.0.0.1:3000", "127.0.0.1:4000"]
    by_host_id = decisions.freeze(_round(), participants, max_workers=5)  # no arrivals known: by host id
    assert list(by_host_id.assignment)[2:] == ["newcomer_early", "newcomer_late", "newcomer_unseen"]


def test_freeze_leaves_out_a_participant_whose_lease_expired():
    participants = {"a": _participant(port=1000), "gone": _participant(previous_rank=0, port=2000)}
    frozen = decisions.freeze(_round(), participants, max_workers=2, alive={"a"})
    assert frozen.assignment == {"a": [0]} and frozen.cluster == ["127.0.0.1:1000"]


def test_freeze_names_the_expected_hosts_whose_lease_is_gone():
    """After a SIGKILL of host b, a survivor's worker only saw a collective fail; the round that follows
    names b, whose lease expired (c, alive but not yet back, is not lost)."""
    participants = {"a": _participant(previous_rank=0)}
    frozen = decisions.freeze(_round(expected=["a", "b", "c"]), participants, max_workers=2, alive={"a", "c"})
    assert frozen.lost == ["b"]
    assert Round.from_json(frozen.to_json()).lost == ["b"]


def test_participants_are_the_leases_that_announce_the_round_and_malformed_ones_are_refused():
    good = dict(_participant(), round=3)
    leases = {"/j/hosts/a": json.dumps(good), "/j/hosts/standby": json.dumps(dict(good, round=2)),
              "/j/hosts/fresh": json.dumps({"addr": "x", "nproc": 1}), "/j/hosts/garbage": "{",
              "/j/hosts/no_ports": json.dumps(dict(good, ports=[])),
              "/j/hosts/bad_port": json.dumps(dict(good, ports=[70000]))}
    participants, refused = participants_of(leases, 3)
    assert participants == {"a": good}
    assert sorted(refused) == ["/j/hosts/bad_port", "/j/hosts/garbage", "/j/hosts/no_ports"]


@pytest.mark.parametrize("offered, divides, size", [(3, 64, 2), (4, 64, 4), (3, None, 3), (5, 6, 3), (1, 7, 1)])
def test_world_size_divides_the_global_batch(offered, divides, size):
    assert decisions.world_size(offered, max_workers=4, divides=divides) == size


def test_next_round_expects_the_ranked_hosts_but_a_leaving_one_and_counts_failures():
    seen = _round(3, "frozen", restarts=1, assignment={"a": [0], "b": [1], "c": []})
    after_failure = decisions.next_round(seen, "worker_exit", failure=True, opened=7.0, opener="b")
    assert (after_failure.number, after_failure.restarts, after_failure.expected) == (4, 2, ["a", "b"])
    assert after_failure.opener == "b"
    after_leave = decisions.next_round(seen, "leave b", failure=False, opened=7.0, opener="b", leaving_host="b")
    assert (after_leave.restarts, after_leave.expected, after_leave.phase) == (1, ["a"], "joining")
    assert after_leave.opener == "a", "a leaving host hands the freezing to the first survivor"


@pytest.mark.parametrize("round_, leaving, expected, opener", [
    (_round(4, expected=["a", "b", "c"], opener="a"), "b", ["a", "c"], "a"),
    (_round(4, expected=["a", "b", "c"], opener="a"), "a", ["b", "c"], "b"),  # the freezing goes on
    (_round(4, expected=["a"], opener="a"), "a", [], "a"),  # nobody expected: a joiner takes over the opener
    (_round(4, expected=["a", "c"], opener="a"), "b", None, None),  # not expected: nothing to change
    (_round(4, "frozen", expected=["a", "b"], assignment={"a": [0]}), "b", None, None),  # frozen: too late
])
def test_a_joining_round_stops_expecting_a_host_that_leaves(round_, leaving, expected, opener):
    changed = decisions.without_leaving_host(round_, leaving)
    if expected is None:
        assert changed is None
    else:
        assert (changed.expected, changed.opener, changed.number, changed.restarts) == (
            expected, opener, round_.number, round_.restarts)


@pytest.mark.parametrize("outcome, current, change", [
    (JobStatus.FAILED, None, GroupChange.JOB_FAILED),
    (JobStatus.DONE, None, GroupChange.JOB_DONE),
    (None, _round(2, restarts=1), GroupChange.NONE),
    (None, _round(3, restarts=1), GroupChange.RESIZED),
    (None, _round(3, restarts=2), GroupChange.RESTARTED),
    (None, None, GroupChange.RESTARTED),
])
def test_judge_group(outcome, current, change):
    assert decisions.judge_group(_round(2, restarts=1), outcome, current) is change


@pytest.mark.parametrize("codes, silent, stalled, expected", [
    ({0: None, 1: None}, set(), set(), (WorkersState.RUNNING, None, None)),
    ({0: 0, 1: 0}, set(), set(), (WorkersState.DONE, None, None)),
    ({0: 0, 1: None}, {1}, set(), (WorkersState.FAILED, 1, Failure.HANG)),
    ({0: None, 1: None}, set(), {1}, (WorkersState.FAILED, 1, Failure.NO_PROGRESS)),
    ({0: None, 1: None}, {1}, {0}, (WorkersState.FAILED, 1, Failure.HANG)),  # silence before a stall
    ({0: None, 1: ExitCode.STOPPED}, set(), set(), (WorkersState.STOPPED, 1, None)),
    ({0: ExitCode.CONFIG_ERROR}, set(), set(), (WorkersState.CONFIG_ERROR, 0, Failure.CONFIG_ERROR)),
    ({0: ExitCode.PEER_FAILURE}, set(), set(), (WorkersState.FAILED, 0, Failure.PEER_FAILURE)),
    ({0: None, 1: -9}, {0}, set(), (WorkersState.FAILED, 0, Failure.HANG)),  # a hang is judged before exits
    ({0: 1, 1: ExitCode.PEER_FAILURE}, set(), set(), (WorkersState.FAILED, 0, Failure.WORKER_EXIT)),
])
def test_judge_workers(codes, silent, stalled, expected):
    verdict = decisions.judge_workers(codes, silent, stalled)
    assert (verdict.state, verdict.rank, verdict.failure) == expected


def test_own_failure_ignores_peers_stops_and_successes():
    assert not decisions.own_failure({0: None, 1: 0, 2: ExitCode.STOPPED, 3: ExitCode.PEER_FAILURE})
    assert decisions.own_failure({0: None, 1: -9})


def test_each_ranked_host_watches_the_next_one_around_a_ring():
    round_ = _round(1, "frozen", assignment={"c": [2, 3], "a": [0], "b": [1], "standby": []})
    assert [decisions.watched_host(round_, h) for h in "abc"] == ["b", "c", "a"]
    assert decisions.watched_host(round_, "standby") is None
    assert decisions.watched_host(_round(1, "frozen", assignment={"a": [0, 1]}), "a") is None  # alone


def test_progress_timeout_is_the_flag_else_ten_longest_gaps_but_never_below_the_floor():
    assert decisions.progress_timeout(5.0, floor=60.0, longest_gap=100.0) == 5.0
    assert decisions.progress_timeout(None, floor=60.0, longest_gap=2.0) == 60.0
    assert decisions.progress_timeout(None, floor=60.0, longest_gap=9.0) == 90.0


@pytest.mark.parametrize("visible, nproc, devices", [
    ([], 4, None), (["0", "1", "2", "3"], 4, ["0", "1", "2", "3"]), (["0", "1", "2", "3"], 2, ["0,1", "2,3"]),
    (["0", "1", "2", "3"], 1, ["0,1,2,3"]), (["4", "6"], 2, ["4", "6"]), (["0", "1", "2"], 2, ["0", "1"]),
])
def test_each_local_worker_gets_its_own_share_of_the_gpus(visible, nproc, devices):
    assert decisions.assign_devices(visible, nproc) == devices


def test_more_workers_than_gpus_is_refused():
    with pytest.raises(ValueError, match="--nproc=3 but only 2 GPUs are visible"):
        decisions.assign_devices(["0", "1"], 3)


def test_a_start_failure_repeated_alike_ends_the_job_and_any_other_does_not():
    error = "ModuleNotFoundError: No module named 'launch'"
    assert decisions.repeated_start_failure([error, error]) == error
    assert decisions.repeated_start_failure(["x", error, error]) == error
    assert decisions.repeated_start_failure([error]) is None  # one failure may be the machine's
    assert decisions.repeated_start_failure(["Killed", error]) is None
    assert decisions.repeated_start_failure([None, None]) is None  # nothing said: not named, not ended


def test_a_standby_watches_rank_zeros_host():
    assert decisions.standby_watch(_round(phase="frozen", assignment={"b": [1, 2], "a": [0], "s": []})) == "a"
    assert decisions.standby_watch(_round(phase="frozen", assignment={"s": []})) is None


@pytest.mark.parametrize("host_ttl, endpoints, limit", [(1.0, 1, 1 / 6), (1.0, 2, 1 / 12), (10.0, 3, 10 / 18)])
def test_a_request_timeout_keeps_a_renewal_inside_its_lease(host_ttl, endpoints, limit):
    assert decisions.request_timeout_limit(host_ttl, endpoints) == pytest.approx(limit)
    # due a third into the lease, behind one request, two of its own, each over every endpoint: 5/6 of it
    assert host_ttl / 3 + 3 * endpoints * limit <= host_ttl * 5 / 6 + 1e-9
