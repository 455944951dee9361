"""`tf-elastic-status` (`launch/status.py`, `tf_elastic/elastic/agent/status.py`): read from the store and the
events, without TensorFlow, on both stores."""
import json
import subprocess
import sys
import time

import pytest

from conftest import REPO
from tf_elastic.elastic.agent.job_record import JobKeys
from tf_elastic.elastic.agent.round import Round
from tf_elastic.elastic.agent.status import read_status, render
from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import Event
from tf_elastic.elastic.store import open_store
from tf_elastic.testing.local_job import LocalJob, repo_env


def test_the_status_names_members_standbys_the_blacklist_stragglers_and_the_last_commit(tmp_path):
    store = open_store(f"file://{tmp_path / 'rdzv'}")
    keys, now = JobKeys("j"), time.time()
    frozen = Round(3, "frozen", "worker_exit rank=1 host=b: RuntimeError: boom", 1, now - 5, ["a", "c"], "a",
                   {"a": [0], "c": [1, 2]}, ["127.0.0.1:1000", "127.0.0.2:1001", "127.0.0.2:1002"])
    store.set(keys.round, frozen.to_json())
    for host in "acd":
        store.set(keys.host(host), json.dumps({"addr": "127.0.0.1", "nproc": 1}), ttl=30)
    store.set(keys.host("dead"), json.dumps({"addr": "127.0.0.1", "nproc": 1}), ttl=0.2)  # never renewed
    store.set(keys.blacklist("b"), json.dumps({"strikes": 1, "until": now + 40}))
    events = EventLog(tmp_path / "run", "worker:0")
    for step in (10, 20, 30):
        events.write(Event.COMMIT, step=step, epoch=0, round=3)
    # c's rank 2 is a straggler now; rank 1 was one and recovered; a was one in an earlier round; e sits out.
    # f sits out again after a probation that found it still slow; g's found it back.
    agents = {host: EventLog(tmp_path / "run", f"agent:{host}") for host in "acefg"}
    agents["a"].write(Event.STRAGGLER, round=2, host="a", rank=0, slowness=3.0, cause="compute")
    agents["c"].write(Event.STRAGGLER, round=3, host="c", rank=1, slowness=1.7, cause="compute")
    agents["c"].write(Event.STRAGGLER, round=3, host="c", rank=2, slowness=2.5, cause="compute")
    agents["c"].write(Event.STRAGGLER_RECOVERED, round=3, host="c", rank=1)  # a record without a cause: compute
    agents["c"].write(Event.STRAGGLER, round=3, host="c", rank=1, slowness=2.0, cause="input")
    agents["c"].write(Event.STRAGGLER, round=3, host="c", rank=2, slowness=3.0, cause="input")
    agents["c"].write(Event.STRAGGLER_RECOVERED, round=3, host="c", rank=2, cause="input")
    agents["e"].write(Event.EVICTED, round=2, host="e", hold_off=60.0, slowness=3.1, evictions=1)
    for host, back in (("f", False), ("g", True)):
        agents[host].write(Event.EVICTED, round=1, host=host, hold_off=0.0, slowness=3.1, evictions=1)
        agents[host].write(Event.PROBATION, host=host, seconds=0.3, median=0.1, back=back, evictions=1,
                           hold_off=0.0 if back else 90.0)
    # A fresh reader of the file store takes each lease as new: two reads a host TTL apart tell the dead one.
    text = render(read_status(open_store(f"file://{tmp_path / 'rdzv'}"), "j", [str(tmp_path / "run")],
                              lease_wait=0.3))
    assert "job j: running" in text and "round 3 (frozen), world size 3, restarts 1" in text
    assert "RuntimeError: boom" in text
    assert "| a | 0 | 127.0.0.1:1000 | - |" in text, text
    assert "| c | 1,2 | 127.0.0.2:1001 127.0.0.2:1002 | rank 1 2.00x (input), rank 2 2.50x (compute) |" in text, text
    assert "evicted as stragglers: e (may rejoin in 5" in text or "evicted as stragglers: e (may rejoin in 6" in text
    assert ", f (may rejoin in 8" in text or ", f (may rejoin in 9" in text, text
    assert "g (" not in text
    assert "\nstandby: d\n" in text and "blacklisted: b (" in text and "s left)" in text
    assert "last commit: step 30 (epoch 0)" in text and "steps/s" in text and "joining" not in text
    # While a round is joining, a leased host outside it is joining it, not a standby.
    store.set(keys.round, Round(4, "joining", "join d", 1, now, [], "a").to_json())
    text = render(read_status(open_store(f"file://{tmp_path / 'rdzv'}"), "j", lease_wait=0.3))
    assert "\njoining: a, c, d\nstandby: none\n" in text, text


@pytest.mark.parametrize("rdzv_url", ["file", "etcd"], indirect=True)
def test_the_status_of_a_live_two_host_job_lists_both_members_with_their_ranks(rdzv_url, tmp_path):
    """Real agents (trivial workers: no TensorFlow), a third host waiting as a standby."""
    job = LocalJob(tmp_path, [], ["--min_workers=2", "--max_workers=2", "--warm_start=false", "--last_call=0.5"],
                   rdzv=rdzv_url, trainer="launch.train")
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    try:
        for host in "ab":
            job.start_agent(host, command=sleeper)
        job.wait_for(lambda: len(job.events(Event.WORKER_START)) == 2, what="both workers")
        job.start_agent("c", command=sleeper)
        job.wait_for(lambda: job.in_rendezvous("c"), what="c waiting as a standby")
        job.wait_for(lambda: job.events(Event.STANDBY, source="agent:c"), what="c's standby event")
        proc = subprocess.run([sys.executable, "-m", "launch.status", f"--rdzv={rdzv_url}", f"--job_id={job.job_id}",
                               f"--run_dir={job.run_dir}"], cwd=REPO, env=repo_env(), capture_output=True, text=True,
                              timeout=60)
    finally:
        job.cleanup()
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| host")}
    assert sorted(rows) == ["a", "b"] and sorted(rows.values()) == ["0", "1"], proc.stdout
    assert "standby: c" in proc.stdout and "world size 2" in proc.stdout, proc.stdout
