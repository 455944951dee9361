"""File-backed sources: a directory of images (one sub-directory per class) and TFRecord shards.

Only file names, offsets and labels are held in memory; bytes are read and decoded inside the
tf.data graph. Bad data fails with an error that names the file (the corrupt image, the shard and
record), which `fit` raises as `ConfigurationError` (exit 78 from a worker).
"""
import posixpath
import struct
from typing import Callable, List, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_elastic.elastic.worker.data.source import AUTOTUNE, Source
from tf_elastic.elastic.worker.errors import ConfigurationError

# Magic numbers of the formats tf.io.decode_image reads: a cheap check that names the bad file.
_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"RIFF")


def _decode(contents: tf.Tensor, path: tf.Tensor, channels: int) -> tf.Tensor:
    head = tf.strings.substr(contents, 0, 4)
    known = tf.reduce_any([tf.strings.substr(head, 0, len(s)) == s for s in _SIGNATURES])
    with tf.control_dependencies([tf.debugging.Assert(known, ["not an image file (corrupt?):", path])]):
        return tf.io.decode_image(contents, channels=channels, expand_animations=False)


class ImageFolder(Source):
    """`root/<class>/<image>`: class index = position of the class folder name in sorted order."""

    def __init__(self, root: str, channels: int = 3, class_names: Optional[List[str]] = None):
        # tf.io.gfile throughout: the folder may be on gs:// or s3:// (it does not touch TF's runtime).
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
        self.paths, self.labels = paths, np.asarray(labels, np.int32)
        self.channels, self.num_examples, self.num_classes = channels, len(paths), len(self.class_names)
        self._tensors: Optional[Tuple[tf.Tensor, tf.Tensor]] = None

    def read(self, index: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        # Tensors on first use: one made before the strategy would initialise TF's runtime too early for MWMS.
        if self._tensors is None:
            with tf.init_scope():  # eager tensors, captured by each traced function
                self._tensors = tf.constant(self.paths), tf.constant(self.labels)
        paths, labels = self._tensors
        path = tf.gather(paths, index)
        return _decode(tf.io.read_file(path), path, self.channels), tf.gather(labels, index)


def default_parse(record: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """(encoded image, label) from a tf.train.Example with ImageNet's keys."""
    parsed = tf.io.parse_single_example(record, {"image/encoded": tf.io.FixedLenFeature([], tf.string),
                                                 "image/class/label": tf.io.FixedLenFeature([], tf.int64)})
    return parsed["image/encoded"], parsed["image/class/label"]


def _record_offsets(path: str) -> Tuple[List[int], List[int]]:
    """(data offset, length) of every record of a TFRecord file, from its headers alone (seeks, no data read)."""
    offsets, lengths = [], []
    size = tf.io.gfile.stat(path).length
    with tf.io.gfile.GFile(path, "rb") as f:  # any TF filesystem; on gs:// each header is a ranged read
        position = 0
        while position < size:
            header = f.read(12)
            if len(header) < 12:
                raise ConfigurationError(f"TFRecord file {path} is truncated at byte {position}.")
            (length,) = struct.unpack("<Q", header[:8])
            if position + 16 + length > size:
                raise ConfigurationError(f"TFRecord file {path}: record {len(offsets)} runs past the end of the file.")
            offsets.append(position + 12)
            lengths.append(length)
            position += 16 + length
            f.seek(position)
    return offsets, lengths


MAX_RUN = 64  # records read with one file open (bounds the bytes a run holds in memory)


class TFRecordSource(Source):
    """TFRecord shards of tf.train.Example with an exact position per record.

    The record offsets come from the shards' headers. An epoch visits the shards in a seeded order,
    each from a seeded rotation of its records, so a worker's share of a global batch is a run of
    consecutive records, read with one file open at an offset (any other order works, only slower).
    `parse(record) -> (encoded image, label)`; labels may start at 0 or 1 (ImageNet's TFRecords
    reserve 0): without `num_classes` the class count is the largest label + 1, found by one pass
    over the labels on first use (`num_classes` may also be a function, e.g. another source's count).
    Nothing touches TF's runtime before first use (MWMS must configure it first)."""

    def __init__(self, pattern: str, parse: Callable = default_parse, channels: int = 3,
                 num_classes: Union[int, Callable[[], int], None] = None, decode_images: bool = True):
        self.files = sorted(tf.io.gfile.glob(pattern))
        if not self.files:
            raise ConfigurationError(f"no TFRecord files match {pattern}.")
        self.parse, self.channels, self.decode_images, self.pattern = parse, channels, decode_images, pattern
        shard, offsets, footers, lengths = [], [], [], []
        for number, path in enumerate(self.files):
            found, sizes = _record_offsets(path)
            size = tf.io.gfile.stat(path).length
            shard += [number] * len(found)
            offsets += found
            lengths += sizes
            footers += [size - o - n for o, n in zip(found, sizes)]
        if not shard:
            raise ConfigurationError(f"the TFRecord files {pattern} hold no records.")
        self.num_examples = len(shard)
        self.shard, self.offsets = np.asarray(shard, np.int32), np.asarray(offsets, np.int64)
        self.lengths, self.footers = np.asarray(lengths, np.int64), np.asarray(footers, np.int64)
        self.first = np.searchsorted(self.shard, np.arange(len(self.files) + 1))  # each shard's first index
        self._classes = num_classes
        self._tensors: Optional[Tuple[tf.Tensor, ...]] = None

    @property
    def num_classes(self) -> int:
        if not isinstance(self._classes, int):
            with tf.init_scope():  # eagerly, even when first asked while a tf.data function is traced
                self._classes = self._classes() if callable(self._classes) else self._largest_label() + 1
        return self._classes

    def tensors(self) -> Tuple[tf.Tensor, ...]:
        """(paths, shard, offsets, lengths) as tensors, made on first use."""
        if self._tensors is None:
            with tf.init_scope():  # eager tensors, captured by each traced function
                self._tensors = tuple(tf.constant(a) for a in (self.files, self.shard, self.offsets, self.lengths))
        return self._tensors

    def _largest_label(self) -> int:
        largest = -1
        for path in self.files:
            labels = tf.data.TFRecordDataset(path).map(lambda r: tf.cast(self.parse(r)[1], tf.int64),
                                                       num_parallel_calls=AUTOTUNE)
            try:
                for batch in labels.batch(4096):
                    low, high = int(tf.reduce_min(batch)), int(tf.reduce_max(batch))
                    if low < 0:
                        raise ConfigurationError(f"TFRecord file {path} has a negative label {low}.")
                    largest = max(largest, high)
            except tf.errors.InvalidArgumentError as error:
                raise ConfigurationError(f"TFRecord file {path} has a record that does not parse: "
                                         f"{str(error).splitlines()[0][:300]}") from None
        return largest

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([seed, epoch, 1])
        parts = []
        for shard in rng.permutation(len(self.files)):
            begin, end = self.first[shard], self.first[shard + 1]
            parts.append(begin + np.roll(np.arange(end - begin), -int(rng.integers(max(1, end - begin)))))
        return np.concatenate(parts)

    def _runs(self, indices: np.ndarray):
        """Splits `indices` into runs of consecutive records of one shard: (first index, count) each."""
        breaks = np.flatnonzero((np.diff(indices) != 1) | (np.diff(self.shard[indices]) != 0)) + 1
        starts = np.concatenate([[0], breaks])
        counts = np.diff(np.concatenate([starts, [len(indices)]]))
        firsts, sizes = [], []
        for start, count in zip(starts, counts):
            for offset in range(0, count, MAX_RUN):
                firsts.append(indices[start + offset])
                sizes.append(min(MAX_RUN, count - offset))
        return np.asarray(firsts, np.int64), np.asarray(sizes, np.int64)

    def examples(self, indices: np.ndarray) -> tf.data.Dataset:
        firsts, counts = self._runs(indices)
        lasts = firsts + counts - 1
        begin = self.offsets[firsts]
        end = self.offsets[lasts] + self.lengths[lasts]
        runs = tf.data.Dataset.from_tensor_slices((firsts, counts, self.shard[firsts], begin, end - begin,
                                                   self.footers[lasts]))
        paths, _, offsets, lengths = self.tensors()

        def read_run(first, count, shard, header, size, footer):
            data = tf.data.FixedLengthRecordDataset(tf.gather(paths, shard), record_bytes=size,
                                                    header_bytes=header, footer_bytes=footer)
            return tf.data.Dataset.zip(tf.data.Dataset.from_tensors((first, count, header)), data)

        def split(run, data):  # the run's bytes -> its records, by their known offsets (one string, broadcast)
            first, count, header = run
            return first + tf.range(count), tf.strings.substr(data, offsets[first:first + count] - header,
                                                              lengths[first:first + count])

        # Runs open in an interleave (no function per run there); splitting them is a parallel map outside.
        records = runs.interleave(lambda *run: read_run(*run), cycle_length=8, num_parallel_calls=AUTOTUNE,
                                  deterministic=True).map(split, num_parallel_calls=AUTOTUNE, deterministic=True)
        return records.unbatch()

    def decode(self, index: tf.Tensor, record: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        paths, shards, offsets, _ = self.tensors()
        path = tf.gather(paths, tf.gather(shards, index))
        encoded, label = self.parse(record)
        label = tf.cast(label, tf.int32)
        in_range = tf.logical_and(label >= 0, label < self.num_classes)
        where = ["label", label, f"outside [0, {self.num_classes}) in", path, "at byte",
                 tf.gather(offsets, index)]
        with tf.control_dependencies([tf.debugging.Assert(in_range, where)]):
            label = tf.identity(label)
        return (_decode(encoded, path, self.channels) if self.decode_images else encoded), label
