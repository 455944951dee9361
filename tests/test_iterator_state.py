"""Tests `tf_elastic/elastic/worker/data/iterator_state.py`: the error a tf.data checkpoint holds for an
element its pipeline read ahead, and a mix whose input ran out (TensorFlow's own ops, its own checkpoints)."""
import time

import pytest
import tensorflow as tf
from tensorflow.python.ops import gen_dataset_ops

from tf_elastic.elastic.worker.data.iterator_state import exhausted_mix, held_error


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
    return tf.data.Dataset.from_tensor_slices(text)


def _unbatched(pipeline: tf.data.Dataset) -> tf.data.Dataset:
    """`pipeline` with no optimization: no prefetch injected at its end, no map fused into a batch."""
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_optimization.inject_prefetch = False
    return pipeline.with_options(options)


@pytest.mark.parametrize("shape", [
    lambda d: d.map(tf.strings.to_number).batch(4).prefetch(3),  # fused map and batch, then prefetch
    lambda d: d.map(tf.strings.to_number).batch(4),  # the fused map and batch alone: X_status_msg
    lambda d: d.map(tf.strings.to_number).batch(4, num_parallel_calls=2, deterministic=True),
    lambda d: _unbatched(d.map(tf.strings.to_number, num_parallel_calls=4, deterministic=True).batch(4)),
    lambda d: _unbatched(tf.data.Dataset.range(2).interleave(
        lambda i: d.shard(2, i).map(tf.strings.to_number), cycle_length=2, num_parallel_calls=2,
        deterministic=True).batch(4))])
def test_an_error_read_ahead_is_found_with_its_type_and_message_and_a_clean_checkpoint_holds_none(shape):
    error = held_error(_saved_after(shape(_numbers("twenty-one")), 5))  # the next batch fails
    assert isinstance(error, tf.errors.InvalidArgumentError), error
    assert "could not correctly convert string: twenty-one" in error.message
    assert held_error(_saved_after(shape(_numbers("21")), 5)) is None


@pytest.mark.parametrize("shape", [
    lambda d: d.map(tf.strings.to_number).batch(4).prefetch(3).ignore_errors(),  # skips it when reached
    lambda d: d.map(tf.strings.to_number, num_parallel_calls=8, deterministic=True).take(20).batch(2),
    lambda d: tf.data.Dataset.zip((d.map(tf.strings.to_number, num_parallel_calls=8, deterministic=True),
                                   tf.data.Dataset.range(20))).batch(2)])
def test_an_error_read_ahead_where_the_pipeline_may_never_raise_it_is_none_held(shape):
    """Restored, these pipelines read on to their end: the element that failed is skipped, or past the
    end of a `take` or of a `zip`'s shortest input (row 21 of 40, read ahead by a parallel map)."""
    assert held_error(_saved_after(shape(_numbers("twenty-one")), 8)) is None


def test_an_error_a_mixs_input_read_ahead_is_held_where_the_mix_reads_every_input_to_its_end():
    """`sample_from_datasets` reads each input only when it picks it, and each to its end (its selector
    never ends): a commit would restart into the error. Where a mix may end first, it is not counted."""
    numbers = _numbers("twenty-one").map(tf.strings.to_number, num_parallel_calls=8, deterministic=True)
    rest = tf.data.Dataset.range(40, 80).map(lambda i: tf.cast(i, tf.float32))
    tf.random.set_seed(3)  # the selector's draws: 16 of the first 18 rows from `numbers` (the 22nd is row 24)
    mix = tf.data.Dataset.sample_from_datasets([numbers, rest], [0.9, 0.1], seed=1)
    saved = _saved_after(_unbatched(mix.batch(2)), 9)  # read ahead by the input's parallel map only
    error = held_error(saved, mixes_drain=True)
    assert isinstance(error, tf.errors.InvalidArgumentError) and "twenty-one" in error.message, error
    assert held_error(saved) is None


def test_data_that_spells_the_keys_is_no_error():
    """A string element that holds the key names TensorFlow writes for an error is data, not an error."""
    words = tf.data.Dataset.from_tensor_slices(["status.error_message", "x_status_msg"] * 8).batch(2).prefetch(4)
    saved = _saved_after(words, 2)
    assert b"status.error_message" in saved and held_error(saved) is None


def test_a_checkpoint_of_another_layout_is_taken_as_holding_no_error_and_an_exhausted_mix():
    assert held_error(b"\x0a\x05not a checkpoint") is None and held_error(b"") is None
    assert exhausted_mix(b"\x0a\x05not a checkpoint") and exhausted_mix(b"")


@pytest.mark.parametrize("mix", ["sample_from_datasets", "choose_from_datasets"])
def test_a_mix_is_exhausted_from_the_read_that_ran_its_first_input_out_on(mix):
    """Nested in a batch, with an unmixed pipeline beside it (`zip`) that is never counted; the pass's end
    (the mix no longer saved) is no exhaustion."""
    short, long = tf.data.Dataset.range(0, 3), tf.data.Dataset.range(10, 30)
    mixed = (tf.data.Dataset.sample_from_datasets([short, long], weights=[0.5, 0.5], seed=1)
             if mix == "sample_from_datasets"
             else tf.data.Dataset.choose_from_datasets([short, long], tf.data.Dataset.range(2).repeat(12),
                                                  stop_on_empty_dataset=False))
    pipeline = _unbatched(tf.data.Dataset.zip(mixed, tf.data.Dataset.range(100)).batch(1))
    seen, verdicts = [], []
    iterator = iter(pipeline)
    for batch in iterator:
        saved = gen_dataset_ops.serialize_iterator(iterator._iterator_resource, external_state_policy=2)
        verdicts.append(exhausted_mix(tf.io.serialize_tensor(saved).numpy()))
        seen.append(int(batch[0][0]))
    # Exhausted once all of `short` was read and the next read found it empty (the mix reads an input only when
    # its selector picks it): from the read after its last element that picked it, on.
    last_short = max(k for k, value in enumerate(seen) if value < 10)
    ran_out = next(k for k in range(last_short + 1, len(seen)) if verdicts[k]) if any(verdicts) else None
    assert not any(verdicts[:last_short + 1]) and ran_out is not None and all(verdicts[ran_out:-1]), verdicts
