"""A user's own `tf.data.Dataset` of global batches, trained exactly across every resize.

`model.fit` under a strategy takes a dataset whose batch is the global batch. Here every worker iterates
that whole pipeline (the semantics of `AutoShardPolicy.DATA`) and trains only its replicas' rows of each
global batch, so every worker's iterator stands at the same position whatever the world's size, and a
restart at any size goes on with the batch after the last commit. What is committed (`state`) is
tf.data's own iterator checkpoint (shuffle buffers, interleave cursors, filter positions, random seeds)
plus the global batches the strategy's prefetch pulled ahead of the last step trained: with them the
next round trains exactly the batches a run without faults would, in its order. Rows are dealt to the
replicas of the moment as evenly as possible (replica q of R takes rows [q*n//R, (q+1)*n//R)).

Each epoch is one pass over the dataset with an iterator of its own, as `model.fit` makes them. TensorFlow
restores a mid-epoch iterator exactly, but one saved after its shuffle's input ran out leaves the
dataset's reshuffle seeds where they were (measured: 6 of 24 positions of a repeated 60-example
shuffle restored a wrong next pass, seeded or not), so the epoch's fresh iterator state is committed too
and restored last: the next epoch's reshuffle then draws the seeds a run without faults drew.

What tf.data cannot save (a Python generator, `from_generator`, `py_function`) or cannot repeat (a
pipeline with `deterministic=False`) is refused before the first step (`ConfigurationError`).
"""
import collections
import hashlib
import threading
from typing import Any, Deque, Iterator, Optional

import tensorflow as tf
from tensorflow.python.ops import gen_dataset_ops

from tf_elastic.elastic.worker.errors import ConfigurationError

_FAIL_ON_EXTERNAL_STATE = 2  # tf.data's ExternalStatePolicy.FAIL


class DatasetFeed:
    """Feeds this worker's replicas their rows of each global batch of `dataset`, and saves its position."""

    def __init__(self, dataset: tf.data.Dataset):
        if dataset.options().deterministic is False:
            raise ConfigurationError("x: the tf.data pipeline sets deterministic=False, so that each worker (and "
                                     "each restart) could read another order; leave it deterministic.")
        self.dataset = dataset
        self._flat_specs = tf.nest.flatten(dataset.element_spec, expand_composites=True)
        self._lock = threading.Lock()
        self._iterator: Optional[Iterator] = None
        self._epoch_start = b""  # the epoch's iterator as it was made: its reshuffle seeds
        self._exhausted = False
        self._queue: Deque[Any] = collections.deque()  # pulled (or restored) global batches not yet trained
        self._handed = 0  # of the queue, those already handed to the replicas
        self.batches = self.examples = 0  # trained in this epoch

    # Position -------------------------------------------------------------------------------------
    def start(self, state: bytes, epoch: int) -> None:
        """Positions the feed where a commit left it (`state`; empty: the start of `epoch` with nothing
        committed, after `epoch` fresh iterators as a run without faults made them)."""
        for _ in range(0 if state else epoch):
            iter(self.dataset)  # each draws the seeds of one epoch's reshuffle
        self._queue.clear()
        self._handed = self.batches = self.examples = 0
        try:
            self._restore(state) if state else self._new_iterator()
        except tf.errors.FailedPreconditionError as error:  # serialize_iterator: state outside TensorFlow
            cause = str(error).split("}}")[-1].split("[Op:")[0].strip()
            raise ConfigurationError(f"x: tf.data cannot save this pipeline's position ({cause}): a Python "
                                     "generator, Dataset.from_generator or tf.py_function has state outside "
                                     "TensorFlow. Build it from tf.data ops (from_tensor_slices, TFRecordDataset, "
                                     "map with TensorFlow ops) or pass arrays.") from None

    def _new_iterator(self) -> None:
        self._iterator, self._exhausted = iter(self.dataset), False
        self._epoch_start = _save(self._iterator)

    def state(self) -> bytes:
        """The iterator's checkpoint, the epoch's fresh one, the batches pulled but not trained and the
        epoch's counts, in one string."""
        with self._lock:
            parts = [_save(self._iterator), self._epoch_start,
                     f"{self.batches} {self.examples} {int(self._exhausted)}".encode()]
            for batch in self._queue:
                parts += [tf.io.serialize_tensor(t).numpy() for t in tf.nest.flatten(batch, expand_composites=True)]
        return tf.io.serialize_tensor(tf.constant(parts, tf.string)).numpy()

    def _restore(self, state: bytes) -> None:
        parts = tf.io.parse_tensor(state, tf.string).numpy().tolist()
        try:
            self._iterator = _load(iter(self.dataset), parts[0])
            _load(iter(self.dataset), parts[1])  # last: the reshuffle seeds as the epoch's start left them
        except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError, ValueError) as error:
            raise ConfigurationError(f"x: the committed position does not fit this tf.data pipeline ("
                                     f"{str(error).splitlines()[0][:200]}); restart with the pipeline the run "
                                     "began with, or start a new run (another run dir).") from None
        self._epoch_start = parts[1]
        batches, examples, exhausted = (int(n) for n in parts[2].split())
        self.batches, self.examples, self._exhausted = batches, examples, bool(exhausted)
        width = len(self._flat_specs)
        for at in range(3, len(parts), width):
            flat = [tf.io.parse_tensor(blob, spec.dtype) for blob, spec in zip(parts[at:at + width], self._flat_specs)]
            self._queue.append(tf.nest.pack_sequence_as(self.dataset.element_spec, flat, expand_composites=True))

    # Feeding --------------------------------------------------------------------------------------
    def steps_left(self) -> Optional[int]:
        """Steps left in this epoch, where the dataset's length is known before it is read."""
        known = int(self.dataset.cardinality())
        return known - self.batches if known >= 0 and not self._exhausted else None

    def finished(self) -> bool:
        """Whether this epoch is trained to its end."""
        return self._exhausted and not self._queue

    def replica_dataset(self, replicas: int, first: int, count: int) -> tf.data.Dataset:
        """Per-replica batches for this worker's replicas `first`..`first+count-1` of `replicas`, `count` for
        each global batch in turn, up to the epoch's end."""
        def split():
            for batch in self._global_batches():
                rows = _rows(batch)
                for q in range(first, first + count):
                    yield tf.nest.map_structure(lambda t: t[q * rows // replicas:(q + 1) * rows // replicas], batch)

        return tf.data.Dataset.from_generator(split, output_signature=_any_rows(self.dataset.element_spec))

    def _global_batches(self):
        limit = self.steps_left()
        handed = 0
        while limit is None or handed < limit:
            with self._lock:
                if self._handed == len(self._queue) and not self._pull():
                    return
                batch = self._queue[self._handed]
                self._handed += 1
            handed += 1
            yield batch

    def _pull(self) -> bool:
        if self._exhausted:
            return False
        try:
            self._queue.append(next(self._iterator))
            return True
        except StopIteration:
            self._exhausted = True
            return False

    def trained(self, steps: int) -> None:
        """`steps` more global batches were trained."""
        with self._lock:
            for _ in range(min(steps, len(self._queue))):
                self.examples += _rows(self._queue.popleft())
                self.batches += 1
            self._handed = max(0, self._handed - steps)

    def next_epoch(self) -> None:
        """The epoch is trained: the next one is a new pass, with a fresh iterator."""
        with self._lock:
            self._new_iterator()
            self.batches = self.examples = 0

    def digest_ahead(self) -> float:
        """48 bits of the SHA-256 of the next global batch (0: none left), read now and trained later: every
        worker must read the same stream (an order that is not repeatable would differ here)."""
        with self._lock:
            if self._handed == len(self._queue) and not self._pull():
                return 0.0
            flat = tf.nest.flatten(self._queue[self._handed], expand_composites=True)
        digest = hashlib.sha256(b"".join(tf.io.serialize_tensor(t).numpy() for t in flat)).hexdigest()
        return float(int(digest[:12], 16))

    def first_rows(self) -> int:
        """Rows of the next global batch (0: none left): the global batch fit reports."""
        with self._lock:
            if self._handed == len(self._queue) and not self._pull():
                return 0
            return _rows(self._queue[self._handed])


def _save(iterator) -> bytes:
    """tf.data's checkpoint of `iterator`, refusing state outside TensorFlow (FailedPreconditionError)."""
    saved = gen_dataset_ops.serialize_iterator(iterator._iterator_resource,
                                               external_state_policy=_FAIL_ON_EXTERNAL_STATE)
    return tf.io.serialize_tensor(saved).numpy()


def _load(iterator, saved: bytes):
    gen_dataset_ops.deserialize_iterator(iterator._iterator_resource, tf.io.parse_tensor(saved, tf.variant))
    return iterator


def _rows(batch: Any) -> int:
    first = tf.nest.flatten(batch)[0]
    return int(first.nrows()) if isinstance(first, tf.RaggedTensor) else int(first.shape[0])


def _any_rows(spec: Any) -> Any:
    """`spec` with an unknown batch dimension: replicas' shares differ when the replicas do not divide it."""
    def relax(s):
        if isinstance(s, tf.RaggedTensorSpec):
            return tf.RaggedTensorSpec([None, *s.shape[1:]], s.dtype, s.ragged_rank, s.row_splits_dtype)
        if isinstance(s, tf.TensorSpec):
            return tf.TensorSpec([None, *s.shape[1:]], s.dtype)
        raise ConfigurationError(f"x: the tf.data pipeline yields a {type(s).__name__}; fit takes dense and "
                                 "ragged tensors (make sparse ones dense in the pipeline).")
    return tf.nest.map_structure(relax, spec)

