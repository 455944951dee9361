"""The elastic agent: one per host. Starts workers, watches them and the group, restarts at the new size.

It never imports TensorFlow. Layers: a `Store` holds shared state, `Rendezvous` agrees on rounds, the
agent runs its local workers through the states below and turns every change into a new round.
"""
import dataclasses
import enum
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

from absl import logging

from tf_elastic.elastic import world as contract
from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.rendezvous import JobEnded, Rendezvous, RendezvousTimeout, Round, Timeouts
from tf_elastic.elastic.store import Store, StoreError


class Outcome(enum.Enum):
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
    heartbeat_timeout: float = 5.0  # a training worker silent this long is hung
    startup_timeout: float = 120.0  # allowance for a worker to reach its first step
    monitor_interval: float = 0.2
    stop_grace: float = 15.0  # SIGTERM, then SIGKILL after this many seconds
    advertise_addr: str = "127.0.0.1"
    host_id: str = ""
    timeouts: Timeouts = Timeouts()
    index_log: bool = False
    warm_start: bool = True  # keep a worker per slot started ahead of the next round
    extra_env: Optional[Dict[str, str]] = None


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


class ElasticAgent:
    def __init__(self, config: AgentConfig, store: Store):
        self.config = config
        self.host_id = config.host_id or f"{socket.gethostname()}-{os.getpid()}"
        self.rendezvous = Rendezvous(store, config.job_id, self.host_id, config.nproc, config.advertise_addr,
                                     config.min_workers, config.max_workers, config.max_restarts, config.timeouts)
        self.events = EventLog(config.run_dir, source=f"agent:{self.host_id}")
        self._leaving = False
        self._warm: List[_Spare] = []
        self._warm_spawned = 0

    def run(self) -> int:
        """Runs until the job ends; returns the process exit code (0: done or left gracefully)."""
        previous = signal.signal(signal.SIGTERM, self._on_leave_signal)
        self.events.write("agent_start", host=self.host_id, nproc=self.config.nproc)
        ranks: Optional[List[int]] = None
        after = -1
        try:
            if self.config.warm_start:
                # Join only once our workers are warm: the group trains on while a newcomer starts up.
                self._spawn_warm(self.config.nproc)
                self._wait_warm_ready()
            while True:
                try:
                    round_ = self.rendezvous.join(previous_ranks=ranks, after=after, cancelled=lambda: self._leaving)
                except JobEnded as ended:
                    return self._exit(0 if ended.status == "done" else 1, ended.reason)
                except RendezvousTimeout as timeout:
                    return self._exit(1, str(timeout))
                if round_ is None:
                    self.rendezvous.leave()
                    return self._exit(0, "left the job gracefully (while waiting for a round)")
                ranks, after = round_.assignment[self.host_id], round_.number
                self.events.write("rendezvous", round=round_.number, world_size=round_.world_size, ranks=ranks,
                                  reason=round_.reason, restarts=round_.restarts)
                outcome = self._run_round(round_, ranks)
                if outcome is Outcome.SUCCEEDED:
                    self.rendezvous.finish("done", "training finished")
                    return self._exit(0, "training finished")
                if outcome is Outcome.LEFT:
                    return self._exit(0, "left the job gracefully")
                if outcome is Outcome.FAILED:
                    return self._exit(1, (self.rendezvous.outcome() or {}).get("reason", "job failed"))
        except StoreError as error:
            return self._exit(1, f"rendezvous store error: {error}")
        finally:
            signal.signal(signal.SIGTERM, previous)
            for spare in self._warm:
                spare.process.kill()
                spare.process.wait()

    # One round ----------------------------------------------------------------------------------------
    def _run_round(self, round_: Round, ranks: List[int]) -> Outcome:
        workers = [self._start(rank, round_) for rank in ranks]
        try:
            return self._monitor(round_, workers)
        finally:
            self._kill(workers)

    def _start(self, rank: int, round_: Round) -> _Worker:
        heartbeat = Path(self.config.run_dir) / "heartbeats" / f"round{round_.number}-rank{rank}"
        heartbeat.parent.mkdir(parents=True, exist_ok=True)
        heartbeat.unlink(missing_ok=True)
        world = {
            "TF_CONFIG": json.dumps({"cluster": {"worker": round_.cluster}, "task": {"type": "worker", "index": rank}}),
            contract.ENV_RUN_DIR: self.config.run_dir,
            contract.ENV_ROUND: str(round_.number),
            contract.ENV_HEARTBEAT_FILE: str(heartbeat),
            contract.ENV_HEARTBEAT_TIMEOUT: str(self.config.heartbeat_timeout),
            contract.ENV_RESTARTS: str(round_.restarts),
        }
        if self.config.index_log:
            world[contract.ENV_INDEX_LOG] = "1"
        process = self._take_warm(world) or self._spawn(dict(self._base_env(), **world), warm=False)
        self.events.write("worker_start", round=round_.number, rank=rank, worker_pid=process.pid,
                          warm=process.stdin is not None)
        return _Worker(rank, process, heartbeat, time.time())

    def _base_env(self) -> Dict[str, str]:
        return dict(os.environ, **(self.config.extra_env or {}))

    def _spawn(self, env: Dict[str, str], warm: bool) -> subprocess.Popen:
        # An argv list, never a shell; a session of its own so terminal signals reach the agent only.
        return subprocess.Popen(self.config.command, env=env, start_new_session=True,
                                stdin=subprocess.PIPE if warm else subprocess.DEVNULL)

    def _spawn_warm(self, count: int) -> None:
        for _ in range(count):
            self._warm_spawned += 1
            ready = Path(self.config.run_dir) / "heartbeats" / f"warm-{self.host_id}-{self._warm_spawned}.ready"
            ready.parent.mkdir(parents=True, exist_ok=True)
            env = dict(self._base_env(), **{contract.ENV_WARM: "1", contract.ENV_WARM_READY: str(ready)})
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

    def _monitor(self, round_: Round, workers: List[_Worker]) -> Outcome:
        while True:
            time.sleep(self.config.monitor_interval)
            self.rendezvous.keepalive()
            if self._leaving:
                return self._leave(round_, workers)
            if self.rendezvous.outcome() is not None:
                return Outcome.SUCCEEDED if self.rendezvous.outcome()["status"] == "done" else Outcome.FAILED
            current = self.rendezvous.current()
            if current is None or current.number != round_.number:
                failed = current is None or current.restarts > round_.restarts
                self.events.write("membership_change", round=round_.number,
                                  next_round=None if current is None else current.number,
                                  reason=None if current is None else current.reason)
                # After a failure the group is broken and nothing more can be committed: kill at once.
                # After a join or leave, SIGTERM lets the workers agree on a step and commit it.
                if failed:
                    self._kill(workers)
                else:
                    self._stop(workers)
                return Outcome.RESTART
            if self.config.warm_start and len(self._warm) < len(workers) and all(
                    contract.read_heartbeat(w.heartbeat) for w in workers):
                # Pay the next round's start-up (imports, data) now that this round is training.
                self._spawn_warm(len(workers) - len(self._warm))
            for spare in self._warm:
                if not spare.announced and spare.ready.exists():
                    spare.announced = True
                    self.events.write("spare_ready", round=round_.number, worker_pid=spare.process.pid)
            codes = {w.rank: w.process.poll() for w in workers}
            if all(code == contract.EXIT_DONE for code in codes.values()):
                self.events.write("workers_done", round=round_.number, ranks=list(codes))
                return Outcome.SUCCEEDED
            hung = [w for w in workers if codes[w.rank] is None and self._silent(w)]
            for worker in hung:
                worker.process.kill()
                self._failure(round_, "hang", worker.rank, None)
                return Outcome.RESTART
            for rank, code in codes.items():
                if code not in (None, contract.EXIT_DONE):
                    if code == contract.EXIT_STOPPED:
                        # Stopped on its own (a preemption notice sent straight to the worker).
                        self.events.write("worker_stopped", round=round_.number, rank=rank)
                        self.rendezvous.open_next(current, reason=f"rank {rank} stopped", failure=False)
                        self._stop(workers)
                        return Outcome.RESTART
                    kind = "peer_failure" if code == contract.EXIT_PEER_FAILURE else "worker_exit"
                    self._failure(round_, kind, rank, code)
                    return Outcome.RESTART
            alive = set(self.rendezvous.alive_hosts())
            lost = [h for h, r in (round_.assignment or {}).items() if r and h not in alive and h != self.host_id]
            if lost:
                self._failure(round_, "host_lost", None, None, host=lost[0])
                return Outcome.RESTART

    def _failure(self, round_: Round, kind: str, rank: Optional[int], code: Optional[int], host: str = None) -> None:
        current = self.rendezvous.current()
        counted = current is not None and current.number == round_.number and self.rendezvous.open_next(
            current, reason=f"{kind} rank={rank} host={host or self.host_id}", failure=True)
        self.events.write("failure", round=round_.number, kind=kind, rank=rank, code=code, host=host or self.host_id,
                          counted=counted)

    def _silent(self, worker: _Worker) -> bool:
        """No heartbeat for heartbeat_timeout once training, or for startup_timeout before the first step."""
        step = contract.read_heartbeat(worker.heartbeat)
        if not step:
            return time.time() - worker.started > self.config.startup_timeout
        try:
            return time.time() - worker.heartbeat.stat().st_mtime > self.config.heartbeat_timeout
        except FileNotFoundError:
            return False

    def _leave(self, round_: Round, workers: List[_Worker]) -> Outcome:
        current = self.rendezvous.current()
        if current is not None and current.number == round_.number:
            self.rendezvous.open_next(current, reason=f"leave {self.host_id}", failure=False, leaving=True)
        self._stop(workers)
        self.rendezvous.leave()
        self.events.write("leave", round=round_.number, host=self.host_id)
        return Outcome.LEFT

    # Processes ---------------------------------------------------------------------------------------
    def _stop(self, workers: List[_Worker]) -> None:
        """SIGTERM (workers commit at their next step boundary and exit), SIGKILL after the grace period."""
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.time() + self.config.stop_grace
        while any(w.process.poll() is None for w in workers) and time.time() < deadline:
            self.rendezvous.keepalive()  # still alive while we wait: others must not count this host lost
            time.sleep(self.config.monitor_interval)
        for worker in workers:
            if worker.process.poll() is None:
                logging.warning("rank %d ignored SIGTERM for %.0fs; killing it", worker.rank, self.config.stop_grace)
        self._kill(workers)

    @staticmethod
    def _kill(workers: List[_Worker]) -> None:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
            worker.process.wait()

    def _on_leave_signal(self, signum, frame) -> None:
        del signum, frame
        self._leaving = True

    def _exit(self, code: int, reason: str) -> int:
        self.events.write("exit", code=code, reason=reason, host=self.host_id)
        (logging.info if code == 0 else logging.error)("tf_elastic agent %s: %s", self.host_id, reason)
        return code
