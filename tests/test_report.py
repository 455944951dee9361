"""`launch.report`: each host's time by cause and the work redone, from a run's events (written here by hand)."""
import json

import pytest

from launch import report
from tf_elastic.elastic.agent.round import why_round_began


def _events(tmp_path, rows):
    """Writes (time, event, source, fields) rows as `events.jsonl`; returns the run dir."""
    with open(tmp_path / "events.jsonl", "w") as f:
        for time, event, source, fields in rows:
            f.write(json.dumps({"time": time, "event": event, "source": source, **fields}) + "\n")
    return tmp_path


def _two_hosts_a_failure_and_a_restart(tmp_path):
    """Hosts a (rank 0) and b (rank 1); b is lost at t=50 after the round reached step 30; a resumes alone
    from step 20. Each first worker evaluates once (a: 40-44 in round 0; b: 30-33) and a again at the end."""
    a, b = "agent:a", "agent:b"
    return _events(tmp_path, [
        (0, "agent_start", a, {}), (1, "agent_start", b, {}),
        (5, "rendezvous", a, {"round": 0, "ranks": [0], "restarts": 0}),
        (5, "rendezvous", b, {"round": 0, "ranks": [1], "restarts": 0}),
        (6, "worker_start", a, {"round": 0, "rank": 0}), (6, "worker_start", b, {"round": 0, "rank": 1}),
        (10, "restore", "worker:0", {"round": 0, "rank": 0, "step": 0}),
        (10, "first_step", "worker:0", {"round": 0, "rank": 0, "step": 0, "global_batch": 64}),
        (11, "first_step", "worker:1", {"round": 0, "rank": 1, "step": 0, "global_batch": 64}),
        (20, "commit", "worker:0", {"round": 0, "step": 20, "seconds": 1.0, "check_seconds": 0.5}),
        (30, "evaluation_begin", "worker:1", {"round": 0, "rank": 1}),
        (33, "evaluation_end", "worker:1", {"round": 0, "rank": 1}),
        (40, "evaluation_begin", "worker:0", {"round": 0, "rank": 0}),
        (44, "evaluation_end", "worker:0", {"round": 0, "rank": 0}),
        (49, "collective_failure", "worker:0", {"round": 0, "rank": 0, "step": 30}),
        (50, "failure", a, {"round": 0, "host": "b", "kind": "host_lost"}),
        (52, "rendezvous", a, {"round": 1, "ranks": [0], "restarts": 1}),
        (53, "worker_start", a, {"round": 1, "rank": 0}),
        (55, "restore", "worker:0", {"round": 1, "rank": 0, "step": 20}),
        (56, "first_step", "worker:0", {"round": 1, "rank": 0, "step": 20, "global_batch": 32}),
        (90, "evaluation_begin", "worker:0", {"round": 1, "rank": 0}),
        (95, "evaluation_end", "worker:0", {"round": 1, "rank": 0}),
        (96, "workers_done", a, {"round": 1}), (97, "exit", a, {}),
    ])


def test_the_causes_tile_each_hosts_wall_time_with_evaluation_apart(tmp_path):
    split = report.time_split(_two_hosts_a_failure_and_a_restart(tmp_path))
    a, b = split["a"], split["b"]
    assert a["wall"] == 97 and b["wall"] == 49  # b's timeline ends where its loss was noticed
    for causes in (a, b):
        assert sum(causes[c] for c in report.CAUSES) == pytest.approx(causes["wall"])
    assert a["evaluation"] == pytest.approx(4 + 5) and b["evaluation"] == pytest.approx(3)
    assert a["commits on the training path"] == pytest.approx(1.5)
    # Round 0 trained 30 steps in 39 s (to its collective failure) without its 4 s of evaluation: the 10
    # redone steps took a third of 35 s.
    assert a["redone after a failure"] == pytest.approx(35 / 3)
    assert a["training"] == pytest.approx(35 - 1.5 - 35 / 3 + (96 - 56 - 5))
    assert a["start-up"] == pytest.approx(10 + 4) and a["rendezvous and restarts"] == pytest.approx(3)
    assert a["finishing"] == pytest.approx(1)


def test_the_samples_redone_are_the_failed_rounds_steps_past_the_resumed_one(tmp_path):
    assert report.samples_redone(_two_hosts_a_failure_and_a_restart(tmp_path)) == (10, 10 * 64, 0)


def test_a_failed_round_without_a_known_last_step_is_named_where_its_time_is_counted_as_redone(tmp_path):
    """The time split showed 0.8 s "redone after a failure" where the summary said 0 steps redone: a round
    whose workers all died saw no collective fail, so its last step is unknown, and only the time split
    (its time after its last commit) counted it. The summary now says so."""
    run_dir = _two_hosts_a_failure_and_a_restart(tmp_path)
    rows = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows
                                                  if r["event"] != "collective_failure"))
    assert report.time_split(run_dir)["a"]["redone after a failure"] > 0
    assert report.samples_redone(run_dir) == (0, 0, 1)


def test_an_evaluation_cut_short_by_a_kill_ends_at_the_hosts_next_state(tmp_path):
    run = _events(tmp_path, [
        (0, "agent_start", "agent:a", {}), (1, "rendezvous", "agent:a", {"round": 0, "ranks": [0], "restarts": 0}),
        (2, "worker_start", "agent:a", {"round": 0, "rank": 0}),
        (3, "first_step", "worker:0", {"round": 0, "rank": 0, "step": 0, "global_batch": 8}),
        (5, "evaluation_begin", "worker:0", {"round": 0, "rank": 0}),
        (9, "failure", "agent:a", {"round": 0, "host": "a", "kind": "worker_exit"}), (10, "exit", "agent:a", {}),
    ])
    causes = report.time_split(run)["a"]
    assert causes["evaluation"] == pytest.approx(4) and causes["rendezvous and restarts"] == pytest.approx(1)


def test_a_standbys_wait_is_its_own_cause(tmp_path):
    """The agent's `standby` event (the round trains without this host) begins the standby time, which used to be
    counted as start-up: no event said it."""
    run = _events(tmp_path, [
        (0, "agent_start", "agent:c", {}), (2, "standby", "agent:c", {"round": 0, "host": "c"}),
        (10, "rendezvous", "agent:c", {"round": 1, "ranks": [1], "restarts": 0}),
        (11, "worker_start", "agent:c", {"round": 1, "rank": 1}),
        (13, "first_step", "worker:1", {"round": 1, "rank": 1, "step": 40, "global_batch": 8}),
        (20, "exit", "agent:c", {}),
    ])
    causes = report.time_split(run)["c"]
    assert causes["standby"] == pytest.approx(8) and causes["start-up"] == pytest.approx(2 + 3)
    assert causes["training"] == pytest.approx(7) and causes["wall"] == pytest.approx(20)


def test_the_summary_counts_a_lost_host_once_and_ends_with_how_the_job_ended(tmp_path):
    lost = {"round": 0, "kind": "host_lost", "host": "b", "rank": None}
    run = _events(tmp_path, [
        (0, "agent_start", "agent:a", {}), (5, "failure", "agent:a", dict(lost, counted=True)),
        (6, "failure", "agent:a", dict(lost, counted=False)),  # rank 0's agent names it again in the next round
        (9, "exit", "agent:a", {"host": "a", "code": 0, "reason": "training finished"}),
    ])
    text = report.summary(run)
    assert "- failures detected: 1 (host_lost)" in text, text
    assert text.endswith("- last agent exit: a, code 0: training finished"), text


def test_a_rounds_why_names_the_lost_host_first_and_shortens_what_the_survivor_saw():
    seen = "peer_failure rank=0 host=a: PeerFailure: " + "x" * 300
    why = why_round_began(seen, ["b", "c"])
    assert why.startswith("lost b, c (lease expired); noticed as peer_failure rank=0 host=a") and len(why) < 160
    assert why_round_began("join c", None) == why_round_began("join c", []) == "join c"


def test_an_errors_line_skips_tensorflows_graph_preamble_and_op_context():
    import tensorflow as tf

    from tf_elastic.elastic.protocol import error_line

    graph = tf.errors.UnavailableError(None, None, "Graph execution error:\n\nDetected at node X defined at:\n"
                                       "  File \"a.py\", line 1\n\nCollective ops is aborted by: task 1 is gone\n"
                                       "\t [[{{node X}}]]")
    assert error_line(graph) == "UnavailableError: Collective ops is aborted by: task 1 is gone"
    eager = tf.errors.UnavailableError(None, None, "{{function_node __wrapped__Op}} Collective ops is aborted by: x")
    assert error_line(eager) == "UnavailableError: Collective ops is aborted by: x"
    assert error_line(RuntimeError("boom\nmore")) == "RuntimeError: boom"
    assert error_line(RuntimeError()) == "RuntimeError"


def test_the_others_wait_for_a_straggler_for_1_minus_1_over_its_slowness_of_the_time(tmp_path):
    """b's worker runs 4x slower than the median from t=20 until it recovers at t=40 (a waits 3/4 of those 20 s),
    the group waits for its input half the time from t=36 to t=46 (a record of the compute cause's recovery
    ends no other), again 2x slower from t=50 until b is evicted at t=54; b's own time stays training."""
    a, b = "agent:a", "agent:b"
    run = _events(tmp_path, [
        (0, "agent_start", a, {}), (0, "agent_start", b, {}),
        (5, "rendezvous", a, {"round": 0, "ranks": [0], "restarts": 0}),
        (5, "rendezvous", b, {"round": 0, "ranks": [1], "restarts": 0}),
        (6, "worker_start", a, {"round": 0, "rank": 0}), (6, "worker_start", b, {"round": 0, "rank": 1}),
        (10, "first_step", "worker:0", {"round": 0, "rank": 0, "step": 1, "global_batch": 64}),
        (10, "first_step", "worker:1", {"round": 0, "rank": 1, "step": 1, "global_batch": 64}),
        (20, "straggler", b, {"round": 0, "host": "b", "rank": 1, "slowness": 4.0, "cause": "compute"}),
        (36, "straggler", b, {"round": 0, "host": "b", "rank": 1, "slowness": 2.0, "cause": "input"}),
        (40, "straggler_recovered", b, {"round": 0, "host": "b", "rank": 1}),
        (46, "straggler_recovered", b, {"round": 0, "host": "b", "rank": 1, "cause": "input"}),
        (50, "straggler", b, {"round": 0, "host": "b", "rank": 1, "slowness": 2.0, "cause": "compute"}),
        (54, "evicted", b, {"round": 0, "host": "b", "hold_off": 30.0}),
        (55, "exit", b, {}),
        (56, "rendezvous", a, {"round": 1, "ranks": [0], "restarts": 0}),
        (60, "exit", a, {}),
    ])
    split = report.time_split(run)
    # 20-40 at 4x (36-40: the slower of the two counts), 40-46 at 2x by input, 50-54 at 2x.
    assert split["a"]["waiting for a straggler"] == pytest.approx(20 * 0.75 + 6 * 0.5 + 4 * 0.5)
    assert split["a"]["training"] == pytest.approx(46 - 20)
    assert split["b"]["waiting for a straggler"] == 0.0
    for causes in split.values():
        assert sum(causes[c] for c in report.CAUSES) == pytest.approx(causes["wall"])
