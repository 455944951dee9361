"""Parse functions of `TFRecordSource`: the default one (ImageNet's keys) and any one run over a vector of records.

A run of records is parsed in one call when the parse function takes a vector (`parse.batched = True`);
any other function a Dataset.map takes still works, record by record. This is the whole contract between
a user's parse function and the source.
"""
from typing import Callable, Tuple

import tensorflow as tf


def default_parse(records: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """(encoded image, label) from tf.train.Example records with ImageNet's keys, one or a vector at once."""
    parsed = tf.io.parse_example(records, {"image/encoded": tf.io.FixedLenFeature([], tf.string),
                                           "image/class/label": tf.io.FixedLenFeature([], tf.int64)})
    return parsed["image/encoded"], parsed["image/class/label"]


default_parse.batched = True  # takes a vector of records: a run is parsed in one op


def vector_parse(parse: Callable) -> Callable:
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
