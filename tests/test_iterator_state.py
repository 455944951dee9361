"""Tests `tf_elastic/elastic/worker/data/iterator_state.py`: the error a tf.data checkpoint holds for an
element its pipeline read ahead (TensorFlow's own ops, its own checkpoints)."""
import time

import pytest
import tensorflow as tf
from tensorflow.python.ops import gen_dataset_ops

from tf_elastic.elastic.worker.data.iterator_state import held_error


def _saved_after(pipeline: tf.data.Dataset, batches: int) -> bytes:
    """The checkpoint of an iterator of `pipeline` that gave `batches` batches, once its read-ahead ran."""
    iterator = iter(pipeline)
    for _ in range(batches):
        next(iterator)
    time.sleep(0.5)
    saved = gen_dataset_ops.serialize_iterator(iterator._iterator_resource, external_state_policy=2)
    return tf.io.serialize_tensor(saved).numpy()


def _numbers(bad: str) -> tf.data.Dataset:
    text = [str(i) for i in range(40)]
    text[21] = bad
    return tf.data.Dataset.from_tensor_slices(text).map(tf.strings.to_number)


@pytest.mark.parametrize("shape", [
    lambda d: d.batch(4).prefetch(3),  # map and batch fused, then prefetch: the message beside status.code
    lambda d: d.batch(4),  # the fused map and batch alone: X_status_msg beside X_status_code
    lambda d: d.batch(4, num_parallel_calls=2, deterministic=True)])
def test_an_error_read_ahead_is_found_with_its_type_and_message_and_a_clean_checkpoint_holds_none(shape):
    error = held_error(_saved_after(shape(_numbers("twenty-one")), 5))  # the next batch fails
    assert isinstance(error, tf.errors.InvalidArgumentError), error
    assert "could not correctly convert string: twenty-one" in error.message
    assert held_error(_saved_after(shape(_numbers("21")), 5)) is None


def test_data_that_spells_the_keys_is_no_error():
    """A string element that holds the key names TensorFlow writes for an error is data, not an error."""
    words = tf.data.Dataset.from_tensor_slices(["status.error_message", "x_status_msg"] * 8).batch(2).prefetch(4)
    saved = _saved_after(words, 2)
    assert b"status.error_message" in saved and held_error(saved) is None


def test_a_checkpoint_of_another_layout_is_taken_as_holding_no_error():
    assert held_error(b"\x0a\x05not a checkpoint") is None and held_error(b"") is None
