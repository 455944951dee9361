"""Tests `tf_elastic/elastic/worker/keras_compat.py`: the Keras fixes, installed only where Keras has the bug."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from test_training import _training_setup
from tf_elastic.elastic.worker import keras_compat


def test_keras_fit_fix_is_installed_only_where_the_bug_is():
    """Each fix is installed exactly where the detector finds its bug in the installed Keras's source; where
    the bug is there, a copy patched the way an upstream fix would (the local results for the build,
    axis=None for scalars, all replicas' finiteness) switches that fix off alone. On a Keras that fixed
    them, nothing is installed and the patched copies have nothing left to change."""
    import inspect

    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.optimizers import loss_scale_optimizer

    real, source = inspect.getsource(tf_trainer), inspect.getsource(loss_scale_optimizer)
    found = dict(keras_compat.bugs_in(real), loss_scale_finite=keras_compat.local_finite_bug_in(source))
    assert keras_compat.install_fit_fix() == found, keras.__version__
    fixes = {"symbolic_build": ('data_batch = self.distribute_strategy.reduce(\n                        "MEAN",\n'
                                '                        maybe_distributed_data_batch,',
                                'data_batch = self.distribute_strategy.experimental_local_results(\n'
                                '                        maybe_distributed_data_batch,'),
             "scalar_reduce": ('return strategy.reduce("MEAN", v, axis=0)',
                               'return strategy.reduce("MEAN", v, axis=0 if v.shape.rank else None)')}
    for name, (bug, fix) in fixes.items():
        if found[name]:
            assert bug in real, f"Keras's source moved: update the patched copy for {name}"
            assert keras_compat.bugs_in(real.replace(bug, fix)) == dict(keras_compat.bugs_in(real), **{name: False})
    if found["loss_scale_finite"]:
        fixed = source.replace("finite = distribution.experimental_local_results(", "finite = all_replicas_finite(")
        assert fixed != source and not keras_compat.local_finite_bug_in(fixed)
    # The detectors themselves, on the two forms of each line (so a detector that never fires fails here too):
    assert keras_compat.bugs_in(fixes["symbolic_build"][0] + "\n" + fixes["scalar_reduce"][0]) == \
        {"symbolic_build": True, "scalar_reduce": True}
    assert keras_compat.bugs_in(fixes["symbolic_build"][1] + "\n" + fixes["scalar_reduce"][1]) == \
        {"symbolic_build": False, "scalar_reduce": False}
    assert keras_compat.local_finite_bug_in("finite = distribution.experimental_local_results(finite_per_replica)[0]")
    assert not keras_compat.local_finite_bug_in("finite = all_replicas_finite(finite_per_replica)[0]")


def test_the_async_checkpoint_fix_is_installed_only_where_keras_creates_a_variable_per_copy(tmp_path):
    """Keras 3.15's `Variable._copy_trackable_to_cpu` makes a new tf.Variable on every call, which TF's
    async checkpoint (a tf.function) refuses after its first trace; with the fix, repeated async writes
    work and read back bit-exact."""
    installed = keras_compat.install_async_checkpoint_fix()
    assert installed, keras.__version__
    assert not keras_compat._ASYNC_COPY_BUG.search("object_map[self] = object_map[self.value]")
    model, schedule = _training_setup()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, history=schedule.state)
    options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
    for step in range(3):
        model.weights[0].assign(model.weights[0] + 1.0)
        checkpoint.write(str(tmp_path / f"ckpt-{step}"), options=options)
    checkpoint.sync()
    fresh, fresh_schedule = _training_setup()
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer, history=fresh_schedule.state).read(
        str(tmp_path / "ckpt-2")).assert_existing_objects_matched()
    for a, b in zip(model.weights, fresh.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_the_fit_fix_builds_from_the_element_spec_and_opens_no_iterator(monkeypatch):
    """Keras's build opened an iterator of the distributed dataset for one batch and dropped it at once; under
    MWMS that dropped a MultiDeviceIterator mid-prefetch, and a worker died of SIGSEGV now and then. Under the
    fix, fit and evaluate reach Keras's `reset` with no iterator opened, and the model still builds (its
    metrics too) from the spec alone. The multi-worker test is forced true so that a one-process
    MirroredStrategy takes the fix's path."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    if not keras_compat.install_fit_fix()["symbolic_build"]:
        return  # Keras fixed its build: Keras's own path runs, and its iterators are its business
    monkeypatch.setattr(tf_trainer, "_collective_all_reduce_multi_worker", lambda strategy: True)
    opened_before_reset = []
    original_reset = tf_trainer.TFEpochIterator.reset

    def reset(self):
        opened_before_reset.append(self._current_iterator is not None)
        original_reset(self)

    monkeypatch.setattr(tf_trainer.TFEpochIterator, "reset", reset)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    x, y = np.ones((32, 4), np.float32), np.zeros(32, np.int64)
    data = strategy.distribute_datasets_from_function(lambda _: tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
    logs = model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), verbose=0, return_dict=True)
    assert opened_before_reset == [False, False], opened_before_reset
    assert set(logs) == {"loss", "accuracy"}, logs  # the metrics built from the spec


def test_a_round_whose_first_batch_the_local_replicas_do_not_divide_trains_it(tmp_path, two_cpu_strategy):
    """One host of several devices (MirroredStrategy) restarted at a short last batch: Keras's build
    MEAN-reduced the replicas' shares of 2 and 1 rows and failed ("AddN must have the same size and shape"),
    which `fit` takes for bad input (exit 78: the job ended for good). Built from the spec, it trains them."""
    from tf_elastic import elastic
    from tf_elastic.elastic.worker.world import World

    if not keras_compat.install_fit_fix()["symbolic_build"]:
        pytest.skip("Keras fixed its build: its own path runs")
    x, y = np.arange(3, dtype=np.float32)[:, None], np.ones((3, 1), np.float32)
    with two_cpu_strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    elastic.fit(model, tf.data.Dataset.from_tensor_slices((x, y)).batch(4), epochs=1, verbose=0, world=World(),
                strategy=two_cpu_strategy, run_dir=str(tmp_path), config=elastic.FitConfig(durable_every_commits=0))
    assert int(model.optimizer.iterations.numpy()) == 1 and model.weights[0].numpy().item() > 0
