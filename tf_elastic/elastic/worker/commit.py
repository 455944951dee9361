"""Committed state: what survives a failure, written atomically and read back bit-exact.

Commit / restore is the one vocabulary for what survives a failure (like Horovod elastic's `State`):
model, optimizer slots and `iterations`, the batch-resize history, epoch, samples consumed in the
epoch and the global step are written together, in the layout `tf.train.CheckpointManager` reads.
"""
import shutil
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from tf_elastic.elastic.protocol import RunDir
from tf_elastic.elastic.worker.errors import ConfigurationError
from tf_elastic.elastic.worker.world import World
from tf_elastic.schedules import BatchResizeSchedule


class CommittedState:
    """What survives a failure, saved atomically: chief to RUN_DIR/checkpoints, others to a temp dir.

    A commit is a traced `Checkpoint.write` followed by the `checkpoint` state file that
    `tf.train.CheckpointManager` and `tf.train.latest_checkpoint` read. The manager's own `save`
    re-serialises the object graph in Python on every call (measured 20-35 ms against 4 ms traced for
    mnist_cnn: 3 % of training at 50-step commits). The state file is replaced atomically once the files
    it names are complete, so a worker killed mid-commit leaves the previous commit in force.
    """

    def __init__(self, world: World, run_dir: str, model: keras.Model,
                 schedule: Optional[BatchResizeSchedule] = None, max_to_keep: int = 3):
        self.world = world
        self.progress = tf.Variable(np.zeros(4, np.int64), trainable=False, name="elastic_progress")
        items = {"model": model, "optimizer": model.optimizer, "progress": self.progress}
        if schedule is not None:
            items["batch_history"] = schedule.state
        self.checkpoint = tf.train.Checkpoint(**items)
        self.directory = str(RunDir(run_dir).checkpoints)
        # A non-chief writes too (saving may run collectives) but keeps nothing: into a scratch dir that
        # the agent deletes even when this process is killed, or a temp dir of our own.
        self._write_dir = self.directory if world.is_chief else (
            world.scratch_dir or tempfile.mkdtemp(prefix=f"tf_elastic-rank{world.rank}-"))
        self._temp_dir = None if world.is_chief else self._write_dir
        Path(self._write_dir).mkdir(parents=True, exist_ok=True)
        self._max_to_keep = max_to_keep
        kept = tf.train.get_checkpoint_state(self._write_dir)
        # (path, time) pairs: with the times, `tf.train.CheckpointManager` also lists these commits.
        self._kept = list(zip(kept.all_model_checkpoint_paths, kept.all_model_checkpoint_timestamps)) if kept else []
        if world.is_chief:
            self._sweep()
        # Traced on the first commit, once every variable (optimizer slots included) exists.
        self._write = tf.function(lambda prefix: self.checkpoint.write(prefix))

    @property
    def epoch(self) -> int:
        return int(self.progress[0])

    @property
    def samples(self) -> int:
        return int(self.progress[1])

    @property
    def step(self) -> int:
        return int(self.progress[2])

    def restore(self) -> Tuple[Optional[str], List[Tuple[str, str]]]:
        """Restores the newest readable commit (every worker reads the chief's).

        Returns its path (None when nothing was committed yet) and the newer ones skipped as unreadable
        (truncated or corrupted files), each with the error. A commit of another model is an error."""
        kept = tf.train.get_checkpoint_state(self.directory)
        skipped = []
        for path in reversed(kept.all_model_checkpoint_paths if kept else []):
            try:
                self.checkpoint.read(path).assert_existing_objects_matched()
                return path, skipped
            except (tf.errors.OpError, IndexError) as error:  # the reader raises IndexError on a short file
                skipped.append((path, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"))
            except (AssertionError, ValueError) as error:
                raise ConfigurationError(f"the committed state {path} does not fit this model or optimizer "
                                 f"({str(error).splitlines()[0][:300]}); use another --run_dir or the "
                                 f"configuration it was written with") from None
        if skipped:
            raise ConfigurationError(f"no readable commit in {self.directory}: " + "; ".join(e for _, e in skipped))
        return None, skipped

    def commit(self, epoch: int, samples: int, step: int, global_batch: int) -> None:
        """All workers call this at the same step: saving may run collectives (SyncOnRead variables)."""
        self.progress.assign(np.array([epoch, samples, step, global_batch], np.int64))
        # Named by the whole position: a commit never overwrites the files the state file names.
        prefix = str(Path(self._write_dir) / f"ckpt-{step}-{epoch}-{samples}")
        self._write(tf.constant(prefix))
        if self._temp_dir:
            for path in Path(self._temp_dir).glob("*"):
                path.unlink() if path.is_file() else shutil.rmtree(path)
            return
        self._kept.append((prefix, time.time()))
        expired, self._kept = self._kept[:-self._max_to_keep], self._kept[-self._max_to_keep:]
        paths, times = zip(*self._kept)
        tf.compat.v1.train.update_checkpoint_state(self._write_dir, prefix, all_model_checkpoint_paths=paths,
                                                   all_model_checkpoint_timestamps=times)
        for old, _ in expired:
            for path in Path(old).parent.glob(Path(old).name + ".*"):
                path.unlink(missing_ok=True)

    def _sweep(self) -> None:
        """Removes what a killed commit left: a `*_temp` directory (SIGKILL mid-write) and files of commits
        the state file no longer names (SIGKILL between its update and the deletion of the expired one).
        The previous round's workers are gone before a round starts, so nothing here is being written."""
        kept = {Path(path).name for path, _ in self._kept}
        for entry in Path(self.directory).iterdir():
            if entry.name == "checkpoint" or entry.name.split(".", 1)[0] in kept:
                continue
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)

    def close(self) -> None:
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


