"""`agent/blacklist.py`: a host out of the job after its own workers failed in a row."""
import threading

import pytest

from tf_elastic.elastic.agent.blacklist import Blacklist
from tf_elastic.elastic.agent.job_record import JobRecord
from tf_elastic.elastic.events import EventLog, read_events
from tf_elastic.elastic.protocol import Event, JobStatus
from tf_elastic.elastic.store.file import FileStore


@pytest.fixture
def blacklist(tmp_path):
    job = JobRecord(FileStore(str(tmp_path / "rdzv")), "job", "a", None)
    return Blacklist(job, "a", EventLog(tmp_path / "run", "agent:a"), after=2, cooldown=30.0)


def test_only_failures_of_its_own_in_a_row_blacklist_a_host(blacklist):
    for own in (True, False, True):  # a peer's failure (False) breaks the run
        blacklist.count(own)
    assert blacklist.job.blacklisted_for() == 0.0
    blacklist.count(True)
    assert 29.0 < blacklist.job.blacklisted_for() <= 30.0


def test_a_blacklisted_host_gives_up_its_lease_and_waits_until_the_job_ends(blacklist, tmp_path):
    blacklist.job.blacklist(600.0)
    left = []
    threading.Timer(0.3, lambda: blacklist.job.finish(JobStatus.DONE, "training finished")).start()
    blacklist.sit_out(leave=lambda: left.append(True), cancelled=lambda: False)  # returns once the job is done
    assert left == [True]
    assert [e["seconds"] for e in read_events(tmp_path / "run") if e["event"] == Event.BLACKLISTED] == [600.0]


def test_a_host_that_is_not_blacklisted_keeps_its_lease(blacklist):
    blacklist.sit_out(leave=lambda: pytest.fail("gave up its lease"), cancelled=lambda: False)
