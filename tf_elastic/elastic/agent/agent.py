"""The elastic agent: one per host. Starts workers, watches them and the group, restarts at the new size.

It never imports TensorFlow. Layers: a `Store` holds shared state, `Rendezvous` agrees on rounds, the
agent runs its local workers through the states below and turns every change into a new round.
"""
import dataclasses
import enum
import functools
import json
import math
import os
import shutil
import signal
import socket
import time
from typing import Callable, Collection, Dict, List, Optional, Tuple

from absl import logging

from tf_elastic.elastic import stragglers
from tf_elastic.elastic.agent import decisions, preemption, probation, workers
from tf_elastic.elastic.agent.blacklist import Blacklist
from tf_elastic.elastic.agent.decisions import GroupChange, WorkersState, WorkersVerdict
from tf_elastic.elastic.agent.job_record import JobEnded, TokenRefused
from tf_elastic.elastic.agent.rendezvous import HostIdTaken, Rendezvous, RendezvousTimeout
from tf_elastic.elastic.agent.round import Round, Timeouts
from tf_elastic.elastic.agent.worker_output import WorkerOutput, logs_dir
from tf_elastic.elastic.agent.spares import WarmSpares
from tf_elastic.elastic.agent.workers import Worker
from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import AgentExit, Env, Event, Failure, JobStatus, error_record_line, read_error_file
from tf_elastic.elastic.store import Store, StoreError
from tf_elastic.elastic.stragglers import ProbeSettings


def _seconds_or_why(read: Optional[float]) -> str:
    """A probation's input read alone, as its log line says it."""
    if read == math.inf:
        return "(too slow to time)"
    return f"{read:.4f}s" if read else "(not measured)"


# What a straggler's log line says of its slowness, by cause.
_STRAGGLER_SAYS = {"compute": "its probe takes %.2fx the group's median",
                   "input": "the group waits for its input and would go %.2fx faster if it kept up"}


class RoundResult(enum.Enum):
    """How one round ended for this host."""
    SUCCEEDED = "succeeded"  # every local worker finished training
    RESTART = "restart"  # the group changed or failed: rejoin at the next round
    LEFT = "left"  # this host left gracefully
    EVICTED = "evicted"  # this host left as a straggler: it sits out, on probation, until it is fast again
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
    progress_timeout: Optional[float] = None  # no progress this long is a hang (None: derived, see below)
    progress_floor: float = 60.0  # the derived progress timeout is never shorter
    preemption_signals: Tuple[int, ...] = (signal.SIGTERM,)  # each makes the agent commit and leave
    preemption_notice_url: Optional[str] = None  # polled; a notice there also makes it commit and leave
    preemption_poll_interval: float = 1.0
    world_size_divides: Optional[int] = None  # form only worlds whose size divides this (a global batch)
    devices: Optional[List[str]] = None  # CUDA_VISIBLE_DEVICES of each local worker slot (None: leave it alone)
    echo_ranks: str = "all"  # whose output the agent echoes, prefixed: all, chief, none (error lines always)
    probe: ProbeSettings = ProbeSettings()  # the workers' straggler probe and its rules
    evict_stragglers: bool = False  # leave while this host is a straggler the group is better off without...
    # ...and sit out this long (doubled at each eviction) before it times its own pass and input (`_probation`)...
    straggler_hold_off: float = 30.0
    probation_interval: float = 10.0  # ...and again this often until they are back within the factor


class ElasticAgent:
    def __init__(self, config: AgentConfig, store: Store):
        self.config = config
        self.host_id = config.host_id or socket.gethostname()
        self.rendezvous = Rendezvous(store, config.job_id, self.host_id, config.nproc, config.advertise_addr,
                                     config.min_workers, config.max_workers, config.max_restarts, config.timeouts,
                                     token=config.job_token, port_range=config.port_range,
                                     world_size_divides=config.world_size_divides)
        self.job = self.rendezvous.job
        self.events = EventLog(config.run_dir, source=f"agent:{self.host_id}")
        self.host_dir = workers.make_host_dir()
        self.notices = preemption.Notices(config.preemption_signals, config.preemption_notice_url,
                                          config.preemption_poll_interval, self.events, self.host_id)
        self.blacklist = Blacklist(self.job, self.host_id, self.events, config.blacklist_after,
                                   config.blacklist_cooldown)
        self.spares = WarmSpares(config.command, self.host_dir, self.events, self._slot_env, self._output)
        self._start_failures: List[Optional[str]] = []  # last error lines of workers failed before a step
        self._trained = False  # a worker of this host reached a training step in this job
        self._training_round = -1  # the last round whose first training step was logged
        self._effects: Optional[Callable[[], RoundResult]] = None  # a verdict's, until the store let them through
        self._slow: Dict[Tuple[int, str], float] = {}  # (rank, cause) -> slowness, this round's stragglers here
        # The group's median probe, its batch and its seconds per step, as last seen.
        self._group_probe: Optional[Tuple[float, int, float]] = None
        self._published: Optional[Tuple[float, int, float]] = None  # what this agent last published of it (the chief's)
        self.evictions = 0

    def run(self) -> int:
        """Runs until the job ends; returns the process exit code (`AgentExit`)."""
        self._started = time.time()
        self.events.write(Event.AGENT_START, host=self.host_id, nproc=self.config.nproc,
                          swept=len(workers.sweep_dead_agents_dirs()))
        ranks: Optional[List[int]] = None
        after = -1
        try:
            self.notices.__enter__()
            if self.config.warm_start:
                # Join only once our workers are warm: the group trains on while a newcomer starts up.
                self.spares.spawn(range(self.config.nproc))
                self.spares.wait_ready(self.config.startup_timeout, self.config.monitor_interval,
                                       cancelled=lambda: self.notices.received)
            while True:
                try:
                    self.blacklist.sit_out(self.rendezvous.leave, cancelled=lambda: self.notices.received)
                    round_ = self.rendezvous.join(previous_ranks=ranks, after=after,
                                                  cancelled=lambda: self.notices.received,
                                                  on_standby=self._report_standby)
                except JobEnded as ended:
                    return self._exit(AgentExit.OK if ended.status is JobStatus.DONE else AgentExit.FAILED,
                                      self._ended_text(ended, after))
                except RendezvousTimeout as timeout:
                    return self._exit(AgentExit.FAILED, str(timeout))
                if round_ is None:
                    self.notices.report()
                    self._withdraw(after)
                    return self._exit(AgentExit.OK, "left the job gracefully (while waiting for a round)")
                ranks, after = round_.assignment[self.host_id], round_.number
                self._report_round(round_, ranks)
                result = self._run_round(round_, ranks)
                if result is RoundResult.SUCCEEDED:
                    self._record_done()
                    return self._exit(AgentExit.OK, "training finished")
                if result is RoundResult.LEFT:
                    return self._exit(AgentExit.OK, "left the job gracefully")
                if result is RoundResult.EVICTED:
                    self._probation()
                if result is RoundResult.FAILED:
                    outcome = self.job.outcome()
                    return self._exit(AgentExit.FAILED, outcome.reason if outcome else "job failed")
        except (TokenRefused, HostIdTaken) as refused:
            return self._exit(AgentExit.REFUSED, str(refused))
        except StoreError as error:
            return self._exit(AgentExit.FAILED, f"rendezvous store error: {error}")
        finally:
            self.notices.__exit__()
            self.spares.kill_all()
            shutil.rmtree(self.host_dir.path, ignore_errors=True)

    def _ended_text(self, ended: JobEnded, after: int) -> str:
        """Why the job ended; one that had ended before this agent took part in any round says so, with when
        and how to go on: a user who changed --epochs must not take an instant exit 0 for training."""
        if after >= 0 or ended.at is None or ended.at >= self._started:
            return ended.reason
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ended.at))
        return (f"job {self.config.job_id!r} had already ended at {when} ({ended.reason}); this agent trained "
                f"nothing. To train on from its commits (more --epochs), start a new --job_id with the same "
                f"--run_dir; to start anew, a new --job_id and a new --run_dir")

    def _report_round(self, round_: Round, ranks: List[int]) -> None:
        """The round's event and log line. Hosts it lost (their lease gone) are the failure's culprit, where the
        survivors' workers only saw a collective fail: rank 0's agent records each as a `host_lost` failure."""
        lost = round_.lost or []
        self.events.write(Event.RENDEZVOUS, round=round_.number, world_size=round_.world_size, ranks=ranks,
                          reason=round_.reason, restarts=round_.restarts, cluster=round_.cluster, lost=lost)
        if 0 in ranks:
            for host in lost:
                self.events.write(Event.FAILURE, round=round_.number - 1, kind=Failure.HOST_LOST.value, rank=None,
                                  code=None, host=host, counted=False, error="its lease expired")
        logging.info("round %d: world size %d, hosts %s, ranks %s here; %s%s (restarts %d)", round_.number,
                     round_.world_size, ",".join(sorted(round_.assignment)), ranks, round_.reason,
                     f"; lost {','.join(lost)} (lease expired)" if lost else "", round_.restarts)

    def _report_training(self, round_: Round, running: List[Worker]) -> None:
        """Logs once a round when this host's first worker shows a training step: the round's restored step is
        one less than the first step a worker reports (it writes that one at once), so the line says where the
        round resumed, to within the steps trained before the agent's next look."""
        first = next((w for w in sorted(running, key=lambda w: w.rank) if w.training), None)
        if first is None or self._training_round == round_.number:
            return
        self._training_round = round_.number
        logging.info("round %d: rank %d trains from about step %d (its first step seen: %d)", round_.number,
                     first.rank, first.last.step - 1, first.last.step)

    def _report_stragglers(self, round_: Round, running: List[Worker]) -> bool:
        """Logs each of this host's workers that the group's probes name a straggler, by its compute or by its
        input, once, and once more when it recovers; returns whether the rules say the group would train more
        without this host (by its compute, or by its input: `stragglers.worth_evicting_for_input`)."""
        for worker in running:
            for cause, slow in (("compute", worker.last.slow if worker.last else 0.0),
                                ("input", worker.last.input_slow if worker.last else 0.0)):
                key = (worker.rank, cause)
                if slow and key not in self._slow:
                    self.events.write(Event.STRAGGLER, round=round_.number, host=self.host_id, rank=worker.rank,
                                      slowness=slow, cause=cause)
                    logging.warning("round %d: rank %d on %s is a straggler: %s (%s)", round_.number, worker.rank,
                                    self.host_id, _STRAGGLER_SAYS[cause] % slow, cause)
                elif not slow and key in self._slow:
                    self.events.write(Event.STRAGGLER_RECOVERED, round=round_.number, host=self.host_id,
                                      rank=worker.rank, cause=cause)
                    logging.info("round %d: rank %d on %s is no longer a straggler (%s)", round_.number, worker.rank,
                                 self.host_id, cause)
                if slow:
                    self._slow[key] = slow
                else:
                    self._slow.pop(key, None)
        self._share_group_probe(running)
        return any(worker.last and worker.last.evict for worker in running)

    def _share_group_probe(self, running: List[Worker]) -> None:
        """Notes the group's median probe (a window's: every rank's heartbeat carries it, once its round had a
        window of probes); the chief's agent publishes each new one in the store, for hosts on probation."""
        seen = next(((w.last.median, w.last.batch, w.last.step_seconds) for w in running
                     if w.last and w.last.median > 0), None)
        if seen is None:
            return
        if not seen[2] and self._group_probe:  # the group's step not known yet this round: the last one known
            seen = (*seen[:2], self._group_probe[2])
        self._group_probe = seen
        if any(w.rank == 0 for w in running) and seen != self._published:
            self.job.publish_probe(*seen)
            self._published = seen

    def _report_standby(self, round_: Round) -> None:
        self.events.write(Event.STANDBY, round=round_.number, host=self.host_id, world_size=round_.world_size)

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

    # One round ----------------------------------------------------------------------------------------
    def _run_round(self, round_: Round, ranks: List[int]) -> RoundResult:
        self._slow.clear()  # a round's stragglers are its own (a rank may be another host's in the next)
        started = [self._start(rank, slot, round_) for slot, rank in enumerate(sorted(ranks))]
        try:
            return self._monitor(round_, started)
        finally:
            self._trained = self._trained or any(worker.training for worker in started)
            for worker in started:
                worker.close()

    def _start(self, rank: int, slot: int, round_: Round) -> Worker:
        heartbeat = self.host_dir.heartbeat(round_.number, rank)
        heartbeat.unlink(missing_ok=True)
        world = {
            "TF_CONFIG": json.dumps({"cluster": {"worker": round_.cluster}, "task": {"type": "worker", "index": rank}}),
            Env.RUN_DIR: self.config.run_dir,
            Env.ROUND: str(round_.number),
            Env.HEARTBEAT_FILE: str(heartbeat),
            Env.HEARTBEAT_TIMEOUT: str(self.config.heartbeat_timeout),
            Env.RESTARTS: str(round_.restarts),
            Env.HOST_ID: self.host_id,
            Env.ERROR_FILE: str(self.host_dir.error_file(round_.number, rank)),
        }
        if self.config.index_log:
            world[Env.INDEX_LOG] = "1"
        process = self._launch(slot, world)
        process.output.assign(round_.number, rank)
        self.events.write(Event.WORKER_START, round=round_.number, rank=rank, worker_pid=process.pid,
                          warm=process.stdin is not None, local_rank=slot)
        return Worker(rank, process, heartbeat)

    def _launch(self, slot: int, world: Dict[str, str]):
        """A worker of local slot `slot` in `world`: the slot's warm spare, else one started now."""
        process = self.spares.take(slot, world)
        if process is None:
            process = workers.spawn(self.config.command, dict(self._slot_env(slot), **world), self._output(),
                                    warm=False)
        return process

    def _slot_env(self, slot: int) -> Dict[str, str]:
        """What every worker of local slot `slot` starts with: this environment less the agent's secrets,
        the slot's devices (set before the worker imports TensorFlow: a warm worker has done so already)."""
        env = {k: v for k, v in os.environ.items() if k not in Env.SECRETS}  # workers never need them
        env.update(self.config.extra_env or {})
        env.update({Env.AGENT_PID: str(os.getpid()), Env.LOCAL_RANK: str(slot),
                    Env.PROBE: self.config.probe.to_text(),
                    Env.EVICT_STRAGGLERS: "1" if self.config.evict_stragglers else "0",
                    Env.STOP_SIGNALS: ",".join(signal.Signals(s).name for s in self.config.preemption_signals)})
        if self.config.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.config.devices[slot]
        return env

    def _output(self) -> WorkerOutput:
        return WorkerOutput(logs_dir(self.config.run_dir, self.host_id), self.config.echo_ranks)

    def _monitor(self, round_: Round, running: List[Worker]) -> RoundResult:
        """Watches the workers and the store until the round ends. While the store is unreachable the
        workers train on; whatever needs the store is retried once it is back."""
        unreachable_since = None
        changed: Collection[str] = ()  # the round was just read; the first wait says what changed since
        while True:
            if self.notices.received:  # before any store call: a notice must be acted on while the store is down
                return self._leave(round_, running)
            try:
                self.rendezvous.renew_if_due()
                result = self._check_round(round_, running, changed)
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
            changed = self.rendezvous.wait_for_change(self.config.monitor_interval, training=round_)
            if unreachable_since is not None:  # what changed while it was unreachable is unknown: read it all
                changed = self.rendezvous.watched_keys(round_)

    def _check_round(self, round_: Round, running: List[Worker], changed: Collection[str]) -> Optional[RoundResult]:
        """One look: observe (worker exit codes, heartbeats, and the store if it `changed`), let
        `decisions` judge, act on the verdict. A verdict whose effects the store failed is not judged
        again: only its effects are carried out again."""
        if self._effects is not None:
            return self._carry_out(self._effects)
        codes = {w.rank: w.process.poll() for w in running}
        own = decisions.own_failure(codes)
        look = self.rendezvous.look(round_, changed)
        result = self._act_on_group(look.change, round_, look.current, running, own)
        if result is not None:
            return result
        for worker in running:
            worker.observe()
        self._report_training(round_, running)
        if self._report_stragglers(round_, running) and self.config.evict_stragglers:
            return self._evict(round_, running)
        self.spares.tend(round_.number, len(running),
                         round_trains=self.config.warm_start and all(w.training for w in running))
        silent = {w.rank for w in running if self._silent(w)}
        stalled = {w.rank for w in running if w.stalled_for() > decisions.progress_timeout(
            self.config.progress_timeout, self.config.progress_floor, w.longest_gap)}
        verdict = decisions.judge_workers(codes, silent, stalled)
        result = self._act_on_workers(verdict, round_, look.current, running, own)
        if result is None and look.lost:
            return self._failure(round_, Failure.HOST_LOST, None, None, host=look.lost[0])
        return result

    def _carry_out(self, effects: Callable[[], RoundResult]) -> RoundResult:
        """Carries out a verdict's `effects` (store writes first, then signals). A `StoreError` leaves them
        for the next look, where they are tried again without judging again: the same dead worker judged
        twice would be counted twice (two start failures "alike", two blacklist strikes)."""
        self._effects = effects
        result = effects()
        self._effects = None
        return result

    def _act_on_group(self, change: GroupChange, round_: Round, current: Optional[Round], running: List[Worker],
                      own: bool) -> Optional[RoundResult]:
        if change is GroupChange.JOB_FAILED:
            return RoundResult.FAILED
        if change is GroupChange.JOB_DONE:
            # Another host's workers finished: ours are finishing too (the last evaluation, the chief's
            # summary). Killing them now would lose that; let them end on their own.
            self._await_exit(running, self.config.stop_grace)
            return RoundResult.SUCCEEDED
        if change is GroupChange.NONE:
            return None
        self.events.write(Event.MEMBERSHIP_CHANGE, round=round_.number,
                          next_round=None if current is None else current.number,
                          reason=None if current is None else current.reason)
        self.blacklist.count(own)
        # After a failure the group is broken and nothing more can be committed: kill at once.
        # After a join or leave, SIGTERM lets the workers agree on a step and commit it.
        logging.info("round %d ends: %s; its workers %s", round_.number,
                     "the group changed" if current is None else f"{current.reason} (round {current.number})",
                     "are killed" if change is GroupChange.RESTARTED else "commit and stop")
        if change is GroupChange.RESTARTED:
            self._kill(running)
        else:
            self._stop(running)
        return RoundResult.RESTART

    def _act_on_workers(self, verdict: WorkersVerdict, round_: Round, current: Round, running: List[Worker],
                        own: bool) -> Optional[RoundResult]:
        if verdict.state is WorkersState.RUNNING:
            return None
        if verdict.state is WorkersState.DONE:
            self.events.write(Event.WORKERS_DONE, round=round_.number, ranks=[w.rank for w in running])
            return RoundResult.SUCCEEDED
        if verdict.state is WorkersState.STOPPED:
            # Stopped on its own (a preemption notice sent straight to the worker).
            self.events.write(Event.WORKER_STOPPED, round=round_.number, rank=verdict.rank)
            return self._carry_out(functools.partial(self._resize, round_, f"rank {verdict.rank} stopped", running))
        failed = next(w for w in running if w.rank == verdict.rank)
        if verdict.state is WorkersState.CONFIG_ERROR:
            cause = self._cause(failed, round_)
            return self._carry_out(functools.partial(
                self._fail_job, f"rank {verdict.rank} on {self.host_id} stopped on a configuration error (exit code "
                                f"{verdict.code}); a restart cannot fix it: {cause or 'see the worker log'}",
                round=round_.number, kind=Failure.CONFIG_ERROR.value, rank=verdict.rank, code=verdict.code,
                **_account(cause, self._traceback(failed, round_))))
        alike = self._failed_alike_before_start(failed, verdict, round_)
        if alike is not None:
            return self._carry_out(functools.partial(
                self._fail_job, f"rank {verdict.rank} on {self.host_id} exited with code {verdict.code} before its "
                                f"first step on {len(self._start_failures)} tries in a row: {alike}",
                round=round_.number, kind=Failure.WORKER_EXIT.value, rank=verdict.rank, code=verdict.code,
                **_account(alike, self._traceback(failed, round_))))
        cause = self._cause(failed, round_)  # before a hung worker is killed: its signal would read as the cause
        if verdict.failure in (Failure.HANG, Failure.NO_PROGRESS):
            # A stalled main thread says where it is stuck (a silent heartbeat: stopped or frozen, most likely).
            workers.dump_stacks([failed.process] if verdict.failure is Failure.NO_PROGRESS else [])
            workers.kill(failed.process)
            # A silent heartbeat is this worker's own; no progress is not always: one blocked main thread
            # stalls every peer in its next collective, and each agent sees a stall. Not blaming a stall on
            # the host keeps healthy peers out of the blacklist; the restart still counts.
            own = verdict.failure is Failure.HANG
        return self._failure(round_, verdict.failure, verdict.rank, verdict.code, own=own, cause=cause,
                             traceback=self._traceback(failed, round_))

    def _resize(self, round_: Round, reason: str, running: List[Worker]) -> RoundResult:
        """Effects of a change that is no failure: the next round opens, our workers commit and stop."""
        self.rendezvous.open_after(round_.number, reason=reason, failure=False)
        self._stop(running)
        return RoundResult.RESTART

    def _fail_job(self, reason: str, **failure) -> RoundResult:
        """Effects of a failure no restart can fix: the job's outcome, then the failure's event."""
        self.job.finish(JobStatus.FAILED, reason)
        self.events.write(Event.FAILURE, host=self.host_id, counted=False, **failure)
        return RoundResult.FAILED

    def _traceback(self, worker: Worker, round_: Round) -> Optional[List[str]]:
        """The last traceback lines a worker that raised wrote to its error file (None: it did not raise)."""
        record = read_error_file(self.host_dir.error_file(round_.number, worker.rank))
        return (record or {}).get("traceback") or None

    def _cause(self, worker: Worker, round_: Round) -> Optional[str]:
        """Why an exited worker ended: the signal that killed it, else its error file (`Env.ERROR_FILE`), else
        its last line on stderr. None while it runs (a hang: the agent kills it)."""
        code = worker.process.poll()
        if code is None:
            return None
        if code < 0:  # its last line on stderr would be whatever it last logged, not why it ended
            workers.finish_output(worker.process)
            return f"killed by {signal.Signals(-code).name}"
        record = read_error_file(self.host_dir.error_file(round_.number, worker.rank))
        if record is not None:
            return error_record_line(record)
        return workers.last_error_line(worker.process)

    def _failed_alike_before_start(self, worker: Worker, verdict: WorkersVerdict, round_: Round) -> Optional[str]:
        """The error line, when this host's workers, none of which ever trained in this job, failed the same
        way before their first step on their last tries (`decisions.repeated_start_failure`: an import
        error, a bad flag): the job ends, naming it. A host whose workers trained before and then fail
        goes the elastic way instead (restarts, its blacklist): its environment may be what broke."""
        if worker.training or verdict.failure is not Failure.WORKER_EXIT or self._trained:
            self._start_failures = []
            return None
        # A signal from outside (a kill, the OOM killer) says nothing of the next start: never "alike".
        self._start_failures.append(None if worker.process.wait() < 0 else self._cause(worker, round_))
        return decisions.repeated_start_failure(self._start_failures)

    def _failure(self, round_: Round, kind: Failure, rank: Optional[int], code: Optional[int],
                 host: Optional[str] = None, own: bool = False, cause: Optional[str] = None,
                 traceback: Optional[List[str]] = None) -> RoundResult:
        """A counted failure: judged here once (the blacklist's count), carried out until the store answers."""
        self.blacklist.count(own)
        # Name only what is known: a lost host has no rank, a hang no exit code.
        known = ([kind.value] + ([f"rank={rank}"] if rank is not None else []) + [f"host={host or self.host_id}"]
                 + ([f"code={code}"] if code is not None else []))
        reason = " ".join(known) + (f": {cause[:200]}" if cause else "")
        return self._carry_out(functools.partial(
            self._restart_after_failure, round_, reason, round=round_.number, kind=kind.value, rank=rank, code=code,
            host=host or self.host_id, **_account(cause, traceback)))

    def _restart_after_failure(self, round_: Round, reason: str, **failure) -> RoundResult:
        """Effects of a counted failure: the next round opens (counted by whoever opens it), then the event."""
        counted = self.rendezvous.open_after(round_.number, reason=reason, failure=True)
        self.events.write(Event.FAILURE, counted=counted, **failure)
        logging.warning("round %d: %s", round_.number, reason)
        return RoundResult.RESTART

    def _silent(self, worker: Worker) -> bool:
        """No heartbeat for heartbeat_timeout once training, or no first step within startup_timeout."""
        if worker.process.poll() is not None:
            return False
        limit = self.config.heartbeat_timeout if worker.training else self.config.startup_timeout
        return worker.silent_for() > limit

    def _leave(self, round_: Round, running: List[Worker]) -> RoundResult:
        """A notice: leaves the job (`_step_out`), unless a verdict judged before it must be carried out."""
        self.notices.report()
        if self._effects is not None:  # a verdict judged before the notice: a failed job must not end as a leave
            try:
                return self._carry_out(self._effects)
            except StoreError as error:
                logging.warning("leaving before a failure's effects reached the store (%s)", error)
        stopped = self._step_out(round_, running, "leave")
        self.events.write(Event.LEAVE, round=round_.number, host=self.host_id,
                          seconds_after_notice=self.notices.seconds_since())
        logging.info("round %d: %s left the job (%s); its workers %s", round_.number, self.host_id,
                     self.notices.what or "asked to leave", "committed and stopped" if stopped else
                     "were killed after the stop grace: steps since their last commit are lost")
        return RoundResult.LEFT

    def _step_out(self, round_: Round, running: List[Worker], why: str) -> bool:
        """Opens the next round without this host (so the others stop at an agreed step too), stops our workers,
        who commit, and gives up the lease. With the store unreachable the workers still stop and commit: the
        others see this host go once its lease expires. Whether our workers stopped on their own (`_stop`)."""
        try:
            self.rendezvous.open_after(round_.number, reason=f"{why} {self.host_id}", failure=False, leaving=True)
        except StoreError as error:
            logging.warning("%s while the rendezvous store is unreachable (%s)", why, error)
        stopped = self._stop(running)
        self._release_lease()
        return stopped

    def _evict(self, round_: Round, running: List[Worker]) -> RoundResult:
        """`--evict_stragglers`: this host is the straggler the group is better off without. It leaves as on a
        notice (the others stop at an agreed step and commit; nothing is lost) and then sits out a hold-off."""
        self.evictions += 1
        seconds = stragglers.hold_off(self.evictions, self.config.straggler_hold_off)
        self._step_out(round_, running, "evict")
        said = eviction_cause(self._slow)
        self.events.write(Event.EVICTED, round=round_.number, host=self.host_id, hold_off=seconds,
                          evictions=self.evictions, **said)
        logging.warning("round %d: %s leaves as a straggler by its %s (eviction %d); it may rejoin in %.0fs",
                        round_.number, self.host_id, said["cause"], self.evictions, seconds)
        self._slow.clear()
        return RoundResult.EVICTED

    def _probation(self) -> None:
        """An evicted host sits out its hold-off, then times its own pass against the group's median probe,
        and its input read alone against the group's seconds per step (`probation.OwnPass`), again every
        --probation_interval while either is not back within the straggler factor (on a host of its own a
        timing costs the group nothing; what the doubling of the hold-off at each eviction prevents is a
        rejoin that the group pays for). The warm spares the timing's workers took are started again after
        the first timing and are ready before the next (their imports beside it would slow it). Returns when
        it may rejoin, on a notice, or once the job ended (the next join says how)."""
        own: Optional[probation.OwnPass] = None
        wait = stragglers.hold_off(self.evictions, self.config.straggler_hold_off)
        try:
            while self._sit_out(wait):
                try:
                    group = self.job.group_probe() or self._group_probe
                except StoreError:
                    group = self._group_probe
                if group is not None and (own is None or not own.running or own.batch != group[1]):
                    if own is not None:
                        own.close()  # the group's batch changed, or a timing ended its workers: start afresh
                    own = probation.OwnPass(self._launch_for_probation, self.host_dir, self.config.nproc, group[1],
                                            self.config.heartbeat_timeout)
                if self.config.warm_start:
                    self.spares.wait_ready(self.config.startup_timeout, self.config.monitor_interval,
                                           cancelled=lambda: self.notices.received)
                if self._judge(own if group is not None else None, group) or self.notices.received:
                    return
                if self.config.warm_start:
                    self.spares.fill(self.config.nproc)
                wait = self.config.probation_interval
        finally:
            if own is not None:
                own.close()

    def _judge(self, own: Optional[probation.OwnPass], group: Optional[Tuple[float, int, float]]) -> bool:
        """Times this host on probation (`own`) against the `group`'s (median probe, batch, step), says so
        (a `probation` event, and a log line: a warning where it stays out), and whether it rejoins now
        (once its warm spares are ready: the group must not wait for this host's cold start); not after a
        notice (the timing it cut short judges nothing)."""
        own_pass, read = (own.time(self.config.startup_timeout, cancelled=lambda: self.notices.received)
                          if own is not None else None) or (None, None)
        if self.notices.received:
            return False
        median, step = group[0::2] if group else (None, None)
        factor = self.config.probe.rules.factor
        back = stragglers.back_within(own_pass, median, factor) and stragglers.back_within(read, step, factor)
        late = own_pass == math.inf  # still starting or timing at --startup_timeout: too slow to time
        self.events.write(Event.PROBATION, host=self.host_id, seconds=None if late else own_pass, median=median,
                          input_seconds=None if late or read == math.inf else read, step_seconds=step,
                          back=back, late=late, evictions=self.evictions,
                          hold_off=0.0 if back else self.config.probation_interval)
        measured = (f"longer than --startup_timeout={self.config.startup_timeout:g}s to start and time" if late
                    else f"{own_pass:.4f}s, its input {_seconds_or_why(read)} a step," if own_pass
                    else "(not measured)")
        logging.log(logging.INFO if back else logging.WARNING, "%s on probation: its pass takes %s against the "
                    "group's median %s and %s a step: %s", self.host_id, measured,
                    f"{median:.4f}s" if median else "(none)", f"{step:.4f}s" if step else "(none)",
                    "it rejoins" if back else f"it times again in {self.config.probation_interval:g}s")
        if back and self.config.warm_start:
            self.spares.fill(self.config.nproc)
            self.spares.wait_ready(self.config.startup_timeout, self.config.monitor_interval,
                                   cancelled=lambda: self.notices.received)
        return back

    def _launch_for_probation(self, slot: int, world: Dict[str, str]):
        process = self._launch(slot, world)
        process.output.assign_probation(slot)
        return process

    def _sit_out(self, seconds: float) -> bool:
        """Waits `seconds` out of the job (no lease: no round waits for this host); False if it ended early, on
        a notice or because the job ended (the next join says how)."""
        deadline = time.time() + seconds
        while time.time() < deadline and not self.notices.received:
            try:
                if self.job.outcome() is not None:
                    return False
            except StoreError:
                pass  # the join after the hold-off retries the store and reports it
            time.sleep(min(1.0, max(0.0, deadline - time.time())))
        return not self.notices.received

    def _release_lease(self) -> None:
        try:
            self.rendezvous.leave()
        except StoreError:
            pass  # unreachable: the lease expires within host_ttl

    def _withdraw(self, after: int) -> None:
        """`Rendezvous.withdraw`: leaves while joining, without costing the others a counted restart."""
        try:
            self.rendezvous.withdraw(after)
        except (StoreError, HostIdTaken):
            pass  # unreachable (the lease expires within host_ttl), or no longer ours

    # Processes ---------------------------------------------------------------------------------------
    def _stop(self, running: List[Worker]) -> bool:
        """SIGTERM (workers commit at their next step boundary and exit), SIGKILL after the grace period
        (their threads' stacks in their logs first). Whether every worker stopped on its own."""
        for worker in running:
            if worker.running():
                workers.signal_group(worker.process, signal.SIGTERM)
        self._await_exit(running, self.config.stop_grace)
        ignored = [worker for worker in running if worker.running()]
        told = workers.dump_stacks([worker.process for worker in ignored])  # one wait for all of them
        for worker in ignored:
            logging.warning("rank %d ignored SIGTERM for %.0fs; killing it%s", worker.rank, self.config.stop_grace,
                            " (the threads' stacks of those that catch SIGQUIT are in their logs)" if told else "")
        self._kill(running)
        return not ignored

    def _await_exit(self, running: List[Worker], grace: float) -> None:
        """Waits up to `grace` seconds for the workers (their whole process groups) to exit, renewing this
        host's lease meanwhile."""
        deadline = time.monotonic() + grace
        while any(w.running() for w in running) and time.monotonic() < deadline:
            try:
                self.rendezvous.renew_if_due()  # still alive while we wait: others must not count this host lost
            except (StoreError, HostIdTaken):
                pass  # reported where the agent next needs the store; the workers still commit and exit
            time.sleep(self.config.monitor_interval)

    @staticmethod
    def _kill(running: List[Worker]) -> None:
        for worker in running:
            worker.close()

    def _exit(self, code: AgentExit, reason: str) -> int:
        self.notices.report()
        self.events.write(Event.EXIT, code=int(code), reason=reason, host=self.host_id)
        (logging.info if code == AgentExit.OK else logging.error)("tf_elastic agent %s: %s", self.host_id, reason)
        return int(code)


def eviction_cause(slow: Dict[Tuple[int, str], float]) -> Dict[str, object]:
    """What the `evicted` event says of why, from this host's stragglers ((rank, cause) -> slowness): `cause`
    "compute", "input" or, a host straggling by both, "compute and input" ("unknown" where a heartbeat said
    to leave before it said why); `slowness` the slowest rank's by
    its compute where that is a cause, else by its input; `input_slowness` too where both are."""
    by_cause: Dict[str, float] = {}
    for (_, cause), slowness in slow.items():
        by_cause[cause] = round(max(slowness, by_cause.get(cause, 0.0)), 3)
    said: Dict[str, object] = {"cause": " and ".join(sorted(by_cause)) or "unknown",
                               "slowness": by_cause.get("compute", by_cause.get("input", 0.0))}
    if len(by_cause) == 2:
        said["input_slowness"] = by_cause["input"]
    return said


def _account(error: Optional[str], traceback: Optional[List[str]]) -> Dict[str, object]:
    """A failure event's account of its cause: `error` (one line) and the raising worker's `traceback`."""
    return {**({"error": error} if error else {}), **({"traceback": traceback} if traceback else {})}
