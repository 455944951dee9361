"""TFDS datasets through their random-access data source (`tfds.data_source`, ArrayRecord files):
examples are fetched by index, never loaded as a whole. The data source decodes in Python, so this
source reads one planned batch of indices per Python call (a variable image shape: one per example)."""
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_elastic.elastic.worker.data.source import AUTOTUNE, Source, digest
from tf_elastic.elastic.protocol import error_line
from tf_elastic.elastic.worker.errors import ConfigurationError

FETCH = 64  # indices per Python call


class TFDSSource(Source):
    def __init__(self, name: str, split: str, data_dir: Optional[str] = None):
        import tensorflow_datasets as tfds

        try:
            self.data = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
        except Exception as error:  # noqa: BLE001 - TFDS raises many kinds; all mean "not prepared here"
            raise ConfigurationError(f"tfds:{name} split {split!r}: no prepared ArrayRecord data source in "
                                     f"--data_dir={data_dir!r} ({error_line(error)})") from None
        features = self.data.dataset_info.features
        self.image_key, self.label_key = self.data.dataset_info.supervised_keys or ("image", "label")
        image = features[self.image_key]
        self.shape, self.dtype = tuple(image.shape), tf.as_dtype(image.np_dtype)
        self.num_examples, self.split = len(self.data), split
        self.num_classes = int(features[self.label_key].num_classes)

    def fingerprint(self) -> str:
        info = self.data.dataset_info
        return digest(info.full_name, self.split, self.num_examples)

    def _fetch(self, indices: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        records = self.data.__getitems__([int(i) for i in indices])
        return (np.stack([r[self.image_key] for r in records]).astype(self.dtype.as_numpy_dtype),
                np.asarray([r[self.label_key] for r in records], np.int32))

    def examples(self, indices: np.ndarray) -> tf.data.Dataset:
        static = None not in self.shape
        fetch = FETCH if static else 1

        def read(batch):
            images, labels = tf.numpy_function(self._fetch, [batch], (self.dtype, tf.int32))
            return batch, (tf.ensure_shape(images, (None, *self.shape)), tf.ensure_shape(labels, (None,)))

        batches = tf.data.Dataset.from_tensor_slices(indices).batch(fetch)
        return batches.map(read, num_parallel_calls=AUTOTUNE, deterministic=True).unbatch()

    def decode(self, index: tf.Tensor, raw: Tuple[tf.Tensor, tf.Tensor]) -> Tuple[tf.Tensor, tf.Tensor]:
        return raw
