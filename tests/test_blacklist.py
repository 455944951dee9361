"""`agent/blacklist.py`: a host out of the job after its own workers failed in a row."""
import threading

import pytest

from tf_elastic.elastic.agent.blacklist import Blacklist
from tf_elastic.elastic.agent.job_record import JobRecord
from tf_elastic.elastic.events import EventLog, read_events
from tf_elastic.elastic.protocol import Event, JobStatus
from tf_elastic.elastic.store import StoreError
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


class _RefusesOneWrite(FileStore):
    refused = False

    def set(self, key, value, ttl=None):
        if "/blacklist/" in key and not self.refused:
            self.refused = True
            raise StoreError("simulated: one request timed out")
        return super().set(key, value, ttl)


def test_a_strike_the_store_refused_is_written_before_the_next_join_and_counted_once(tmp_path):
    job = JobRecord(_RefusesOneWrite(str(tmp_path / "rdzv")), "job", "a", None)
    blacklist = Blacklist(job, "a", EventLog(tmp_path / "run", "agent:a"), after=2, cooldown=30.0)
    blacklist.count(True)
    blacklist.count(True)  # the strike: the store refuses it, and count never raises
    assert job.store.refused and job.blacklisted_for() == 0.0
    blacklist.sit_out(leave=lambda: None, cancelled=lambda: True)  # before the next join: written now
    assert 29.0 < job.blacklisted_for() <= 30.0
    blacklist.count(False)
    assert 29.0 < job.blacklisted_for() <= 30.0  # one strike, not doubled
