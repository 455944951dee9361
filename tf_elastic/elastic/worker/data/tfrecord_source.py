"""TFRecord shards of tf.train.Example as a source, read by runs of consecutive records from exact offsets.

Only file names, offsets and labels are held in memory; records are read and parsed inside the tf.data
graph. A run is read three ways: whole and parsed at once (the usual case); if that fails, again record
by record (naming a record that does not parse, or failing with the read's own error); and, inside that
second try, its bytes checked in Python (naming a corrupt record). Bad data fails with an error naming the
shard and byte, which `fit` raises as `ConfigurationError` (exit 78 from a worker). A shard that does not
read (gone, cut short, an object store's transient error) fails with the read's own error: a restart may help.
"""
import re
from typing import Callable, List, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_elastic.elastic.protocol import first_line
from tf_elastic.elastic.worker.data.image_files import is_image
from tf_elastic.elastic.worker.data.index_cache import IndexCache, shard_identity
from tf_elastic.elastic.worker.data.parse import default_parse, vector_parse
from tf_elastic.elastic.worker.data.parse_key import parse_key
from tf_elastic.elastic.worker.data.source import AUTOTUNE, Source, digest
from tf_elastic.elastic.worker.data.tfrecord_format import payload_ok, read_header, record_offsets
from tf_elastic.elastic.worker.errors import ConfigurationError


def _reason(error: tf.errors.OpError) -> str:
    """An error's first line, without the prefix tf.data puts before an error in a user function."""
    return re.sub(r"^Error in user-defined function passed to .*? transformation with iterator: \S+: ", "",
                  first_line(error, limit=10_000))[:300]


RUN_BYTES = 4 << 20  # a run of records is read with one file open and held whole: at most this many bytes
BUFFER = 1 << 20  # read buffer of a run, at most


class TFRecordSource(Source):
    """TFRecord shards of tf.train.Example with an exact position per record.

    The record offsets come from the shards' headers (one sequential read per shard; with `cache_dir`,
    only for shards not read before). An epoch visits the shards in a seeded order, each from a seeded
    rotation of its records, so a worker's share of a global batch is a run of consecutive records, read
    with one file open from a seek to its first record (any other order works, only slower). A record
    that does not parse, or fails its checksum, fails the run with an error naming the shard and byte.
    `parse(record) -> (encoded image, label)`, run record by record over a run; a parse function that
    takes a vector of records says so with `parse.batched = True` (as `default_parse` does) and parses a
    run in one call. Labels may start at 0 or 1 (ImageNet's TFRecords
    reserve 0): without `num_classes` the class count is the largest label + 1, found by one pass
    over the labels on first use (`num_classes` may also be a function, e.g. another source's count).
    Nothing touches TF's runtime before first use (MWMS must configure it first)."""

    def __init__(self, pattern: str, parse: Callable = default_parse, channels: int = 3,
                 num_classes: Union[int, Callable[[], int], None] = None, decode_images: bool = True,
                 cache_dir: Optional[str] = None):
        self.files = sorted(tf.io.gfile.glob(pattern))
        if not self.files:
            raise ConfigurationError(f"no TFRecord files match {pattern}.")
        self.parse, self.channels, self.decode_images, self.pattern = parse, channels, decode_images, pattern
        self._parse_vector = vector_parse(parse)
        self.cache = IndexCache(cache_dir) if cache_dir else None
        self.shard_reads = 0  # shards read whole (to index them or find their labels): not the cache's
        self._identities, self._labels, sizes, shard, offsets, ends = [], [], [], [], [], []
        for number, path in enumerate(self.files):
            found, size = self._index(path)
            sizes.append(size)
            shard += [number] * len(found)
            offsets += list(found)
            ends += (list(found) + [size])[1:]  # a record ends where the next begins
        if not shard:
            raise ConfigurationError(f"the TFRecord files {pattern} hold no records.")
        self.num_examples, self.sizes = len(shard), np.asarray(sizes, np.int64)
        self.shard, self.offsets, self.ends = (np.asarray(shard, np.int32), np.asarray(offsets, np.int64),
                                               np.asarray(ends, np.int64))
        self.first = np.searchsorted(self.shard, np.arange(len(self.files) + 1))  # each shard's first index
        self._classes = num_classes
        self._tensors: Optional[Tuple[tf.Tensor, ...]] = None
        self._read_run_function: Optional[Callable] = None

    def fingerprint(self) -> str:
        """The shards' paths and sizes."""
        return digest(self.files, self.sizes)

    def _index(self, path: str) -> Tuple[List[int], int]:
        """A shard's (record offsets, size), from the cache when it holds this version of the shard."""
        # (identity before the read: a shard changed during it gets a key that no longer fits)
        identity = shard_identity(path) if self.cache else None
        self._identities.append(identity)
        cached = self.cache.load(identity) if identity else None
        if cached is not None:
            self._labels.append(cached[1])
            return cached[0].tolist(), identity["size"]
        self.shard_reads += 1
        offsets, size = record_offsets(path)
        self._labels.append({})
        if identity:
            self.cache.store(identity, offsets, {})
        return offsets, size

    def _changed(self, number: int) -> bool:
        """Whether shard `number`'s size is no longer the one it was indexed with."""
        return tf.io.gfile.stat(self.files[number]).length != self.sizes[number]

    def _forget(self, number: int) -> None:
        """Drops shard `number`'s cached index: the shard failed to read, so it may be stale."""
        if self.cache is not None:
            self.cache.forget(self._identities[number])

    @property
    def num_classes(self) -> int:
        if not isinstance(self._classes, int):
            with tf.init_scope():  # eagerly, even when first asked while a tf.data function is traced
                self._classes = self._classes() if callable(self._classes) else self._largest_label() + 1
        return self._classes

    def tensors(self) -> Tuple[tf.Tensor, ...]:
        """(paths, shard, offsets) as tensors, made on first use."""
        if self._tensors is None:
            with tf.init_scope():  # eager tensors, captured by each traced function
                self._tensors = tuple(tf.constant(a) for a in (self.files, self.shard, self.offsets))
        return self._tensors

    def _largest_label(self) -> int:
        key = parse_key(self.parse) if self.cache else None
        largest = -1
        for number, path in enumerate(self.files):
            if key in (self._labels[number] if key else {}):
                largest = max(largest, self._labels[number][key])
                continue
            self.shard_reads += 1
            high = self._shard_largest_label(number)
            largest = max(largest, high)
            if key and self._identities[number]:
                self._labels[number] = {key: high}  # only the current parse function's: entries never pile up
                offsets = self.offsets[self.first[number]:self.first[number + 1]]
                self.cache.store(self._identities[number], offsets, self._labels[number])
        return largest

    def _shard_largest_label(self, number: int) -> int:
        path, largest = self.files[number], -1
        labels = tf.data.TFRecordDataset(path).batch(256).map(lambda r: tf.cast(self._parse_vector(r)[1], tf.int64),
                                                              num_parallel_calls=AUTOTUNE)  # 28 MB of ImageNet
        try:
            for batch in labels:
                low, high = int(tf.reduce_min(batch)), int(tf.reduce_max(batch))
                if low < 0:
                    raise ConfigurationError(f"TFRecord file {path} has a negative label {low}.")
                largest = max(largest, high)
        except tf.errors.InvalidArgumentError as error:
            raise ConfigurationError(f"TFRecord file {path} has a record that does not parse: "
                                     f"{_reason(error)}") from None
        except tf.errors.DataLossError as error:  # a checksum that fails, or a shard cut short under us
            if self._changed(number):
                self._forget(number)
                raise  # changed since it was indexed: a restart indexes it again
            raise ConfigurationError(f"TFRecord file {path} has a corrupt record: {_reason(error)}") from None
        return largest

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([seed, epoch, 1])
        parts = []
        for shard in rng.permutation(len(self.files)):
            begin, end = self.first[shard], self.first[shard + 1]
            parts.append(begin + np.roll(np.arange(end - begin), -int(rng.integers(max(1, end - begin)))))
        return np.concatenate(parts)

    def _runs(self, indices: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Splits `indices` into runs of consecutive records of one shard, each of RUN_BYTES at most (plus
        one record that crosses the limit): (first index, count) each."""
        if not len(indices):  # an empty share of a batch or an epoch
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        breaks = np.flatnonzero((np.diff(indices) != 1) | (np.diff(self.shard[indices]) != 0)) + 1
        firsts, counts = [], []
        for run in np.split(indices, breaks):
            ends = np.cumsum(self.ends[run] - self.offsets[run])
            pieces = np.split(run, np.flatnonzero(np.diff((ends - 1) // RUN_BYTES)) + 1)
            firsts += [piece[0] for piece in pieces]
            counts += [len(piece) for piece in pieces]
        return np.asarray(firsts, np.int64), np.asarray(counts, np.int64)

    def examples(self, indices: np.ndarray) -> tf.data.Dataset:
        firsts, counts = self._runs(indices)
        begin, end = self.offsets[firsts], self.ends[firsts + counts - 1]
        runs = tf.data.Dataset.from_tensor_slices((firsts, counts, self.shard[firsts], begin, end - begin))
        if self._read_run_function is None:  # traced once per source, not once per epoch's pipeline
            self._read_run_function = tf.function(self._read_run, autograph=False)
        # Runs are read in parallel, each one element: batch k stays the plan's batch k.
        runs = runs.map(self._read_run_function, num_parallel_calls=AUTOTUNE, deterministic=True)
        return runs.unbatch()

    def _read_run(self, first, count, shard, offset, size):
        """One run's (indices, parsed records). The run is read and parsed as a whole; if that fails, once
        more slowly (`_run_again`), which names bad data or fails with the read's own error. Then its labels
        and images are checked (outside the nested dataset: a heavy function there costs ~40 ms at a
        pipeline's first batch)."""
        run = tf.data.Dataset.from_tensors((first, tf.gather(self.tensors()[0], shard), count, offset, size))
        parsed = run.map(self._run).ignore_errors().concatenate(run.map(self._run_again)).take(1) \
            .get_single_element()  # the second made only if the first failed
        return self._check(first + tf.range(count), parsed)

    def _run(self, first, path, count, offset, size):
        return self._parse_vector(self._records(path, count, offset, size))

    def _run_again(self, first, path, count, offset, size):
        """The run read again, after a look for a corrupt record (bad data, named), and parsed record by
        record, naming the first that does not parse. A read that fails again fails with its own error
        (NotFoundError, DataLossError for a shard cut short, UnavailableError...): not bad input, a restart
        may help. (ignore_errors on the read itself would hide them, and loops forever on a missing file.)"""
        corrupt = tf.numpy_function(self._corrupt_record, [first, count], tf.string, stateful=True)
        with tf.control_dependencies([tf.debugging.Assert(tf.strings.length(corrupt) == 0, [corrupt])]):
            records = self._records(path, count, offset, size)
        indices = first + tf.range(count)
        each = tf.data.Dataset.from_tensor_slices((indices, records)).map(
            lambda index, record: (index, tf.nest.map_structure(lambda t: t[0], self._parse_vector(record[None])))
        ).ignore_errors()
        empty = tf.nest.map_structure(lambda spec: tf.zeros([0] + [d or 0 for d in spec.shape], spec.dtype),
                                      each.element_spec)
        parsed_indices, parsed = each.batch(count).concatenate(tf.data.Dataset.from_tensors(empty)).take(1) \
            .get_single_element()
        missing = count - tf.size(parsed_indices, tf.int64)
        padded = tf.pad(parsed_indices, [[0, missing]], constant_values=-1)  # ascending: the first gap is the record
        unparsed = indices[tf.argmin(tf.cast(tf.equal(padded, indices), tf.int32))]
        parsed_all = tf.debugging.Assert(missing == 0, [
            "a record that does not parse in TFRecord file", path, "at byte",
            tf.strings.as_string(tf.gather(self.tensors()[2], unparsed))])
        with tf.control_dependencies([parsed_all]):
            return tf.nest.map_structure(tf.identity, parsed)

    @staticmethod
    def _records(path, count, offset, size) -> tf.Tensor:
        """The run's `count` serialized records. TFRecordDatasetV2 starts at a byte offset with a seek
        (tf.data.TFRecordDataset has no offset; FixedLengthRecordDataset reads up to it); it lives only
        inside a run's function, where TF never has to serialize it (its graph form drops the offsets). A
        shard that ends early fails (FailedPreconditionError): it changed since it was indexed."""
        records = tf.data.experimental.from_variant(
            tf.raw_ops.TFRecordDatasetV2(filenames=path[None], compression_type="",
                                         buffer_size=tf.minimum(size, BUFFER), byte_offsets=offset[None]),
            tf.TensorSpec([], tf.string))
        return records.take(count).apply(tf.data.experimental.assert_cardinality(count)).batch(count) \
            .get_single_element()

    def _corrupt_record(self, first: np.int64, count: np.int64) -> bytes:
        """The run's first record whose checksum fails, as a message; b"" when none does. Unless the run's
        bytes are what the index expects, the shard's cached index goes: the next start must not meet the
        same failure (when the shard changed or does not read, the second try's own error tells)."""
        first, count = int(first), int(count)
        message, as_indexed = self._inspect_run(first, count)
        if not as_indexed:
            self._forget(int(self.shard[first]))
        return message

    def _inspect_run(self, first: int, count: int) -> Tuple[bytes, bool]:
        """(message naming the first corrupt record or b"", whether the bytes are as indexed)."""
        number = int(self.shard[first])
        path, begin, end = self.files[number], int(self.offsets[first]), int(self.ends[first + count - 1])
        try:
            if self._changed(number):
                return b"", False
            with tf.io.gfile.GFile(path, "rb") as f:
                f.seek(begin)
                data = f.read(end - begin)
        except tf.errors.OpError:
            return b"", False
        for index in range(first, first + count):
            at, length = int(self.offsets[index]) - begin, int(self.ends[index] - self.offsets[index]) - 16
            if at + length + 16 > len(data):
                return b"", False  # read short
            stored, header_ok = read_header(data, at)
            if header_ok and stored != length:
                return b"", False  # another record than the index's: the shard changed
            if not (header_ok and payload_ok(data, at, length)):
                return (f"corrupt record (checksum mismatch) in TFRecord file {path} at byte "
                        f"{self.offsets[index]}").encode(), False
        return b"", True  # the first try met a transient error, or a record that does not parse

    def _check(self, indices, parsed):
        """A run's labels and images, checked together (per example it would cost more than reading). The
        messages hold strings and int32 only: anything else makes Assert a cond, far slower."""
        paths, shards, offsets = self.tensors()
        encoded, label = parsed
        label, path = tf.cast(label, tf.int32), tf.gather(paths, tf.gather(shards, indices[0]))
        good_label = tf.logical_and(label >= 0, label < self.num_classes)
        good_image = is_image(encoded) if self.decode_images else tf.ones_like(good_label)
        bad = tf.argmin(tf.cast(good_label & good_image, tf.int32))  # the first bad record, if any
        at = ["in", path, "at byte", tf.strings.as_string(tf.gather(offsets, indices[bad]))]
        checks = [tf.debugging.Assert(good_label[bad], ["label", label[bad], f"outside [0, {self.num_classes})", *at]),
                  tf.debugging.Assert(good_image[bad], ["not an image file (corrupt?)", *at])]
        with tf.control_dependencies(checks):
            return tf.identity(indices), (tf.identity(encoded), tf.identity(label))

    def decode(self, index: tf.Tensor, parsed) -> Tuple[tf.Tensor, tf.Tensor]:
        encoded, label = parsed  # checked per run by `examples`
        return (tf.io.decode_image(encoded, channels=self.channels, expand_animations=False)
                if self.decode_images else encoded), label
