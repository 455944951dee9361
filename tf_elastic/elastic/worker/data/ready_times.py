"""How long a step waited for a batch that tf.data reads inside the compiled step (a `Source`'s, a PyDataset's).

No Python code runs between a `Source`'s pipeline and the step that reads it, so nothing there sees the
step wait. `ReadyTimes.stamp` adds a stage just before the pipeline's prefetch that writes each element's
wall time, as it enters the buffer, into a hash table (a table, not a variable: a variable made under a
distribution strategy's scope would be a distributed one); after each call of steps `called` notes the
element its first step waited for and when the call before it ended, and `take` looks them all up in one
op (at each straggler probe, not at each step). A step waited for what became ready after the call before
it ended: the same measure as `DatasetFeed.take_input_wait` (the callbacks' time after a step counts while
nothing is ready; a call of several steps counts only its first step's wait). An epoch's pipeline is new:
its first call waited for what became ready after the epoch began (`epoch_begins`: its iterator's start, a
run's first read; on a disk capped at 64 KB/s, 2.5 s of TFRecords an epoch whose 21 steps then took 1 ms
each, that went uncounted), except a round's first pipeline, whose first call traces the step too (as
`DatasetFeed` counts a new epoch's first batch). The stamp costs tf.data 15-25 us an element (an enumerate and
a map, against the same pipeline unstamped on 2 cores), off the step's path unless the step waits for its
input: at 64-image batches `bench_input` finds it within its noise.
"""
import collections
import time
from typing import Deque, Optional, Tuple

import numpy as np
import tensorflow as tf

# Ring slots of the table: far more than a prefetch ever holds ahead of the step. Times are looked up (`take`,
# or once the oldest pending is SLOTS // 2 behind the newest read) before a newer element takes their slot.
SLOTS = 1 << 16


class ReadyTimes:
    def __init__(self, measuring: bool = True):
        """`measuring`: False where nothing reads the waits (the straggler probe is off): no stamp is paid."""
        self.measuring = measuring
        self._table: Optional[tf.lookup.experimental.MutableHashTable] = None
        # (element, when the call before ended, or the epoch began)
        self._pending: Deque[Tuple[int, float]] = collections.deque()
        self._last_end: Optional[float] = None
        self._asked: Optional[float] = None  # when the epoch began, if a pipeline was read before it
        self._read_before = False
        self._waited = 0.0

    def stamp(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """`dataset` with each element's ready time recorded as it is produced: put it before the prefetch.
        Each new pipeline (an epoch's) calls it once; its elements count from 0. (Keras opens no iterator
        for a next epoch: `feed.to_replicas` hides the length; in a world of one replica its build reads a
        batch at each `fit` first, whose stamps the epoch's own iterator writes again.)"""
        self._flush()
        if not self.measuring:
            return dataset
        table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float64, default_value=-1.0)
        self._table, self._last_end = table, None

        def stamped(element_index, element):
            with tf.control_dependencies([table.insert(element_index % SLOTS, tf.timestamp())]):
                return tf.nest.map_structure(tf.identity, element)

        return dataset.enumerate().map(stamped)

    def epoch_begins(self) -> None:
        """The steps ask for a new pipeline's first element from now (not counted in a round's first epoch)."""
        self._asked = time.time() if self._read_before else None

    def called(self, element: int) -> None:
        """A call of steps ended whose first step waited for the pipeline's `element` (its last replica's)."""
        now = time.time()
        since = self._asked if self._last_end is None else self._last_end
        if since is not None and self.measuring:
            self._pending.append((element, since))
            if self._pending[0][0] < element - SLOTS // 2:  # looked up before a newer element takes its slot
                self._flush()
        self._last_end, self._asked, self._read_before = now, None, True

    def take(self) -> float:
        """Seconds the steps waited for their input since the last call."""
        self._flush()
        waited, self._waited = self._waited, 0.0
        return waited

    def _flush(self) -> None:
        if self._pending and self._table is not None:
            elements, since = zip(*self._pending)
            ready = self._table.lookup(tf.constant(elements, tf.int64) % SLOTS).numpy()
            known = ready > 0  # every element looked up was read by a step, so it was stamped
            self._waited += float(np.sum(np.maximum(0.0, ready - np.asarray(since))[known]))
        self._pending.clear()
