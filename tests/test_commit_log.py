"""`worker/commit_log.py`: a commit's life, from made to announced."""
import math

from tf_elastic.elastic.events import EventLog, read_events
from tf_elastic.elastic.protocol import Event
from tf_elastic.elastic.worker.commit_log import CommitLog


def _announced(run_dir):
    return [e["step"] for e in read_events(run_dir) if e["event"] == Event.COMMIT]


def test_the_chief_announces_a_commit_only_once_every_worker_has_it_in_force(tmp_path):
    log = CommitLog(keeps_commits=True, events=EventLog(tmp_path, "worker:0"))
    first, second = log.make({"step": 10}), log.make({"step": 20})
    assert (first, second, log.in_force) == (1, 2, 0.0)
    log.kept(second, blocked=0.01, in_force_seconds=0.2)  # in force here (the commit thread; out of order)
    log.kept(first, blocked=0.01, in_force_seconds=0.1)
    assert log.in_force == 2.0
    assert log.in_force_everywhere(0.0) == [] and _announced(tmp_path) == []  # another worker holds none yet
    assert log.in_force_everywhere(1.0) == [1] and _announced(tmp_path) == [10]
    assert log.in_force_everywhere(2.0) == [2] and _announced(tmp_path) == [10, 20]
    assert log.in_force_everywhere(2.0) == [], "announced twice"
    event = read_events(tmp_path)[-1]
    # The event carries what `kept` was told for this commit (not the other one's), and its own field set.
    assert (event["seconds"], event["in_force_seconds"]) == (0.01, 0.2) and "everywhere_seconds" in event
    assert "started" not in event


def test_a_commit_whose_write_failed_is_never_announced_and_a_later_one_covers_it(tmp_path):
    log = CommitLog(keeps_commits=True, events=EventLog(tmp_path, "worker:0"))
    failed, later = log.make({"step": 10}), log.make({"step": 20})  # `failed`'s write never put it in force
    log.kept(later, blocked=0.0, in_force_seconds=0.0)
    assert log.in_force_everywhere(2.0) == [later] and _announced(tmp_path) == [20]
    assert failed == 1


def test_a_worker_that_keeps_no_commits_holds_none_back_and_other_workers_announce_nothing(tmp_path):
    log = CommitLog(keeps_commits=False)
    assert log.in_force == math.inf
    assert log.make({"step": 10}) == 1  # numbered alike on every worker
    assert log.in_force_everywhere(1.0) == [] and not (tmp_path / "events.jsonl").exists()
