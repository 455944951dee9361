"""Multi-host behaviour on one machine: job tokens, blacklisting, an etcd outage, agents on three
loopback addresses. Real agents, real etcd, real signals."""
import sys

import pytest

from tf_elastic.testing.etcd_server import EtcdServer
from tf_elastic.testing.local_job import LocalJob

pytestmark = pytest.mark.slow

TRAIN = ["--dataset=mnist", "--train_examples=3000", "--per_replica_batch_size=16", "--threads=1",
         "--commit_every_steps=10", "--optimizer=sgd"]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(6)"]  # a worker that ends well (exit 0)
CRASHER = [sys.executable, "-c", "import sys; sys.exit(7)"]
# Rank 0 ends 3 s after rank 1 (as a chief does, writing its evaluation) and leaves a file saying so.
FINISHER = [sys.executable, "-c", "import json, os, pathlib, time; rank = json.loads(os.environ['TF_CONFIG'])"
            "['task']['index']; time.sleep(3 * (rank == 0)); pathlib.Path(os.environ['TF_ELASTIC_RUN_DIR'], "
            "f'finished{rank}').touch()"]


@pytest.fixture
def jobs(mnist_dir):
    made = []
    yield made, mnist_dir
    for job in made:
        job.cleanup()


def _job(jobs, tmp_path, rdzv, train=(), agent=()):
    made, mnist_dir = jobs
    train = [*train, f"--data_dir={mnist_dir}"] if train else []
    made.append(LocalJob(tmp_path, train, list(agent), rdzv=rdzv, trainer="launch.train"))
    return made[-1]


@pytest.mark.light
def test_an_agent_with_another_job_token_is_refused_and_the_job_goes_on(jobs, tmp_path, rdzv_url):
    job = _job(jobs, tmp_path, rdzv_url, agent=["--nowarm_start", "--max_workers=2", "--last_call=0.5"])
    job.start_agent("a", command=SLEEPER, env={"TF_ELASTIC_JOB_TOKEN": "right"})
    job.wait_for(lambda: job.events("worker_start"), what="a's worker")
    intruder = job.start_agent("x", command=SLEEPER, job_token="wrong")
    assert intruder.wait(timeout=60) == 2
    refusal = job.events("exit", source="agent:x")[-1]["reason"]
    assert f"refused to join job '{job.job_id}'" in refusal and "wrong" not in refusal
    assert job.agents["a"].wait(timeout=60) == 0
    assert all(e["ranks"] == [0] and e["world_size"] == 1 for e in job.events("rendezvous"))


@pytest.mark.light
def test_a_host_whose_workers_keep_failing_is_blacklisted_and_the_job_goes_on(jobs, tmp_path, rdzv_url):
    job = _job(jobs, tmp_path, rdzv_url, agent=["--nowarm_start", "--max_workers=2", "--last_call=1",
                                                "--blacklist_after=2", "--blacklist_cooldown=300"])
    job.start_agent("a", command=SLEEPER)
    job.start_agent("b", command=CRASHER)
    blacklisted = job.wait_for(lambda: job.events("blacklisted", source="agent:b"), what="b blacklisted")[0]
    assert blacklisted["seconds"] == 300.0
    assert job.wait_agents(timeout=120) == {"a": 0, "b": 0}
    last = job.events("rendezvous", source="agent:a")[-1]
    assert last["world_size"] == 1 and last["restarts"] == 2
    assert not [e for e in job.events("rendezvous", source="agent:b") if e["time"] > blacklisted["time"]]


@pytest.mark.light
def test_a_host_whose_workers_end_later_is_not_cut_short_by_another_hosts_success(jobs, tmp_path, rdzv_url):
    job = _job(jobs, tmp_path, rdzv_url, agent=["--nowarm_start", "--min_workers=2", "--max_workers=2"])
    job.start_agent("a", command=FINISHER)
    job.start_agent("b", command=FINISHER)
    assert job.wait_agents(timeout=120) == {"a": 0, "b": 0}
    assert sorted(p.name for p in job.run_dir.glob("finished*")) == ["finished0", "finished1"]


@pytest.mark.light
def test_an_agent_cannot_rendezvous_without_its_store_and_says_so(jobs, tmp_path):
    etcd = EtcdServer()  # never started: nothing listens on its port
    job = _job(jobs, tmp_path, etcd.url, agent=["--nowarm_start", "--rendezvous_timeout=2"])
    assert job.start_agent("a", command=SLEEPER).wait(timeout=60) == 1
    reason = job.events("exit")[-1]["reason"]
    assert "no rendezvous within --rendezvous_timeout=2s: cannot reach etcd" in reason, reason
    etcd.close()


@pytest.mark.alone
def test_agents_on_three_loopback_addresses_train_one_group_through_an_etcd_outage(jobs, tmp_path):
    """Three agents, each on an address of its own, train one group of three; etcd stops after a commit: the
    agents notice, the workers commit on through the outage, and once etcd is back every agent reaches it
    again, with no failure and no new round."""
    with EtcdServer() as etcd:
        job = _job(jobs, tmp_path, etcd.url, train=TRAIN + ["--epochs=6"],
                   agent=["--min_workers=3", "--max_workers=3", "--last_call=1"])
        for host, addr in zip("abc", ("127.0.0.1", "127.0.0.2", "127.0.0.3")):
            job.start_agent(host, advertise_addr=addr)
        job.wait_for(lambda: job.events("commit"), what="a commit at world size 3")
        etcd.stop()
        down = job.wait_for(lambda: job.events("store_unreachable"), what="the agents noticing the outage")[0]
        job.wait_for(lambda: [e for e in job.events("commit") if e["time"] > down["time"] + 3], timeout=60,
                     what="commits during the outage")
        etcd.start()
        assert job.wait_agents(timeout=300) == {"a": 0, "b": 0, "c": 0}
    cluster = job.events("rendezvous", source="agent:a")[-1]["cluster"]
    assert sorted(a.rsplit(":", 1)[0] for a in cluster) == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert {e["world_size"] for e in job.events("first_step")} == {3}
    assert {e["source"] for e in job.events("store_reachable")} == {"agent:a", "agent:b", "agent:c"}
    assert not job.events("failure") and len(job.events("rendezvous")) == 3
    assert job.events("commit")[-1]["epoch"] == 6
