"""Regression tests for the defects a review of the agent, rendezvous and stores found (issue 14), in one
process where they can be: each failed before its fix."""
import dataclasses
import errno
import fcntl
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from tf_elastic.elastic.agent import workers
from tf_elastic.elastic.agent.agent import AgentConfig, ElasticAgent, RoundResult
from tf_elastic.elastic.agent.job_record import JobRecord
from tf_elastic.elastic.agent.worker_output import WorkerOutput
from tf_elastic.elastic.agent.rendezvous import HostIdTaken, Rendezvous
from tf_elastic.elastic.agent.round import Round, Timeouts
from tf_elastic.elastic.events import EventLog, read_events
from tf_elastic.elastic.protocol import Event, Heartbeat, HostDir, write_heartbeat
from tf_elastic.elastic.store import StoreError, StoreOptions, open_store
from tf_elastic.elastic.store.etcd import EtcdStore
from tf_elastic.elastic.store.file import FileStore
from tf_elastic.elastic.worker.world import World
from tf_elastic.elastic import audit
from tf_elastic.testing.etcd_server import EtcdServer
from tf_elastic.testing.local_job import REPO, LocalJob, repo_env, running, signal_pid
from tf_elastic.testing.net import free_port

FAST = Timeouts(rendezvous=10, last_call=0.2, survivor_wait=5, host_ttl=0.4, poll=0.05)


def _rendezvous(store, host, job="job", **kwargs):
    args = dict(nproc=1, addr="127.0.0.1", min_workers=1, max_workers=2, max_restarts=3, timeouts=FAST)
    return Rendezvous(store, job, host, **dict(args, **kwargs))


# File store ----------------------------------------------------------------------------------------
def test_file_store_is_private_and_refuses_a_root_others_can_write(tmp_path):
    store = FileStore(str(tmp_path / "rdzv"))
    store.set("/job/k", "v")
    assert (tmp_path / "rdzv").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "rdzv" / "job" / "k.json").stat().st_mode & 0o777 == 0o600
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(StoreError, match="writable by group or others"):
        FileStore(str(shared))
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)  # (the tests run as root, as CI does)
    with pytest.raises(StoreError, match="belongs to another user"):
        FileStore(str(foreign))


def test_file_store_lock_held_by_a_stuck_process_is_an_error_not_a_hang(tmp_path):
    store = FileStore(str(tmp_path / "rdzv"), lock_timeout=0.3)
    store.set("/job/k", "v")
    holder = os.open(tmp_path / "rdzv" / ".lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file description: as another process would hold it
    try:
        with pytest.raises(StoreError, match="lock .* is held by another process"):
            store.set("/job/k", "w")
    finally:
        os.close(holder)
    store.set("/job/k", "w")
    assert store.get("/job/k") == "w"


def test_a_lock_the_filesystem_refuses_is_a_store_error(tmp_path, monkeypatch):
    """NFS without a lock daemon answers ENOLCK: the agent must train on as through any store outage."""
    store = FileStore(str(tmp_path / "rdzv"))

    def refused(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    with pytest.raises(StoreError, match="cannot lock the file store.*No locks available"):
        store.set("/job/k", "v")


def test_a_store_root_of_ours_that_others_may_read_is_made_private(tmp_path):
    root = tmp_path / "rdzv"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    FileStore(str(root)).set("/job/k", "v")
    assert root.stat().st_mode & 0o777 == 0o700
    assert (root / ".lock").stat().st_mode & 0o777 == 0o600


def test_file_store_disk_errors_are_store_errors_and_files_are_synced_before_the_rename(tmp_path, monkeypatch):
    store = FileStore(str(tmp_path / "rdzv"))
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b)))
    store.set("/job/k", "v")
    assert calls == ["fsync", "replace"]

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(StoreError, match="No space left on device"):
        store.set("/job/k", "w")
    assert store.get("/job/k") == "v"  # the committed value stays


def test_a_lease_is_timed_on_the_readers_clock_not_the_writers(tmp_path, monkeypatch):
    """A writer whose wall clock runs an hour behind (or a file server's) must not make its live lease
    look expired; a lease nobody renews expires after its TTL on the reader's own clock."""
    writer, reader = FileStore(str(tmp_path / "rdzv")), FileStore(str(tmp_path / "rdzv"))
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - 3600)
    writer.set("/job/hosts/a", "{}", ttl=0.5)
    monkeypatch.setattr(time, "time", real_time)
    for _ in range(8):  # renewed every 0.1 s for longer than the TTL
        assert reader.get("/job/hosts/a") == "{}"
        writer.set("/job/hosts/a", "{}", ttl=0.5)
        time.sleep(0.1)
    assert reader.get("/job/hosts/a") == "{}"  # the last renewal, first seen now
    time.sleep(0.7)
    assert reader.get("/job/hosts/a") is None


@pytest.mark.parametrize("record", [{"value": "v", "version": "1", "ttl": "soon"}, {"value": "v", "expires": 3}])
def test_file_store_malformed_records_are_named(tmp_path, record):
    store = FileStore(str(tmp_path))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "k.json").write_text(json.dumps(record))
    with pytest.raises(StoreError, match="malformed store file"):
        store.get("/job/k")


# Rendezvous ----------------------------------------------------------------------------------------
def _round_record(**change):
    record = json.loads(Round(0, "joining", "start", 0, 1.0, [], "a").to_json())
    record.update(change)
    return json.dumps(record)


@pytest.mark.parametrize("text", [
    _round_record(number="3"), _round_record(opener=None), _round_record(opened="soon"),
    _round_record(expected=[1]), _round_record(assignment={"a": ["0"]}), "[]", "null",
    _round_record(opened=float("nan")), _round_record(cluster=[1]),
], ids=["number as text", "no opener", "opened as text", "expected ints", "ranks as text", "a list",
        "null", "opened NaN", "cluster ints"])
def test_malformed_round_records_are_store_errors_naming_the_field(text):
    with pytest.raises(StoreError, match="malformed rendezvous round record"):
        Round.from_json(text)


def test_a_second_live_agent_with_the_same_host_id_is_refused(tmp_path):
    store = FileStore(str(tmp_path))
    first = _rendezvous(store, "node1")
    first.claim_host_id()
    stop = threading.Event()

    def renew():
        while not stop.is_set():
            first.keepalive()
            time.sleep(0.05)

    thread = threading.Thread(target=renew)
    thread.start()
    try:
        with pytest.raises(HostIdTaken, match="another live agent already uses --host_id='node1'"):
            _rendezvous(FileStore(str(tmp_path)), "node1").claim_host_id()
    finally:
        stop.set()
        thread.join()
    _rendezvous(FileStore(str(tmp_path)), "node1").claim_host_id()  # once the first is gone, the id is free


@pytest.mark.parametrize("raw", ["[]", "5", "null", '{"until": NaN}', '{"strikes": true}', "{"])
def test_a_malformed_blacklist_record_is_a_store_error(tmp_path, raw):
    store = FileStore(str(tmp_path))
    store.set("/job/blacklist/a", raw)
    with pytest.raises(StoreError, match="malformed blacklist record at /job/blacklist/a"):
        JobRecord(store, "job", "a").blacklisted_for()


def test_two_agents_started_at_once_with_one_host_id_get_one_claim(tmp_path):
    """Containers started together with the same host name: both used to read 'free' and both claim."""
    for attempt in range(2):
        job = f"job{attempt}"
        barrier, stop, outcomes = threading.Barrier(2), threading.Event(), []

        def agent():
            rendezvous = Rendezvous(FileStore(str(tmp_path)), job, "node1", nproc=1, addr="127.0.0.1",
                                    min_workers=1, max_workers=2, max_restarts=3,
                                    timeouts=dataclasses.replace(FAST, host_ttl=1.0))  # (stalls on a busy machine)
            barrier.wait()
            try:
                rendezvous.claim_host_id()
                outcomes.append("claimed")
                while not stop.is_set():  # a live agent renews its lease
                    rendezvous.keepalive()
                    time.sleep(0.05)
            except HostIdTaken:
                outcomes.append("refused")
                stop.set()

        threads = [threading.Thread(target=agent) for _ in range(2)]
        [t.start() for t in threads]
        deadline = time.time() + 20
        while len(outcomes) < 2 and time.time() < deadline:
            time.sleep(0.05)
        stop.set()
        [t.join() for t in threads]
        assert sorted(outcomes) == ["claimed", "refused"], (attempt, outcomes)


def test_a_dead_agents_lease_that_etcd_lengthened_is_waited_out():
    """etcd raises a lease below 1.5 election timeouts to that minimum (3 s here, for a 0.4 s --host_ttl):
    an agent restarted after a SIGKILL used to give up on its own old lease after 2.2 s (exit 2)."""
    server = EtcdServer(election_timeout_ms=2000).start()
    try:
        dead = _rendezvous(open_store(server.url), "node1")
        dead.claim_host_id()  # then SIGKILLed: nobody renews its lease
        restarted = _rendezvous(open_store(server.url), "node1")
        restarted.claim_host_id()  # refused (HostIdTaken) before the fix
        assert _incarnation_at(restarted) == restarted.incarnation
    finally:
        server.close()


def test_an_agent_whose_lapsed_lease_was_taken_by_another_stops(tmp_path):
    store = FileStore(str(tmp_path))
    first = _rendezvous(store, "node1")
    first.claim_host_id()
    store.delete("/job/hosts/node1")  # as if its lease expired while it was stopped or cut off
    _rendezvous(FileStore(str(tmp_path)), "node1").claim_host_id()
    with pytest.raises(HostIdTaken, match="took --host_id='node1'"):
        first.keepalive()


def test_a_renewal_never_overwrites_a_newcomers_lease(rdzv_url, monkeypatch):
    """The lease lapses and a newcomer takes the id just after the renewal's read: a read-then-write
    renewal used to overwrite the newcomer's lease (the newcomer then found itself refused)."""
    job = uuid.uuid4().hex
    first = _rendezvous(open_store(rdzv_url), "node1", job=job)
    first.claim_host_id()
    first.store.delete(first.keys.host("node1"))  # lapsed
    newcomer = _rendezvous(open_store(rdzv_url), "node1", job=job)
    newcomer.claim_host_id()
    with monkeypatch.context() as patch:
        patch.setattr(first.store, "get", lambda key: first._lease())  # a read from before the takeover
        with pytest.raises(HostIdTaken):
            first.keepalive()
    newcomer.keepalive()  # still its own
    first.leave()  # and a refused agent's leave never deletes it
    assert _incarnation_at(newcomer) == newcomer.incarnation


def test_a_lease_that_lapsed_unclaimed_is_taken_back_and_kept_by_renewals(rdzv_url):
    job = uuid.uuid4().hex
    first = _rendezvous(open_store(rdzv_url), "node1", job=job)
    first.claim_host_id()
    first.store.delete(first.keys.host("node1"))
    for _ in range(5):
        first.keepalive()
    assert _incarnation_at(first) == first.incarnation
    _rendezvous(open_store(rdzv_url), "node1", job=job).leave()  # one that never claimed it leaves it alone
    assert _incarnation_at(first) == first.incarnation


def _incarnation_at(rendezvous):
    return json.loads(rendezvous.store.get(rendezvous.keys.host("node1")))["incarnation"]


def test_two_agents_of_one_address_get_different_ports_from_a_port_range(tmp_path):
    low = free_port()
    store = FileStore(str(tmp_path))
    rounds = {}
    threads = [threading.Thread(target=lambda h=h: rounds.update({h: _rendezvous(
        store, h, port_range=(low, low + 1), min_workers=2).join()})) for h in "ab"]
    [t.start() for t in threads]
    [t.join(timeout=20) for t in threads]
    ports = [int(addr.rsplit(":", 1)[1]) for addr in rounds["a"].cluster]
    assert sorted(ports) == [low, low + 1]


def test_an_advertised_address_that_is_not_this_hosts_still_gets_ports(tmp_path):
    """A NAT or public address (here TEST-NET-3) cannot be bound here; the probe used to loop forever."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(round=_rendezvous(
        FileStore(str(tmp_path)), "a", addr="203.0.113.7", max_workers=1).join()), daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive() and result["round"].cluster[0].startswith("203.0.113.7:")


def test_losing_the_race_to_open_the_next_round_never_fails_the_job(tmp_path):
    store = FileStore(str(tmp_path))
    a, b = _rendezvous(store, "a", max_restarts=0, max_workers=1), _rendezvous(store, "b", max_restarts=0)
    seen = a.join()
    assert b.open_next(seen, reason="join b", failure=False)  # b moves on first, without a failure
    assert not a.open_next(seen, reason="worker_exit", failure=True)
    assert a.job.outcome() is None




# One agent, driven in this process, with real worker processes ----------------------------------------
def _agent(tmp_path, store):
    return ElasticAgent(AgentConfig(command=["true"], job_id="job", run_dir=str(tmp_path / "run"), host_id="a",
                                    stop_grace=10, monitor_interval=0.05), store)


@pytest.fixture
def agent(tmp_path):
    """An agent whose store is an etcd that cannot be reached (a closed port on 127.0.0.1)."""
    made = _agent(tmp_path, EtcdStore([f"127.0.0.1:{free_port()}"], StoreOptions(request_timeout=0.2)))
    yield made
    shutil.rmtree(made.host_dir.path, ignore_errors=True)


def _trainer(tmp_path, name, wrapped):
    """A worker that commits for 1 s on SIGTERM, then exits; behind `sh -c ... & wait` if `wrapped`.
    Returns the Worker and the trainer's PID."""
    code = (f"import pathlib, signal, sys, time, os\n"
            f"def term(*_):\n    time.sleep(1.0)\n    pathlib.Path({str(tmp_path / name)!r}).write_text('committed')\n"
            f"    sys.exit(0)\n"
            f"signal.signal(signal.SIGTERM, term)\n"
            f"pathlib.Path({str(tmp_path / (name + '.pid'))!r}).write_text(str(os.getpid()))\n"
            f"time.sleep(600)\n")
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    command = ["sh", "-c", f"{sys.executable} {script} & wait"] if wrapped else [sys.executable, str(script)]
    process = workers.spawn(command, dict(os.environ), WorkerOutput(tmp_path / "logs", "all"), warm=False)
    pid_file = tmp_path / f"{name}.pid"
    deadline = time.time() + 30
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # (the handler is installed before the PID is written)
    return workers.Worker(0, process, tmp_path / f"{name}.heartbeat"), int(pid_file.read_text())


def test_a_wrapped_trainer_is_waited_for_and_never_outlives_its_worker(tmp_path, agent):
    """`sh -c` dies at SIGTERM at once: the agent used to move on while the trainer behind it still
    committed (and then overlapped the next round); and a wrapper that exited left its child running."""
    worker, trainer = _trainer(tmp_path, "wrapped", wrapped=True)
    agent._stop([worker])
    assert (tmp_path / "wrapped").read_text() == "committed"  # waited for the trainer's commit
    assert not running(trainer)
    orphaned = workers.spawn(["sh", "-c", f"sleep 600 & echo $! > {tmp_path / 'sleep.pid'}; exit 1"], dict(os.environ),
                             WorkerOutput(tmp_path / "logs", "all"), warm=False)
    assert orphaned.wait(timeout=10) == 1
    child = int((tmp_path / "sleep.pid").read_text())
    assert running(child)
    workers.Worker(0, orphaned, tmp_path / "hb").close()
    assert not running(child)


def test_a_notice_while_the_store_is_unreachable_still_stops_and_commits(tmp_path, agent):
    """The agent used to retry the store forever before stopping its workers, who trained on."""
    worker, trainer = _trainer(tmp_path, "plain", wrapped=False)
    round_ = Round(0, "frozen", "start", 0, time.time(), [], "a", {"a": [0]}, ["127.0.0.1:1"])
    agent._on_leave_signal(signal.SIGTERM, None)
    result = []
    monitor = threading.Thread(target=lambda: result.append(agent._monitor(round_, [worker])), daemon=True)
    monitor.start()
    monitor.join(timeout=60)  # (it used to retry the store for ever)
    assert result == [RoundResult.LEFT]
    assert (tmp_path / "plain").read_text() == "committed" and not running(trainer)
    assert [e["event"] for e in read_events(tmp_path / "run")] == [Event.PREEMPTION_NOTICE.value, Event.LEAVE.value]


def test_an_agent_whose_id_was_taken_meanwhile_still_lets_its_workers_commit(tmp_path):
    store = FileStore(str(tmp_path / "rdzv"))
    made = _agent(tmp_path, store)
    try:
        made.rendezvous.claim_host_id()
        store.delete(made.rendezvous.keys.host("a"))  # lapsed (the agent was stopped), and then taken
        _rendezvous(FileStore(str(tmp_path / "rdzv")), "a").claim_host_id()
        worker, trainer = _trainer(tmp_path, "taken", wrapped=False)
        made._stop([worker])
        assert (tmp_path / "taken").read_text() == "committed" and not running(trainer)
    finally:
        shutil.rmtree(made.host_dir.path, ignore_errors=True)


def test_workers_always_stop_gracefully_on_sigterm_whatever_the_notice_signals():
    """The agent stops its workers with SIGTERM: with --preemption_signals=SIGUSR1 alone they used to die
    of it, uncommitted."""
    assert World.from_env({"TF_ELASTIC_STOP_SIGNALS": "SIGUSR1"}).stop_signals == (signal.SIGTERM, signal.SIGUSR1)
    assert World.from_env({}).stop_signals == (signal.SIGTERM,)


def test_a_notice_signal_never_waits_for_the_event_log(tmp_path, agent):
    """The handler runs on the main thread, which may hold the event log's lock at that moment: writing
    the event from the handler would wait for itself forever."""
    log = EventLog(tmp_path / "run", "test")
    with open(log.path, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the interrupted main thread would hold it
        handler = threading.Thread(target=agent._on_leave_signal, args=(signal.SIGUSR1, None), daemon=True)
        handler.start()
        handler.join(timeout=5)
        assert not handler.is_alive() and agent._leaving
    agent._report_notice()
    notices = [e for e in read_events(tmp_path / "run") if e["event"] == Event.PREEMPTION_NOTICE.value]
    assert [e["notice"] for e in notices] == ["signal SIGUSR1"]


def test_the_heartbeat_outlives_disk_errors_and_workers_ignore_notice_signals_until_fit(tmp_path):
    """A heartbeat write that failed (a full or vanished disk) used to end the heartbeat thread, and with
    it the watch on the agent; a worker signalled by Slurm before training used to die of SIGUSR1."""
    heartbeat = tmp_path / "later" / "heartbeat"
    code = ("import os, signal, time\n"
            "from tf_elastic.elastic.worker.world import World, report_progress, start_heartbeat\n"
            "world = World.from_env()\n"
            "thread = start_heartbeat(world, interval=0.05)\n"
            "report_progress(1)\n"  # the first step's write, on the main thread: fails, must not raise
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "time.sleep(0.3)\n"
            f"os.mkdir({str(heartbeat.parent)!r})\n"
            "deadline = time.time() + 20\n"
            f"while not os.path.exists({str(heartbeat)!r}) and time.time() < deadline:\n"
            "    time.sleep(0.05)\n"
            "print('alive', thread.is_alive())\n")
    env = dict(repo_env(), TF_ELASTIC_HEARTBEAT_FILE=str(heartbeat), TF_ELASTIC_STOP_SIGNALS="SIGTERM,SIGUSR1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "alive True" in proc.stdout
    assert "cannot write the heartbeat file" in proc.stderr
    assert Heartbeat.from_text(heartbeat.read_text()).step == 1


def test_the_derived_progress_timeout_measures_the_longest_wait_for_progress(tmp_path, monkeypatch):
    """Timed on the agent's monotonic clock (here a controlled one): the longest gap between two changes of
    the progress counter, not between beats."""
    clock = [100.0]
    monkeypatch.setattr(workers.time, "monotonic", lambda: clock[0])
    beat = tmp_path / "heartbeat"
    worker = workers.Worker(0, subprocess.Popen(["true"]), beat)
    for progress, beat_count, pause in [(1, 1, 0.0), (2, 2, 0.05), (2, 3, 0.3), (3, 4, 0.4), (4, 5, 0.05)]:
        clock[0] += pause
        write_heartbeat(beat, Heartbeat(step=progress, progress=progress, beat=beat_count))
        worker.observe()
    worker.process.wait()
    assert worker.longest_gap == pytest.approx(0.7)  # progress 2 -> 3: two beats apart, 0.3 + 0.4 s


def test_host_dirs_of_live_agents_are_kept_whatever_their_pid(tmp_path, monkeypatch):
    """Agents in other PID namespaces (containers sharing /tmp) have PIDs this one cannot see: a dead PID
    does not make a directory dead; only a lock nobody holds does."""
    monkeypatch.setattr(workers.tempfile, "gettempdir", lambda: str(tmp_path))
    live = tmp_path / f"{HostDir.PREFIX}999999999-live"  # a PID that does not exist here
    dead = tmp_path / f"{HostDir.PREFIX}999999998-dead"
    for path in (live, dead):
        path.mkdir()
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # (another open file description: as another process would hold it)
    try:
        assert workers.sweep_dead_agents_dirs() == [str(dead)]
        assert live.exists() and not dead.exists()
    finally:
        os.close(held)


# With real agents and workers ------------------------------------------------------------------------
# A worker that heartbeats like launch.train (and so watches its agent), wrapped in a shell that stays its
# parent, as `sh -c ...` or `conda run ...` would. It writes its PID, then waits.
WRAPPED = ["sh", "-c", f"{sys.executable} -c \"import os, sys, time; "
           "from tf_elastic.elastic.worker.world import World, report_progress, start_heartbeat; "
           "w = World.from_env(); start_heartbeat(w); report_progress(1); "
           "open(os.path.join(os.environ['TF_ELASTIC_RUN_DIR'], f'pid{w.rank}'), 'w').write(str(os.getpid())); "
           "time.sleep(600)\"; true"]


@pytest.fixture
def job(tmp_path):
    made = LocalJob(tmp_path, [], ["--nowarm_start", "--min_workers=1", "--max_workers=2", "--last_call=0.5"])
    yield made
    made.cleanup()


@pytest.mark.slow
def test_waiting_on_a_job_stops_once_every_agent_exited_and_says_why(job):
    """A benchmark or test used to wait out its whole timeout after every agent had failed."""
    job.start_agent("a", command=[sys.executable, "-c", "raise SystemExit(78)"])
    with pytest.raises(AssertionError, match=r"every agent exited .*'a': .1: rank 0 stopped on a configuration"):
        job.wait_for(lambda: job.events(Event.FIRST_STEP), timeout=600, what="a first step")
    # (the message is the early exit's: waiting out the timeout would have said "timed out after 600s")


def test_a_jobs_cleanup_kills_its_own_workers_only(tmp_path):
    """Cleanup used to SIGKILL every PID its events ever named, long after those workers exited: a PID
    taken by another process since (another job's worker) was killed, and counted as an orphan."""
    job = LocalJob(tmp_path, [])
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


@pytest.mark.slow
def test_an_etcd_password_without_tls_is_warned_about(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.elastic_run", f"--rdzv=file://{tmp_path / 'rdzv'}",
                           "--job_id=j", f"--run_dir={tmp_path / 'run'}", "--rdzv_user=u", "--min_workers=2",
                           "--max_workers=2", "--rendezvous_timeout=0.5", "--", "true"],
                          cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=60)
    assert "the password goes to etcd in clear text" in proc.stderr


@pytest.mark.slow
def test_a_wrapped_worker_is_stopped_with_its_group_and_dies_with_a_killed_agent(job):
    """The agent signals the worker's whole process group, so a graceful stop reaches the real trainer
    behind `sh -c`; and a trainer whose agent was SIGKILLed ends itself instead of training on alone."""
    for host in "ab":
        job.start_agent(host, command=WRAPPED)
    pids = {}
    for rank in (0, 1):
        job.wait_for(lambda r=rank: (job.run_dir / f"pid{r}").exists(), timeout=60, what=f"rank {rank}'s PID")
        pids[rank] = int((job.run_dir / f"pid{rank}").read_text())
    hosts = {e["source"].split(":")[1]: e["rank"] for e in job.events(Event.WORKER_START)}
    job.agents["a"].send_signal(signal.SIGTERM)  # a graceful leave: SIGTERM to a's group
    job.wait_for(lambda: not running(pids[hosts["a"]]), timeout=30, what="a's trainer to stop")
    job.agents["b"].kill()  # SIGKILL: b cannot stop its worker
    deadline = time.time() + 30
    while running(pids[hosts["b"]]) and time.time() < deadline:
        time.sleep(0.1)
    assert not running(pids[hosts["b"]]), "b's trainer outlived its SIGKILLed agent"


@pytest.mark.slow
def test_nproc_gpu_starts_one_worker_per_visible_gpu_each_seeing_only_its_own(job):
    """Tested by the environment each worker receives (this machine has no GPU)."""
    report = [sys.executable, "-c", "import json, os; open(os.path.join(os.environ['TF_ELASTIC_RUN_DIR'], "
              "'devices' + os.environ['TF_ELASTIC_LOCAL_RANK']), 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])"]
    job.agent_args = ["--nowarm_start", "--min_workers=4", "--max_workers=4", "--nproc=gpu"]
    assert job.start_agent("a", command=report, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}).wait(timeout=120) == 0
    assert {p.name: p.read_text() for p in job.run_dir.glob("devices*")} == {
        "devices0": "0", "devices1": "1", "devices2": "2", "devices3": "3"}


@pytest.mark.slow
def test_a_third_host_waits_as_standby_and_takes_a_freed_place(job):
    """Three hosts, two places: the third waits without opening round after round (it used to open 25 in
    30 s), and takes the place of a host that is lost."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    for host in "abc":
        job.start_agent(host, command=sleeper)
    job.wait_for(lambda: len({e["source"] for e in job.events(Event.RENDEZVOUS)}) == 2, timeout=60,
                 what="two hosts training")
    time.sleep(4.0)  # time enough for the round-after-round churn this test guards against
    rounds = {e["round"] for e in job.events(Event.RENDEZVOUS)}
    assert len(rounds) <= 2, rounds  # the start, and at most one join before the standby saw a full round
    training = {e["source"].split(":")[1] for e in job.events(Event.RENDEZVOUS) if e["round"] == max(rounds)}
    (standby,) = set("abc") - training
    lost = sorted(training)[0]
    job.kill_host(lost)
    job.wait_for(lambda: [e for e in job.events(Event.RENDEZVOUS, source=f"agent:{standby}")], timeout=60,
                 what=f"the standby {standby} to take a place")
    assert not job.events(Event.EXIT)  # nobody gave up waiting


@pytest.mark.slow
def test_only_worlds_whose_size_divides_the_given_number_form(job):
    """With --batch_policy=global a world of 3 cannot split a global batch of 4: it must never form."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    job.agent_args = ["--nowarm_start", "--min_workers=1", "--max_workers=3", "--last_call=0.5",
                      "--world_size_divides=4"]
    for host in "abc":
        job.start_agent(host, command=sleeper)
    job.wait_for(lambda: any(e["world_size"] == 2 for e in job.events(Event.RENDEZVOUS)), timeout=60,
                 what="a world of two")
    time.sleep(2.0)  # time enough for a world of three to form, if it could
    assert {e["world_size"] for e in job.events(Event.RENDEZVOUS)} <= {1, 2}
    assert not job.events(Event.EXIT)


class _Notices(http.server.BaseHTTPRequestHandler):
    """A metadata-server stand-in: 404 (no notice) until `notice` is set, as AWS's spot endpoint does."""
    notice = None

    def do_GET(self):  # noqa: N802 (the handler's API)
        body = (self.notice or "").encode()
        self.send_response(200 if self.notice else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_preemption_notices_and_a_stuck_main_thread(tmp_path):
    """One training job, three hosts. c gets a notice from its metadata URL, b Slurm's SIGUSR1: each commits
    and leaves without a counted failure or a lost step. Then a's worker's main thread blocks (its heartbeat
    goes on): the progress watchdog restarts it and the job finishes."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _Notices)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/latest/meta-data/spot/instance-action"
    train = ["--dataset=digits", "--epochs=40", "--per_replica_batch_size=16", "--threads=1", "--optimizer=sgd",
             "--learning_rate=0.02", "--commit_every_steps=10"]
    job = LocalJob(tmp_path, train, ["--min_workers=1", "--max_workers=3", "--index_log", "--last_call=1",
                                     "--preemption_signals=SIGTERM,SIGUSR1", "--nowarm_start"])
    try:
        job.start_agent("a", env={"TF_ELASTIC_TEST_FAULTS": "1"}, progress_timeout=5)
        job.start_agent("b")
        job.start_agent("c", preemption_notice_url=url, preemption_poll_interval=0.2)
        job.first_step_after(0, world_size=3, timeout=300)
        noticed = time.time()
        _Notices.notice = json.dumps({"action": "terminate", "time": "2099-01-01T00:00:00Z"})
        job.first_step_after(noticed, world_size=2)
        signalled = time.time()
        job.agents["b"].send_signal(signal.SIGUSR1)
        signal_pid(job.worker_pid("b"), signal.SIGUSR1)  # Slurm signals every process of the step
        job.first_step_after(signalled, world_size=1)
        stuck = time.time()
        signal_pid(job.worker_pid("a"), signal.SIGUSR2)
        job.first_step_after(stuck, world_size=1)
        assert job.wait_agents(timeout=600) == {"a": 0, "b": 0, "c": 0}
    finally:
        job.cleanup()
        server.shutdown()
    notices = job.events(Event.PREEMPTION_NOTICE)
    assert {e["host"] for e in notices} == {"b", "c"} and "SIGUSR1" in str(notices)
    announced = [e["seconds_left"] for e in notices if e["host"] == "c"]  # the notice's own time field
    assert len(announced) == 1 and announced[0] > 0
    leaves = {e["host"]: e for e in job.events(Event.LEAVE)}
    lead = [e["seconds_after_notice"] for e in leaves.values()]  # recorded from each notice to its leave
    assert set(leaves) == {"b", "c"} and all(n is not None and n > 0 for n in lead)
    failures = job.events(Event.FAILURE)
    assert [(f["kind"], f["host"]) for f in failures] == [("no_progress", "a")]
    restores = audit.restores(job.run_dir)
    leave_rounds = sorted(e["round"] for e in leaves.values())
    # A graceful leave loses nothing: the next round restores exactly the step the group stopped at.
    for round_ in leave_rounds:
        reached = max(r["step"] for r in audit.index_records(job.run_dir) if r["round"] == round_)
        assert restores[round_ + 1] == reached
    assert not (job.run_dir / "heartbeats").exists()  # heartbeats live on the host, not in the run dir
