"""A user's own `tf.data.Dataset` of global batches, trained exactly across every resize.

`model.fit` under a strategy takes a dataset whose batch is the global batch. Here every worker iterates
that whole pipeline (the semantics of `AutoShardPolicy.DATA`) and trains only its replicas' rows of each
global batch, so every worker's iterator stands at the same position whatever the world's size, and a
restart at any size goes on with the batch after the last commit. What is committed (`state`) is
tf.data's own iterator checkpoint (shuffle buffers, interleave cursors, filter positions, random seeds)
plus the global batches handed ahead of the last step trained (at most `steps_per_execution` + 3, see
`replica_dataset`): with them the next round trains exactly the batches a run without faults would, in
its order. Rows are dealt to the replicas of the moment as evenly as possible (replica q of R takes rows
[q*n//R, (q+1)*n//R)). Not its share only: that needs random access (`tf.data.experimental.at`), which
TensorFlow 2.21 refuses for file readers, `interleave`, `shuffle`, `filter`, mixes and a `map` fused into a
`batch`, and which crashed the process (a segmentation fault) where it was allowed (slices and a `map`),
once a dataset reading by index was iterated again or the process ended; a `Source` is the share-only path.

Each epoch is one pass over the dataset with an iterator of its own, as `model.fit` makes them. TensorFlow
restores a mid-epoch iterator exactly, but one saved after its shuffle's input ran out leaves the
dataset's reshuffle seeds where they were (measured: 6 of 24 positions of a repeated 60-example
shuffle restored a wrong next pass, seeded or not), so the epoch's fresh iterator state is committed too
and restored last: the next epoch's reshuffle then draws the seeds a run without faults drew.

A mix of datasets (`sample_from_datasets`, `choose_from_datasets`: TensorFlow's DirectedInterleave) is
restored wrongly by TensorFlow 2.21 once one of its inputs ran out: the restored iterator keeps counting
inputs that had run out as active, so once the rest run out it draws from its selector for ever and the read
never returns (it stopped a two-worker job for good; three mixed `range`s of 32 hung at the pass's end from
2 of 14 saved positions). Before any input ran out it restores exactly. So such a pipeline commits its newest
checkpoint taken before an input ran out (its anchor: the epoch's fresh iterator at worst) and how many
batches the pass had read at it; a restore reads the batches since then again (none while every input
lasts; from the first input's end on, the batches since the last commit before it). Inputs run out in the
checkpoint as far ahead of the step as tf.data reads (a `shuffle` after the mix: a buffer ahead), so on
each worker at its own time; every worker trains the same batches either way. A pipeline whose graph is
not read (over 2 GB) is taken as such a mix.

What tf.data cannot save (a Python generator, `from_generator`, `py_function`) or cannot repeat (a
pipeline with `deterministic=False`) is refused before the first step (`ConfigurationError`).
"""
import collections
import math
import threading
import time
from typing import Any, Deque, Iterator, List, Optional, Tuple

import numpy as np
import tensorflow as tf
from absl import logging
from google.protobuf.message import DecodeError
from tensorflow.python.data.ops import options as options_lib
from tensorflow.python.data.ops.directed_interleave_op import _DirectedInterleaveDataset as DirectedInterleaveDataset
from tensorflow.python.ops import gen_data_flow_ops, gen_dataset_ops

from tf_elastic.elastic.worker.data.feed import LONGEST_READ_SECONDS, local_replicas, seconds_per_step
from tf_elastic.elastic.worker.data.iterator_state import exhausted_mix, held_error
from tf_elastic.elastic.worker.data.source import digest
from tf_elastic.elastic.worker.errors import ConfigurationError

_FAIL_ON_EXTERNAL_STATE = options_lib.ExternalStatePolicy.FAIL.value
# sample_from_datasets' and choose_from_datasets' op: restored wrongly unless it stops at its first empty input.
_MIXES = ("DirectedInterleaveDataset", "ExperimentalDirectedInterleaveDataset")
_CACHES = ("CacheDataset", "CacheDatasetV2")
# A read alone copies the iterator's checkpoint (its buffers) twice more; above this many bytes it reads nothing.
LARGEST_COPY_BYTES = 256 << 20
_BATCH, _END, _FAILED = 1, 0, -1  # what a reader's queue hands it: a batch, the pass's end, the pipeline's error
# From this many workers on the chief says what reading the whole pipeline costs (each does W times the input
# work of a sharded read: measured 0.54x to 0.66x plain FILE sharding's steps/s at 4 workers) and names the way out.
_SAY_WHOLE_READ_COST_FROM = 4


class DatasetFeed:
    """Feeds this worker's replicas their rows of each global batch of `dataset`, and saves its position."""

    def __init__(self, dataset: tf.data.Dataset, world_size: int = 1, rank: int = 0):
        nodes = _check_pipeline(dataset)  # None: its graph was not read (any mix in it is taken as restored wrongly)
        mixes = None if nodes is None else [node for node in nodes if node.op in _MIXES]
        self._anchored = mixes is None or any(not node.attr["stop_on_empty_dataset"].b for node in mixes)
        self._mixes_drain = mixes is not None and _mixes_drain(dataset, len(mixes))  # a held error there is raised
        # A `cache` is shared by every iterator of the pipeline (a file's shards, or memory that a restore
        # resets): no second iterator reads it beside the pump's (`time_input`).
        self._cached = nodes is None or any(node.op in _CACHES for node in nodes)
        self.dataset, self.world_size, self.rank = dataset, world_size, rank
        if rank == 0 and world_size >= _SAY_WHOLE_READ_COST_FROM:
            logging.warning("x: each of the %d workers reads the whole tf.data pipeline and trains 1/%d of each "
                            "batch, %d times the input work of a sharded read; where input bounds a step, pass a "
                            "data.Source, which each worker reads its share of", world_size, world_size, world_size)
        self._flat_specs = tf.nest.flatten(any_rows(dataset.element_spec), expand_composites=True)
        self._lock = threading.Lock()  # the queue and counts: held briefly (a step's callback takes it)
        self._pulling = threading.Lock()  # the iterator: held while the user's pipeline makes a batch
        self._iterator: Optional[Iterator] = None
        self._alone: Optional[Iterator] = None  # a probation's reads alone, on from where the last one stopped
        self._epoch_start = b""  # the epoch's iterator as it was made: its reshuffle seeds
        self._anchor: Tuple[bytes, int] = (b"", 0)  # a mix: its restorable checkpoint, batches read at it
        self.replayed = 0  # batches read again to restore the last committed state (a mix's, past its anchor)
        self._exhausted = False
        self._queue: Deque[Any] = collections.deque()  # pulled (or restored) global batches not yet trained
        self._handed = 0  # of the queue, those the newest reader handed to the replicas
        self._readers = self._popped = 0  # readers opened; batches trained (and dropped from the queue) in all
        self._room = threading.Condition(self._lock)  # a reader's thread waits for trained batches
        self._made = 0  # advanced by each dataset made (`replica_dataset`: one a `model.fit`) and by `close`
        self._replicas = 1  # of the newest dataset made: a batch of fewer rows leaves some without one
        self._said_rows_missing = False  # `rows_are_missing`, once
        self._failure: Optional[Exception] = None  # the user's pipeline failed under a reader (`_pump`)
        self._starved_since: Optional[float] = None  # every handed batch was trained: the step waits for input
        self._asked: Optional[float] = None  # the epoch began, after a reader before it: its first batch is waited
        self._opened = False  # a reader Keras opened in this process (a restore's peek opens none)
        self._input_wait = 0.0  # seconds the step waited for a batch, since `take_input_wait`
        self.batches = self.trained_examples = 0  # trained in this epoch
        self.examples = None  # in an epoch: not known before it is read
        self.epoch = 0
        self.global_batch = 0  # the rows of the run's first batch (committed): what events and schedules report

    def identity(self) -> Tuple[float, float]:
        """What every worker must see alike: a digest of the next global batch (see `digest_ahead`), once
        the feed is positioned (nothing before)."""
        return (self.digest_ahead() if self._iterator is not None else 0.0), 0.0

    def committed_data(self) -> Tuple[int, int]:
        """A commit's position is the iterator's own: no fingerprint of a source (nor an array's) matches it."""
        return 0, 0

    def restore(self, epoch: int, samples: int, saved: bytes) -> None:
        """Where the agreed commit left the feed (`saved`: its `state`)."""
        del samples  # counted in `saved`
        self.epoch = epoch
        self.start(saved, epoch)
        if not self.global_batch:
            self.global_batch = self.first_rows()
            if not self.global_batch:
                raise ConfigurationError("x: the tf.data pipeline yields no batch: an epoch would have no step.")

    # Position -------------------------------------------------------------------------------------
    def start(self, state: bytes, epoch: int) -> None:
        """Positions the feed where a commit left it (`state`; empty: the start of `epoch` with nothing
        committed, after `epoch` fresh iterators as a run without faults made them). A pull of the reader
        closed here ends first: it must not leave its batch in the new queue."""
        self.close()
        with self._pulling:
            for _ in range(0 if state else epoch):
                iter(self.dataset)  # each draws the seeds of one epoch's reshuffle
            self._queue.clear()
            self._handed = self.batches = self.trained_examples = 0
            self._restore(state) if state else self._new_iterator()

    def _new_iterator(self) -> None:
        self._iterator, self._exhausted = iter(self.dataset), False
        self._epoch_start = self._checkpoint()
        self._anchor = (self._epoch_start, 0)

    def _checkpoint(self) -> bytes:
        """tf.data's checkpoint of the iterator. One that holds an error read ahead (`held_error`) is never
        committed: that error becomes the feed's failure, raised here and by every later `state`. After a
        failed read nothing is saved: the iterator is past the rows it failed on."""
        if self._failure is None:
            saved = _save(self._iterator)
            self._failure = held_error(saved, self._mixes_drain)
        if self._failure is not None:
            raise self._failure
        return saved

    def state(self) -> bytes:
        """The iterator's checkpoint (a mix's anchor), the epoch's fresh one, the batches pulled but not
        trained and the epoch's counts, in one string; once the pipeline failed, its error instead. The time
        it takes (it stops the pump) is no wait for input."""
        began = time.monotonic()
        with self._pulling, self._lock:
            saved, read = self._checkpoint(), self.batches + len(self._queue)
            if self._anchored and not exhausted_mix(saved):
                self._anchor = (saved, read)
            saved, at = self._anchor if self._anchored else (saved, read)
            parts = [saved, self._epoch_start, f"{self.batches} {self.trained_examples} {int(self._exhausted)} "
                     f"{self.global_batch} {at}".encode()]
            for batch in self._queue:
                parts += [tf.io.serialize_tensor(t).numpy() for t in tf.nest.flatten(batch, expand_composites=True)]
            if self._starved_since is not None:
                self._starved_since += time.monotonic() - began
        return tf.io.serialize_tensor(tf.constant(parts, tf.string)).numpy()

    def _restore(self, state: bytes) -> None:
        parts = tf.io.parse_tensor(state, tf.string).numpy().tolist()
        batches, examples, exhausted, self.global_batch, *at = (int(n) for n in parts[2].split())
        self.batches, self.trained_examples, self._exhausted = batches, examples, bool(exhausted)
        width = len(self._flat_specs)
        for first in range(3, len(parts), width):
            flat = [tf.io.parse_tensor(blob, spec.dtype)
                    for blob, spec in zip(parts[first:first + width], self._flat_specs)]
            self._queue.append(tf.nest.pack_sequence_as(self.dataset.element_spec, flat, expand_composites=True))
        at = at[0] if at else 0  # a commit older than anchors: a mix replays from the epoch's start
        anchor = parts[0] if at or not self._anchored else parts[1]
        self._iterator = _restored(self.dataset, anchor)
        self.replayed = batches + len(self._queue) - at if self._anchored else 0
        for _ in range(self.replayed):
            next(self._iterator, None)
        if self.replayed:
            logging.info("x: a mix of datasets restored by reading %d batches again (since its last commit "
                         "before an input ran out)", self.replayed)
        _restored(self.dataset, parts[1])  # last: the reshuffle seeds as the epoch's start left them
        self._epoch_start, self._anchor = parts[1], (anchor, at)

    # Feeding --------------------------------------------------------------------------------------
    def steps(self) -> Optional[int]:
        """Steps left in this epoch, where the dataset's length is known before it is read."""
        known = int(self.dataset.cardinality())
        return known - self.batches if known >= 0 and not self._exhausted else None

    def finished(self) -> bool:
        """Whether this epoch is trained to its end (read one batch ahead to know)."""
        return self._peek() is None

    nothing_left = finished  # a restored position at the end of a pass: the next epoch begins

    def skipped(self) -> int:
        """Nothing: a partial last batch is trained, split over the replicas as evenly as it goes."""
        return 0

    def position(self) -> int:
        """Examples of the epoch trained."""
        return self.trained_examples

    def distributed(self, strategy: tf.distribute.Strategy,
                    steps_per_call: int = 1) -> tf.distribute.DistributedDataset:
        """This worker's replicas' rows of each global batch, dealt to its replicas in order; one call of
        the training step reads `steps_per_call` global batches (`compile(steps_per_execution=...)`)."""
        local = local_replicas(strategy, self.world_size)
        return strategy.distribute_datasets_from_function(lambda context: self.replica_dataset(
            local * self.world_size, self.rank * local, local, steps_per_call))

    def replica_dataset(self, replicas: int, first: int, count: int, steps_per_call: int = 1) -> tf.data.Dataset:
        """Per-replica batches for this worker's replicas `first`..`first+count-1` of `replicas`, `count` for
        each global batch in turn, up to the epoch's end.

        Each reader (an iterator Keras makes of it) has a queue of its own, which a thread of ours fills with
        the global batches (`_pump`), `steps_per_call` and three more ahead of the trained ones (fewer would
        leave a call waiting for batches that only its end lets in); the rows are cut in the graph. The next
        global batch's shares wait in a prefetch (tf.data would inject an autotuned one), which holds one of
        those batches: with two more only, the pump starved it (measured at 2 workers of 14 ms steps, medians
        of five runs: 0.97x plain DATA's steps/s with three more, 0.93x with two and tf.data's own prefetch;
        of three: 0.86x with two and this one; a commit holds the one batch more). No Python runs on
        tf.data's threads for a batch, as it did in a `Dataset.from_generator` (measured: 0.5 to 1 ms of CPU
        less a batch)."""
        kinds = [tf.int32] + [spec.dtype for spec in self._flat_specs]  # the status (`_BATCH`...), the batch
        ahead = steps_per_call + 3  # one of them in the prefetch
        self._replicas = replicas
        with self._lock:
            self._made += 1
            made = self._made

        def reader(_):
            # Never full: at most `ahead` batches are handed and not trained, and then the end.
            queue = gen_data_flow_ops.fifo_queue_v2(component_types=kinds, capacity=ahead + 1)
            opened = tf.py_function(lambda handle: self._open_reader(handle, ahead, made), [queue], tf.int64)
            handed = tf.data.Dataset.from_tensors(opened).repeat().map(
                lambda _: tuple(gen_data_flow_ops.queue_dequeue_v2(queue, kinds)))
            return handed.take_while(lambda status, *_: status != _END).flat_map(shares)

        def shares(status, *flat):
            failed = tf.cond(status == _FAILED, lambda: tf.py_function(self._raise_failure, [], tf.bool),
                             lambda: tf.constant(False))
            with tf.control_dependencies([failed]):
                flat = [tf.identity(part) for part in flat]
            for part, spec in zip(flat, self._flat_specs):
                part.set_shape(spec.shape)
            batch = tf.nest.pack_sequence_as(self.dataset.element_spec, flat, expand_composites=True)
            return tf.data.Dataset.range(first, first + count).map(lambda q: replica_share(batch, q, replicas))

        return tf.data.Dataset.range(1).flat_map(reader).prefetch(count)

    def _open_reader(self, queue: tf.Tensor, ahead: int, made: int) -> int:
        """A reader's start: its thread hands it the untrained batches, then new ones. The reader before it
        (one Keras dropped) is done: its thread ends. A reader of a dataset made before the last `close`
        (one `model.fit` made it), which tf.data may open as that `model.fit` ends, is never read: it must
        not end the newest reader, and a read of it fails at once (its queue closed)."""
        with self._lock:
            stale = made != self._made
            me = 0 if stale else self._supersede()
            self._opened = self._opened or not stale
        if stale:
            _close(queue)
        else:
            threading.Thread(target=self._pump, args=(me, queue, ahead), name=f"dataset-feed-reader-{me}",
                             daemon=True).start()
        return me

    def close(self) -> None:
        """Ends the newest reader's thread (the epoch is over, or training is); the datasets made so far
        open no reader."""
        with self._lock:
            self._supersede()
            self._made += 1

    def time_input(self, seconds: float, rows_a_step: Optional[int] = None,
                   limit: float = LONGEST_READ_SECONDS) -> float:
        """Seconds per step of this worker's input read alone (`feed.seconds_per_step`, `limit` its;
        `rows_a_step`: every worker reads whole global batches): a copy of the pump's iterator (tf.data's
        checkpoint, its buffers with it) reads on from where the pump stands, the batches not read yet (a read
        from the pass's start would come from the page cache, and fill a shuffle's buffer first); where the
        pump has no position (a probation's worker) one pass read on from where the last read stopped, a new
        one once it ran out; a fresh pass where the pump's pass ended (the next epoch's), and a
        mix whose input ran out reads from its anchor (a copy of it would be restored wrongly). A new iterator
        draws the next epoch's reshuffle seeds on the ranks that read only: they are put back as the epoch's
        start left them, as a restore does. 0 (not weighed): a pipeline with a `cache`, a checkpoint over
        LARGEST_COPY_BYTES, an iterator that cannot be made, a copy that ran out before `seconds` (a pass's
        last batches, from its buffers). The time it takes to copy is no wait for input."""
        del rows_a_step
        if self._cached:
            return 0.0
        if self._iterator is None:  # no pump: a probation's worker
            return self._read_on(seconds, limit)
        began = time.monotonic()
        with self._pulling:
            try:
                elements, copied = self._copy()
            except tf.errors.OpError as error:
                return _not_weighed(error)
            finally:
                if self._epoch_start:
                    _restored(self.dataset, self._epoch_start)
                with self._lock:
                    if self._starved_since is not None:
                        self._starved_since += time.monotonic() - began
        if elements is None:
            return 0.0
        ran_out = []
        timed = seconds_per_step(_noting_the_end(elements, ran_out), 1, seconds, limit)
        return 0.0 if copied and ran_out else timed

    def _read_on(self, seconds: float, limit: float) -> float:
        """A probation's read alone (asked again every interval): on from where the last one stopped (a fresh
        pass would read what the last left in the page cache, and fill a shuffle's buffer again); where it
        ran out, again from a new pass at once, within what is left of `limit` (a pass's last batches come
        from the buffers its pipeline filled between reads: timed quick, or not at all, they would let a
        slow host rejoin); a new pass after a read still at it past `limit` too (its thread is left to end
        at its next element: no other reads beside it)."""
        deadline, timed = time.monotonic() + limit, 0.0
        for _ in range(2):
            if self._alone is None:
                try:
                    self._alone = iter(self.dataset)
                except tf.errors.OpError as error:
                    return _not_weighed(error)
            ran_out = []
            timed = seconds_per_step(_noting_the_end(self._alone, ran_out), 1, seconds,
                                     max(0.0, deadline - time.monotonic()))
            if ran_out or timed == math.inf:
                self._alone = None
            if not ran_out:
                break
        return timed

    def _copy(self) -> Tuple[Optional[Iterator], bool]:
        """(`_pulling` held.) An iterator where the pump's stands (None: too large to copy), and whether it
        is a copy (`time_input`)."""
        if self._exhausted or self._failure is not None:
            return iter(self.dataset), False
        saved = _save(self._iterator)
        if self._anchored and exhausted_mix(saved):
            saved = self._anchor[0]
        if len(saved) > LARGEST_COPY_BYTES:
            logging.info("the input is not read alone: its iterator's checkpoint holds %d MB", len(saved) >> 20)
            return None, True
        return _restored(self.dataset, saved), True

    def epoch_begins(self) -> None:
        """The epoch's steps ask for its first batch from now: its new reader's wait for it counts from here,
        except in a round's first epoch (its first step traces too)."""
        with self._lock:
            self._asked = time.monotonic() if self._opened else None

    def take_input_wait(self) -> float:
        """Seconds the training step waited for this worker's own input since the last call: from a step's
        end with no batch handed ahead to the next batch handed, and a new epoch's first from the epoch's
        begin (`epoch_begins`; a round's first batch not counted: it waits for the start, not for the
        pipeline; a commit's `state` not counted). Approximate: the time
        after a step in callbacks counts while nothing is handed, and a call of several steps counts only
        the wait for its first batch. What the straggler probe reports besides compute."""
        with self._lock:
            waited, self._input_wait = self._input_wait, 0.0
        return waited

    def _supersede(self) -> int:
        """(The lock held.) A new newest reader's number: the thread of the one before ends."""
        self._readers += 1
        self._handed = 0
        self._starved_since, self._asked = self._asked, None
        self._room.notify_all()
        return self._readers

    def _pump(self, me: int, queue: tf.Tensor, ahead: int) -> None:
        """Hands reader `me` its batches through `queue`, then the end; an error of the user's pipeline is
        kept and raised in the reader (`_raise_failure`), where Keras reads it. It never waits in the queue
        (which TensorFlow deletes with the reader) but for room ahead of the trained batches (`_global_batches`).
        A reader it cannot end (a newer one opened) has its queue closed: a read of it fails, never waits."""
        try:
            for batch in self._global_batches(me, ahead):
                if not _hand(queue, [_BATCH, *tf.nest.flatten(batch, expand_composites=True)]):
                    return
            status = _END
        except Exception as error:
            self._failure, status = error, _FAILED
        end = [tf.zeros([d or 0 for d in spec.shape] if spec.shape.rank is not None else [], spec.dtype)
               for spec in self._flat_specs]
        try:
            ended = me == self._readers and _hand(queue, [status, *end])
        except tf.errors.OpError:
            ended = False
        if not ended:
            _close(queue)

    @property
    def failure(self) -> Optional[Exception]:
        """The user's pipeline's own error, if it failed: Keras sees it as `UnknownError`, the type a Python
        function's error takes in a graph, which would hide whether it was bad data or a failed read."""
        return self._failure

    def _raise_failure(self) -> bool:
        """The user's pipeline's error, raised in the reader's graph (a `py_function`)."""
        raise self._failure

    def _global_batches(self, me: int, ahead: int):
        """Reader `me`'s batches, at most `ahead` of them handed and not trained: the untrained ones in
        order, then new ones. Each reader starts at the first untrained batch: one Keras opens to read a
        batch for its model build and drops must not cost one. Ends when a newer reader opens."""
        with self._lock:
            at = self._popped  # the absolute index of the next batch
            left = self.steps()
        end = None if left is None else at + left  # a known length is never read past
        while end is None or at < end:
            with self._room:
                self._room.wait_for(lambda: me != self._readers or at - self._popped < ahead)
                if me != self._readers:
                    return
            batch = self._batch(at)
            if batch is None:
                return
            self._said_rows_missing = self._said_rows_missing or rows_are_missing(rows_of(batch), self._replicas)
            at += 1
            with self._lock:
                if me == self._readers:
                    self._handed = at - self._popped
                    if self._starved_since is not None:
                        self._input_wait += time.monotonic() - self._starved_since
                        self._starved_since = None
            yield batch

    def _batch(self, at: int) -> Any:
        """The batch of absolute index `at` (read from the pipeline if it is next), or None: the pass ended,
        or a reader that lags behind the trained batches (one Keras dropped) asks for one already gone."""
        while True:
            with self._lock:
                if at < self._popped:
                    return None
                if at - self._popped < len(self._queue):
                    return self._queue[at - self._popped]
                if self._exhausted:
                    return None
            self._pull()

    def _pull(self) -> None:
        """One more batch from the pipeline into the queue (unless another reader just did)."""
        with self._pulling:
            with self._lock:
                if self._exhausted:
                    return
            try:
                batch = next(self._iterator)
            except StopIteration:
                batch = None
            except Exception as error:
                self._failure = error  # no state of this iterator may be committed now (`state`)
                raise
            with self._lock:
                if batch is None:
                    self._exhausted = True
                else:
                    self._queue.append(batch)

    def trained(self, steps: int, first_step: int = 0) -> int:
        """`steps` more global batches were trained (at most those handed out); returns how many."""
        del first_step
        with self._lock:
            steps = min(steps, self._handed)
            for _ in range(steps):
                self.trained_examples += rows_of(self._queue.popleft())
                self.batches += 1
            self._handed -= steps
            self._popped += steps
            if steps and not self._handed:
                self._starved_since = time.monotonic()
            self._room.notify_all()
        return steps

    def next_epoch(self) -> None:
        """The epoch is trained: the next one is a new pass, with a fresh iterator."""
        self.close()
        with self._pulling, self._lock:
            self._new_iterator()
            self.batches = self.trained_examples = 0
            self.epoch += 1

    def digest_ahead(self) -> float:
        """`batch_number` of the next global batch to train (0: none left): every worker must read the same
        stream (an order that is not repeatable would differ here)."""
        batch = self._peek()
        return 0.0 if batch is None else batch_number(batch)

    def first_rows(self) -> int:
        """Rows of the next global batch (0: none left this epoch)."""
        batch = self._peek()
        return 0 if batch is None else rows_of(batch)

    def _peek(self) -> Any:
        """The next batch to train (read now if none is waiting), or None at the end of the pass."""
        with self._lock:
            at = self._popped
        return self._batch(at)


def _check_pipeline(dataset: tf.data.Dataset) -> Optional[list]:
    """Refuses, in one line, what cannot be resumed exactly: state tf.data cannot checkpoint, an order that
    is not repeatable, and repeats (found in the pipeline's graph, before any iterator is made); returns
    the graph's `NodeDef`s (its mixes of datasets, which TensorFlow restores some wrongly, see the module's
    docstring; its caches), None where the graph is not read. The graph
    holds the arrays of a `from_tensor_slices`: serializing it costs a copy of them once (22 s for 2.4 GB
    measured here), which arrays passed as x and y do not."""
    try:
        serialized = dataset._as_serialized_graph(external_state_policy=options_lib.ExternalStatePolicy.FAIL)
    except tf.errors.FailedPreconditionError as error:
        cause = str(error).split("graph: ")[-1].split("[Op:")[0].strip().rstrip(".")
        raise ConfigurationError(f"x: tf.data cannot save this pipeline's position ({cause}): a Python "
                                 "generator, Dataset.from_generator, tf.py_function or a stateful random op keeps "
                                 "state outside TensorFlow's checkpoint. Build it from tf.data ops and stateless "
                                 "random ops (tf.random.stateless_*), or pass arrays.") from None
    try:
        graph = tf.compat.v1.GraphDef.FromString(serialized.numpy())
    except DecodeError:  # over protobuf's 2 GB: arrays held in the graph (`from_tensor_slices` of large arrays)
        logging.warning("x: the tf.data pipeline's graph is over 2 GB (arrays inside it?): its order and repeats "
                        "are not checked; pass large arrays as x and y instead")
        return None
    nodes = [*graph.node, *(node for function in graph.library.function for node in function.node_def)]
    unordered = sorted({node.op for node in nodes if node.attr["deterministic"].s == b"false"
                        or node.attr["sloppy"].b} | ({"options"} if dataset.options().deterministic is False
                                                      else set()))
    if unordered:
        raise ConfigurationError(f"x: the tf.data pipeline reads in no fixed order (deterministic=False in "
                                 f"{', '.join(unordered)}): each worker and each restart could read another "
                                 "order; leave it deterministic.")
    if int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY or any(node.op == "RepeatDataset" for node in nodes):
        raise ConfigurationError("x: the tf.data pipeline repeats (.repeat()): an epoch is one pass over it (give "
                                 "epochs), and TensorFlow restores a repeated reshuffle wrongly at some positions.")
    return nodes


def _not_weighed(error: tf.errors.OpError) -> float:
    """0: a pipeline whose iterator cannot be made (a `cache` file in use) is not read alone, and says so."""
    logging.warning("the input could not be read alone (%s): it is not weighed", error.message[:200])
    return 0.0


def _noting_the_end(elements: Iterator, ended: list) -> Iterator:
    """`elements`, and True appended to `ended` once they ran out."""
    yield from elements
    ended.append(True)


def _mixes_drain(dataset: tf.data.Dataset, in_graph: int) -> bool:
    """Whether every mix of datasets in the pipeline (`in_graph` of them) reads each of its inputs to its
    end: an error an input read ahead is then raised when the mix reaches it, as anywhere else, and a commit
    holding it is refused (`held_error`). So `sample_from_datasets` (its selector never ends) without
    `stop_on_empty_dataset`; not a mix that stops at its first empty input or whose selector ends
    (`choose_from_datasets`), nor one the pipeline's Python objects do not show (built inside a function)."""
    found, seen, stack = [], set(), [dataset]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, DirectedInterleaveDataset):
            found.append(node)
        stack.extend(node._inputs())
    return len(found) == in_graph and all(
        not mix._stop_on_empty_dataset and int(mix._selector_input.cardinality()) == tf.data.INFINITE_CARDINALITY
        for mix in found)


def _hand(queue: tf.Tensor, parts: List[Any]) -> bool:
    """Puts `parts` in a reader's queue; False when the reader is gone (TensorFlow deleted its queue)."""
    try:
        gen_data_flow_ops.queue_enqueue_v2(queue, parts)
        return True
    except (tf.errors.CancelledError, tf.errors.NotFoundError):
        return False


def _close(queue: tf.Tensor) -> None:
    """Closes a reader's queue (unless TensorFlow deleted it with the reader): its reads fail once empty."""
    try:
        gen_data_flow_ops.queue_close_v2(queue)
    except tf.errors.NotFoundError:
        pass


def _save(iterator) -> bytes:
    """tf.data's checkpoint of `iterator`, refusing state outside TensorFlow (FailedPreconditionError)."""
    saved = gen_dataset_ops.serialize_iterator(iterator._iterator_resource,
                                               external_state_policy=_FAIL_ON_EXTERNAL_STATE)
    return tf.io.serialize_tensor(saved).numpy()


def _restored(dataset: tf.data.Dataset, saved: bytes):
    """A new iterator of `dataset` at `saved` (`_save`'s), or a one-line error when it does not fit."""
    iterator = iter(dataset)
    try:
        gen_dataset_ops.deserialize_iterator(iterator._iterator_resource, tf.io.parse_tensor(saved, tf.variant))
    except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError, ValueError) as error:
        raise ConfigurationError(f"x: the committed position does not fit this tf.data pipeline ("
                                 f"{str(error).splitlines()[0][:200]}); restart with the pipeline the run "
                                 "began with, or start a new run (another run dir).") from None
    return iterator


def replica_share(batch: Any, q, replicas: int) -> Any:
    """Replica `q`'s rows of a global batch: [q*n//R, (q+1)*n//R) of its n rows (eager or in a graph)."""
    first = tf.nest.flatten(batch)[0]
    rows = first.nrows() if isinstance(first, tf.RaggedTensor) else tf.shape(first, out_type=tf.int64)[0]
    q = tf.cast(q, tf.int64)
    begin, end = q * rows // replicas, (q + 1) * rows // replicas
    return tf.nest.map_structure(lambda t: t[begin:end], batch)


def rows_are_missing(rows: int, replicas: int) -> bool:
    """Whether a global batch of `rows` leaves some of `replicas` with no row (a short last batch at a large
    world), and if so says so: a layer of batch statistics (BatchNormalization) makes its moments, and then
    its weights, NaN there, as it does under plain MultiWorkerMirroredStrategy. A feed says it once."""
    if rows >= replicas:
        return False
    logging.warning("x: a global batch of %d rows for %d replicas: %d of them train on no row, and a layer of batch "
                    "statistics (BatchNormalization) turns NaN there (as under plain MultiWorkerMirroredStrategy); "
                    "batch with drop_remainder=True, or keep every batch at least as many rows as there are "
                    "replicas", rows, replicas, replicas - rows)
    return True


def batch_number(batch: Any) -> float:
    """48 bits of a digest of a batch's bytes, exact in the workers' float64 sums (as `fingerprint_number`)."""
    flat = tf.nest.flatten(batch, expand_composites=True)
    return float(int(digest(*(np.frombuffer(tf.io.serialize_tensor(t).numpy(), np.uint8) for t in flat))[:12], 16))


def rows_of(batch: Any) -> int:
    first = tf.nest.flatten(batch)[0]
    return int(first.nrows()) if isinstance(first, tf.RaggedTensor) else int(first.shape[0])


def any_rows(spec: Any) -> Any:
    """`spec` with an unknown batch dimension: replicas' shares differ when the replicas do not divide it."""
    def relax(s):
        if isinstance(s, tf.RaggedTensorSpec):
            return tf.RaggedTensorSpec([None, *s.shape[1:]], s.dtype, s.ragged_rank, s.row_splits_dtype)
        if isinstance(s, tf.TensorSpec):
            return tf.TensorSpec([None, *s.shape[1:]], s.dtype)
        raise ConfigurationError(f"x: the tf.data pipeline yields a {type(s).__name__}; fit takes dense and "
                                 "ragged tensors (make sparse ones dense in the pipeline).")
    return tf.nest.map_structure(relax, spec)

