"""File-backed sources: a directory of images (one sub-directory per class) and TFRecord shards.

Only file names, offsets and labels are held in memory; bytes are read and decoded inside the
tf.data graph. Bad data fails with an error that names the file (the corrupt image, the shard and
record), which `fit` raises as `ConfigurationError` (exit 78 from a worker). A shard that does not read
(gone, cut short, an object store's transient error) fails with the read's own error: a restart may help.
"""
import hashlib
import json
import os
import posixpath
import re
import struct
import tempfile
from typing import Callable, Dict, List, Optional, Tuple, Union

from absl import logging

import numpy as np
import tensorflow as tf

from tf_elastic.elastic.worker.data.source import AUTOTUNE, Source
from tf_elastic.elastic.worker.errors import ConfigurationError

# Magic numbers of the formats tf.io.decode_image reads: a cheap check that names the bad file.
_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"RIFF")


def _is_image(contents: tf.Tensor) -> tf.Tensor:
    """Elementwise: does each string start like an image file."""
    return tf.reduce_any(tf.stack([tf.strings.substr(contents, 0, len(s)) == s for s in _SIGNATURES]), axis=0)


def _decode(contents: tf.Tensor, path: tf.Tensor, channels: int) -> tf.Tensor:
    with tf.control_dependencies([tf.debugging.Assert(_is_image(contents), ["not an image file (corrupt?):", path])]):
        return tf.io.decode_image(contents, channels=channels, expand_animations=False)


class ImageFiles(Source):
    """Image files you list, with their integer labels: `ImageFiles(paths, labels)` (any `tf.io.gfile` path;
    JPEG, PNG, GIF, BMP). `num_classes`: default the largest label + 1."""

    def __init__(self, paths: List[str], labels, channels: int = 3, num_classes: Optional[int] = None):
        if len(paths) != len(labels) or not len(paths):
            raise ConfigurationError(f"paths and labels need the same, non-zero length; got {len(paths)} and "
                                     f"{len(labels)}.")
        self.paths, self.labels = list(paths), np.asarray(labels, np.int32)
        if self.labels.min() < 0:
            raise ConfigurationError(f"labels must be >= 0; got {int(self.labels.min())}.")
        self.channels, self.num_examples = channels, len(self.paths)
        self.num_classes = int(num_classes if num_classes is not None else self.labels.max() + 1)
        self._tensors: Optional[Tuple[tf.Tensor, tf.Tensor]] = None

    def read(self, index: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        # Tensors on first use: one made before the strategy would initialise TF's runtime too early for MWMS.
        if self._tensors is None:
            with tf.init_scope():  # eager tensors, captured by each traced function
                self._tensors = tf.constant(self.paths), tf.constant(self.labels)
        paths, labels = self._tensors
        path = tf.gather(paths, index)
        return _decode(tf.io.read_file(path), path, self.channels), tf.gather(labels, index)


class ImageFolder(ImageFiles):
    """`root/<class>/<image>`: class index = position of the class folder name in sorted order."""

    def __init__(self, root: str, channels: int = 3, class_names: Optional[List[str]] = None):
        # tf.io.gfile throughout: the folder may be on gs:// or another TF filesystem (it does not touch TF's runtime).
        gfile = tf.io.gfile
        if not gfile.isdir(root):
            raise ConfigurationError(f"image folder {root} does not exist or is not a directory.")
        self.class_names = class_names or sorted(
            n.rstrip("/") for n in gfile.listdir(root) if gfile.isdir(posixpath.join(root, n)))
        if not self.class_names:
            raise ConfigurationError(f"image folder {root} has no class sub-directories.")
        paths, labels = [], []
        for label, name in enumerate(self.class_names):
            folder = posixpath.join(root, name)
            # (a listing marks sub-directories with "/" on object stores; a stray one elsewhere fails
            # at decode time, naming its path: one stat per file would cost a request each on gs://)
            files = sorted(f for f in gfile.listdir(folder) if not f.endswith("/")) if gfile.isdir(folder) else []
            if not files:
                raise ConfigurationError(f"class folder {folder} is missing or has no files.")
            paths += [posixpath.join(folder, f) for f in files]
            labels += [label] * len(files)
        super().__init__(paths, labels, channels, num_classes=len(self.class_names))


def default_parse(records: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """(encoded image, label) from tf.train.Example records with ImageNet's keys, one or a vector at once."""
    parsed = tf.io.parse_example(records, {"image/encoded": tf.io.FixedLenFeature([], tf.string),
                                           "image/class/label": tf.io.FixedLenFeature([], tf.int64)})
    return parsed["image/encoded"], parsed["image/class/label"]


default_parse.batched = True  # takes a vector of records: a run is parsed in one op


def _vector_parse(parse: Callable) -> Callable:
    """`parse` over a vector of records: itself when it says it takes one (`parse.batched`), else record
    by record in a tf.map_fn (any function a Dataset.map takes; tf.vectorized_map fails on sparse and
    ragged features and on decoding images of different sizes). Autograph applies, as in a Dataset.map."""
    function = tf.function(parse)
    if getattr(parse, "batched", False):
        return function

    def each(records: tf.Tensor):
        outputs = function.get_concrete_function(tf.TensorSpec([], tf.string)).structured_outputs
        signature = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), outputs)
        return tf.map_fn(function, records, fn_output_signature=signature)

    return each


def _reason(error: tf.errors.OpError) -> str:
    """An error's first line, without the prefix tf.data puts before an error in a user function."""
    line = re.sub(r"^\{\{[^}]*\}\}\s*", "", str(error.message).strip()).splitlines()[0]
    return re.sub(r"^Error in user-defined function passed to .*? transformation with iterator: \S+: ", "",
                  line)[:300]


CHUNK = 8 << 20  # bytes per read while indexing a shard


def _crc_table() -> List[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC_TABLE = _crc_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C, rotated and offset ("masked"). Pure Python (no dependency): the index
    pass checks 8 bytes a record, about 1 us; whole records only when diagnosing one that did not read."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record_offsets(path: str) -> Tuple[List[int], int]:
    """(the offset of every record, file size) of a TFRecord file, from its headers (each one's checksum
    checked: a corrupt length would mis-index the rest), in one sequential read of large chunks: on an
    object store a few requests per shard, not one per record."""
    offsets, buffer, start, position = [], b"", 0, 0  # buffer holds the file's bytes from `start` on
    with tf.io.gfile.GFile(path, "rb") as f:  # any TF filesystem
        size = f.size()
        while position < size:
            if position + 12 > start + len(buffer):
                if position > start + len(buffer):  # a record longer than a chunk: skip the rest of it
                    f.seek(position)
                    buffer, start = b"", position
                buffer, start = buffer[position - start:] + f.read(CHUNK), position
                if position + 12 > start + len(buffer):
                    raise ConfigurationError(f"TFRecord file {path} is truncated at byte {position}.")
            at = position - start
            length, crc = struct.unpack_from("<QI", buffer, at)
            if masked_crc32c(buffer[at:at + 8]) != crc:
                raise ConfigurationError(f"TFRecord file {path}: the header of record {len(offsets)} at byte "
                                         f"{position} is corrupt (checksum mismatch).")
            if position + 16 + length > size:
                raise ConfigurationError(f"TFRecord file {path}: record {len(offsets)} runs past the end of the file.")
            offsets.append(position)
            position += 16 + length
    return offsets, size


def _code_hash(code, digest) -> None:
    """Feeds a code object into `digest`: its bytecode, the names it uses and its constants, nested code
    objects (comprehensions, inner functions) by their own contents, never by a repr with an address."""
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for constant in code.co_consts:
        if hasattr(constant, "co_code"):
            _code_hash(constant, digest)
        else:
            digest.update(repr(constant).encode())


def _parse_key(parse: Callable) -> Optional[str]:
    """The same parse function in the next process: its name and a hash of its code (an edited function
    gets another key); None for what a name and code do not pin down: a lambda, a local function, a
    closure or a bound method (their behaviour depends on captured values)."""
    name = f"{getattr(parse, '__module__', '')}.{getattr(parse, '__qualname__', '<none>')}"
    code = getattr(parse, "__code__", None)
    if "<" in name or code is None or getattr(parse, "__closure__", None) or hasattr(parse, "__self__"):
        return None
    digest = hashlib.sha256()
    _code_hash(code, digest)
    return f"{name}:{digest.hexdigest()[:16]}"


def _identity(path: str) -> Optional[dict]:
    """What must be unchanged for a shard's cached index to hold (None: nothing reliable, no cache). A local
    file adds its inode and change time (set by every rewrite, unlike mtime, which tar or rsync restore);
    other filesystems give size and modification time (none on ram://)."""
    if "://" not in path:
        local = os.stat(path)
        return {"path": os.path.abspath(path), "size": local.st_size, "inode": local.st_ino,
                "ctime": local.st_ctime_ns, "mtime": local.st_mtime_ns}
    stat = tf.io.gfile.stat(path)
    return {"path": path, "size": stat.length, "mtime": stat.mtime_nsec} if stat.mtime_nsec else None


class IndexCache:
    """Each shard's index (record offsets, and its largest label under the current parse function) in a
    host-local directory, keyed by the shard's `_identity`: a restarted worker skips the pass over the
    shards. Files are written whole (temp file, then rename); an entry that does not load or does not
    match the shard is ignored (the shard is indexed again), never trusted, and one whose shard failed to
    read is removed."""

    def __init__(self, directory: str):
        if "://" in directory:
            raise ConfigurationError(f"the TFRecord index cache directory {directory} must be a local, host-local "
                                     f"directory (--index_cache_dir), not a remote filesystem.")
        self.directory, self._warned = directory, False

    def _file(self, identity: dict) -> str:
        return os.path.join(self.directory, hashlib.sha256(identity["path"].encode()).hexdigest()[:40] + ".npz")

    def load(self, identity: dict) -> Optional[Tuple[np.ndarray, Dict[str, int]]]:
        """(offsets, largest labels) of the shard `identity` describes, or None."""
        try:
            with np.load(self._file(identity), allow_pickle=False) as entry:
                meta, offsets = json.loads(str(entry["meta"])), entry["offsets"]
            if meta["identity"] != identity:
                return None
            in_order = offsets.ndim == 1 and offsets.dtype == np.int64 and (not len(offsets) or (
                offsets[0] == 0 and offsets[-1] + 16 <= identity["size"] and np.all(np.diff(offsets) >= 16)))
            return (offsets, {str(k): int(v) for k, v in meta["labels"].items()}) if in_order else None
        except Exception:  # noqa: BLE001 - missing, partly written by a killed process, another format: re-index
            return None

    def store(self, identity: dict, offsets: np.ndarray, labels: Dict[str, int]) -> None:
        meta = json.dumps({"identity": identity, "labels": labels})
        temp = None
        try:
            os.makedirs(self.directory, exist_ok=True)
            handle, temp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(handle, "wb") as f:
                np.savez(f, offsets=np.asarray(offsets, np.int64), meta=np.array(meta))
            os.replace(temp, self._file(identity))
        except OSError as error:  # a cache only saves time: a full or read-only disk must not stop training
            if temp is not None and os.path.exists(temp):
                os.remove(temp)
            if not self._warned:
                logging.warning("cannot write the TFRecord index cache in %s: %s", self.directory, error)
                self._warned = True

    def forget(self, identity: Optional[dict]) -> None:
        try:
            if identity is not None:
                os.remove(self._file(identity))
        except OSError:
            pass


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
        self._parse_vector = _vector_parse(parse)
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

    def _index(self, path: str) -> Tuple[List[int], int]:
        """A shard's (record offsets, size), from the cache when it holds this version of the shard."""
        # (identity before the read: a shard changed during it gets a key that no longer fits)
        identity = _identity(path) if self.cache else None
        self._identities.append(identity)
        cached = self.cache.load(identity) if identity else None
        if cached is not None:
            self._labels.append(cached[1])
            return cached[0].tolist(), identity["size"]
        self.shard_reads += 1
        offsets, size = _record_offsets(path)
        self._labels.append({})
        if identity:
            self.cache.store(identity, offsets, {})
        return offsets, size

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
        key = _parse_key(self.parse) if self.cache else None
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
            if tf.io.gfile.stat(path).length != self.sizes[number]:
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
            if tf.io.gfile.stat(path).length != self.sizes[number]:
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
            (stored,) = struct.unpack_from("<Q", data, at)
            header_ok = masked_crc32c(data[at:at + 8]) == struct.unpack_from("<I", data, at + 8)[0]
            if header_ok and stored != length:
                return b"", False  # another record than the index's: the shard changed
            if not header_ok or masked_crc32c(data[at + 12:at + 12 + length]) != struct.unpack_from(
                    "<I", data, at + 12 + length)[0]:
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
        good_image = _is_image(encoded) if self.decode_images else tf.ones_like(good_label)
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
