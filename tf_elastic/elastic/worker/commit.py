"""Committed state: what survives a failure, written atomically on each host and read back bit-exact.

Commit / restore is the one vocabulary for what survives a failure (like Horovod elastic's `State`):
model, optimizer slots and `iterations`, the batch-resize history, epoch, samples consumed in the
epoch, the global step and the commit's generation (`CommitId`) are written together, in the layout
`tf.train.CheckpointManager` reads.
Each host keeps its own commits (its first worker writes them; hosts share no directory); the group
hands a commit to the workers that lack it (`group.py`), and the chief copies one to durable storage
every few commits (`durable.py`). Local file operations go through `tf.io.gfile`.
"""
import concurrent.futures
import contextlib
import inspect
import os
import posixpath
import time
import uuid
from typing import Callable, Dict, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.ops import resource_variable_ops

from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import Event, RunDir, error_line, first_line
from tf_elastic.elastic.worker import keras_compat
from tf_elastic.elastic.worker.commit_files import STATE_FILE, check_plain, complete_on_disk, kept_commits
from tf_elastic.elastic.worker.commit_log import CommitLog
from tf_elastic.elastic.worker.durable import NO_COMMIT, CommitId, DurableCopies, commit_id
from tf_elastic.elastic.worker.storage import files_of, sync_local
from tf_elastic.elastic.worker.errors import ConfigurationError
from tf_elastic.elastic.worker.world import World
from tf_elastic.schedules import BatchResizeSchedule

# Commits are written asynchronously: the step goes on while the checkpoint's files are written.
_ASYNC = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)


class CommittedState:
    """What survives a failure. A host's first worker (`World.keeps_commits`) keeps the host's commits:
    `RUN_DIR/commits/HOST` under an agent, `RUN_DIR/checkpoints` without one; other workers keep nothing.

    A commit is an asynchronous `Checkpoint.write` (TensorFlow's: it copies every variable to host memory,
    0.7 ms for mnist_cnn against 4 ms for a traced synchronous write, and writes the files on a thread of
    its own) followed by the `checkpoint` state file that `tf.train.CheckpointManager` and
    `tf.train.latest_checkpoint` read. The state file is replaced atomically once the files it names are
    complete, so a worker killed at any point of a commit leaves the previous commit in force. With
    `background=True` what follows the copy (waiting for the files, the state file, deleting the expired
    commit, the durable copy) runs on a thread of ours, off the training path; `close` waits for it.
    """

    def __init__(self, world: World, run_dir: str, model: keras.Model,
                 schedule: Optional[BatchResizeSchedule] = None, max_to_keep: int = 3,
                 durable: Optional[DurableCopies] = None, durable_every_commits: int = 0,
                 events: Optional[EventLog] = None, background: bool = False, input_state: bool = False):
        self.world, self.events = world, events
        # epoch, samples, step, global batch, generation, the data's fingerprint and size (`commit`'s `data`),
        # and whether a user's callback ended training early
        with _plain_variables():
            self.progress = tf.Variable(np.zeros(8, np.int64), trainable=False, name="elastic_progress")
            # A tf.data pipeline's position (`DatasetFeed.state`): bytes whose encoding differs between
            # workers at one position (prefetch buffers fill as they do), so the group's bitwise check leaves
            # it out and `_start_from_group` hands the source's on whenever a commit is handed on.
            self.input_state = tf.Variable(b"", dtype=tf.string, trainable=False,
                                           name="elastic_input_state") if input_state else None
        self.model, self.schedule = model, schedule
        items = {"model": model, "optimizer": model.optimizer, "progress": self.progress}
        if self.input_state is not None:
            items["input_state"] = self.input_state
        if schedule is not None:
            items["batch_history"] = schedule.state
        # What Keras does not make trackable (a SeedGenerator's state: dropout's and augmentation's random
        # stream) is added by position, so that a restart resumes every random stream where it was. (At
        # construction: an asynchronous write leaves out what is assigned to a checkpoint afterwards.)
        untracked = _untracked(tf.train.Checkpoint(**items), self._listed())
        self.checkpoint = tf.train.Checkpoint(**items, **({"untracked": untracked} if untracked else {}))
        self.variables, self.names = _named(self._listed() + _saved_variables(self.checkpoint))
        layout = RunDir(run_dir)
        self.directory = str(layout.host_commits(world.host_id) if world.host_id else layout.checkpoints)
        if "://" not in self.directory:  # `~` and relative run dirs: one absolute path in the state file
            self.directory = os.path.abspath(os.path.expanduser(self.directory))
        check_plain(self.directory, "the run dir's commit directory")
        if durable is not None:
            check_plain(durable.directory, "--checkpoint_dir")
        self.durable = durable if world.is_chief and durable_every_commits else None
        self._durable_every, self._commits, self._copied = durable_every_commits, 0, None
        self._max_to_keep = max_to_keep
        self._kept: List[Tuple[str, float]] = []
        self.log = CommitLog(world.keeps_commits, events if world.is_chief else None)  # each commit's life
        self.restored: Optional[str] = None
        self.generation = world.round  # of this round's commits: see `begin_generation`
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "tf_elastic-commit") if background else None
        self._warm: Optional[concurrent.futures.Future] = None
        self._finishing: List[concurrent.futures.Future] = []  # background finishes not yet checked
        if world.keeps_commits:
            tf.io.gfile.makedirs(self.directory)
            # (path, time) pairs: with the times, `tf.train.CheckpointManager` also lists these commits. An
            # unreadable state file yields the complete commits on disk: the sweep below keeps them.
            self._kept = kept_commits(self.directory)
            self._sweep()
        if self.durable:
            self.durable.check_writable()
        keras_compat.install_async_checkpoint_fix()
        if self._pool is not None and world.keeps_commits:
            self._warm_up()

    def _write(self, prefix: str) -> str:
        """The state's checkpoint at `prefix`, asynchronously (`CheckpointOptions`)."""
        with _plain_variables():  # the first write makes its host copies: on this worker only
            return self.checkpoint.write(prefix, options=_ASYNC)

    def _listed(self) -> List:
        """What training reads and writes: every model variable (weights, statistics, random seeds; not
        metrics), every optimizer variable (slots, `iterations`, loss scale, EMA copies), and ours."""
        return [*self.model.variables, *self.model.optimizer.variables, self.progress,
                *([self.schedule.state] if self.schedule is not None else [])]

    def check_unchanged(self) -> None:
        """Raises `ConfigurationError` naming any model or optimizer variable created after this state was
        captured: it would be neither committed, nor transferred, nor checked."""
        known = {id(v) for v in self.variables}
        new = [_name(v) for v in self._listed() if id(_tf_variable(v)) not in known]
        if new:
            raise ConfigurationError(f"{len(new)} variable(s) appeared after fit captured the state to commit: "
                                     f"{', '.join(new[:8])}. Build the model (keras.Input, or model.build) and "
                                     "create every layer before fit, which builds the optimizer itself.")

    def _warm_up(self) -> None:
        """Two asynchronous writes to memory before training. TensorFlow makes its host-memory copies of
        the variables at the first write (about 20 ms here) and traces the function that fills them at the
        second (80-250 ms); on the training path that would block the first two commits. The second write
        runs on the commit thread, overlapping the round's start; `keep` waits for it."""
        directory = f"ram://tf_elastic-warm-up-{uuid.uuid4().hex}"
        self._write(posixpath.join(directory, "first"))

        def second() -> None:
            try:
                self._write(posixpath.join(directory, "second"))
                self.checkpoint.sync()
                tf.io.gfile.rmtree(directory)
            except tf.errors.OpError as error:  # only time is lost: the first commit sets it up instead
                logging.warning("the commit warm-up failed: %s", error_line(error))

        self._warm = self._pool.submit(second)

    @property
    def epoch(self) -> int:
        return int(self.progress[0])

    @property
    def samples(self) -> int:
        return int(self.progress[1])

    @property
    def step(self) -> int:
        return int(self.progress[2])

    @property
    def data(self) -> Tuple[int, int]:
        """(fingerprint, examples) of the data the commit's positions index."""
        return int(self.progress[5]), int(self.progress[6])

    @property
    def early_stopped(self) -> bool:
        return bool(self.progress[7])

    @property
    def held(self) -> CommitId:
        """(generation, step) of the commit this worker restored (`NO_COMMIT`: none), for the agreement."""
        return CommitId(int(self.progress[4]), self.step) if self.restored else NO_COMMIT

    def generation_floor(self) -> int:
        """The lowest generation this round may commit under, as far as this worker knows: above the durable
        directory's mark on the chief (`DurableCopies.generation_mark`), 0 elsewhere."""
        return self.durable.generation_mark() + 1 if self.durable else 0

    def begin_generation(self, agreed: CommitId, floor: int = 0) -> None:
        """Numbers this round's commits once the round agreed on where it starts: above the agreed commit's
        generation (generations grow along a history) and at `floor` or above (the chief's
        `generation_floor`, the same on every worker: a job restarted from an older durable copy outranks
        what the old job's hosts committed after it), plus the round's number. The round's number is added,
        not compared: two rounds that start from the same commit (a host cut off from the store that trained
        on alone in round 1, the group that went on without it in round 2) then never share a generation,
        and the later round's outranks the other even when a new store counts rounds from 0 again and the
        agreed generation is far above them; with a shared generation the cut-off host's longer history
        would win the next agreement and the group's work be dropped. The chief raises the mark before any
        commit of the generation exists. A commit that is received keeps its own generation."""
        self.generation = max(agreed.generation + 1, floor) + self.world.round
        if self.durable:
            try:
                self.durable.mark_generation(self.generation)
            except (tf.errors.OpError, OSError) as error:  # as a durable copy that fails: the next round tries again
                self._report(Event.DURABLE_COPY, path=self.durable.directory, error=error_line(error))

    def restore(self) -> Tuple[Optional[str], List[Tuple[str, str]]]:
        """Restores the newest readable commit: this host's (those the state file names, then any other
        complete one on disk), and on the chief the durable copies (a restart of the whole job on fresh
        hosts), each tried newest first in `CommitId` order, so that a damaged one falls back to the next.

        Returns its path (None when none was readable: the group may hold one; `_start_from_group` decides)
        and the newer ones skipped as unreadable (truncated or corrupted files), each with the error. A
        commit of another model is an error."""
        skipped = []
        for path, read in self._candidates():
            try:
                self.checkpoint.read(read()).assert_existing_objects_matched()
                self.restored = path
                return path, skipped
            except (tf.errors.OpError, IndexError, OSError) as error:  # IndexError: the reader's, on a short file
                skipped.append((path, error_line(error)))
            except (AssertionError, ValueError) as error:
                raise ConfigurationError(f"the committed state {path} does not fit this model or optimizer "
                                         f"({first_line(error, 300)}); use another --run_dir "
                                         f"(--checkpoint_dir) or the configuration it was written with") from None
        return None, skipped

    def _candidates(self) -> List[Tuple[str, Callable[[], str]]]:
        """(path, how to get a prefix TensorFlow reads) of every commit to try, newest first."""
        local = []
        if self.world.keeps_commits:
            named = [path for path, _ in kept_commits(self.directory)]
            local = named + [p for p in complete_on_disk(self.directory) if p not in named]
        found = [(commit_id(posixpath.basename(p)) or NO_COMMIT, p, lambda p=p: p) for p in local]
        for copy in reversed(self.durable.copies() if self.durable else []):
            if copy.complete:  # one TensorFlow cannot read where it is (s3://) is downloaded into `fetched`
                found.append((copy.id, copy.prefix, lambda copy=copy: self.durable.readable(
                    copy, posixpath.join(self.directory, "fetched"))))
        found.sort(key=lambda item: item[0], reverse=True)  # stable: a local commit before its durable copy
        return [(path, read) for _, path, read in found]

    def commit(self, epoch: int, samples: int, step: int, global_batch: int, announce: Optional[Dict] = None,
               started: Optional[float] = None, data: Tuple[int, int] = (0, 0), early_stop: bool = False) -> None:
        """All workers call this at the same step; the host's first worker writes. The chief gives the
        fields of the `commit` event `log` writes once every host holds the commit (`announce`), and when
        the commit began (`started`, `time.perf_counter()`: the group's check before it counts). `data`:
        (fingerprint, examples) of the data that `epoch` and `samples` index; `early_stop`: a user's callback
        ended training here (a restart trains no further)."""
        started = time.perf_counter() if started is None else started
        self.progress.assign(np.array([epoch, samples, step, global_batch, self.generation, *data, early_stop],
                                      np.int64))
        self.log.make(announce, started)
        self.keep(started)

    def keep(self, started: Optional[float] = None) -> None:
        """Writes the state as it is now (a commit, or one this worker received) if this worker keeps its
        host's commits. A write that fails (a full disk) is reported and the previous commit stays in
        force: the group holds the state, and the next commit tries again."""
        if not self.world.keeps_commits:
            return
        started = time.perf_counter() if started is None else started
        if self._warm is not None:
            self._warm.result()  # done long before, unless a commit comes within the first steps
        self._raise_background_error()
        epoch, samples, step, _, generation = (int(v) for v in self.progress.numpy()[:5])
        # Named by generation and the whole position: a commit never overwrites the files the state file names.
        prefix = posixpath.join(self.directory, f"ckpt-{generation}-{step}-{epoch}-{samples}")
        try:
            self._write_at(prefix)
        except tf.errors.OpError as error:
            self._report(Event.COMMIT_FAILED, step=step, path=prefix, error=error_line(error))
            return
        blocked = time.perf_counter() - started
        if self._pool is None:
            self._finish(prefix, self.log.made, time.time(), started, blocked)
        else:
            self._finishing.append(self._pool.submit(self._finish, prefix, self.log.made, time.time(), started,
                                                     blocked))

    def _write_at(self, prefix: str) -> None:
        """Starts the write of a commit. TensorFlow's asynchronous writer raises a background write's error
        at the next write: that error is the previous commit's (its finish reports it, finding no index),
        so this commit's write is started once more rather than lost with it."""
        try:
            self._write(prefix)
        except tf.errors.OpError as error:
            logging.warning("a commit write raised %s; writing %s once more", error_line(error), prefix)
            self._write(prefix)

    def _raise_background_error(self, wait: bool = False) -> None:
        """Re-raises, in the training thread, what a background finish raised beyond the errors it reports
        and outlives (a full disk, a store that failed): a bug there would otherwise vanish with its future,
        and `log.in_force` would stop advancing, so that no commit is announced again. Checked at each commit
        and at `close` (`wait`: after every finish has ended)."""
        if wait:
            concurrent.futures.wait(self._finishing)
        done = [future for future in self._finishing if future.done()]
        self._finishing = [future for future in self._finishing if not future.done()]
        for future in done:
            future.result()

    def _finish(self, prefix: str, number: int, written: float, started: float, blocked: float) -> None:
        """Waits for the commit's files, names it in the state file (atomically), deletes the expired one
        and, on the chief, makes a durable copy when one is due."""
        try:
            self.checkpoint.sync()
            if not tf.io.gfile.exists(prefix + ".index"):  # the index is written last
                raise tf.errors.DataLossError(None, None, f"{prefix}.index was not written")
            sync_local(files_of(prefix))  # on the disk before the state file names them
            kept = self._kept + [(prefix, written)]
            expired, kept = kept[:-self._max_to_keep], kept[-self._max_to_keep:]
            paths, times = zip(*kept)
            self._name_in_state_file(prefix, paths, times)
            sync_local([posixpath.join(self.directory, STATE_FILE)])  # and its rename: now it is in force
            self._kept = kept
            for old, _ in expired:
                for path in files_of(old):
                    tf.io.gfile.remove(path)
        except (tf.errors.OpError, OSError) as error:
            self._report(Event.COMMIT_FAILED, path=prefix, error=error_line(error))
            return
        self.log.kept(number, blocked, time.perf_counter() - started)
        self._commits += 1
        if self.durable and self._commits % self._durable_every == 0:
            self._copy(prefix)

    def _name_in_state_file(self, prefix: str, paths, times) -> None:
        """Makes the commit at `prefix` the newest the state file names, beside the kept ones (atomically:
        TensorFlow writes a temporary file and renames it); until then a restore does not see it."""
        # (lists: TensorFlow rewrites the paths in place where the directory is relative; a tuple failed)
        tf.compat.v1.train.update_checkpoint_state(self.directory, prefix, all_model_checkpoint_paths=list(paths),
                                                   all_model_checkpoint_timestamps=list(times))

    def _copy(self, prefix: str) -> None:
        started = time.time()
        try:
            self.durable.mark_generation(self.generation)  # again: in case it failed at the round's start
            copied = self.durable.copy(prefix)
        except (tf.errors.OpError, OSError, ConfigurationError) as error:
            self._report(Event.DURABLE_COPY, path=prefix, error=error_line(error))
            return
        self._copied = prefix
        self._report(Event.DURABLE_COPY, path=posixpath.join(self.durable.directory, posixpath.basename(prefix)),
                     bytes=copied, seconds=round(time.time() - started, 4))

    def _report(self, event: Event, **fields) -> None:
        if fields.get("error"):
            logging.warning("%s: %s (%s)", event.value, fields["error"], fields.get("path"))
        if self.events is not None:
            self.events.write(event, round=self.world.round, rank=self.world.rank, **fields)

    def _sweep(self) -> None:
        """Removes what a killed commit left: a `*_temp` directory (SIGKILL mid-write) and files of commits
        the state file no longer names (SIGKILL between its update and the deletion of the expired one).
        The previous round's workers are gone before a round starts, so nothing here is being written."""
        kept = {posixpath.basename(path) for path, _ in self._kept}
        for name in tf.io.gfile.listdir(self.directory):
            name = name.rstrip("/")
            if name == "checkpoint" or name.split(".", 1)[0] in kept:
                continue
            path = posixpath.join(self.directory, name)
            tf.io.gfile.rmtree(path) if tf.io.gfile.isdir(path) else tf.io.gfile.remove(path)

    def close(self, final: bool = False) -> None:
        """Waits for what the background thread still has to do; `final`: the chief also copies the last
        commit to durable storage (the end of training)."""
        if self._pool is not None:
            try:
                self._raise_background_error(wait=True)
            finally:
                self._pool.shutdown(wait=True)
        if final and self.durable and self._kept and self._copied != self._kept[-1][0]:
            self._copy(self._kept[-1][0])


def _tf_variable(variable):
    """The TensorFlow variable behind a Keras one."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _name(variable) -> str:
    return getattr(variable, "path", None) or variable.name


def _named(variables: List) -> Tuple[List[tf.Variable], List[str]]:
    """Each TensorFlow variable once (LARS lists the schedule's state among its own), with its name."""
    seen, unique, names = set(), [], []
    for variable in variables:
        if id(_tf_variable(variable)) not in seen:
            seen.add(id(_tf_variable(variable)))
            unique.append(_tf_variable(variable))
            names.append(_name(variable))
    return unique, names


def _saved_variables(checkpoint: tf.train.Checkpoint) -> List:
    """Every variable `checkpoint` writes (so that the group's check covers all that a commit holds)."""
    return [t for t in tf.train.TrackableView(checkpoint).descendants() if isinstance(t, (tf.Variable, keras.Variable))]


def _untracked(checkpoint: tf.train.Checkpoint, variables: List) -> List:
    saved = {id(_tf_variable(v)) for v in _saved_variables(checkpoint)}
    return [v for v in variables if id(_tf_variable(v)) not in saved]


_RESOURCE_VARIABLE_ARGS = frozenset(inspect.signature(resource_variable_ops.ResourceVariable.__init__).parameters)


@contextlib.contextmanager
def _plain_variables():
    """Variables made here are this process's own, even inside a strategy's scope (`elastic.run` runs `main`
    in one): under MultiWorkerMirroredStrategy a variable's creation is a collective (its initial value is
    broadcast from the chief), and the host copies TensorFlow's asynchronous checkpoint makes at its first
    write exist only on the workers that keep commits; made as mirrored variables, the others would wait
    in a different collective (measured: a host with two workers failed every round at step 0)."""
    def plain(next_creator, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in _RESOURCE_VARIABLE_ARGS and k != "distribute_strategy"}
        return resource_variable_ops.ResourceVariable(**kwargs)

    with tf.variable_creator_scope(plain):
        yield
