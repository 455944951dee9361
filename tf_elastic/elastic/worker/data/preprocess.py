"""Preprocessing for `launch/train.py` (`--preprocess`): `preprocess(features, label, seed)` functions.

Random choices use stateless ops seeded per (seed, epoch, example), so a step redone after a restart
sees the same crops and flips."""
from typing import Tuple

import tensorflow as tf

from tf_elastic.choices import PREPROCESSING
from tf_elastic.elastic.worker.data.source import Preprocess

CENTER_FRACTION = 0.875  # evaluation: resize to size / 0.875, keep the center (the common ImageNet recipe)


def _scale(image: tf.Tensor) -> tf.Tensor:
    return tf.cast(image, tf.float32) / (255.0 if image.dtype.is_integer else 1.0)


def simple(image_size: int) -> Preprocess:
    """Resize to image_size x image_size (0: keep the size), scale to [0, 1]."""
    def apply(image: tf.Tensor, label: tf.Tensor, seed: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        image = _scale(image)
        if image_size:
            image = tf.image.resize(image, (image_size, image_size))
        return image, label

    return apply


def imagenet(image_size: int, training: bool) -> Preprocess:
    """Training: random-resized crop (8%-100% of the area, aspect 3/4-4/3) and a random flip;
    evaluation: resize, then a center crop."""
    def train(image: tf.Tensor, label: tf.Tensor, seed: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.shape(image), tf.zeros([1, 0, 4]), seed=crop_seed, min_object_covered=0.08,
            aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
            use_image_if_no_bounding_boxes=True)
        crop = tf.slice(image, begin, size)
        crop.set_shape([None, None, image.shape[-1]])
        image = tf.image.resize(_scale(crop), (image_size, image_size))
        return tf.image.stateless_random_flip_left_right(image, flip_seed), label

    def evaluate(image: tf.Tensor, label: tf.Tensor, seed: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        shape = tf.cast(tf.shape(image)[:2], tf.float32)
        scale = image_size / CENTER_FRACTION / tf.reduce_min(shape)
        image = tf.image.resize(_scale(image), tf.cast(tf.round(shape * scale), tf.int32))
        return tf.image.resize_with_crop_or_pad(image, image_size, image_size), label

    return train if training else evaluate


def get(name: str, image_size: int, training: bool) -> Preprocess:
    if name == "simple":
        return simple(image_size)
    if name == "imagenet":
        return imagenet(image_size or 224, training)
    raise ValueError(f"--preprocess must be one of {', '.join(PREPROCESSING)}; got {name!r}.")
