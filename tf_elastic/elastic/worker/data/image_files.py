"""Image files as a source: ones you list with their labels (`ImageFiles`), or a folder per class (`ImageFolder`).

Only paths and labels are held in memory; bytes are read and decoded inside the tf.data graph. A file that
is not an image fails with an error naming it, which `fit` raises as `ConfigurationError` (exit 78 from a
worker). `is_image` is the cheap magic-number check, shared with `TFRecordSource`'s encoded images.

What decoding can and cannot catch: a truncated JPEG or PNG and a PNG chunk whose CRC fails are errors; a
JPEG whose entropy-coded bytes are damaged in the middle decodes without an error to wrong pixels (libjpeg
only warns, TensorFlow has no strict mode, and JPEG carries no checksum). Where silent corruption of
stored images matters, keep them in TFRecords: every record has a CRC-32C that `TFRecordSource` checks.
"""
import posixpath
from typing import List, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_elastic.elastic.worker.data.source import Source, digest
from tf_elastic.elastic.worker.errors import ConfigurationError

# Magic numbers of the formats tf.io.decode_image reads: a cheap check that names the bad file.
_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"RIFF")


def is_image(contents: tf.Tensor) -> tf.Tensor:
    """Elementwise: does each string start like an image file."""
    return tf.reduce_any(tf.stack([tf.strings.substr(contents, 0, len(s)) == s for s in _SIGNATURES]), axis=0)


def _decode(contents: tf.Tensor, path: tf.Tensor, channels: int) -> tf.Tensor:
    with tf.control_dependencies([tf.debugging.Assert(is_image(contents), ["not an image file (corrupt?):", path])]):
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

    def fingerprint(self) -> str:
        """The paths and labels (no stat per file: a request each on gs://)."""
        return digest(self.channels, self.paths, self.labels)

    def read(self, index: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        # Tensors on first use: one made before the strategy would initialise TF's runtime too early for MWMS.
        if self._tensors is None:
            with tf.init_scope():  # eager tensors, captured by each traced function
                self._tensors = tf.constant(self.paths), tf.constant(self.labels)
        paths, labels = self._tensors
        path = tf.gather(paths, index)
        return _decode(tf.io.read_file(path), path, self.channels), tf.gather(labels, index)


class ImageFolder(ImageFiles):
    """`root/<class>/<image>`: class index = position of the class folder name in sorted order, or in
    `class_names` (a validation folder takes its training folder's): a class folder not among them is an
    error, not dropped."""

    def __init__(self, root: str, channels: int = 3, class_names: Optional[List[str]] = None):
        # tf.io.gfile throughout: the folder may be on gs:// or another TF filesystem (it does not touch TF's runtime).
        gfile = tf.io.gfile
        if not gfile.isdir(root):
            raise ConfigurationError(f"image folder {root} does not exist or is not a directory.")
        found = sorted(n.rstrip("/") for n in gfile.listdir(root) if gfile.isdir(posixpath.join(root, n)))
        self.class_names = class_names or found
        if not self.class_names:
            raise ConfigurationError(f"image folder {root} has no class sub-directories.")
        unknown = sorted(set(found) - set(self.class_names))
        if unknown:  # e.g. validation classes the training folder lacks, or a misspelt one: never dropped silently
            raise ConfigurationError(f"image folder {root} has class folders that are not among the "
                                     f"{len(self.class_names)} classes given: {', '.join(unknown)} (classes: "
                                     f"{', '.join(self.class_names)}).")
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
