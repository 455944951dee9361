"""Keras 3.15's own optimizer and schedule tests, adapted to LARS and BatchResizeSchedule.

Adapted from keras/src/optimizers/{optimizer_test, optimizer_sparse_test, loss_scale_optimizer_test, sgd_test,
lamb_test}.py and optimizers/schedules/learning_rate_schedule_test.py (3.15.1). Most Keras tests check SGD's
numbers; `sgd_like()` is LARS with momentum 0, trust ratio 1 and no decay, which is plain SGD, so the same numbers
apply. LARS's own numbers come from the NumPy reference in tests/lars_reference.py. Every optimizer test runs with
`jit_compile=True` and `False` on TensorFlow (the XLA path writes variables itself, see LARS's docstring).

The module runs on the TensorFlow backend in the main session and, whole, on the JAX backend (two host CPU
devices) in a subprocess: `test_conformance_on_jax_backend`.

Keras tests that do not apply, and why:
- optimizer_test `test_get_method`, `test_pickleable_optimizers` and `test_gradient_accumulation_with_weigth_decay`
  loop over Keras's built-in optimizer names; here they run for LARS only (`keras.optimizers.get` with LARS's
  serialised config: a registered custom class has no short string name).
- sgd_test `test_invalid_momentum` and the argument checks: LARS's messages differ; tests/test_lars.py checks them.
- sgd_test / lamb_test `test_single_step` and `test_correctness_with_golden`: their golden numbers are SGD's and
  LAMB's algorithms. Kept as SGD's numbers through `sgd_like()`, and as LARS's own from the NumPy reference.
- optimizer_sparse_test `test_sparse_gradients` with `jit_compile=True`: it fails any direct `variable.assign`,
  which is what the XLA path does by design (in place, one launch per variable). It runs with `jit_compile=False`,
  and `test_sparse_correctness` checks both paths. The "expect sparse variable updates" flags are False: LARS
  densifies (momentum and weight decay touch every row, and the trust ratio needs the whole gradient's norm).
- loss_scale_optimizer_test `test_config`, `test_serialization`, `test_init_*` and
  `test_deserialization_backwards_compatibility` test LossScaleOptimizer's own arguments; only the round trip
  with a LARS inside is kept. Its stateless (JAX) and stateful (TensorFlow) variants run on their own backends.
- learning_rate_schedule_test: all but `test_fit_lr_correctness`, `test_config` and `test_variables` test the
  numbers of Keras's own schedules (ExponentialDecay, PiecewiseConstantDecay, PolynomialDecay, InverseTimeDecay,
  CosineDecay, CosineDecayRestarts). They are kept as the check that BatchResizeSchedule at its reference batch
  gives exactly the schedule it wraps, over those six schedules.
"""
import os
import pickle
import re
from unittest import mock

import keras
import numpy as np
import pytest
from keras import ops

from conftest import REPO, run_python
from lars_reference import reference_step
from tf_elastic import LARS, BatchResizeSchedule

BACKEND = keras.backend.backend()
# `jit_compile` only changes the TensorFlow path; on JAX Keras compiles the whole step anyway.
JIT = [True, False] if BACKEND == "tensorflow" else [True]
only_tf = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow-only Keras test")
jit = pytest.mark.parametrize("jit_compile", JIT, ids=[f"jit{j}" for j in JIT])


def sgd_like(learning_rate=1.0, jit_compile=True, **kwargs) -> LARS:
    """LARS that is plain SGD: no momentum, trust ratio 1 ("" matches every path), no weight decay."""
    return LARS(learning_rate, momentum=0.0, exclude_from_layer_adaptation=[""], jit_compile=jit_compile, **kwargs)


def variable(value, name=None):
    return keras.Variable(np.asarray(value, np.float32), name=name)


def close(actual, expected, atol=1e-6):
    np.testing.assert_allclose(ops.convert_to_numpy(actual), expected, rtol=1e-5, atol=atol)


ONES = [[1.0, 1.0], [1.0, 1.0]]


# ---- optimizer_test.py ----

@jit
def test_iterations_counter(jit_compile):
    v = variable([[1.0, 2.0], [3.0, 4.0]])
    optimizer = LARS(1.0, jit_compile=jit_compile)
    close(optimizer.iterations, 0)
    for expected in (1, 2):
        optimizer.apply_gradients([(ops.convert_to_tensor(ONES), v)])
        close(optimizer.iterations, expected)


@jit
def test_empty_gradients(jit_compile):
    v = variable([[3.0, 4.0], [5.0, 6.0]])
    with pytest.raises(ValueError, match="No gradients provided for any variable."):
        sgd_like(jit_compile=jit_compile).apply_gradients([(None, v)])
    v2 = variable([[3.0, 4.0], [5.0, 6.0]])
    with pytest.warns(UserWarning):
        sgd_like(jit_compile=jit_compile).apply_gradients([(None, v), (ops.convert_to_tensor(ONES), v2)])
    close(v, [[3.0, 4.0], [5.0, 6.0]])
    close(v2, [[2.0, 3.0], [4.0, 5.0]])


def test_clip_arguments_and_clipping():
    for argument in ("clipnorm", "clipvalue", "global_clipnorm"):
        assert getattr(LARS(**{argument: 0.1}), argument) == 0.1
    for pair in (dict(clipnorm=0.1, clipvalue=0.1), dict(clipnorm=0.1, global_clipnorm=0.1)):
        with pytest.raises(ValueError, match="Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can"):
            LARS(**pair)
    close(LARS(clipnorm=1)._clip_gradients([ops.convert_to_tensor([100.0, 100.0])])[0], [2**0.5 / 2] * 2)
    close(LARS(clipvalue=1)._clip_gradients([ops.convert_to_tensor([100.0, 100.0])])[0], [1.0, 1.0])
    grad = np.array([50.0, 100.0], np.float32)
    close(LARS(global_clipnorm=1)._clip_gradients([ops.convert_to_tensor(grad)])[0], grad / np.linalg.norm(grad))


@jit
def test_clipping_reaches_the_update(jit_compile):
    v = variable([[0.0, 0.0], [0.0, 0.0]])
    sgd_like(jit_compile=jit_compile, clipvalue=0.5).apply([ops.convert_to_tensor([[3.0, -3.0], [0.1, 0.0]])], [v])
    close(v, [[-0.5, 0.5], [-0.1, 0.0]])


@jit
def test_ema(jit_compile):
    v = variable([[3.0, 4.0], [5.0, 6.0]])
    optimizer = sgd_like(jit_compile=jit_compile, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3)
    grads = ops.convert_to_tensor(ONES)
    optimizer.apply_gradients([(grads, v)])
    close(v, [[2.0, 3.0], [4.0, 5.0]])
    close(optimizer._model_variables_moving_average[0], [[2.0, 3.0], [4.0, 5.0]])
    optimizer.apply_gradients([(grads, v)])
    close(v, [[1.0, 2.0], [3.0, 4.0]])
    close(optimizer._model_variables_moving_average[0], [[1.9, 2.9], [3.9, 4.9]])
    optimizer.apply_gradients([(grads, v)])
    close(v, [[1.71, 2.71], [3.71, 4.71]])  # overwritten with the average
    close(optimizer._model_variables_moving_average[0], [[1.71, 2.71], [3.71, 4.71]])


@jit
@pytest.mark.parametrize("run_eagerly", [True, False], ids=["eager", "compiled"])
def test_ema_with_model_fit(jit_compile, run_eagerly):
    optimizer = sgd_like(0.1, jit_compile=jit_compile, use_ema=True, ema_momentum=0.9)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2, kernel_initializer="ones", use_bias=False)])
    model.compile(loss="mse", optimizer=optimizer, run_eagerly=run_eagerly)
    model.fit(np.ones((1, 1), np.float32), np.zeros((1, 1), np.float32), batch_size=1, epochs=2, verbose=0)
    close(optimizer._model_variables_moving_average[0], [[0.891, 0.891]], atol=1e-5)
    close(model.trainable_variables[0], [[0.891, 0.891]], atol=1e-5)


@jit
def test_constraints_are_applied(jit_compile):
    v = variable(np.random.default_rng(0).random((2, 2)) - 1.0)
    v.constraint = keras.constraints.NonNeg()
    LARS(1e-4, jit_compile=jit_compile).apply_gradients([(ops.zeros((2, 2)), v)])
    assert float(np.min(ops.convert_to_numpy(v))) == 0.0


def test_get_method():
    optimizer = keras.optimizers.get(keras.optimizers.serialize(LARS(0.3, weight_decay=1e-4)))
    assert isinstance(optimizer, LARS) and optimizer.weight_decay == 1e-4
    assert keras.optimizers.get(None) is None


@jit
def test_static_loss_scaling(jit_compile):
    v = variable([[1.0, 2.0], [3.0, 4.0]])
    optimizer = sgd_like(jit_compile=jit_compile, loss_scale_factor=1024.0)
    optimizer.apply_gradients([(ops.convert_to_tensor([[1.0, 2.0], [3.0, 4.0]]) * 1024.0, v)])
    assert float(optimizer.scale_loss(1.0)) == 1024.0
    close(v, [[0.0, 0.0], [0.0, 0.0]])


@jit
def test_set_weights(jit_compile):
    x = variable([[1.0, 2.0], [3.0, 4.0]])
    first = LARS(0.5, jit_compile=jit_compile)
    first.apply_gradients([(ops.convert_to_tensor([[1.0, 2.0], [3.0, 4.0]]), x)])
    second = LARS(0.5, jit_compile=jit_compile)
    with pytest.raises(ValueError, match="You are calling"):
        second.set_weights(first.variables)
    second.build([x])
    second.set_weights(first.variables)
    for a, b in zip(first.variables, second.variables):
        close(b, ops.convert_to_numpy(a))


@jit
def test_gradient_accumulation(jit_compile):
    v = variable([[1.0, 2.0], [3.0, 4.0]])
    optimizer = sgd_like(jit_compile=jit_compile, gradient_accumulation_steps=3)
    assert optimizer.gradient_accumulation_steps == 3
    grads = ops.convert_to_tensor(ONES)
    expected = [  # (v, accumulator, _iterations, iterations) after each step
        ([[1.0, 2.0], [3.0, 4.0]], ONES, 1, 0),
        ([[1.0, 2.0], [3.0, 4.0]], [[2.0, 2.0], [2.0, 2.0]], 2, 0),
        ([[0.0, 1.0], [2.0, 3.0]], [[0.0, 0.0], [0.0, 0.0]], 3, 1),
        ([[0.0, 1.0], [2.0, 3.0]], ONES, 4, 1),
    ]
    for value, accumulator, raw_iterations, iterations in expected:
        optimizer.apply_gradients([(grads, v)])
        close(v, value)
        close(optimizer._accumulated_gradients[0], accumulator)
        close(optimizer._iterations, raw_iterations)
        close(optimizer.iterations, iterations)


@only_tf
@jit
def test_tf_checkpointing(jit_compile, tmp_path):
    import tensorflow as tf

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    optimizer = LARS(0.5, weight_decay=1e-3, jit_compile=jit_compile)
    x, y = np.random.default_rng(0).random((2, 1, 2))
    model.compile(optimizer, "mse")
    model.train_on_batch(x, y)
    reference = model.predict(x, verbose=0)
    path = tf.train.Checkpoint(model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    model.train_on_batch(x, y)
    assert not np.allclose(model.predict(x, verbose=0), reference, atol=1e-4)
    tf.train.Checkpoint(model, optimizer=optimizer).restore(path)
    np.testing.assert_allclose(model.predict(x, verbose=0), reference, atol=1e-6)


@jit
def test_callable_learning_rate(jit_compile):
    v = variable([[1.0, 2.0], [3.0, 4.0]])
    optimizer = sgd_like(lambda: 0.1, jit_compile=jit_compile)
    optimizer.apply_gradients([(ops.convert_to_tensor(ONES), v)])
    close(v, [[0.9, 1.9], [2.9, 3.9]])
    close(optimizer.iterations, 1)


@jit
def test_overwrite_with_gradient(jit_compile):
    v, v2 = variable([[1.0, 2.0], [3.0, 4.0]]), variable([[1.0, 2.0], [3.0, 4.0]])
    v.overwrite_with_gradient = True
    sgd_like(jit_compile=jit_compile).apply_gradients([(ops.convert_to_tensor(ONES), v),
                                                       (ops.convert_to_tensor(ONES), v2)])
    close(v, ONES)
    close(v2, [[0.0, 1.0], [2.0, 3.0]])


@jit
def test_overwrite_with_gradient_with_gradient_accumulation(jit_compile):
    v, v2 = variable([[1.0, 2.0], [3.0, 4.0]]), variable([[1.0, 2.0], [3.0, 4.0]])
    v.overwrite_with_gradient = True
    optimizer = sgd_like(jit_compile=jit_compile, gradient_accumulation_steps=2)
    ones, twos = ops.convert_to_tensor(ONES), ops.convert_to_tensor([[2.0, 2.0], [2.0, 2.0]])
    optimizer.apply_gradients([(ones, v), (ones, v2)])
    close(v, [[1.0, 2.0], [3.0, 4.0]])
    close(v2, [[1.0, 2.0], [3.0, 4.0]])
    optimizer.apply_gradients([(twos, v), (twos, v2)])
    close(optimizer.iterations, 1)
    close(v, [[2.0, 2.0], [2.0, 2.0]])
    close(v2, [[-0.5, 0.5], [1.5, 2.5]])
    close(optimizer._accumulated_gradients[1], [[0.0, 0.0], [0.0, 0.0]])


@jit
def test_gradient_accumulation_with_weight_decay(jit_compile):
    """Three accumulated steps equal one step on the mean gradient, weight decay (inside the trust ratio,
    taken at the update step) included."""
    kwargs = dict(learning_rate=0.5, weight_decay=0.05, trust_coefficient=0.1, jit_compile=jit_compile)
    once, accumulated = LARS(**kwargs), LARS(gradient_accumulation_steps=3, **kwargs)
    v1, v3 = variable([[0.9], [0.5]]), variable([[0.9], [0.5]])
    rng = np.random.default_rng(0)
    for _ in range(8):
        grads = rng.random((3, 2, 1)).astype(np.float32)
        once.apply_gradients([(ops.convert_to_tensor(grads.mean(axis=0)), v1)])
        for batch in grads:
            accumulated.apply_gradients([(ops.convert_to_tensor(batch), v3)])
    close(v3, ops.convert_to_numpy(v1))
    assert not np.allclose(ops.convert_to_numpy(v1), [[0.9], [0.5]])


def test_setting_lr_to_schedule_untracks_lr_variable():
    optimizer = LARS(0.001)
    assert len(optimizer.variables) == 2
    optimizer.learning_rate = keras.optimizers.schedules.PolynomialDecay(optimizer.learning_rate, 4)
    assert len(optimizer.variables) == 1


def test_pickle_and_serialization_round_trip():
    optimizer = LARS(0.5, momentum=0.8, weight_decay=0.004, nesterov=True, exclude_from_weight_decay=["bias"])
    assert pickle.loads(pickle.dumps(optimizer)).get_config() == optimizer.get_config()
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(restored) is LARS and restored.get_config() == optimizer.get_config()


def test_optimizer_auto_naming():
    first, second = LARS(), LARS()
    assert first.name != second.name and first.name.startswith("lars") and second.name.startswith("lars")
    assert LARS(name="my_lars").name == "my_lars"
    assert keras.optimizers.deserialize(keras.optimizers.serialize(second)).name == second.name


@only_tf
@jit
def test_mixed_with_tf_variables(jit_compile):
    import tensorflow as tf

    v, tf_v = variable([[1.0, 2.0], [3.0, 4.0]]), tf.Variable([[1.0, 2.0], [3.0, 4.0]])
    optimizer = sgd_like(jit_compile=jit_compile)
    grads = ops.convert_to_tensor(ONES)
    optimizer.apply_gradients([(grads, v), (grads, tf_v)])
    close(optimizer.iterations, 1)
    close(tf_v, [[0.0, 1.0], [2.0, 3.0]])
    with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
        optimizer.apply_gradients([(grads, v), (None, tf_v)])
    close(optimizer.iterations, 2)


@only_tf
@jit
def test_regex_exclusions_match_a_plain_tf_variable_by_name(jit_compile):
    """Fault 3: a plain tf.Variable has no `.path`; like Keras, LARS matches its name."""
    import tensorflow as tf

    frozen = tf.Variable(np.full((2, 2), 2.0, np.float32), name="frozen")
    free = tf.Variable(np.full((2, 2), 2.0, np.float32), name="free")
    optimizer = sgd_like(jit_compile=jit_compile, weight_decay=0.1, exclude_from_weight_decay=["frozen"])
    optimizer.apply_gradients([(ops.zeros((2, 2)), frozen), (ops.zeros((2, 2)), free)])
    close(frozen, np.full((2, 2), 2.0))
    close(free, np.full((2, 2), 1.8))


# ---- sgd_test.py / lamb_test.py ----

def test_weight_decay_attribute_matches_config():
    """Fault 2: `weight_decay` is the base class's attribute, as in every Keras optimizer."""
    optimizer = LARS(weight_decay=0.01)
    assert optimizer.weight_decay == 0.01 == optimizer.get_config()["weight_decay"]
    assert LARS().weight_decay == 0.0


@jit
def test_weight_decay_exclusions_by_keras_method(jit_compile):
    """Fault 1: Keras's `exclude_from_weight_decay(var_names=..., var_list=...)` is obeyed. Variables of rank 0,
    as in Keras's test; `exclude_from_weight_decay=[]` lifts LARS's default exclusion of rank <= 1."""
    make = lambda: sgd_like(jit_compile=jit_compile, weight_decay=0.004, exclude_from_weight_decay=[])
    zero = ops.zeros(())
    var1, var2, var3 = variable(2.0), variable(2.0, name="exclude"), variable(2.0)
    make().apply_gradients([(zero, var1)])
    by_name = make()
    by_name.exclude_from_weight_decay(var_names=["exclude"])
    by_name.apply_gradients([(zero, var1), (zero, var2)])
    by_list = make()
    by_list.exclude_from_weight_decay(var_list=[var3])
    by_list.apply_gradients([(zero, var1), (zero, var3)])
    close(var1, 2.0 * (1 - 0.004) ** 3)  # w - lr * beta * w, three times
    close(var2, 2.0)
    close(var3, 2.0)


@jit
def test_keras_exclusion_and_argument_combine(jit_compile):
    """A variable decays only if neither LARS's argument nor Keras's method excludes it."""
    kernels = [variable(np.full((2, 2), 2.0), name=n) for n in ("a", "b", "c")]
    optimizer = sgd_like(jit_compile=jit_compile, weight_decay=0.1, exclude_from_weight_decay=[r"\bb\b"])
    optimizer.exclude_from_weight_decay(var_list=[kernels[2]])
    optimizer.apply_gradients([(ops.zeros((2, 2)), k) for k in kernels])
    close(kernels[0], np.full((2, 2), 1.8))
    close(kernels[1], np.full((2, 2), 2.0))
    close(kernels[2], np.full((2, 2), 2.0))
    with pytest.raises(ValueError, match="before the optimizer is built"):
        optimizer.exclude_from_weight_decay(var_names=["a"])


def test_config_round_trip():
    optimizer = LARS(0.5, momentum=0.06, nesterov=True, weight_decay=0.004, classic_momentum=False)
    restored = LARS.from_config(optimizer.get_config())
    assert restored.get_config() == optimizer.get_config()
    assert restored.weight_decay == 0.004


@jit
def test_single_step(jit_compile):
    optimizer = sgd_like(0.5, jit_compile=jit_compile)
    assert len(optimizer.variables) == 2  # iterations, learning rate
    v = variable([1.0, 2.0, 3.0, 4.0])
    optimizer.build([v])
    optimizer.apply_gradients([(ops.convert_to_tensor([1.0, 6.0, 7.0, 2.0]), v)])
    close(v, [0.5, -1.0, -0.5, 3.0])
    assert len(optimizer.variables) == 3  # + momentum
    close(optimizer.variables[0], 1)
    close(optimizer.variables[1], 0.5)


@jit
def test_correctness_with_golden(jit_compile):
    """SGD's golden run (lr 0.01), then LARS's own (nesterov, weight decay, trust ratio) from the reference."""
    x = variable(np.ones(10))
    optimizer = sgd_like(0.01, jit_compile=jit_compile)
    grads, first = np.arange(0.1, 1.05, 0.1, dtype=np.float32), np.full(10, 0.01, np.float32)
    optimizer.apply_gradients([(ops.convert_to_tensor(first), x)])
    for i in range(5):
        close(x, 1 - 0.01 * (0.01 + i * grads), atol=1e-5)
        optimizer.apply_gradients([(ops.convert_to_tensor(grads), x)])
    kw = dict(momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, epsilon=0.0, nesterov=True,
              classic_momentum=True)
    x = variable(np.ones(10))
    optimizer = LARS(0.5, jit_compile=jit_compile, exclude_from_weight_decay=[], exclude_from_layer_adaptation=[],
                     **kw)
    w, velocity = np.ones(10), np.zeros(10)
    for g in [first] + [grads] * 5:
        optimizer.apply_gradients([(ops.convert_to_tensor(g), x)])
        w, velocity = reference_step(w, g, velocity, 0.5, decays=True, adapts=True, **kw)
        close(x, w)


# ---- optimizer_sparse_test.py ----

def _sparse(values, rows, shape):
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.IndexedSlices(values, rows, shape)  # rows as a Python tuple, as Keras's tests build them
    import jax.experimental.sparse as jax_sparse

    return jax_sparse.BCOO((values, tuple((r,) for r in rows)), shape=shape)


SPARSE_CASES = {
    "lars": lambda jit: LARS(0.5, weight_decay=1e-2, trust_coefficient=0.01, jit_compile=jit),
    "lars_no_exclusions": lambda jit: LARS(0.5, weight_decay=1e-2, exclude_from_weight_decay=[],
                                           exclude_from_layer_adaptation=[], jit_compile=jit),
    "lars_nesterov_tpu_momentum": lambda jit: LARS(0.5, nesterov=True, classic_momentum=False, jit_compile=jit),
    "loss_scale_lars": lambda jit: keras.optimizers.LossScaleOptimizer(LARS(0.5, jit_compile=jit)),
}


@pytest.mark.parametrize("case", sorted(SPARSE_CASES))
def test_sparse_gradients_use_optimizer_assign(case):
    """Keras's mock test, with `jit_compile=False` (the XLA path writes in place by design). LARS densifies,
    so neither model nor optimizer variables get sparse updates; every write goes through `self.assign`."""
    model_variable = keras.Variable(initializer="ones", shape=(5, 10))
    optimizer = SPARSE_CASES[case](False)
    grad = _sparse(0.5 * ops.ones((3, 10)), (0, 2, 4), (5, 10))
    if BACKEND == "tensorflow":
        import tensorflow as tf

        sparse_class, variable_class = tf.IndexedSlices, model_variable._value.__class__
    else:
        import jax.experimental.sparse as jax_sparse

        sparse_class, variable_class = jax_sparse.JAXSparse, model_variable.__class__
    inner = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    sparse_updates, writes = [], []

    def optimizer_assign(target, value):
        writes.append(target)
        sparse_updates.append(isinstance(value, sparse_class))

    def variable_assign(target, value):
        if len(target.shape):
            pytest.fail("LARS wrote a variable directly instead of through `self.assign`")

    with mock.patch.object(inner, "_apply_weight_decay", autospec=True), \
            mock.patch.object(inner, "assign", autospec=True, side_effect=optimizer_assign), \
            mock.patch.object(inner, "assign_add", autospec=True, side_effect=optimizer_assign), \
            mock.patch.object(inner, "assign_sub", autospec=True, side_effect=optimizer_assign), \
            mock.patch.object(variable_class, "assign", autospec=True, side_effect=variable_assign), \
            mock.patch.object(variable_class, "assign_add", autospec=True, side_effect=variable_assign), \
            mock.patch.object(variable_class, "assign_sub", autospec=True, side_effect=variable_assign):
        optimizer.apply([grad], [model_variable])
    assert len(writes) == 2 and not any(sparse_updates)  # weights and momentum, dense


@jit
@pytest.mark.parametrize("case", sorted(SPARSE_CASES))
def test_sparse_correctness(case, jit_compile):
    """Faults 4 and 5: a sparse gradient gives the numbers of the same dense gradient."""
    sparse_optimizer, dense_optimizer = SPARSE_CASES[case](jit_compile), SPARSE_CASES[case](jit_compile)
    var_sparse = keras.Variable(initializer="ones", shape=(5, 3, 2))
    var_dense = keras.Variable(initializer="ones", shape=(5, 3, 2))
    stateless = BACKEND == "jax"
    if stateless:
        sparse_optimizer.build([var_sparse])
        dense_optimizer.build([var_dense])
    sparse_state, dense_state = sparse_optimizer.variables, dense_optimizer.variables
    sparse_values, dense_values = [var_sparse.value], [var_dense.value]
    for i in range(5):
        grad_sparse = _sparse(ops.ones((3, 3, 2)) * (10.0 - i), (0, 2, 4), (5, 3, 2))
        grad_dense = ops.convert_to_tensor(np.where(np.isin(np.arange(5), (0, 2, 4))[:, None, None], 10.0 - i, 0.0)
                                           .astype(np.float32) * np.ones((5, 3, 2), np.float32))
        if stateless:
            sparse_values, sparse_state = sparse_optimizer.stateless_apply(sparse_state, [grad_sparse], sparse_values)
            dense_values, dense_state = dense_optimizer.stateless_apply(dense_state, [grad_dense], dense_values)
            close(sparse_values[0], ops.convert_to_numpy(dense_values[0]))
        else:
            sparse_optimizer.apply([grad_sparse], [var_sparse])
            dense_optimizer.apply([grad_dense], [var_dense])
            close(var_sparse.value, ops.convert_to_numpy(var_dense.value))
    final = ops.convert_to_numpy(sparse_values[0] if stateless else var_sparse.value)
    assert not np.allclose(final[0], final[1])  # rows with a gradient moved further than rows without


# ---- loss_scale_optimizer_test.py ----

def _loss_scale_apply(optimizer, grads, variables):
    """Keras's stateless path on JAX (LossScaleOptimizer must use it there), the stateful one on TensorFlow."""
    if BACKEND != "jax":
        optimizer.apply(grads, variables)
        return variables
    if not optimizer.built:
        optimizer.build(variables)
    values, state = optimizer.stateless_apply([v.value for v in optimizer.variables], grads,
                                              [v.value for v in variables])
    for target, value in zip(optimizer.variables, state):
        target.assign(value)
    return values


@jit
@pytest.mark.parametrize("inner_scale", [None, 100.0], ids=["plain", "inner_loss_scale"])
def test_loss_scale_finite_step(jit_compile, inner_scale):
    optimizer = keras.optimizers.LossScaleOptimizer(sgd_like(0.5, jit_compile, loss_scale_factor=inner_scale))
    grads = [ops.convert_to_tensor([1.0, 6.0, 7.0, 2.0]) * optimizer.initial_scale]
    result = _loss_scale_apply(optimizer, grads, [variable([1.0, 2.0, 3.0, 4.0])])
    close(result[0], [0.5, -1.0, -0.5, 3.0], atol=1e-4)


@jit
def test_loss_scale_infinite_step_is_skipped(jit_compile):
    """A non-finite step leaves weights, momentum and iterations alone (LossScaleOptimizer's `cond`)."""
    inner = LARS(0.5, weight_decay=1e-2, jit_compile=jit_compile, exclude_from_weight_decay=[])
    optimizer = keras.optimizers.LossScaleOptimizer(inner)
    v = variable([1.0, 2.0, 3.0, 4.0])
    result = _loss_scale_apply(optimizer, [ops.convert_to_tensor([np.inf] * 4)], [v])
    close(result[0], [1.0, 2.0, 3.0, 4.0])
    close(inner.momentums[0], [0.0] * 4)
    close(inner.iterations, 0)


@jit
def test_loss_scale_finite_step_with_overwrite(jit_compile):
    optimizer = keras.optimizers.LossScaleOptimizer(LARS(0.5, jit_compile=jit_compile))
    v = variable([1.0, 2.0, 3.0, 4.0])
    v.overwrite_with_gradient = True
    grads = [ops.convert_to_tensor([1.0, 6.0, 7.0, 2.0])]
    close(_loss_scale_apply(optimizer, grads, [v])[0], [1.0, 6.0, 7.0, 2.0])


@jit
@pytest.mark.parametrize("direction", ["down", "up"])
def test_loss_scale_dynamics(jit_compile, direction):
    down = direction == "down"
    optimizer = keras.optimizers.LossScaleOptimizer(LARS(0.5, jit_compile=jit_compile),
                                                    initial_scale=400.0 if down else 2.0, dynamic_growth_steps=2)
    v = variable([1.0, 2.0, 3.0, 4.0])
    grads = [ops.convert_to_tensor([np.inf] * 4 if down else [1.0, 6.0, 7.0, 2.0])]
    for step in range(4 if down else 8):
        values = _loss_scale_apply(optimizer, grads, [v])
        if BACKEND == "jax":
            v.assign(values[0])
        if not down:
            assert int(ops.convert_to_numpy(optimizer.iterations)) == step + 1
    assert float(optimizer.scale_loss(1.0)) == (25.0 if down else 32.0)


def test_loss_scale_serialization_with_lars_inside():
    optimizer = keras.optimizers.LossScaleOptimizer(LARS(0.5, weight_decay=1e-3), initial_scale=64.0)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(restored.inner_optimizer, LARS)
    assert restored.inner_optimizer.get_config() == optimizer.inner_optimizer.get_config()


# ---- schedules/learning_rate_schedule_test.py ----

KERAS_SCHEDULES = {
    "exponential": lambda: keras.optimizers.schedules.ExponentialDecay(0.1, 3, 0.96, staircase=True),
    "piecewise": lambda: keras.optimizers.schedules.PiecewiseConstantDecay([10, 20], [0.1, 0.05, 0.01]),
    "polynomial": lambda: keras.optimizers.schedules.PolynomialDecay(0.1, 30, 0.01, power=0.5, cycle=True),
    "inverse_time": lambda: keras.optimizers.schedules.InverseTimeDecay(0.1, 5, 0.5),
    "cosine": lambda: keras.optimizers.schedules.CosineDecay(0.0, 30, alpha=0.1, warmup_target=0.1,
                                                            warmup_steps=5),
    "cosine_restarts": lambda: keras.optimizers.schedules.CosineDecayRestarts(0.1, 7, t_mul=2.0, m_mul=0.5),
}


@pytest.mark.parametrize("name", sorted(KERAS_SCHEDULES))
def test_at_reference_batch_wraps_keras_schedules_exactly(name):
    base = KERAS_SCHEDULES[name]()
    schedule = BatchResizeSchedule(base, 32)
    for step in (0, 1, 2, 3, 5, 9, 10, 11, 19, 20, 29, 30, 45, 100):
        np.testing.assert_allclose(float(schedule(step)), float(base(step)), rtol=1e-6, err_msg=f"step {step}")


def test_schedule_config():
    schedule = BatchResizeSchedule(KERAS_SCHEDULES["cosine"](), 32, batch_size=64, transition="momentum",
                                   momentum=0.9, name="my_schedule", history=[(10, 128)])
    restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(schedule))
    assert restored.get_config() == schedule.get_config()
    assert [float(restored(s)) for s in range(0, 40, 3)] == [float(schedule(s)) for s in range(0, 40, 3)]


def test_schedule_follows_a_step_variable():
    step = keras.Variable(1.0)
    schedule = BatchResizeSchedule(KERAS_SCHEDULES["exponential"](), 32, transition="none")
    close(schedule(step), 0.1)
    step.assign(100)
    close(schedule(step), 0.1 * 0.96 ** (100 // 3))
    schedule.resize(50, 64)
    close(schedule(step), 0.2 * 0.96 ** (150 // 3))  # 50 reference steps, then 50 steps of two


@pytest.mark.parametrize("transition", ["none", "linear"])
def test_fit_lr_correctness(transition):
    """Keras's test with LARS and BatchResizeSchedule: the schedule's state becomes an optimizer variable at
    build, iterations count the steps, and fit's losses follow the schedule (same as the schedule's history
    given up front)."""
    def losses(schedule):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, kernel_initializer="ones",
                                                                        bias_initializer="ones")])
        optimizer = LARS(schedule, trust_coefficient=0.05, weight_decay=1e-3)
        assert len(optimizer.variables) == 1
        model.compile(optimizer=optimizer, loss="mse")
        x = np.arange(32).reshape((16, 2)).astype(np.float32) / 32
        history = model.fit(x, x[:, ::-1], epochs=3, batch_size=4, shuffle=False, verbose=0).history["loss"]
        assert int(ops.convert_to_numpy(optimizer.variables[0])) == 4 * 3
        assert any(v is schedule.state for v in optimizer.variables)
        return history

    resized = losses(BatchResizeSchedule(0.05, 4, transition=transition, history=[(5, 16)]))
    plain = losses(BatchResizeSchedule(0.05, 4))
    assert np.all(np.isfinite(resized)) and not np.allclose(resized, plain)


# ---- beyond Keras's tests: resizes reach compiled train steps ----

def _fit_with_resize(make_optimizer, resize_between: bool):
    """Two fits; the schedule goes from 16 to 32 at the first fit's end (4 steps), either between the fits
    (after the train step was compiled) or up front. Returns the final weights."""
    keras.utils.set_random_seed(0)
    schedule = BatchResizeSchedule(0.5, 16, transition="none", history=None if resize_between else [(4, 32)])
    optimizer = make_optimizer(schedule)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 6)).astype(np.float32), rng.integers(0, 3, 64)
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=4, shuffle=False, verbose=0)
    train_function = model.train_function
    if resize_between:
        schedule.resize(4, 32)
    # The same batch shape as before: a new shape would retrace the step (JAX would then read the new state).
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, shuffle=False, verbose=0)
    assert model.train_function is train_function  # the resize had to reach the already-compiled step
    assert int(ops.convert_to_numpy(model.optimizer._iterations)) == 6
    return [ops.convert_to_numpy(v) for v in model.trainable_variables]


RESIZE_OPTIMIZERS = {
    "lars": lambda s: LARS(s, trust_coefficient=0.02, weight_decay=1e-3),
    "lars_no_xla": lambda s: LARS(s, trust_coefficient=0.02, weight_decay=1e-3, jit_compile=False),
    "lars_accumulation": lambda s: LARS(s, trust_coefficient=0.02, gradient_accumulation_steps=2),
    "lars_ema": lambda s: LARS(s, trust_coefficient=0.02, use_ema=True),
    "sgd_attached": lambda s: _attached(keras.optimizers.SGD(s, momentum=0.9), s),
}


def _attached(optimizer, schedule):
    schedule.attach(optimizer)
    schedule.attach(optimizer)  # twice adds nothing
    assert sum(v is schedule.state for v in optimizer.variables) == 1
    return optimizer


# Keras 3.15.1 on JAX: a second `fit` with `use_ema=True` fails for any optimizer, Keras's SGD included ("Attempt to
# donate the same buffer twice", then an EMA variable without a value).
JAX_EMA_BUG = pytest.mark.skipif(BACKEND == "jax", reason="Keras 3.15.1 on JAX: a second fit with use_ema fails")


@pytest.mark.parametrize("name", [pytest.param(n, marks=JAX_EMA_BUG) if "ema" in n else n
                                  for n in sorted(RESIZE_OPTIMIZERS)])
def test_resize_between_fits_reaches_whole_step_xla(name):
    """Fault 6, and `model.compile(jit_compile=True)` on one device (Keras compiles the whole step with XLA; on
    JAX always): a resize after the step was compiled gives the weights of a schedule that had it up front."""
    make = RESIZE_OPTIMIZERS[name]
    resized = _fit_with_resize(make, resize_between=True)
    up_front = _fit_with_resize(make, resize_between=False)
    for a, b in zip(resized, up_front):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _ResizeAt(keras.callbacks.Callback):
    def __init__(self, schedule, step, batch_size):
        super().__init__()
        self.schedule, self.step, self.batch_size = schedule, step, batch_size

    def on_train_batch_end(self, batch, logs=None):
        step = int(ops.convert_to_numpy(self.model.optimizer.iterations))  # `self.model` syncs JAX's state
        if step == self.step:
            self.schedule.resize(step, self.batch_size)


def test_resize_from_a_callback_inside_fit():
    """A resize from a callback mid-epoch reaches the next step on both backends (on JAX, because reading
    `self.model` makes Keras write back the state it holds and re-read it before the next step)."""
    def weights(in_callback):
        keras.utils.set_random_seed(0)
        schedule = BatchResizeSchedule(0.5, 16, transition="none", history=None if in_callback else [(3, 32)])
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer=LARS(schedule, trust_coefficient=0.02), loss="mse")
        rng = np.random.default_rng(0)
        model.fit(rng.standard_normal((96, 6)).astype(np.float32), rng.standard_normal((96, 3)), batch_size=16,
                  shuffle=False, verbose=0, callbacks=[_ResizeAt(schedule, 3, 32)] if in_callback else [])
        assert schedule.history == [(0, 16), (3, 32)]
        return [ops.convert_to_numpy(v) for v in model.trainable_variables]

    for a, b in zip(weights(True), weights(False)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution is JAX-only here; runs in the JAX subprocess")
def test_resize_between_fits_under_jax_data_parallel():
    import jax

    assert jax.device_count() >= 2, "the JAX subprocess sets --xla_force_host_platform_device_count=2"
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    try:
        make = RESIZE_OPTIMIZERS["lars"]
        resized = _fit_with_resize(make, resize_between=True)
        up_front = _fit_with_resize(make, resize_between=False)
        kernel = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)]).weights[0]
        assert len(kernel.value.sharding.device_set) == jax.device_count()  # replicated: the distribution is on
    finally:
        keras.distribution.set_distribution(None)
    for a, b in zip(resized, up_front):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@only_tf
@pytest.mark.parametrize("jit_compile", [True, False])
def test_whole_step_xla_matches_eager_with_ema_and_accumulation(jit_compile):
    """Fault 7 in fit: LARS's in-place XLA writes inside Keras's whole-step XLA, with EMA and accumulation,
    give the eager `self.assign` path's weights."""
    def weights(run_eagerly, model_jit):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
        optimizer = LARS(0.5, trust_coefficient=0.02, weight_decay=1e-3, use_ema=True, ema_overwrite_frequency=3,
                         gradient_accumulation_steps=2, jit_compile=jit_compile and not run_eagerly)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      run_eagerly=run_eagerly, jit_compile=model_jit)
        rng = np.random.default_rng(0)
        model.fit(rng.standard_normal((96, 6)).astype(np.float32), rng.integers(0, 3, 96), batch_size=16,
                  shuffle=False, verbose=0)
        return [v.numpy() for v in model.trainable_variables]

    for a, b in zip(weights(False, True), weights(True, False)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow(minutes=1.5)
@pytest.mark.skipif(BACKEND != "tensorflow", reason="started from the TensorFlow session")
def test_conformance_on_jax_backend():
    """This module on Keras's JAX backend with two host CPU devices (for DataParallel), in a fresh process."""
    proc = run_python(
        "import sys, pytest; sys.exit(pytest.main(['-q', '-rA', '-p', 'no:cacheprovider', '-m', 'not slow', "
        f"{os.path.relpath(__file__, REPO)!r}]))",
        env={"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, timeout=600)
    passed = set(re.findall(r"^PASSED \S+::(\w+)", proc.stdout, re.M))
    for name in ("test_resize_between_fits_under_jax_data_parallel", "test_resize_between_fits_reaches_whole_step_xla",
                 "test_resize_from_a_callback_inside_fit",
                 "test_sparse_correctness", "test_weight_decay_exclusions_by_keras_method",
                 "test_sparse_gradients_use_optimizer_assign", "test_loss_scale_infinite_step_is_skipped"):
        assert name in passed, f"{name} did not pass on JAX:\n{proc.stdout[-3000:]}"

