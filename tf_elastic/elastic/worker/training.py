"""`fit`: trains a compiled Keras model with `model.fit` from the last commit, at any world size.

It feeds each worker its exact share of the rest of the epoch, commits on cadence at steps all
workers agree on, and raises instead of ending the process: `StopRequested` after a SIGTERM (state
committed), `PeerFailure` when a collective fails, `ConfigurationError` for bad input.
"""
import contextlib
import dataclasses
import os
import signal
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple, Union

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import Env, Event, ExitCode, RunDir, error_line
from tf_elastic.elastic.worker import consumed, entry, keras_compat
from tf_elastic.elastic.worker.cadence import AgreementCadence
from tf_elastic.elastic.worker.commit import CommittedState
from tf_elastic.elastic.worker.durable import NO_COMMIT, DurableCopies
from tf_elastic.elastic.worker.data import (ArraySource, ImageFiles, Preprocess, Source, describe_error, evaluation,
                                            pipeline)
from tf_elastic.elastic.worker.data.dataset_feed import DatasetFeed
from tf_elastic.elastic.worker.data.planned_feed import PlannedFeed
from tf_elastic.elastic.worker.data.pydataset_feed import PyDatasetFeed
from tf_elastic.elastic.worker.entry import COLLECTIVE_FAILURES
from tf_elastic.elastic.worker.errors import ConfigurationError, PeerFailure, StopRequested
from tf_elastic.elastic.worker.group import GroupState, SumOverWorkers, sum_over_workers
from tf_elastic.elastic.stragglers import ProbeSettings
from tf_elastic.elastic.worker.probe import GroupProbe, time_alone
from tf_elastic.elastic.worker.replicas import StatisticsAverage, statistics
from tf_elastic.elastic.worker.world import World, exit_now, report_activity, report_progress
from tf_elastic.schedules import BatchResizeSchedule

@dataclasses.dataclass(frozen=True)
class FitConfig:
    """How `fit` commits and agrees, beyond what `model.fit` takes.

    Commits happen every `commit_every_steps` (0: only at epoch ends) and, if set, once
    `commit_every_seconds` passed; workers agree on stops and time-based commits every `sync_every_steps`
    steps, or about every `sync_every_seconds` where steps are quicker (an agreement is a collective of its
    own: see `cadence`; None: every `sync_every_steps`).
    `seed` orders the data. The chief copies every `durable_every_commits`-th commit (0: none) and the last
    one to `checkpoint_dir` (any `tf.io.gfile` filesystem; default `RUN_DIR/durable`), for a restart of the
    whole job.
    """
    commit_every_steps: int = 100
    commit_every_seconds: Optional[float] = None
    sync_every_steps: int = 5
    sync_every_seconds: Optional[float] = 0.5
    seed: int = 0
    checkpoint_dir: Optional[str] = None
    durable_every_commits: int = 10

    def __post_init__(self):
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigurationError(f"seed must be a whole number >= 0 (it draws each epoch's order); got "
                                     f"{self.seed!r}.")
        if self.commit_every_steps < 0 or self.sync_every_steps < 1 or self.durable_every_commits < 0:
            raise ConfigurationError(f"commit_every_steps >= 0, sync_every_steps >= 1 and durable_every_commits >= 0 "
                                     f"are needed; got {self.commit_every_steps}, {self.sync_every_steps}, "
                                     f"{self.durable_every_commits}.")
        for name in ("commit_every_seconds", "sync_every_seconds"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigurationError(f"{name} must be > 0 (or None); got {getattr(self, name)}.")


class ProgressCallback(keras.callbacks.Callback):
    """Tells the agent's progress watchdog that evaluation (or prediction) moves on, and brackets each
    evaluation with `evaluation_begin` / `evaluation_end` events, so that `launch.report` counts its time
    apart from training: pass it to `model.evaluate` after `fit`, which reports training steps and commits
    itself. Outside `elastic.run` (no run dir) it writes no events."""

    def __init__(self, events: Optional[EventLog] = None, world: Optional[World] = None):
        super().__init__()
        context = entry.current()
        self._world = world or (context.world if context else None)
        self._events = events or (EventLog(context.run_dir, f"worker:{context.world.rank}") if context else None)

    def on_test_begin(self, logs=None):
        self._write(Event.EVALUATION_BEGIN)

    def on_test_end(self, logs=None):
        self._write(Event.EVALUATION_END)

    def _write(self, event: Event) -> None:
        if self._events is not None:
            self._events.write(event, round=self._world.round, rank=self._world.rank)

    def on_test_batch_end(self, batch, logs=None):
        report_activity()

    def on_predict_batch_end(self, batch, logs=None):
        report_activity()


class _ElasticCallback(ProgressCallback):
    """Hands Keras's epoch and batch boundaries to the trainer; `fit`'s validation batches are progress."""

    def __init__(self, trainer: "_ElasticTrainer"):
        super().__init__(trainer.events, trainer.world)
        self.trainer = trainer

    def on_epoch_begin(self, epoch, logs=None):
        self.trainer.begin_epoch(epoch)

    def on_train_batch_end(self, batch, logs=None):
        self.trainer.end_step(batch, logs or {})

    def on_epoch_end(self, epoch, logs=None):
        self.trainer.end_epoch(epoch, logs if logs is not None else {})


class _EpochEdges(keras.callbacks.Callback):
    """The last of the callbacks: at an epoch's begin the steps ask for its input from here (the time of the
    callbacks before is no wait for it); at its end it commits, once the user's callbacks have had their say."""

    def __init__(self, trainer: "_ElasticTrainer"):
        super().__init__()
        self.trainer = trainer

    def on_epoch_begin(self, epoch, logs=None):
        self.trainer.feed.epoch_begins()

    def on_epoch_end(self, epoch, logs=None):
        self.trainer.commit_epoch(epoch)


# What a worker's steps read: one small interface (see planned_feed.py).
Feed = Union[PlannedFeed, DatasetFeed, PyDatasetFeed]
# Errors of the input that a restart would meet again: `fit` ends with `ConfigurationError` (exit 78).
BAD_INPUT = (tf.errors.InvalidArgumentError, tf.errors.PermissionDeniedError, tf.errors.UnauthenticatedError)


class _ElasticTrainer:
    """Exact data positions, commits on cadence, and stops at the same step on every worker."""

    def __init__(self, *, model: keras.Model, feed: Feed, world: World, strategy: tf.distribute.Strategy,
                 state: CommittedState, config: FitConfig, events: EventLog, sum_fn: SumOverWorkers,
                 group: Optional[GroupState], schedule: Optional[BatchResizeSchedule]):
        self.model, self.feed, self.group, self.schedule = model, feed, group, schedule
        self.average_statistics = StatisticsAverage(strategy, statistics(model.variables))
        self.validation = _Validation(None, 1)
        self.world, self.strategy = world, strategy
        self.state, self.config, self.events = state, config, events
        self.sum_over_workers = sum_fn
        self.step = 0  # from the agreed commit, at `restored`
        self.last_commit = time.time()
        self.epoch_began = time.time()
        self.stop_requested = self.stopped = False
        self.first_step_logged = False
        self.last_loss = None
        self.probe = GroupProbe(model, strategy, world, ProbeSettings.from_text(world.probe))
        # The epoch's `model.fit` counts an optimizer iteration too many where its data runs out (`_train`).
        self.iterations_counted = keras_compat.IterationsThatCountSteps(model.optimizer, lambda: 0, False)
        self.probe.input_wait = feed.take_input_wait  # when the step waited for its batches
        self.probe.time_input = feed.time_input  # its input read alone, while another's holds the group back
        # Alone, an agreement is no collective: every `sync_every_steps` costs nothing.
        self.cadence = AgreementCadence(config.sync_every_steps, config.sync_every_seconds if world.size > 1 else None,
                                        world.is_chief)

    @property
    def epoch(self) -> int:
        return self.feed.epoch

    @property
    def global_batch(self) -> int:
        return self.feed.global_batch

    def check_same_data(self) -> None:
        """Every worker sees the data this one sees (one sum over the workers, a slot each)."""
        slots = [0.0] * (2 * self.world.size)
        slots[2 * self.world.rank: 2 * self.world.rank + 2] = self.feed.identity()
        seen = np.asarray(self.sum_over_workers(slots)).reshape(-1, 2)
        other = next((rank for rank, row in enumerate(seen) if tuple(row) != tuple(seen[0])), None)
        if other is not None:
            raise ConfigurationError(
                f"the workers see different training data: rank 0 {_data_text(*seen[0])}, rank {other} "
                f"{_data_text(*seen[other])}: give every host the same files (and a tf.data pipeline whose order "
                "is repeatable: seeded, no deterministic=False).")

    def restored(self) -> None:
        """The group agreed on its starting commit: positions and the schedule's batch history follow it."""
        committed, data = self.state.data, self.feed.committed_data()
        if self.state.held != NO_COMMIT and committed != data:
            raise ConfigurationError(
                f"the training data differs from the data of the commit of step {self.state.step}: it has "
                f"{_data_text(*data)}, the commit {_data_text(*committed)}: "
                "restart on the same data (a PyDataset's order too: shuffle, FitConfig.seed), or start a new run "
                "(another run dir) for new data.")
        self.step = self.state.step
        self.cadence.start(self.step)
        saved = self.state.input_state.numpy() if self.state.input_state is not None else b""
        if self.state.input_state is not None and not saved and self.group is not None and self.world.size > 1:
            # Nothing committed: the chief's fresh pipeline (its shuffles' seeds) for all, seeded or not.
            self.feed.restore(self.state.epoch, self.state.samples, b"")
            saved = self.group.hand_on(self.feed.state() if self.world.is_chief else b"", 0)
        self.feed.restore(self.state.epoch, self.state.samples, saved)
        if self.state.input_state is not None:
            self.check_same_data()  # a pipeline's stream, now that it is positioned
        if self.schedule is not None:
            self.schedule.resize(self.state.step, self.global_batch)
        # Traced here, not at the first commit (seconds for a ResNet under MWMS, which the progress watchdog
        # would see as a stall): the agreed state is the same everywhere, so averaging keeps every bit.
        self.average_statistics()
        if self.group is not None:
            self.group.check("at the round's start")

    def record_consumption(self) -> None:
        """Test mode (`--index_log`): every replica writes the indices its steps train (`consumed`)."""
        if getattr(self.feed, "index_log", None) is not None:
            spec = self.feed.pipeline(np.zeros([0], np.int64), 1).element_spec
            with self.strategy.scope():
                consumed.record_steps(self.model, RunDir(self.world.run_dir).consumed_log(
                    self.world.round, self.world.rank), spec)

    # Callback hooks ------------------------------------------------------------------------------
    def begin_epoch(self, epoch: int) -> None:
        self.epoch_began = time.time()
        self.steps_in_call = 0

    def end_step(self, batch: int, logs: Dict) -> None:
        """Keras ended the call's step `batch` (0-based): with `compile(steps_per_execution=k)` it calls once
        for k steps, so every step up to `batch` is counted here."""
        self.last_loss = logs.get("loss")
        before = self.step
        counted = self.feed.trained(batch + 1 - self.steps_in_call, self.step + 1)
        self.steps_in_call += counted
        self.step += counted
        report_progress(self.step)
        if not self.first_step_logged:
            self.first_step_logged = True
            self.events.write(Event.FIRST_STEP, round=self.world.round, rank=self.world.rank, step=self.step,
                              world_size=self.world.size, examples=self.feed.examples,
                              global_batch=self.global_batch)
            self.probe.first_step(self.global_batch // self.strategy.num_replicas_in_sync)
        commit = _crossed(before, self.step, self.config.commit_every_steps)
        if self.cadence.due(self.step):
            stop, due = self._agree(self.stop_requested, self._commit_due())
            commit, self.stopped = commit or due or stop, stop
        # The epoch's last step commits at the epoch's end (a stop too): its validation and end come first.
        if commit and not self.feed.finished():
            self.commit(self.epoch, self.feed.position())
        if self.stopped:
            self.model.stop_training = True

    def end_epoch(self, epoch: int, logs: Dict) -> None:
        """Keras ended the epoch (first of the callbacks): its event, and validation, whose logs the user's
        callbacks then see, as `model.fit` validates an epoch a user's callback stopped too. The epoch-end
        commit comes after them (`commit_epoch`); a user's stop mid-epoch commits here, an agreed stop (a
        SIGTERM: committed at its step, its grace short) mid-epoch validates nothing."""
        self.iterations_counted.take_back()  # before validation, the user's callbacks and the commit see it
        finished = self.feed.finished()
        if self.stopped and not finished:
            return
        if finished:
            self._epoch_done(epoch)
        if self.validation.due(epoch):
            self.average_statistics()  # every worker evaluates one model
            logs.update(self.validation.run(self.model, ProgressCallback(self.events, self.world)))
        if not finished:  # a callback of the user's stopped training mid-epoch
            self.commit(epoch, self.feed.position(), early_stop=True)

    def _epoch_done(self, epoch: int) -> None:
        if self.world.is_chief:
            seconds, (probes, traces) = time.time() - self.epoch_began, self.probe.take_spent()
            self.events.write(Event.EPOCH_END, round=self.world.round, epoch=epoch, steps=self.steps_in_call,
                              seconds=round(seconds, 4), world_size=self.world.size, probe_seconds=round(probes, 4),
                              probe_trace_seconds=round(traces, 4))
            logging.info("epoch %d done: world size %d, global batch %d, learning rate %.4g, loss %.4f, %.1fs",
                         epoch + 1, self.world.size, self.global_batch, _learning_rate(self.model),
                         float(self.last_loss or 0.0), seconds)
        skipped = self.feed.skipped()
        if skipped:
            self.events.write(Event.REMAINDER_SKIPPED, epoch=epoch, samples=skipped, rank=self.world.rank)

    def commit_epoch(self, epoch: int) -> None:
        """After every callback of the epoch's end: the commit holds what they decided too (a user's early
        stop, a learning rate ReduceLROnPlateau lowered)."""
        if not self.feed.finished():
            return  # stopped mid-epoch: committed at the step already
        self.feed.next_epoch()
        self.commit(epoch + 1, 0, early_stop=self.model.stop_training and not self.stopped)

    # Commit and agreement ------------------------------------------------------------------------
    def commit(self, epoch: int, samples: int, early_stop: bool = False) -> None:
        """Commits on every worker. The chief's `commit` event, the promise that this step survives the loss of
        any host, is written only once the commit is in force on every host that keeps commits (learnt at the
        next agreement): `seconds` is what the training step paid for the write, `check_seconds` for averaging
        the replicas' statistics and comparing every variable across workers, `in_force_seconds` the time
        until the chief's state file named it, `everywhere_seconds` until it was known in force everywhere."""
        fields, started = None, time.perf_counter()
        self.state.check_unchanged()
        self.average_statistics()
        if self.group is not None:
            self.group.check(f"before the commit of step {self.step}")
        if self.world.is_chief:
            fields = dict(round=self.world.round, step=self.step, epoch=epoch, samples=samples,
                          loss=None if self.last_loss is None else float(self.last_loss),
                          learning_rate=_learning_rate(self.model), world_size=self.world.size,
                          global_batch=self.global_batch, check_seconds=round(time.perf_counter() - started, 4))
        if self.state.input_state is not None:
            self.state.input_state.assign(self.feed.state())
        self.state.commit(epoch, samples, self.step, self.global_batch, announce=fields, started=started,
                          data=self.feed.committed_data(), early_stop=early_stop)
        report_activity()
        self.last_commit = time.time()

    def _commit_due(self) -> bool:
        every = self.config.commit_every_seconds
        return bool(every) and time.time() - self.last_commit >= every

    def _agree(self, stop: bool, commit: bool) -> Tuple[bool, bool]:
        """If any worker wants to stop or commit, all do, at this same step. The same sum carries each worker's
        newest commit in force (a slot per rank), so the chief can announce the commits every host holds,
        and the straggler probe: whether one is due, and the times of the last one (`probe.GroupProbe`), and
        the chief's interval to the next agreement (`cadence`)."""
        values = [float(stop), float(commit), self.probe.due(), self.cadence.proposal(self.step)]
        stops, commits, due, interval, *probed = self._sum_with_in_force(values + self.probe.slots())
        self.cadence.agreed(self.step, interval)
        self.probe.after_agreement(due > 0, probed)
        return stops > 0, commits > 0

    def announce_commits(self) -> None:
        """At the end (every worker calls it, after the commit thread is done): announces what is in force."""
        self._sum_with_in_force([])

    def _sum_with_in_force(self, values: List[float]) -> List[float]:
        slots = [0.0] * self.world.size
        slots[self.world.rank] = self.state.log.in_force
        total = self.sum_over_workers(values + slots)
        self.state.log.in_force_everywhere(min(total[len(values):]))
        return list(total[:len(values)])

    def remaining_epochs(self, epochs: int) -> List[int]:
        """The epochs still to train, from the restored one. If less than one global batch of a restored
        partial epoch is left at this world size (a commit at the epoch's last step restored into a larger
        world, or the epoch-end commit lost), that is the remainder every epoch skips: go on with the next."""
        if self.feed.nothing_left():
            self.events.write(Event.REMAINDER_SKIPPED, epoch=self.epoch, rank=self.world.rank,
                              samples=self.feed.skipped())
            self.feed.next_epoch()
        if self.state.early_stopped or self.epoch >= epochs:
            if self.world.is_chief:  # a second run of a finished script must say so
                logging.warning("training is already complete: the commit in %s is at epoch %d of %d (step %d%s); "
                                "nothing to train. %s", self.state.directory, self.epoch, epochs, self.step,
                                ", where a callback stopped it early" if self.state.early_stopped else "",
                                "Another run dir starts anew." if self.state.early_stopped else
                                "Give more epochs to train on, or another run dir to start anew.")
            return []
        return list(range(self.epoch, epochs))

    def close(self) -> None:
        if getattr(self.feed, "index_log", None) is not None:
            self.feed.index_log.close()
        if isinstance(self.feed, DatasetFeed):
            self.feed.close()  # its last reader's thread, which a stop mid-epoch leaves waiting


def fit(model: keras.Model, x: Union[np.ndarray, Source, Sequence[Tuple[str, int]]], y: Optional[np.ndarray] = None,
        *, batch_size: Optional[int] = None, per_replica_batch_size: Optional[int] = None, epochs: int = 1,
        verbose="auto", callbacks: Optional[Sequence[keras.callbacks.Callback]] = None, validation_data=None,
        validation_freq: Union[int, Sequence[int]] = 1, class_weight: Optional[Dict[int, float]] = None,
        validation_split: float = 0.0, validation_steps: Optional[int] = None,
        validation_batch_size: Optional[int] = None, shuffle: bool = True, sample_weight=None,
        initial_epoch: int = 0, steps_per_epoch: Optional[int] = None,
        preprocess: Optional[Preprocess] = None, validation_preprocess: Optional[Preprocess] = None,
        config: Optional[FitConfig] = None, schedule: Optional[BatchResizeSchedule] = None,
        world: Optional[World] = None, strategy: Optional[tf.distribute.Strategy] = None,
        run_dir: Optional[str] = None) -> keras.callbacks.History:
    """`model.fit` for a compiled model, from the last commit, at any world size; returns the `History`.

    As in `model.fit`: `epochs`, `verbose`, `callbacks`, `validation_data` (an `(x, y)` or `(x, y,
    sample_weight)` tuple of arrays, a `Source`, or any batched `tf.data.Dataset` whose batch is the global
    batch, as `model.fit` takes it under a strategy; the workers share it, each example evaluated once, and
    every worker reports the whole set's metrics), `validation_freq`, `validation_split` (the last part of
    in-memory arrays, as `model.fit` splits it), `validation_steps` (global batches), `validation_batch_size`
    (default: the global batch), `class_weight`, `sample_weight` (with in-memory arrays: a dataset or a
    source carries its own weights), and `batch_size`, the global batch, constant at every world size (which
    must divide it); or `per_replica_batch_size`: the global batch follows the world (Dynamic SGD). Default:
    a global batch of 32. `shuffle` is ignored with a tf.data dataset, as by `model.fit`; with a PyDataset
    it reads each epoch's batches in an order drawn from `FitConfig.seed` and the epoch (False: in order).
    Refused, in one line saying why (`_refuse_what_fit_cannot_honour`): `shuffle=False` with arrays or a
    source, `initial_epoch` and `steps_per_epoch`. The returned
    `History` holds the epochs this process trained: after a restart, from the restored epoch on (a partial
    epoch's logs cover its rest only); `events.jsonl` has the whole run.

    `x`: a `tf.data.Dataset` of global batches (`(x, y)` or `(x, y, sample_weight)`, any structure; `y`,
    `batch_size` and `class_weight` None), read whole by every worker, each keeping its replicas' rows
    (`DatasetFeed`: the global batches of a run without faults, in its order, through any resize); or
    in-memory arrays `x` with targets `y` (each an array, or a dict, list or tuple of arrays, as `model.fit`
    takes them), a list of `(image path, label)` pairs, or a `data.Source` (`y` None), of which each worker
    reads its share by plan (`PlannedFeed`). Each step trains exactly one global batch, split over the
    replicas of the moment; `compile(steps_per_execution=k)` is taken. `preprocess(features, target, seed)`
    runs per example of a source before batching (default: none for arrays, uint8 images to float in
    [0, 1] for sources); `validation_preprocess` likewise.

    The world, strategy and run dir are `elastic.run`'s (pass them to run without it); the schedule is the
    optimizer's learning rate when it is a `BatchResizeSchedule`. The optimizer is built here, before the
    state to commit is captured. Raises `StopRequested` after a SIGTERM (committed at the next agreed
    step), `PeerFailure` when a collective failed and `ConfigurationError` for input a restart cannot fix."""
    keras_compat.install_fit_fix()
    world, strategy, run_dir = _context(world, strategy, run_dir)
    config, schedule = config or FitConfig(), schedule_of(model.optimizer, schedule)
    is_dataset = isinstance(x, (tf.data.Dataset, keras.utils.PyDataset))
    _refuse_what_fit_cannot_honour(shuffle=True if is_dataset else shuffle, initial_epoch=initial_epoch,
                                   steps_per_epoch=steps_per_epoch)
    x, y, sample_weight, validation_data = _split_off_validation(x, y, sample_weight, validation_data, validation_split)
    _require_counts(epochs=epochs, validation_steps=validation_steps, validation_batch_size=validation_batch_size)
    feed, global_batch = _training_feed(x, y, sample_weight, world, strategy, config.seed, batch_size=batch_size,
                                        per_replica_batch_size=per_replica_batch_size, class_weight=class_weight,
                                        preprocess=preprocess, shuffle=shuffle)
    validation = _Validation(_validation_dataset(validation_data, validation_batch_size or global_batch,
                                                 validation_preprocess, validation_steps), validation_freq)
    _build_optimizer(model, strategy)
    _end_here_on_probation(model, strategy, world, feed)
    trainer, group = _trainer(model, feed, world, strategy, run_dir, config, schedule, input_state=is_dataset)
    trainer.validation = validation
    return _train(trainer, group, epochs, callbacks, verbose)


def _raise_as_what_failed(trainer: "_ElasticTrainer", error: tf.errors.OpError) -> None:
    """Raises what a step's `error` says of the group: a peer failed (`PeerFailure`), the input is bad
    (`ConfigurationError`), or the error itself."""
    world = trainer.world
    failure = trainer.feed.failure if isinstance(trainer.feed, DatasetFeed) else None
    if failure is None and isinstance(error, COLLECTIVE_FAILURES):
        trainer.events.write(Event.COLLECTIVE_FAILURE, round=world.round, rank=world.rank,
                             error=type(error).__name__, step=trainer.step)
        logging.error("collective failure at step %d: %s", trainer.step, error_line(error, 300))
        raise PeerFailure(trainer.step, error_line(error, 300)) from None
    # Bad data (a corrupt image, a record that does not parse, a label out of range) or data this job
    # may not read: the error names the file; a restart would only meet it again (on every host). A
    # user's tf.data pipeline fails in the feed's thread (or in a buffer a commit found), and the feed
    # keeps its own error (`failure`): Keras saw UnknownError, and no failure of it is a peer's.
    if not isinstance(failure or error, BAD_INPUT):
        raise error
    raise ConfigurationError(f"bad input at step {trainer.step}: {describe_error(failure or error)}") from error


def _trainer(model: keras.Model, feed: Feed, world: World, strategy: tf.distribute.Strategy, run_dir: str,
             config: FitConfig, schedule: Optional[BatchResizeSchedule], input_state: bool
             ) -> Tuple["_ElasticTrainer", Optional[GroupState]]:
    """The trainer of `fit`, with what it commits (`input_state`: the feed's own position too) and the group
    that agrees on it (None alone on one replica)."""
    durable = DurableCopies(config.checkpoint_dir or str(RunDir(run_dir).durable)) if config.durable_every_commits \
        else None
    events = EventLog(run_dir, source=f"worker:{world.rank}")
    state = CommittedState(world, run_dir, model, schedule, durable=durable,
                           durable_every_commits=config.durable_every_commits, events=events, background=True,
                           input_state=input_state)
    sum_fn = sum_over_workers(strategy, world)
    group = GroupState(strategy, world, state.variables, state.names, sum_fn) \
        if strategy.num_replicas_in_sync > 1 else None
    trainer = _ElasticTrainer(model=model, feed=feed, world=world, strategy=strategy, state=state, config=config,
                              events=events, sum_fn=sum_fn, group=group, schedule=schedule)
    return trainer, group


def _train(trainer: "_ElasticTrainer", group: Optional[GroupState], epochs: int,
           user_callbacks: Optional[Sequence[keras.callbacks.Callback]], verbose) -> keras.callbacks.History:
    """Restores, trains the remaining epochs with the user's callbacks, and says how this worker ended (an
    event, or what it raises); returns the epochs' `History`."""
    state, world, events, model = trainer.state, trainer.world, trainer.events, trainer.model
    history, fit_args = _History(), dict(verbose=verbose)
    callbacks = _CallbacksOfOneFit([_ElasticCallback(trainer), *(user_callbacks or ()), history,
                                    _EpochEdges(trainer)], verbose=verbose, epochs=epochs, model=model)
    previous = {}
    try:
        trainer.check_same_data()
        _start_from_group(state, group, world, events)
        trainer.restored()
        trainer.record_consumption()
        previous = {sig: signal.signal(sig, lambda *_: setattr(trainer, "stop_requested", True))
                    for sig in world.stop_signals}
        remaining = trainer.remaining_epochs(epochs)
        if not remaining:  # finished before this process: what model.fit's end did (EMA averages) is not committed
            model.optimizer.finalize_variable_values(model.trainable_variables)
        for epoch in remaining:
            if trainer.stopped or model.stop_training:
                break
            # One `model.fit` an epoch: each epoch's planned order (and augmentation seeds) is a dataset of its
            # own, and a restored partial epoch is as long as what is left of it.
            steps = trainer.feed.steps()
            callbacks.set_params({"verbose": fit_args["verbose"], "epochs": epochs, "steps": steps})
            with _averages_held_back(model.optimizer, hold=epoch + 1 < epochs), warnings.catch_warnings(), \
                    keras_compat.steps_per_execution_that_runs(model, trainer.strategy), \
                    keras_compat.IterationsThatCountSteps(model.optimizer, lambda: trainer.step,
                                                          steps is None) as trainer.iterations_counted:
                # A pipeline of unknown length ends its epoch by running out, as `model.fit` expects it to.
                warnings.filterwarnings("ignore", message="Your input ran out of data")
                epoch_input = trainer.feed.distributed(trainer.strategy, model.steps_per_execution)
                model.fit(epoch_input, epochs=epoch + 1, initial_epoch=epoch, shuffle=False, steps_per_epoch=steps,
                          callbacks=callbacks, **fit_args)
        callbacks.end()
        state.close()  # the commit thread's work done: the last agreement announces every commit in force
        trainer.announce_commits()
    except tf.errors.OpError as error:
        _raise_as_what_failed(trainer, error)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        trainer.close()
        state.close()
    digest = group.digest() if group else None
    code = ExitCode.STOPPED if trainer.stopped else ExitCode.DONE
    if not trainer.stopped:
        state.close(final=True)
    events.write(Event.WORKER_EXIT, round=world.round, rank=world.rank, code=int(code), step=trainer.step,
                 state_digest=digest)
    if trainer.stopped:
        raise StopRequested(trainer.step)
    return history


def _data_text(fingerprint, examples) -> str:
    return f"{int(examples)} examples (fingerprint {int(fingerprint):012x})"


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of `every` (0: never) lies in (before, after]: steps counted several at a time."""
    return bool(every) and after // every > before // every


def global_batch_size(replicas: int, batch_size: Optional[int] = None,
                      per_replica_batch_size: Optional[int] = None) -> int:
    """The global batch of a world of `replicas` replicas: `batch_size` (the same at every size), or
    `per_replica_batch_size` times `replicas`; neither: 32, as `model.fit`."""
    for name, value in (("batch_size", batch_size), ("per_replica_batch_size", per_replica_batch_size)):
        _require_count(name, value, optional=True)
    if batch_size is not None and per_replica_batch_size is not None:
        raise ConfigurationError("give batch_size (a constant global batch) or per_replica_batch_size (a global "
                                 f"batch that follows the world), not both; got {batch_size} and "
                                 f"{per_replica_batch_size}.")
    if per_replica_batch_size is not None:
        return per_replica_batch_size * replicas
    batch_size = 32 if batch_size is None else batch_size
    if batch_size % replicas:
        raise ConfigurationError(f"batch_size={batch_size} does not split evenly over the {replicas} replicas of "
                                 f"this world: give fit a batch_size that every world size divides (and the agents "
                                 f"--world_size_divides), or per_replica_batch_size (a global batch that follows "
                                 f"the world).")
    return batch_size


def _end_here_on_probation(model: keras.Model, strategy: tf.distribute.Strategy, world: World, feed: Feed) -> None:
    """An evicted host on probation times its pass and its input alone (`probe.time_alone`), as often as its
    agent asks, then ends: it trains nothing."""
    if world.probation:
        time_alone(model, strategy, world.probation, ProbeSettings.from_text(world.probe), feed.time_input)
        exit_now(ExitCode.DONE)


def _require_counts(epochs, validation_steps, validation_batch_size) -> None:
    """`fit`'s counts: `epochs` a whole number >= 1, the validation's too or None."""
    _require_count("validation_steps", validation_steps, optional=True)
    _require_count("validation_batch_size", validation_batch_size, optional=True)
    _require_count("epochs", epochs)


def _require_count(name: str, value, optional: bool = False) -> None:
    """A whole number >= 1 (None too, if `optional`), or a `ConfigurationError` naming the argument."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigurationError(f"{name} must be a whole number >= 1{' (or None)' if optional else ''}; "
                                 f"got {value!r}.")


def schedule_of(optimizer: keras.optimizers.Optimizer,
                given: Optional[BatchResizeSchedule] = None) -> Optional[BatchResizeSchedule]:
    """The `BatchResizeSchedule` that is `optimizer`'s learning rate (inside a `LossScaleOptimizer` too)."""
    inner = optimizer
    while isinstance(inner, keras.optimizers.LossScaleOptimizer):
        inner = inner.inner_optimizer
    found = getattr(inner, "_learning_rate", None)
    found = found if isinstance(found, BatchResizeSchedule) else None
    if given is not None and found is not None and given is not found:
        raise ConfigurationError("schedule is not the optimizer's learning rate: leave it out, fit finds it.")
    return given or found


def _context(world: Optional[World], strategy: Optional[tf.distribute.Strategy],
             run_dir: Optional[str]) -> Tuple[World, tf.distribute.Strategy, str]:
    """What `elastic.run` made, else what was passed, else a world of one."""
    context = entry.current()
    if context is None and world is None and os.environ.get(Env.HEARTBEAT_FILE):
        raise ConfigurationError("under the elastic agent, start the worker with elastic.run(main) (or pass "
                                 "world=, strategy= and run_dir= after starting the heartbeat yourself).")
    world = world or (context.world if context else World())
    strategy = strategy or (context.strategy if context else tf.distribute.get_strategy())
    run_dir = run_dir or (context.run_dir if context else world.run_dir or "runs/train")
    return world, strategy, run_dir


def _training_feed(x, y, sample_weight, world: World, strategy: tf.distribute.Strategy, seed: int, *, batch_size,
                   per_replica_batch_size, class_weight, preprocess, shuffle: bool = True):
    """(the feed of `fit`'s training data, its global batch): a dataset or PyDataset read whole by every
    worker, else a source (arrays, files) of which each worker reads its share by plan."""
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        _refuse_with_a_dataset(y=y, sample_weight=sample_weight, batch_size=batch_size,
                               per_replica_batch_size=per_replica_batch_size, class_weight=class_weight,
                               preprocess=preprocess)
        if isinstance(x, tf.data.Dataset):
            return DatasetFeed(x, world.size, world.rank), _static_batch(x)
        feed = PyDatasetFeed(x, world.size, world.rank, shuffle_seed=seed if shuffle else None,
                             measure_waits=world.probes_stragglers)
        return feed, feed.global_batch
    global_batch = global_batch_size(strategy.num_replicas_in_sync, batch_size, per_replica_batch_size)
    return _planned_feed(_training_source(x, y, sample_weight), preprocess, world, global_batch,
                         strategy.num_replicas_in_sync, seed, class_weight), global_batch


def _planned_feed(source: Source, preprocess: Optional[Preprocess], world: World, global_batch: int, replicas: int,
                  seed: int, class_weight: Optional[Dict[int, float]]) -> PlannedFeed:
    """Arrays, files and sources: each worker reads its share of the plan (an index log in test mode)."""
    if source.num_examples < global_batch:
        raise ConfigurationError(f"the training data has {source.num_examples} examples, fewer than one global "
                                 f"batch of {global_batch} ({replicas} replicas): an epoch would have no step. Use a "
                                 "smaller batch size (or more data).")
    preprocess = preprocess or (_unchanged if isinstance(source, ArraySource) else None)
    if class_weight:  # traced once now: class weights beside sample weights, or several outputs, refused at start
        pipeline(source, np.zeros([0], np.int64), 1, preprocess=preprocess, class_weight=class_weight)
    index_log = None
    if world.index_log and world.run_dir:
        path = RunDir(world.run_dir).index_log(world.round, world.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        index_log = open(path, "a", encoding="utf-8")
    return PlannedFeed(source, preprocess, world, global_batch // world.size, seed, class_weight, index_log,
                       measure_waits=world.probes_stragglers)


def _refuse_with_a_dataset(**given) -> None:
    """What `model.fit` refuses beside a dataset (its batches, labels and weights are the pipeline's), and
    what a pipeline does itself."""
    for name, value in given.items():
        if value is not None:
            raise ConfigurationError(f"{name} is not taken with a tf.data.Dataset or PyDataset x: it yields (x, y) "
                                     "or (x, y, sample_weight) in global batches (put preprocessing and weights "
                                     "into it).")


def _static_batch(dataset: tf.data.Dataset) -> int:
    """The dataset's batch where its spec says it (`batch(n, drop_remainder=True)`), else 32: validation's
    default batch, as `model.fit`'s."""
    first = tf.nest.flatten(dataset.element_spec)[0]
    return int(first.shape[0]) if first.shape.rank and first.shape[0] is not None else 32


def _training_source(x, y, sample_weight) -> Source:
    if isinstance(x, Source) or y is None and _path_label_pairs(x):
        if sample_weight is not None:
            raise ConfigurationError("sample_weight is taken with in-memory arrays only: a Source's examples carry "
                                     "their own (features, target, sample_weight).")
        return x if isinstance(x, Source) else ImageFiles([p for p, _ in x], [label for _, label in x])
    if y is None:
        raise ConfigurationError("y: targets are needed with in-memory features x (or pass a Source as x).")
    return ArraySource(x, y, sample_weight=sample_weight)


def _path_label_pairs(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], (str, os.PathLike)) for p in x)


def _refuse_what_fit_cannot_honour(**given) -> None:
    """`model.fit`'s arguments that an elastic fit cannot honour, refused before anything starts."""
    why = {"shuffle": (True, "every epoch is shuffled from FitConfig.seed, so that all workers and every restart "
                             "read one order"),
           "initial_epoch": (0, "fit starts at the epoch its last commit names"),
           "steps_per_epoch": (None, "an epoch is one pass over the data, which fit's committed positions count (a "
                                     "repeated tf.data shuffle cannot be restored exactly at every position: "
                                     "drop .repeat() and give epochs)")}
    for name, value in given.items():
        default, reason = why[name]
        if not (value is default or type(default) is int and type(value) is not bool and value == default):
            shown = repr(value) if isinstance(value, (bool, int, float, np.number)) else f"<{type(value).__name__}>"
            raise ConfigurationError(f"{name}={shown} is not taken by elastic.fit (only {default!r}): {reason}.")


def _split_off_validation(x, y, sample_weight, validation_data, split: float):
    """`validation_split` as `model.fit` takes it: the last `split` of in-memory arrays (and their sample
    weights) validates, unless `validation_data` is given (which wins, as in `model.fit`)."""
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0 <= split < 1:
        raise ConfigurationError(f"validation_split must be a number in [0, 1); got {split!r}.")
    if not split or validation_data is not None:
        return x, y, sample_weight, validation_data
    if y is None or isinstance(x, (Source, tf.data.Dataset, keras.utils.PyDataset)):
        raise ConfigurationError("validation_split takes in-memory arrays x and y; with another x, pass "
                                 "validation_data.")
    arrays = ArraySource(x, y, sample_weight=sample_weight)
    at = int(np.floor(arrays.num_examples * (1 - split)))
    if at in (0, arrays.num_examples):
        raise ConfigurationError(f"validation_split={split} leaves no example on one side of {arrays.num_examples}.")
    train, held_out = (tf.nest.map_structure(lambda a: a[part], arrays.element)
                       for part in (slice(at), slice(at, None)))
    x, y, *weight = train
    return x, y, (weight[0] if weight else None), held_out


def _validation_dataset(validation_data, batch: int, preprocess: Optional[Preprocess],
                        steps: Optional[int] = None) -> Optional[tf.data.Dataset]:
    """The validation set in global batches (`steps` of them, if given)."""
    if validation_data is None:
        return None
    if isinstance(validation_data, tf.data.Dataset):
        dataset = validation_data if steps is None else _shared_by_global_batch(validation_data)
    elif isinstance(validation_data, Source):
        dataset = evaluation(validation_data, batch, preprocess)
    elif isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        x, y, *weight = validation_data
        dataset = evaluation(ArraySource(x, y, sample_weight=weight[0] if weight else None), batch,
                             preprocess or _unchanged)
    else:
        raise ConfigurationError(f"validation_data must be an (x, y) or (x, y, sample_weight) tuple of arrays, a "
                                 f"Source or a batched tf.data.Dataset; got {type(validation_data).__name__}.")
    return dataset if steps is None else dataset.take(steps)


def _shared_by_global_batch(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """A user's validation pipeline with `validation_steps`, shared as a source's is (`data.evaluation`):
    every worker reads it whole and evaluates its share of each global batch (`AutoShardPolicy.DATA`), so
    `validation_steps` takes the same first global batches at every world size. TensorFlow's default (AUTO)
    shards a file reader's by file: each worker took `validation_steps` batches of its own files, other
    examples at each world size (and the metrics that EarlyStopping and ReduceLROnPlateau act on). The
    whole set (no steps) stays AUTO's, each file read once; a policy other than AUTO the user set stays.
    The workers must read one order (as a training pipeline must: seeded, no `deterministic=False`)."""
    auto = tf.data.experimental.AutoShardPolicy.AUTO
    if dataset.options().experimental_distribute.auto_shard_policy != auto:
        return dataset
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def _build_optimizer(model: keras.Model, strategy: tf.distribute.Strategy) -> None:
    """Builds the optimizer eagerly (keras#23085: not while tracing), so that its slots exist when the state
    to commit, transfer and check is captured."""
    if getattr(model, "optimizer", None) is None:
        raise ConfigurationError("model: compile it (model.compile(optimizer=..., loss=...)) before fit.")
    if not model.built or not model.trainable_variables:
        raise ConfigurationError("model: it has no weights yet; build it before fit (keras.Input(shape) as its "
                                 "first layer, or model.build(input_shape)).")
    if not model.optimizer.built:
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)


@contextlib.contextmanager
def _averages_held_back(optimizer: keras.optimizers.Optimizer, hold: bool):
    """`model.fit` ends by copying an EMA optimizer's averages into the model's weights: right once training
    ends, wrong after the partial epoch that the next `model.fit` call goes on from."""
    if hold:
        optimizer.finalize_variable_values = lambda variables: None
    try:
        yield
    finally:
        if hold:
            del optimizer.finalize_variable_values


def _learning_rate(model: keras.Model) -> float:
    """The optimizer's current learning rate (a schedule's value, or its variable: mirrored under MWMS)."""
    return float(tf.convert_to_tensor(model.optimizer.learning_rate))


def _unchanged(features: tf.Tensor, label: tf.Tensor, seed: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Arrays reach the model as they are, as with `model.fit`."""
    del seed
    return features, label


class _Validation:
    """fit's validation pass: at the epochs `freq` names (an int: every `freq`-th; a list: those, from 1),
    the workers sharing the dataset (`data.evaluation`). Its logs join the epoch's with `val_` before them."""

    def __init__(self, dataset: Optional[tf.data.Dataset], freq: Union[int, Sequence[int]]):
        whole = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1  # noqa: E731
        if not (whole(freq) or isinstance(freq, (list, tuple, set, range)) and all(whole(e) for e in freq)):
            raise ConfigurationError(f"validation_freq must be a whole number >= 1 or a list of epochs >= 1; "
                                     f"got {freq!r}.")
        self.dataset, self.freq = dataset, freq

    def due(self, epoch: int) -> bool:
        if self.dataset is None:
            return False
        return (epoch + 1) % self.freq == 0 if isinstance(self.freq, (int, np.integer)) else epoch + 1 in self.freq

    def run(self, model: keras.Model, progress: ProgressCallback) -> Dict[str, float]:
        logs = model.evaluate(self.dataset, verbose=0, callbacks=[progress], return_dict=True)
        return {f"val_{name}": value for name, value in logs.items()}


class _History(keras.callbacks.History):
    """One `History` over the `model.fit` calls of a `fit` (one an epoch); empty when training was done."""

    def __init__(self):
        super().__init__()
        self.epoch = []

    def on_train_begin(self, logs=None):
        pass


class _CallbacksOfOneFit(keras.callbacks.CallbackList):
    """The callbacks of one `fit`, over its `model.fit` calls (one an epoch): a user's callback sees one
    `on_train_begin` and one `on_train_end` (`end`), as under a single `model.fit` (EarlyStopping and
    ReduceLROnPlateau keep their counts across epochs)."""

    def __init__(self, callbacks, verbose, epochs: int, model: keras.Model):
        super().__init__(list(callbacks), add_history=False, add_progbar=verbose != 0, verbose=verbose,
                         epochs=epochs, steps=None, model=model)
        self._began, self._end_logs = False, None

    def on_train_begin(self, logs=None):
        if not self._began:
            self._began = True
            super().on_train_begin(logs)

    def on_train_end(self, logs=None):
        self._end_logs = logs

    def end(self) -> None:
        if self._began:
            super().on_train_end(self._end_logs)


def _start_from_group(state: CommittedState, group: Optional[GroupState], world: World, events: EventLog) -> None:
    """Restores this host's newest commit, then agrees with the group on the newest any worker holds and
    receives it if this worker lacks it (a host that keeps commits then writes it: it holds it now)."""
    restored, skipped = state.restore()
    for path, error in skipped:
        events.write(Event.CHECKPOINT_SKIPPED, round=world.round, rank=world.rank, path=path, error=error)
        logging.warning("skipped the unreadable commit %s: %s", path, error)
    agreement = None
    if group is not None and world.size > 1:
        try:
            agreement = group.agree(state.held, state.generation_floor())
        except PeerFailure:
            events.write(Event.RESTORE_MISMATCH, round=world.round, rank=world.rank, step=state.step)
            raise
        if agreement.handed and state.input_state is not None:  # the tf.data position travels with its commit
            state.input_state.assign(group.hand_on(state.input_state.numpy(), agreement.source))
        if agreement.received_bytes:
            events.write(Event.STATE_TRANSFER, round=world.round, rank=world.rank, source_rank=agreement.source,
                         step=agreement.id.step, generation=agreement.id.generation, bytes=agreement.received_bytes,
                         seconds=round(agreement.seconds, 4))
            logging.info("received step %d (generation %d) from rank %d: %d bytes in %.3fs", agreement.id.step,
                         agreement.id.generation, agreement.source, agreement.received_bytes, agreement.seconds)
            if agreement.id != NO_COMMIT:
                state.keep()
    agreed = agreement.id if agreement else state.held
    if agreed == NO_COMMIT and skipped:  # what this host kept is unreadable, and nobody holds another
        raise ConfigurationError(f"no readable commit in {state.directory} and no other worker holds one: "
                                 + "; ".join(error for _, error in skipped))
    state.begin_generation(agreed, agreement.floor if agreement else state.generation_floor())
    events.write(Event.RESTORE, round=world.round, rank=world.rank, restored=agreed != NO_COMMIT, path=restored,
                 source_rank=agreement.source if agreement else world.rank, step=state.step, epoch=state.epoch,
                 samples=state.samples, generation=agreed.generation, commit_generation=state.generation,
                 world_size=world.size, state_digest=agreement.digest if agreement else None)
