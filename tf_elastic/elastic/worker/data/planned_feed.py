"""A `Source` fed by plan: each worker reads only its own share of every global batch, by index.

The plan (`DataPlan`) deals the rest of each epoch's seeded permutation into global batches at the world
size of the moment; committed progress is the number of samples of the epoch consumed. `fit` drives it
through the same small interface as `DatasetFeed` (`begin`, `steps`, `distributed`, `trained`, `position`,
`finished`, `skipped`, `next_epoch`, `identity`, `committed_data`).
"""
import json
from typing import Dict, List, Optional, TextIO, Tuple

import numpy as np
import tensorflow as tf

from tf_elastic.elastic.worker.data import feed
from tf_elastic.elastic.worker.data.ready_times import ReadyTimes
from tf_elastic.elastic.worker.data.source import Preprocess, Source, fingerprint_number, pipeline
from tf_elastic.elastic.worker.data_plan import DataPlan
from tf_elastic.elastic.worker.world import World


# A read alone (`time_input`) reads at most this many batches: far more than its half second takes, and not
# an epoch's indices made into one array.
READ_ALONE_BATCHES = 256


class PlannedFeed:
    def __init__(self, source: Source, preprocess: Optional[Preprocess], world: World, worker_batch: int, seed: int,
                 class_weight: Optional[Dict[int, float]] = None, index_log: Optional[TextIO] = None,
                 measure_waits: bool = True):
        """`index_log` (test mode): every step's indices are written to it as the step is counted;
        `measure_waits`: stamp the batches' ready times (`take_input_wait`; False where no probe reads them)."""
        self.source, self.preprocess, self.world, self.seed = source, preprocess, world, seed
        self.class_weight, self.index_log = class_weight, index_log
        self.plan = DataPlan(source.num_examples, seed, lambda epoch: source.epoch_order(seed, epoch))
        self.worker_batch = worker_batch  # this worker's share of a global batch (all its local replicas)
        self.global_batch = worker_batch * world.size
        self.examples = source.num_examples
        self.fingerprint = fingerprint_number(source)
        self.epoch = self.epoch_start = self.batch_in_epoch = 0
        self.batches: List[np.ndarray] = []
        self.ready_times = ReadyTimes(measure_waits)  # when each batch the step reads was ready: its waits
        self._local = 1  # replicas of this worker, each reading the pipeline's next element in a step

    def identity(self) -> Tuple[float, float]:
        """What every worker must see alike: the data's fingerprint and size."""
        return float(self.fingerprint), float(self.examples)

    def committed_data(self) -> Tuple[int, int]:
        """What a commit records of the data its positions index."""
        return self.fingerprint, self.examples

    def restore(self, epoch: int, samples: int, saved: bytes = b"") -> None:
        """Where the agreed commit left the plan: its epoch and samples (`saved`: nothing of ours)."""
        del saved
        self.begin(epoch, samples)

    def begin(self, epoch: int, start: int) -> None:
        """The rest of `epoch` from its sample `start`, at this world size."""
        self.epoch, self.epoch_start, self.batch_in_epoch = epoch, start, 0
        self.batches = self.plan.replica_batches(epoch, start, self.world.size, self.world.rank, self.worker_batch)

    def steps(self) -> Optional[int]:
        return len(self.batches)

    def distributed(self, strategy: tf.distribute.Strategy,
                    steps_per_call: int = 1) -> tf.distribute.DistributedDataset:
        """This worker's planned batches, read by the source in the tf.data graph and split over its local
        replicas as the plan splits them (see `data.feed`); tf.data reads them as the steps ask, however
        many a call takes."""
        del steps_per_call
        indices = np.concatenate(self.batches) if self.batches else np.zeros([0], np.int64)
        self._local = feed.local_replicas(strategy, self.world.size)
        return feed.to_replicas(strategy, self.world.size, self.worker_batch,
                                lambda per_replica: self.pipeline(indices, per_replica, self.ready_times.stamp))

    def pipeline(self, indices: np.ndarray, batch: int, stamp=None) -> tf.data.Dataset:
        return pipeline(self.source, indices, batch, preprocess=self.preprocess, seed=self.seed, epoch=self.epoch,
                        class_weight=self.class_weight, with_indices=self.index_log is not None, stamp=stamp)

    def time_input(self, seconds: float, rows_a_step: Optional[int] = None,
                   limit: float = feed.LONGEST_READ_SECONDS) -> float:
        """Seconds per step of this worker's input read alone (`feed.seconds_per_step`) at `rows_a_step` rows
        a step (default: its own), by a side pipeline over the epoch's batches this worker has not read yet
        (before its first step, a probation's: the epoch's), from one drawn at random: read again, those
        just read, or read at the last time, would come from the page cache. Nothing the steps read moves;
        `limit`: `feed.seconds_per_step`'s."""
        per_replica = max(1, (rows_a_step or self.worker_batch) // self._local)
        ahead = self.batches[self.batch_in_epoch:] or self.plan.replica_batches(
            self.epoch, 0, self.world.size, self.world.rank, per_replica * self._local)
        if not ahead:
            return 0.0
        start = int(np.random.default_rng().integers(len(ahead)))  # a measurement's, not the training's
        indices = np.concatenate((ahead[start:] + ahead[:start])[:READ_ALONE_BATCHES])
        return feed.seconds_per_step(self.pipeline(indices, per_replica), self._local, seconds, limit)

    def epoch_begins(self) -> None:
        """The epoch's steps ask for its pipeline from now (`ReadyTimes.epoch_begins`)."""
        self.ready_times.epoch_begins()

    def take_input_wait(self) -> float:
        """Seconds the training step waited for this worker's own input since the last call (`ReadyTimes`):
        what the straggler probe reports besides compute."""
        return self.ready_times.take()

    def trained(self, steps: int, first_step: int) -> int:
        """`steps` more steps trained (from global step `first_step`); returns how many the plan held (Keras
        names the last step an execution could reach: the epoch's last stops where the data does)."""
        steps = min(steps, len(self.batches) - self.batch_in_epoch)
        if steps > 0:  # the call's first step read the next `_local` elements of the pipeline
            self.ready_times.called((self.batch_in_epoch + 1) * self._local - 1)
        for step in range(first_step, first_step + steps):
            if self.index_log is not None:
                self.index_log.write(json.dumps({"round": self.world.round, "rank": self.world.rank,
                                                 "epoch": self.epoch, "step": step,
                                                 "indices": self.batches[self.batch_in_epoch].tolist()}) + "\n")
                self.index_log.flush()
            self.batch_in_epoch += 1
        return steps

    def position(self) -> int:
        """Samples of the epoch consumed."""
        return self.epoch_start + self.batch_in_epoch * self.global_batch

    def finished(self) -> bool:
        return self.batch_in_epoch >= len(self.batches)

    def nothing_left(self) -> bool:
        """A restored partial epoch with less than a global batch left at this world size."""
        return self.epoch_start > 0 and not self.batches

    def skipped(self) -> int:
        """Samples of the epoch left unused because they do not fill a global batch."""
        start = self.position()
        return self.plan.remainder(start, self.global_batch) if start < self.plan.num_examples else 0

    def next_epoch(self) -> None:
        self.begin(self.epoch + 1, 0)
