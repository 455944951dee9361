"""Tests the agent: `tf_elastic/elastic/agent/` (agent, cli, workers, spares, preemption) with real processes."""
import fcntl
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import run_python
from test_rendezvous import _host_rendezvous
from tf_elastic.elastic import audit
from tf_elastic.elastic.agent import workers
from tf_elastic.elastic.agent.agent import AgentConfig, ElasticAgent, RoundResult, eviction_cause
from tf_elastic.elastic.agent.round import Round, Timeouts
from tf_elastic.elastic.agent.worker_output import WorkerOutput
from tf_elastic.elastic.events import EventLog, read_events
from tf_elastic.elastic.protocol import Event, Heartbeat, HostDir, write_heartbeat
from tf_elastic.elastic.store import StoreError, StoreOptions
from tf_elastic.elastic.store.etcd import EtcdStore
from tf_elastic.elastic.store.file import FileStore
from tf_elastic.testing.local_job import REPO, LocalJob, repo_env, running, signal_pid
from tf_elastic.testing.net import free_port


def test_agent_side_never_imports_tensorflow():
    modules = ["tf_elastic", "tf_elastic.elastic", "tf_elastic.elastic.protocol", "tf_elastic.elastic.events",
               *[f"tf_elastic.elastic.agent.{m}" for m in ("agent", "cli", "decisions", "job_record", "ports",
                                                            "rendezvous", "round")],
               "tf_elastic.elastic.store.file", "tf_elastic.elastic.store.etcd",
               "tf_elastic.elastic.worker.world", "tf_elastic.elastic.worker.errors"]
    proc = run_python(f"import sys, {', '.join(modules)}\n"
                      "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    assert proc.stdout.strip() == "False False"


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
    assert agent._stop([worker]) is True  # stopped on its own
    assert (tmp_path / "wrapped").read_text() == "committed"  # waited for the trainer's commit
    assert not running(trainer)
    orphaned = workers.spawn(["sh", "-c", f"sleep 600 & echo $! > {tmp_path / 'sleep.pid'}; exit 1"], dict(os.environ),
                             WorkerOutput(tmp_path / "logs", "all"), warm=False)
    assert orphaned.wait(timeout=10) == 1
    child = int((tmp_path / "sleep.pid").read_text())
    assert running(child)
    workers.Worker(0, orphaned, tmp_path / "hb").close()
    assert not running(child)


def _deaf_worker(tmp_path, wrapped: bool):
    """A worker that ignores SIGTERM and writes its stacks at SIGQUIT, as `elastic.run` has it, behind
    `sh -c` if `wrapped`, with a child that does not catch SIGQUIT; returns it once ready, and its log."""
    script = tmp_path / "deaf.py"
    script.write_text("import faulthandler, signal, subprocess, sys, time\n"
                      "faulthandler.register(signal.SIGQUIT, all_threads=True)  # as elastic.run does\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "child = subprocess.Popen(['sleep', '600'])  # SIGQUIT would core-dump it\n"
                      "def stuck_in_a_commit():\n"
                      "    print('ready', child.pid, flush=True)\n"
                      "    time.sleep(600)\n"
                      "stuck_in_a_commit()\n")
    command = ["sh", "-c", f"trap '' TERM; {sys.executable} {script}"] if wrapped else [sys.executable, str(script)]
    output = WorkerOutput(tmp_path / "logs", "none")
    output.assign(0, 0)
    process = workers.spawn(command, dict(os.environ), output, warm=False)
    log = tmp_path / "logs" / "round-0" / "rank-0.log"
    deadline = time.time() + 60
    while b"ready" not in (log.read_bytes() if log.exists() else b"") and time.time() < deadline:
        time.sleep(0.02)
    assert b"ready" in log.read_bytes(), "the worker did not start within 60 s"
    return workers.Worker(0, process, tmp_path / "hb"), log


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_worker_that_ignores_sigterm_writes_its_stacks_before_it_is_killed(tmp_path, wrapped):
    """A worker that outlives the stop grace was killed with no word of where it was stuck. The stacks come
    from the trainer behind a wrapper too; what does not catch SIGQUIT (the wrapper, the trainer's child) is
    not sent it: its default action is a core dump."""
    made = ElasticAgent(AgentConfig(command=["true"], job_id="job", run_dir=str(tmp_path / "run"), host_id="a",
                                    stop_grace=1, monitor_interval=0.05), FileStore(str(tmp_path / "rdzv")))
    worker, log = _deaf_worker(tmp_path, wrapped)
    try:
        assert workers.dump_stacks([worker.process], wait=0) == 1  # the trainer: not its wrapper, nor its child
        assert made._stop([worker]) is False
        assert worker.process.returncode == -signal.SIGKILL  # the wrapper (or the worker) took no SIGQUIT
        assert log.read_text().count("in stuck_in_a_commit") == 2
    finally:
        workers.kill(worker.process)
        shutil.rmtree(made.host_dir.path, ignore_errors=True)


def test_a_notice_while_the_store_is_unreachable_still_stops_and_commits(tmp_path, agent):
    """The agent used to retry the store forever before stopping its workers, who trained on."""
    worker, trainer = _trainer(tmp_path, "plain", wrapped=False)
    round_ = Round(0, "frozen", "start", 0, time.time(), [], "a", {"a": [0]}, ["127.0.0.1:1"])
    agent.notices.on_signal(signal.SIGTERM, None)
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
        _host_rendezvous(FileStore(str(tmp_path / "rdzv")), "a").claim_host_id()
        worker, trainer = _trainer(tmp_path, "taken", wrapped=False)
        made._stop([worker])
        assert (tmp_path / "taken").read_text() == "committed" and not running(trainer)
    finally:
        shutil.rmtree(made.host_dir.path, ignore_errors=True)


def test_a_notice_signal_never_waits_for_the_event_log(tmp_path, agent):
    """The handler runs on the main thread, which may hold the event log's lock at that moment: writing
    the event from the handler would wait for itself forever."""
    log = EventLog(tmp_path / "run", "test")
    with open(log.path, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the interrupted main thread would hold it
        handler = threading.Thread(target=agent.notices.on_signal, args=(signal.SIGUSR1, None), daemon=True)
        handler.start()
        handler.join(timeout=5)
        assert not handler.is_alive() and agent.notices.received
    agent.notices.report()
    notices = [e for e in read_events(tmp_path / "run") if e["event"] == Event.PREEMPTION_NOTICE.value]
    assert [e["notice"] for e in notices] == ["signal SIGUSR1"]


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


def test_each_cause_of_a_straggler_is_reported_once_and_recovers_alone_and_only_compute_makes_it_leave(
        tmp_path, agent):
    """A worker's heartbeat says the group waits for its input (2.5x), then its compute is slow too, then its
    input keeps up again: one event per cause, one recovery naming its cause; only the compute rules'
    verdict makes the host leave."""
    worker = workers.Worker(1, subprocess.Popen(["true"]), tmp_path / "beat")
    round_ = Round(3, "frozen", "test", 0, time.time(), [], "a")
    leaves = []
    for beat in (Heartbeat(5, 5, 5, input_slow=2.5), Heartbeat(6, 6, 6, slow=3.0, evict=True, input_slow=2.5),
                 Heartbeat(7, 7, 7, slow=3.0, evict=True)):
        worker.last = beat
        leaves.append(agent._report_stragglers(round_, [worker]))
    worker.process.wait()
    assert leaves == [False, True, True]
    said = [(e["event"], e["cause"], e.get("slowness")) for e in read_events(tmp_path / "run")
            if e["event"] in (Event.STRAGGLER, Event.STRAGGLER_RECOVERED)]
    assert said == [("straggler", "input", 2.5), ("straggler", "compute", 3.0), ("straggler_recovered", "input", None)]


def test_an_eviction_names_each_cause_its_host_straggles_by():
    assert eviction_cause({(0, "compute"): 3.0, (1, "compute"): 2.0}) == {
        "cause": "compute", "slowness": 3.0}
    assert eviction_cause({(1, "input"): 2.5}) == {"cause": "input", "slowness": 2.5}
    assert eviction_cause({(0, "input"): 2.5, (1, "compute"): 1.7}) == {
        "cause": "compute and input", "slowness": 1.7, "input_slowness": 2.5}
    assert eviction_cause({}) == {"cause": "unknown", "slowness": 0.0}


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


@pytest.mark.slow
@pytest.mark.light
def test_an_etcd_password_without_tls_is_warned_about(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.elastic_run", f"--rdzv=file://{tmp_path / 'rdzv'}",
                           "--job_id=j", f"--run_dir={tmp_path / 'run'}", "--rdzv_user=u", "--min_workers=2",
                           "--max_workers=2", "--rendezvous_timeout=0.5", "--", "true"],
                          cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=60)
    assert "the password goes to etcd in clear text" in proc.stderr


# A worker that heartbeats like launch.train (and so watches its agent), wrapped in a shell that stays its
# parent, as `sh -c ...` or `conda run ...` would. It writes its PID, then waits.
WRAPPED = ["sh", "-c", f"{sys.executable} -c \"import os, sys, time; "
           "from tf_elastic.elastic.worker.world import World, report_progress, start_heartbeat; "
           "w = World.from_env(); start_heartbeat(w); report_progress(1); "
           "open(os.path.join(os.environ['TF_ELASTIC_RUN_DIR'], f'pid{w.rank}'), 'w').write(str(os.getpid())); "
           "time.sleep(600)\"; true"]


@pytest.mark.slow
@pytest.mark.light
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
@pytest.mark.light
def test_nproc_gpu_starts_one_worker_per_visible_gpu_each_seeing_only_its_own(job):
    """Tested by the environment each worker receives (this machine has no GPU)."""
    report = [sys.executable, "-c", "import json, os; open(os.path.join(os.environ['TF_ELASTIC_RUN_DIR'], "
              "'devices' + os.environ['TF_ELASTIC_LOCAL_RANK']), 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])"]
    job.agent_args = ["--nowarm_start", "--min_workers=4", "--max_workers=4", "--nproc=gpu"]
    assert job.start_agent("a", command=report, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}).wait(timeout=120) == 0
    assert {p.name: p.read_text() for p in job.run_dir.glob("devices*")} == {
        "devices0": "0", "devices1": "1", "devices2": "2", "devices3": "3"}


@pytest.mark.slow
@pytest.mark.light
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
@pytest.mark.light
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
@pytest.mark.alone
def test_preemption_notices_and_a_stuck_main_thread(tmp_path):
    """One training job, three hosts. c gets a notice from its metadata URL, b Slurm's SIGUSR1: each commits
    and leaves without a counted failure or a lost step. Then a's worker's main thread blocks (its heartbeat
    goes on): the progress watchdog has it write its threads' stacks, restarts it, and the job finishes."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _Notices)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/latest/meta-data/spot/instance-action"
    train = ["--dataset=digits", "--epochs=20", "--per_replica_batch_size=16", "--threads=1", "--optimizer=sgd",
             "--learning_rate=0.02", "--commit_every_steps=10"]
    job = LocalJob(tmp_path, train, ["--min_workers=1", "--max_workers=3", "--index_log", "--last_call=1",
                                     "--preemption_signals=SIGTERM,SIGUSR1", "--nowarm_start"], trainer="launch.train")
    try:
        job.start_agent("a", faults=True, progress_timeout=5)
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
    # Before the kill the agent had the stuck worker write its threads' stacks: the main thread's names the wait.
    stuck_log = job.worker_log("a", failures[0]["round"])
    assert re.search(r'testing/faults.py", line \d+ in <lambda>', stuck_log), stuck_log[-3000:]
    restores = audit.restores(job.run_dir)
    leave_rounds = sorted(e["round"] for e in leaves.values())
    # A graceful leave loses nothing: the next round restores exactly the step the group stopped at.
    for round_ in leave_rounds:
        reached = max(r["step"] for r in audit.index_records(job.run_dir) if r["round"] == round_)
        assert restores[round_ + 1] == reached
    assert not (job.run_dir / "heartbeats").exists()  # heartbeats live on the host, not in the run dir


class _OneFailedRoundRead(FileStore):
    """The first read of the round key (the one a failure's effects make, to open the next round) fails."""
    failed = False

    def get(self, key):
        if key.endswith("/group/round") and not self.failed:
            self.failed = True
            raise StoreError("simulated: one request timed out")
        return super().get(key)


def test_a_failure_whose_effects_met_a_store_error_is_judged_once(tmp_path):
    """The store failed once while the agent opened the next round after a worker's exit: the monitor
    judged the same dead worker again at its next look, so one start failure counted as two "alike" and
    the job failed after one start."""
    store = _OneFailedRoundRead(str(tmp_path / "rdzv"))
    command = [sys.executable, "-c", "import sys; print('ImportError: transient', file=sys.stderr); sys.exit(1)"]
    config = AgentConfig(command=command, job_id="job", run_dir=str(tmp_path / "run"), max_restarts=5, host_id="h",
                         warm_start=False, preemption_signals=(), monitor_interval=0.05,
                         timeouts=Timeouts(rendezvous=10, last_call=0.2, survivor_wait=2, host_ttl=1.0, poll=0.05))
    assert ElasticAgent(config, store).run() == 1  # two starts failed alike: the job ends, naming the error
    assert store.failed
    failures = [e for e in read_events(tmp_path / "run") if e["event"] == Event.FAILURE]
    assert [(e["round"], e["counted"]) for e in failures] == [(0, True), (1, False)]
    assert "on 2 tries in a row: ImportError: transient" in store.get("/job/group/outcome")
    assert Round.from_json(store.get("/job/group/round")).restarts == 1
