"""File-backed sources: a directory of images (one sub-directory per class) and TFRecord shards.

Only file names, offsets and labels are held in memory; bytes are read and decoded inside the
tf.data graph. Bad data fails with an error that names the file (the corrupt image, the shard and
record), which `fit` raises as `ConfigurationError` (exit 78 from a worker).
"""
import os
import struct
from pathlib import Path
from typing import Callable, List, Optional, Tuple

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
        root_path = Path(root)
        if not root_path.is_dir():
            raise ConfigurationError(f"image folder {root} does not exist or is not a directory.")
        self.class_names = class_names or sorted(e.name for e in os.scandir(root) if e.is_dir())
        if not self.class_names:
            raise ConfigurationError(f"image folder {root} has no class sub-directories.")
        paths, labels = [], []
        for label, name in enumerate(self.class_names):
            folder = root_path / name
            files = sorted(e.name for e in os.scandir(folder) if e.is_file()) if folder.is_dir() else []
            if not files:
                raise ConfigurationError(f"class folder {folder} is missing or has no files.")
            paths += [os.path.join(folder, f) for f in files]
            labels += [label] * len(files)
        self.paths = tf.constant(paths)
        self.labels = tf.constant(labels, tf.int32)
        self.channels, self.num_examples, self.num_classes = channels, len(paths), len(self.class_names)

    def read(self, index: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        path = tf.gather(self.paths, index)
        return _decode(tf.io.read_file(path), path, self.channels), tf.gather(self.labels, index)


def default_parse(record: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """(encoded image, label) from a tf.train.Example with ImageNet's keys."""
    parsed = tf.io.parse_single_example(record, {"image/encoded": tf.io.FixedLenFeature([], tf.string),
                                                 "image/class/label": tf.io.FixedLenFeature([], tf.int64)})
    return parsed["image/encoded"], parsed["image/class/label"]


def _record_offsets(path: str) -> Tuple[List[int], List[int]]:
    """(data offset, length) of every record of a TFRecord file, from its headers alone (seeks, no data read)."""
    offsets, lengths = [], []
    size = os.path.getsize(path)
    with open(path, "rb") as f:
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


class TFRecordSource(Source):
    """TFRecord shards of tf.train.Example, read by record offset (random access, exact position per
    example). `parse(record) -> (encoded image, label)`; labels may start at 0 or 1 (ImageNet's
    TFRecords reserve 0): without `num_classes` the class count is the largest label + 1, found by
    one pass over the labels when the source is made."""

    def __init__(self, pattern: str, parse: Callable = default_parse, channels: int = 3,
                 num_classes: Optional[int] = None, decode: bool = True):
        self.files = sorted(tf.io.gfile.glob(pattern))
        if not self.files:
            raise ConfigurationError(f"no TFRecord files match {pattern}.")
        self.parse, self.channels, self.decode, self.pattern = parse, channels, decode, pattern
        shard, offsets, footers, lengths = [], [], [], []
        for number, path in enumerate(self.files):
            found, sizes = _record_offsets(path)
            size = os.path.getsize(path)
            shard += [number] * len(found)
            offsets += found
            lengths += sizes
            footers += [size - o - n for o, n in zip(found, sizes)]
        if not shard:
            raise ConfigurationError(f"the TFRecord files {pattern} hold no records.")
        self.num_examples = len(shard)
        self.shard, self.offsets = tf.constant(shard, tf.int32), tf.constant(offsets, tf.int64)
        self.lengths, self.footers = tf.constant(lengths, tf.int64), tf.constant(footers, tf.int64)
        self.paths = tf.constant(self.files)
        self.num_classes = num_classes or self._largest_label() + 1

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

    def _record(self, index: tf.Tensor) -> tf.data.Dataset:
        return tf.data.FixedLengthRecordDataset(
            tf.gather(self.paths, tf.gather(self.shard, index)), record_bytes=tf.gather(self.lengths, index),
            header_bytes=tf.gather(self.offsets, index), footer_bytes=tf.gather(self.footers, index))

    def _parse(self, index: tf.Tensor, record: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        path = tf.gather(self.paths, tf.gather(self.shard, index))
        encoded, label = self.parse(record)
        label = tf.cast(label, tf.int32)
        in_range = tf.logical_and(label >= 0, label < self.num_classes)
        where = ["label", label, f"outside [0, {self.num_classes}) in", path, "at byte", tf.gather(self.offsets, index)]
        with tf.control_dependencies([tf.debugging.Assert(in_range, where)]):
            label = tf.identity(label)
        return (_decode(encoded, path, self.channels) if self.decode else encoded), label

    def examples(self, indices: tf.data.Dataset) -> tf.data.Dataset:
        records = indices.interleave(lambda i: tf.data.Dataset.zip(tf.data.Dataset.from_tensors(i), self._record(i)),
                                     cycle_length=16, num_parallel_calls=AUTOTUNE, deterministic=True)
        return records.map(self._parse, num_parallel_calls=AUTOTUNE, deterministic=True)
