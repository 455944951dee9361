"""A `keras.utils.PyDataset` of global batches, trained exactly across every resize.

A PyDataset is addressed by batch index (`dataset[i]`, `num_batches`), so its position is a number: the
batches of the epoch trained. As `model.fit(shuffle=True)` (its default) does, each epoch reads the batches in
an order of its own: here a permutation drawn from the job's seed and the epoch, the same on every worker and
after every restart (`model.fit` draws it from Python's unseeded `random`). Every worker reads each global
batch (one at a time, in that order) and trains its replicas' rows of it, as with a tf.data pipeline
(`DatasetFeed`); nothing is pulled ahead that a commit could lose. `on_epoch_begin()` and `on_epoch_end()`
bracket each epoch, and a restart at epoch e replays the calls of the epochs before it: whatever they
reshuffle must be seeded (a reshuffle that is not would differ between workers, which the group's check of the
next batch refuses, and between runs, which nothing can see).
"""
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_elastic.elastic.worker.data.dataset_feed import any_rows, batch_number, replica_share, rows_are_missing
from tf_elastic.elastic.worker.data.feed import LONGEST_READ_SECONDS, local_replicas
from tf_elastic.elastic.worker.data.ready_times import ReadyTimes
from tf_elastic.elastic.worker.errors import ConfigurationError


class PyDatasetFeed:
    """Feeds this worker's replicas their rows of each batch of a `keras.utils.PyDataset`."""

    def __init__(self, dataset, world_size: int = 1, rank: int = 0, shuffle_seed: Optional[int] = None,
                 measure_waits: bool = True):
        """`shuffle_seed`: each epoch's order of the batches is drawn from it and the epoch (None: in order);
        `measure_waits`: stamp the batches' ready times (`take_input_wait`; False where no probe reads them)."""
        self.dataset, self.world_size, self.rank, self.shuffle_seed = dataset, world_size, rank, shuffle_seed
        try:
            self.num_batches = dataset.num_batches
        except NotImplementedError:
            self.num_batches = None
        if not self.num_batches:
            raise ConfigurationError(f"x: the PyDataset has num_batches={self.num_batches!r}; fit needs a finite "
                                     "number of batches an epoch (an epoch is one pass).")
        first = dataset[0]
        first = tuple(first) if isinstance(first, list) else first  # as Keras reads `[x, y]`
        self._structure = first if isinstance(first, tuple) else (first,)
        self._flat = [np.asarray(a) for a in tf.nest.flatten(self._structure)]
        self._spec = any_rows(tf.nest.pack_sequence_as(
            self._structure, [tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in self._flat]))
        self.epoch = self.batches = 0
        self._order = np.arange(self.num_batches)  # the epoch's order of the batches (`restore`)
        self._said_rows_missing = False  # `rows_are_missing`, once
        self.examples = None  # an epoch's: a PyDataset says its batches, not its examples
        self._epochs_begun = self._epochs_ended = 0  # calls of on_epoch_begin and on_epoch_end made
        self.global_batch = len(self._flat[0])
        self.ready_times = ReadyTimes(measure_waits)  # when each batch the step reads was ready: its waits
        self._first_read = 0  # the epoch's batch the newest pipeline reads first

    # The feed's interface (see planned_feed.py) ---------------------------------------------------
    def identity(self) -> Tuple[float, float]:
        """A digest of the next batch to train, and the epoch's length: every worker must read alike."""
        if self.batches >= self.num_batches:
            return 0.0, float(self.num_batches)
        return batch_number(self._read(int(self._order[self.batches]))), float(self.num_batches)

    def committed_data(self) -> Tuple[int, int]:
        """(which order: 0 in order, else 1 + the seed; the batches): a restart reading another order (shuffle
        or the seed changed, or a commit of a version that read in order) would train some batches of the
        epoch twice and others never, so it is refused."""
        return (0 if self.shuffle_seed is None else 1 + self.shuffle_seed), self.num_batches

    def restore(self, epoch: int, samples: int, saved: bytes) -> None:
        """The calls of `on_epoch_begin` / `on_epoch_end` up to `epoch`'s begin replayed (those not made yet),
        then the batches the commit trained (`saved`)."""
        del samples
        while self._epochs_begun <= epoch:
            if self._epochs_begun > self._epochs_ended:
                self.dataset.on_epoch_end()
                self._epochs_ended += 1
            self.dataset.on_epoch_begin()
            self._epochs_begun += 1
        self.epoch = epoch
        self.batches = int(saved) if saved else 0
        self._order = np.arange(self.num_batches) if self.shuffle_seed is None else \
            np.random.default_rng([self.shuffle_seed, epoch]).permutation(self.num_batches)

    def state(self) -> bytes:
        return str(self.batches).encode()

    def steps(self) -> Optional[int]:
        return self.num_batches - self.batches

    def distributed(self, strategy: tf.distribute.Strategy,
                    steps_per_call: int = 1) -> tf.distribute.DistributedDataset:
        """Read as the steps ask (a generator on tf.data's thread), however many a call takes."""
        del steps_per_call
        local = local_replicas(strategy, self.world_size)
        self._first_read = self.batches
        return strategy.distribute_datasets_from_function(lambda context: self.replica_dataset(
            local * self.world_size, self.rank * local, local, self.ready_times.stamp))

    def epoch_begins(self) -> None:
        """The epoch's steps ask for its pipeline from now (`ReadyTimes.epoch_begins`)."""
        self.ready_times.epoch_begins()

    def take_input_wait(self) -> float:
        """Seconds the training step waited for this worker's own input since the last call (`ReadyTimes`):
        what the straggler probe reports besides compute."""
        return self.ready_times.take()

    def time_input(self, seconds: float, rows_a_step: Optional[int] = None,
                   limit: float = LONGEST_READ_SECONDS) -> float:
        """0: a PyDataset's input is not read alone. Its `__getitem__` may draw from state it shares (a
        seeded generator: read one batch at a time, in order, it draws the same on every worker), and a read
        beside the pipeline's, on the ranks not straggling only, would draw differently on them."""
        del seconds, rows_a_step, limit
        return 0.0

    def replica_dataset(self, replicas: int, first: int, count: int, stamp=None) -> tf.data.Dataset:
        """Per-replica batches for this worker's replicas `first`..`first+count-1` of `replicas`, `count` for
        each global batch from the next untrained one to the epoch's end (`stamp`: applied to the global
        batches as they are read, `ReadyTimes.stamp`)."""
        dtypes = [tf.as_dtype(a.dtype) for a in self._flat]
        order = self._order  # this epoch's, whenever tf.data reads

        def read_rows(index):
            flat = self._read(int(order[index]))
            self._said_rows_missing = self._said_rows_missing or rows_are_missing(len(flat[0]), replicas)
            return flat

        def read(index):
            flat = tf.numpy_function(read_rows, [index], dtypes)
            for tensor, spec in zip(flat, tf.nest.flatten(self._spec)):
                tensor.set_shape(spec.shape)
            return tf.nest.pack_sequence_as(self._structure, flat)

        # One batch at a time, in order: a `__getitem__` drawing from a shared seeded generator then draws the
        # same on every worker (a user's reads may run in parallel inside `__getitem__`); but a restart draws
        # from the generator's seed again, not from where the run was: draws seeded by the epoch and the index
        # repeat a run without faults.
        batches = tf.data.Dataset.range(self.batches, self.num_batches).map(read)
        batches = (stamp(batches) if stamp else batches).prefetch(1)
        return batches.flat_map(lambda *batch: tf.data.Dataset.range(first, first + count).map(
            lambda q: replica_share(batch if len(batch) > 1 else batch[0], q, replicas)))

    def _read(self, index: int):
        return [np.asarray(a) for a in tf.nest.flatten(self.dataset[index])]

    def trained(self, steps: int, first_step: int = 0) -> int:
        del first_step
        steps = min(steps, self.num_batches - self.batches)
        if steps > 0:  # the call's first step read the next global batch
            self.ready_times.called(self.batches - self._first_read)
        self.batches += steps
        return steps

    def position(self) -> int:
        """The epoch's batches trained times the batch (what commits show as samples; `state` holds batches)."""
        return self.batches * self.global_batch

    def finished(self) -> bool:
        return self.batches >= self.num_batches

    nothing_left = finished

    def skipped(self) -> int:
        return 0

    def next_epoch(self) -> None:
        self.epoch += 1
        self.restore(self.epoch, 0, b"")
