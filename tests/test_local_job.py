"""Tests the test harness `tf_elastic/testing/local_job.py`: waiting on a job, its cleanup, its SIGTERM."""
import os
import signal
import subprocess
import sys

import pytest

from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import Event
from tf_elastic.testing.local_job import REPO, LocalJob, repo_env


@pytest.mark.slow
@pytest.mark.light
def test_waiting_on_a_job_stops_once_every_agent_exited_and_says_why(job):
    """A benchmark or test used to wait out its whole timeout after every agent had failed."""
    job.start_agent("a", command=[sys.executable, "-c", "raise SystemExit(78)"])
    with pytest.raises(AssertionError, match=r"every agent exited .*'a': .1: rank 0 on a stopped on a configuration"):
        job.wait_for(lambda: job.events(Event.FIRST_STEP), timeout=600, what="a first step")


def test_a_jobs_cleanup_kills_its_own_workers_only(tmp_path):
    """Cleanup used to SIGKILL every PID its events ever named, long after those workers exited: a PID
    taken by another process since (another job's worker) was killed, and counted as an orphan."""
    job = LocalJob(tmp_path, [], trainer="launch.train")
    job.agents["a"] = subprocess.Popen(["sleep", "60"])
    worker = subprocess.Popen(["sleep", "60"], env=dict(os.environ, TF_ELASTIC_AGENT_PID=str(job.agents["a"].pid)))
    stranger = subprocess.Popen(["sleep", "60"])  # as if it had reused an exited worker's PID
    log = EventLog(job.run_dir, "agent:a")
    for process in (worker, stranger):
        log.write(Event.WORKER_START, round=0, rank=0, worker_pid=process.pid)
    try:
        assert job.worker_pids_alive() == [worker.pid]
        job.cleanup()
        assert worker.wait(timeout=10) == -signal.SIGKILL and stranger.poll() is None
    finally:
        for process in (worker, stranger):
            process.kill()
            process.wait()


def test_sigterm_ends_a_job_script_through_its_cleanup():
    """`kill PID` of a soak or benchmark used to end it at once, its agents and workers training on."""
    code = ("import sys, time\n"
            "from tf_elastic.testing.local_job import stop_jobs_on_sigterm\n"
            "stop_jobs_on_sigterm()\n"
            "try:\n    print('ready', flush=True)\n    time.sleep(60)\n"
            "finally:\n    print('cleaned up', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=repo_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert "cleaned up" in out and "KeyboardInterrupt: signal SIGTERM" in err
