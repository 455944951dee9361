"""The elastic agent: one per host. Starts workers, watches them and the group, restarts at the new size.

It never imports TensorFlow. Layers: a `Store` holds shared state, `Rendezvous` agrees on rounds, the
agent runs its local workers through the states below and turns every change into a new round.
"""
import dataclasses
import enum
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from absl import logging

from tf_elastic.elastic.agent import decisions
from tf_elastic.elastic.agent.decisions import GroupChange, WorkersState, WorkersVerdict
from tf_elastic.elastic.agent.job_record import JobEnded, TokenRefused
from tf_elastic.elastic.agent.rendezvous import Rendezvous, RendezvousTimeout
from tf_elastic.elastic.agent.round import Round, Timeouts
from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import AgentExit, Env, Event, Failure, JobStatus, RunDir, read_heartbeat
from tf_elastic.elastic.store import Store, StoreError

_SCRATCH_PREFIX = "tf_elastic-agent"  # + agent pid: a later agent on this host removes a dead agent's


def sweep_dead_agents_scratch() -> List[str]:
    """Removes the workers' scratch dirs of agents on this host that died without cleaning up (SIGKILL)."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{_SCRATCH_PREFIX}*-rank*"):
        pid = path.name[len(_SCRATCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


class RoundResult(enum.Enum):
    """How one round ended for this host."""
    SUCCEEDED = "succeeded"  # every local worker finished training
    RESTART = "restart"  # the group changed or failed: rejoin at the next round
    LEFT = "left"  # this host left gracefully
    FAILED = "failed"  # the job failed (max_restarts, rendezvous timeout)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    command: List[str]
    job_id: str
    run_dir: str
    nproc: int = 1
    min_workers: int = 1
    max_workers: int = 1
    max_restarts: int = 3
    heartbeat_timeout: float = 3.0  # a training worker silent this long is hung (it beats every 0.5 s)
    startup_timeout: float = 120.0  # allowance for a worker to reach its first step
    monitor_interval: float = 0.2
    # SIGTERM, then SIGKILL this many seconds later; also how long workers get to end once the job is done.
    stop_grace: float = 15.0
    advertise_addr: str = "127.0.0.1"
    host_id: str = ""
    timeouts: Timeouts = Timeouts()
    index_log: bool = False
    warm_start: bool = True  # keep a worker per slot started ahead of the next round
    extra_env: Optional[Dict[str, str]] = None
    job_token: Optional[str] = None  # shared secret every agent of the job presents
    port_range: Optional[Tuple[int, int]] = None  # workers' TF server ports come from here
    blacklist_after: int = 2  # this many failures of our own workers in a row keep this host out...
    blacklist_cooldown: float = 60.0  # ...for this long, doubled at each further strike


@dataclasses.dataclass
class _Spare:
    """A warm worker: started ahead of its round, blocked until it is handed a world on stdin."""
    process: subprocess.Popen
    ready: Path  # created by the worker once its imports are done
    announced: bool = False


@dataclasses.dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    heartbeat: Path
    started: float
    scratch: Path  # deleted once the process is gone


class ElasticAgent:
    def __init__(self, config: AgentConfig, store: Store):
        self.config = config
        self.host_id = config.host_id or f"{socket.gethostname()}-{os.getpid()}"
        self.rendezvous = Rendezvous(store, config.job_id, self.host_id, config.nproc, config.advertise_addr,
                                     config.min_workers, config.max_workers, config.max_restarts, config.timeouts,
                                     token=config.job_token, port_range=config.port_range)
        self.job = self.rendezvous.job
        self.run_dir = RunDir(config.run_dir)
        self.events = EventLog(config.run_dir, source=f"agent:{self.host_id}")
        self._leaving = False
        self._warm: List[_Spare] = []
        self._warm_spawned = 0
        self._own_failures = 0  # failures of this host's own workers, in a row

    def run(self) -> int:
        """Runs until the job ends; returns the process exit code (`AgentExit`)."""
        previous = signal.signal(signal.SIGTERM, self._on_leave_signal)
        self.events.write(Event.AGENT_START, host=self.host_id, nproc=self.config.nproc,
                          swept=len(sweep_dead_agents_scratch()))
        ranks: Optional[List[int]] = None
        after = -1
        try:
            if self.config.warm_start:
                # Join only once our workers are warm: the group trains on while a newcomer starts up.
                self._spawn_warm(self.config.nproc)
                self._wait_warm_ready()
            while True:
                try:
                    self._sit_out_blacklist()
                    round_ = self.rendezvous.join(previous_ranks=ranks, after=after, cancelled=lambda: self._leaving)
                except JobEnded as ended:
                    return self._exit(AgentExit.OK if ended.status is JobStatus.DONE else AgentExit.FAILED,
                                      ended.reason)
                except RendezvousTimeout as timeout:
                    return self._exit(AgentExit.FAILED, str(timeout))
                if round_ is None:
                    self.rendezvous.leave()
                    return self._exit(AgentExit.OK, "left the job gracefully (while waiting for a round)")
                ranks, after = round_.assignment[self.host_id], round_.number
                self.events.write(Event.RENDEZVOUS, round=round_.number, world_size=round_.world_size, ranks=ranks,
                                  reason=round_.reason, restarts=round_.restarts, cluster=round_.cluster)
                result = self._run_round(round_, ranks)
                if result is RoundResult.SUCCEEDED:
                    self._record_done()
                    return self._exit(AgentExit.OK, "training finished")
                if result is RoundResult.LEFT:
                    return self._exit(AgentExit.OK, "left the job gracefully")
                if result is RoundResult.FAILED:
                    outcome = self.job.outcome()
                    return self._exit(AgentExit.FAILED, outcome.reason if outcome else "job failed")
        except TokenRefused as refused:
            return self._exit(AgentExit.REFUSED, str(refused))
        except StoreError as error:
            return self._exit(AgentExit.FAILED, f"rendezvous store error: {error}")
        finally:
            signal.signal(signal.SIGTERM, previous)
            for spare in self._warm:
                spare.process.kill()
                spare.process.wait()

    def _record_done(self) -> None:
        """Tells every agent the job is done, retrying while the store is unreachable (up to the
        rendezvous timeout): a store outage at the very end must not turn a finished job into a failure."""
        deadline = time.monotonic() + self.config.timeouts.rendezvous
        while True:
            try:
                return self.job.finish(JobStatus.DONE, "training finished")
            except StoreError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(self.config.monitor_interval)

    def _sit_out_blacklist(self) -> None:
        """Stays out of the job while this host is blacklisted: no lease, so no round waits for it."""
        try:
            seconds = self.job.blacklisted_for()
        except StoreError:
            return  # the rendezvous retries the store and reports it
        if not seconds:
            return
        self.rendezvous.leave()
        self.events.write(Event.BLACKLISTED, host=self.host_id, seconds=round(seconds, 1))
        logging.warning("host %s is blacklisted for %.0fs after repeated worker failures", self.host_id, seconds)
        deadline = time.time() + seconds
        while time.time() < deadline and not self._leaving:
            if self.job.outcome() is not None:
                return  # join() reports how the job ended
            time.sleep(min(1.0, max(0.0, deadline - time.time())))

    # One round ----------------------------------------------------------------------------------------
    def _run_round(self, round_: Round, ranks: List[int]) -> RoundResult:
        workers = [self._start(rank, round_) for rank in ranks]
        try:
            return self._monitor(round_, workers)
        finally:
            self._kill(workers)

    def _start(self, rank: int, round_: Round) -> _Worker:
        heartbeat = self.run_dir.heartbeat(round_.number, rank)
        heartbeat.parent.mkdir(parents=True, exist_ok=True)
        heartbeat.unlink(missing_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-rank{rank}-"))
        world = {
            "TF_CONFIG": json.dumps({"cluster": {"worker": round_.cluster}, "task": {"type": "worker", "index": rank}}),
            Env.RUN_DIR: self.config.run_dir,
            Env.ROUND: str(round_.number),
            Env.HEARTBEAT_FILE: str(heartbeat),
            Env.HEARTBEAT_TIMEOUT: str(self.config.heartbeat_timeout),
            Env.RESTARTS: str(round_.restarts),
            Env.SCRATCH_DIR: str(scratch),
        }
        if self.config.index_log:
            world[Env.INDEX_LOG] = "1"
        process = self._take_warm(world) or self._spawn(dict(self._base_env(), **world), warm=False)
        self.events.write(Event.WORKER_START, round=round_.number, rank=rank, worker_pid=process.pid,
                          warm=process.stdin is not None)
        return _Worker(rank, process, heartbeat, time.time(), scratch)

    def _base_env(self) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in Env.SECRETS}  # workers never need them
        return dict(env, **(self.config.extra_env or {}))

    def _spawn(self, env: Dict[str, str], warm: bool) -> subprocess.Popen:
        # An argv list, never a shell; a session of its own so terminal signals reach the agent only.
        return subprocess.Popen(self.config.command, env=env, start_new_session=True,
                                stdin=subprocess.PIPE if warm else subprocess.DEVNULL)

    def _spawn_warm(self, count: int) -> None:
        for _ in range(count):
            self._warm_spawned += 1
            ready = self.run_dir.warm_ready(self.host_id, self._warm_spawned)
            ready.parent.mkdir(parents=True, exist_ok=True)
            env = dict(self._base_env(), **{Env.WARM: "1", Env.WARM_READY: str(ready)})
            self._warm.append(_Spare(self._spawn(env, warm=True), ready))

    def _wait_warm_ready(self) -> None:
        """Waits (up to startup_timeout) until every warm worker has done its imports."""
        deadline = time.time() + self.config.startup_timeout
        while time.time() < deadline and not self._leaving and any(
                s.process.poll() is None and not s.ready.exists() for s in self._warm):
            time.sleep(self.config.monitor_interval)
        for spare in self._warm:
            spare.ready.unlink(missing_ok=True)

    def _take_warm(self, world: Dict[str, str]) -> Optional[subprocess.Popen]:
        """A warm worker, handed this round's world on its stdin; None if none is alive."""
        while self._warm:
            process = self._warm.pop(0).process
            if process.poll() is not None:
                continue
            try:
                process.stdin.write((json.dumps(world) + "\n").encode())
                process.stdin.close()
                return process
            except (BrokenPipeError, OSError):
                process.kill()
                process.wait()
        return None

    def _tend_spares(self, round_: Round, workers: List[_Worker]) -> None:
        """Once this round trains, pays the next round's start-up (imports, data) ahead of time."""
        if self.config.warm_start and len(self._warm) < len(workers) and all(
                read_heartbeat(w.heartbeat) for w in workers):
            self._spawn_warm(len(workers) - len(self._warm))
        for spare in self._warm:
            if not spare.announced and spare.ready.exists():
                spare.announced = True
                self.events.write(Event.SPARE_READY, round=round_.number, worker_pid=spare.process.pid)

    def _monitor(self, round_: Round, workers: List[_Worker]) -> RoundResult:
        """Watches the workers and the store until the round ends. While the store is unreachable the
        workers train on; whatever needs the store is retried once it is back."""
        unreachable_since = None
        changed = True
        while True:
            try:
                self.rendezvous.keepalive()
                result = self._check_round(round_, workers, changed)
            except StoreError as error:
                if unreachable_since is None:
                    unreachable_since = time.time()
                    self.events.write(Event.STORE_UNREACHABLE, round=round_.number, error=str(error)[:300])
                    logging.warning("rendezvous store unreachable (%s); the workers train on", error)
                result = None
            else:
                if unreachable_since is not None:
                    self.events.write(Event.STORE_REACHABLE, round=round_.number,
                                      seconds=round(time.time() - unreachable_since, 2))
                    unreachable_since = None
            if result is not None:
                return result
            # The local workers are checked every interval; the store only when it may have changed.
            changed = self.rendezvous.wait_for_change(self.config.monitor_interval) or unreachable_since is not None

    def _check_round(self, round_: Round, workers: List[_Worker], changed: bool) -> Optional[RoundResult]:
        """One look: observe (worker exit codes, heartbeats, and the store if it `changed`), let
        `decisions` judge, act on the verdict."""
        if self._leaving:
            return self._leave(round_, workers)
        codes = {w.rank: w.process.poll() for w in workers}
        own = decisions.own_failure(codes)
        current = round_
        if changed:
            outcome = self.job.outcome()
            current = self.rendezvous.current()
            result = self._act_on_group(decisions.judge_group(round_, outcome and outcome.status, current),
                                        round_, current, workers, own)
            if result is not None:
                return result
        self._tend_spares(round_, workers)
        silent = {w.rank for w in workers if codes[w.rank] is None and self._silent(w)}
        result = self._act_on_workers(decisions.judge_workers(codes, silent), round_, current, workers, own)
        if result is None and changed:
            lost = decisions.lost_hosts(round_, set(self.rendezvous.alive_hosts()), self.host_id)
            if lost:
                self._failure(round_, Failure.HOST_LOST, None, None, host=lost[0])
                return RoundResult.RESTART
        return result

    def _act_on_group(self, change: GroupChange, round_: Round, current: Optional[Round], workers: List[_Worker],
                      own: bool) -> Optional[RoundResult]:
        if change is GroupChange.JOB_FAILED:
            return RoundResult.FAILED
        if change is GroupChange.JOB_DONE:
            # Another host's workers finished: ours are finishing too (the last evaluation, the chief's
            # summary). Killing them now would lose that; let them end on their own.
            self._await_exit(workers, self.config.stop_grace)
            return RoundResult.SUCCEEDED
        if change is GroupChange.NONE:
            return None
        self.events.write(Event.MEMBERSHIP_CHANGE, round=round_.number,
                          next_round=None if current is None else current.number,
                          reason=None if current is None else current.reason)
        self._count_own_failure(own)
        # After a failure the group is broken and nothing more can be committed: kill at once.
        # After a join or leave, SIGTERM lets the workers agree on a step and commit it.
        if change is GroupChange.RESTARTED:
            self._kill(workers)
        else:
            self._stop(workers)
        return RoundResult.RESTART

    def _act_on_workers(self, verdict: WorkersVerdict, round_: Round, current: Round, workers: List[_Worker],
                        own: bool) -> Optional[RoundResult]:
        if verdict.state is WorkersState.RUNNING:
            return None
        if verdict.state is WorkersState.DONE:
            self.events.write(Event.WORKERS_DONE, round=round_.number, ranks=[w.rank for w in workers])
            return RoundResult.SUCCEEDED
        if verdict.state is WorkersState.STOPPED:
            # Stopped on its own (a preemption notice sent straight to the worker).
            self.events.write(Event.WORKER_STOPPED, round=round_.number, rank=verdict.rank)
            self.rendezvous.open_next(current, reason=f"rank {verdict.rank} stopped", failure=False)
            self._stop(workers)
            return RoundResult.RESTART
        if verdict.state is WorkersState.CONFIG_ERROR:
            self.job.finish(JobStatus.FAILED, f"rank {verdict.rank} stopped on a configuration error (exit code "
                                              f"{verdict.code}); a restart cannot fix it: see the worker's log")
            self.events.write(Event.FAILURE, round=round_.number, kind=Failure.CONFIG_ERROR.value, rank=verdict.rank,
                              code=verdict.code, host=self.host_id, counted=False)
            return RoundResult.FAILED
        if verdict.failure is Failure.HANG:
            next(w for w in workers if w.rank == verdict.rank).process.kill()
            own = True
        self._failure(round_, verdict.failure, verdict.rank, verdict.code, own=own)
        return RoundResult.RESTART

    def _count_own_failure(self, own: bool) -> None:
        """Blacklists this host after `blacklist_after` failures of its own workers in a row."""
        self._own_failures = self._own_failures + 1 if own else 0
        if own and self._own_failures >= self.config.blacklist_after:
            self._own_failures = 0
            seconds = self.job.blacklist(self.config.blacklist_cooldown)
            logging.warning("host %s: %d failures of its own workers in a row; out for %.0fs", self.host_id,
                            self.config.blacklist_after, seconds)

    def _failure(self, round_: Round, kind: Failure, rank: Optional[int], code: Optional[int],
                 host: Optional[str] = None, own: bool = False) -> None:
        self._count_own_failure(own)
        current = self.rendezvous.current()
        # Name only what is known: a lost host has no rank, a hang no exit code.
        known = [kind.value] + ([f"rank={rank}"] if rank is not None else []) + [f"host={host or self.host_id}"]
        reason = " ".join(known)
        counted = current is not None and current.number == round_.number and self.rendezvous.open_next(
            current, reason=reason, failure=True)
        self.events.write(Event.FAILURE, round=round_.number, kind=kind.value, rank=rank, code=code,
                          host=host or self.host_id, counted=counted)

    def _silent(self, worker: _Worker) -> bool:
        """No heartbeat for heartbeat_timeout once training, or for startup_timeout before the first step."""
        step = read_heartbeat(worker.heartbeat)
        if not step:
            return time.time() - worker.started > self.config.startup_timeout
        try:
            return time.time() - worker.heartbeat.stat().st_mtime > self.config.heartbeat_timeout
        except FileNotFoundError:
            return False

    def _leave(self, round_: Round, workers: List[_Worker]) -> RoundResult:
        current = self.rendezvous.current()
        if current is not None and current.number == round_.number:
            self.rendezvous.open_next(current, reason=f"leave {self.host_id}", failure=False, leaving=True)
        self._stop(workers)
        self.rendezvous.leave()
        self.events.write(Event.LEAVE, round=round_.number, host=self.host_id)
        return RoundResult.LEFT

    # Processes ---------------------------------------------------------------------------------------
    def _stop(self, workers: List[_Worker]) -> None:
        """SIGTERM (workers commit at their next step boundary and exit), SIGKILL after the grace period."""
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)
        self._await_exit(workers, self.config.stop_grace)
        for worker in workers:
            if worker.process.poll() is None:
                logging.warning("rank %d ignored SIGTERM for %.0fs; killing it", worker.rank, self.config.stop_grace)
        self._kill(workers)

    def _await_exit(self, workers: List[_Worker], grace: float) -> None:
        """Waits up to `grace` seconds for the workers to exit, renewing this host's lease meanwhile."""
        deadline = time.time() + grace
        while any(w.process.poll() is None for w in workers) and time.time() < deadline:
            try:
                self.rendezvous.keepalive()  # still alive while we wait: others must not count this host lost
            except StoreError:
                pass  # the monitor reports the outage; waiting goes on
            time.sleep(self.config.monitor_interval)

    @staticmethod
    def _kill(workers: List[_Worker]) -> None:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
            worker.process.wait()
            shutil.rmtree(worker.scratch, ignore_errors=True)

    def _on_leave_signal(self, signum, frame) -> None:
        del signum, frame
        self._leaving = True

    def _exit(self, code: AgentExit, reason: str) -> int:
        self.events.write(Event.EXIT, code=int(code), reason=reason, host=self.host_id)
        (logging.info if code == AgentExit.OK else logging.error)("tf_elastic agent %s: %s", self.host_id, reason)
        return int(code)
