"""LARS against a NumPy reference, under XLA and strategies, through fit, saving and mixed precision."""
import glob
import itertools
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_elastic
from conftest import run_python, run_workers
from lars_reference import check_optimizer_against_reference, reference_step
from tf_elastic import LARS

COMBINATIONS = list(itertools.product([True, False], [False, True], [0.0, 1e-2], [0.0, 1e-3]))


@pytest.mark.parametrize("classic_momentum,nesterov,weight_decay,epsilon", COMBINATIONS)
@pytest.mark.parametrize("jit_compile", [True, False])
def test_matches_reference_on_random_gradients(classic_momentum, nesterov, weight_decay, epsilon, jit_compile):
    check_optimizer_against_reference(dict(
        learning_rate=0.5, momentum=0.9, weight_decay=weight_decay, trust_coefficient=0.01, epsilon=epsilon,
        nesterov=nesterov, classic_momentum=classic_momentum, jit_compile=jit_compile))


def _model(synchronized=False):
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.BatchNormalization(synchronized=synchronized, name="bn"),
        keras.layers.Dense(3, name="head"),
    ])


@pytest.mark.parametrize("classic_momentum,nesterov,weight_decay,epsilon", COMBINATIONS)
def test_matches_reference_on_model_gradients(classic_momentum, nesterov, weight_decay, epsilon):
    """A model with kernels, biases and BatchNormalization; real gradients from a loss, 5 steps."""
    keras.utils.set_random_seed(1)
    model = _model()
    x = np.random.default_rng(0).standard_normal((32, 6)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, 32)
    kw = dict(momentum=0.9, weight_decay=weight_decay, trust_coefficient=0.02, epsilon=epsilon, nesterov=nesterov,
              classic_momentum=classic_momentum)
    optimizer = LARS(learning_rate=0.3, **kw)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    weights = [v.numpy().astype(np.float64) for v in variables]
    velocities = [np.zeros_like(w) for w in weights]
    for step in range(5):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        optimizer.apply(grads, variables)
        for i, (v, g) in enumerate(zip(variables, grads)):
            weights[i], velocities[i] = reference_step(weights[i], g.numpy(), velocities[i], 0.3,
                                                       decays=len(v.shape) > 1, adapts=len(v.shape) > 1, **kw)
            np.testing.assert_allclose(v.numpy(), weights[i], rtol=1e-5, atol=1e-7, err_msg=f"{v.path} step {step}")


def test_exclusions_by_regex():
    # Variables: dense/kernel, dense/bias, bn/gamma, conv/kernel, frozen/kernel (see lars_reference).
    check_optimizer_against_reference(
        dict(learning_rate=0.5, weight_decay=1e-2, trust_coefficient=0.01,
             exclude_from_weight_decay=["conv", r"bias$"], exclude_from_layer_adaptation="dense_kernel"),
        decays=[True, False, True, False, True], adapts=[False, True, True, True, True])


def test_exclusions_by_callable():
    check_optimizer_against_reference(
        dict(learning_rate=0.5, weight_decay=1e-2, trust_coefficient=0.01,
             exclude_from_weight_decay=lambda v: v.shape == (5,),
             exclude_from_layer_adaptation=[lambda v: len(v.shape) == 4]),
        decays=[True, False, False, True, True], adapts=[True, True, True, False, True])


def test_zero_norm_guard_lets_zero_initialised_bias_train():
    """With nothing excluded from adaptation, a zero bias (|w| = 0) still moves (trust 1), a zero
    gradient leaves trust at 1 (only weight decay acts), and nothing becomes NaN. eta != beta: with them
    equal, eta |w| / (0 + beta |w|) is 1 too, and a missing guard would go unseen."""
    variables, _ = check_optimizer_against_reference(
        dict(learning_rate=0.5, weight_decay=1e-2, trust_coefficient=0.03,
             exclude_from_weight_decay=[], exclude_from_layer_adaptation=[]),
        decays=[True] * 5, adapts=[True] * 5)
    bias = variables[1].numpy()
    assert np.all(np.isfinite(bias)) and np.abs(bias).max() > 0


def test_sparse_gradients_from_embedding():
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(20, 4)
    embedding.build((None,))
    optimizer = LARS(learning_rate=0.5, weight_decay=1e-2, trust_coefficient=0.01)
    table = embedding.embeddings
    expected = table.numpy().astype(np.float64)
    velocity = np.zeros_like(expected)
    for step in range(3):
        ids = tf.constant([[1, 3, 3], [7, 1, 0]])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(embedding(ids) - 1.0))
        (grad,) = tape.gradient(loss, [table.value])
        assert isinstance(grad, tf.IndexedSlices)
        optimizer.apply([grad], [table])
        expected, velocity = reference_step(expected, tf.convert_to_tensor(grad).numpy(), velocity, 0.5,
                                            momentum=0.9, weight_decay=1e-2, trust_coefficient=0.01, epsilon=0.0,
                                            nesterov=False, classic_momentum=True, decays=True, adapts=True)
        np.testing.assert_allclose(table.numpy(), expected, rtol=1e-5, atol=1e-7)


def test_learning_rate_schedule_is_followed():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    check_optimizer_against_reference(dict(learning_rate=schedule, trust_coefficient=0.01, weight_decay=1e-3))


_XLA_PROGRAM = """
import numpy as np, keras
from tf_elastic import LARS
v = [keras.Variable(np.ones((4, 3), np.float32)), keras.Variable(np.zeros(3, np.float32))]
opt = LARS(0.1, jit_compile={jit})
for _ in range(2):
    opt.apply([np.full((4, 3), 0.5, np.float32), np.ones(3, np.float32)], v)
np.save("weights.npy", v[0].numpy())
"""


@pytest.mark.slow
def test_xla_is_used_only_when_jit_compile(tmp_path):
    """XLA's dump shows a `lars_update` module with jit_compile=True and none without; same numbers."""
    results = {}
    for jit in (True, False):
        work = tmp_path / str(jit)
        work.mkdir()
        run_python(_XLA_PROGRAM.format(jit=jit), cwd=work,
                   env={"XLA_FLAGS": f"--xla_dump_to={work / 'dump'} --xla_dump_hlo_as_text"})
        results[jit] = (sorted(glob.glob(str(work / "dump" / "*lars_update*.txt"))), np.load(work / "weights.npy"))
    assert results[True][0], "no lars_update XLA module was dumped with jit_compile=True"
    assert not results[False][0], f"XLA compiled lars_update with jit_compile=False: {results[False][0][:3]}"
    np.testing.assert_allclose(results[True][1], results[False][1], rtol=1e-6)


def _fit_weights(strategy, x, y, steps=4):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = _model(synchronized=True)  # batch statistics over the global batch, as on one device
        model.compile(optimizer=LARS(0.5, weight_decay=1e-3, trust_coefficient=0.02),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)
    return [v.numpy() for v in model.trainable_variables]


def test_mirrored_two_devices_equals_one_device(two_cpu_strategy):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 6)).astype(np.float32), rng.integers(0, 3, 64)
    one = _fit_weights(tf.distribute.OneDeviceStrategy("/cpu:0"), x, y)
    two = _fit_weights(two_cpu_strategy, x, y)
    assert two_cpu_strategy.num_replicas_in_sync == 2
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


_MWMS_WORKER = """
import json, os, sys
import numpy as np, tensorflow as tf, keras
from tf_elastic import LARS
strategy = tf.distribute.MultiWorkerMirroredStrategy() if os.environ.get("TF_CONFIG") else tf.distribute.get_strategy()
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if os.environ.get("TF_CONFIG") else 0
workers = strategy.num_replicas_in_sync
rng = np.random.default_rng(0)
x, y = rng.standard_normal((64, 6)).astype(np.float32), rng.integers(0, 3, 64)
with strategy.scope():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(3)])
    optimizer = LARS(0.5, weight_decay=1e-3, trust_coefficient=0.02)
    optimizer.build(model.trainable_variables)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

@tf.function
def train_step(xb, yb):
    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=16)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
    strategy.run(replica_step, args=(xb, yb))

per_worker = 16 // workers
for step in range(4):
    lo = step * 16 + rank * per_worker
    train_step(x[lo:lo + per_worker], y[lo:lo + per_worker])
np.savez(sys.argv[1] + sys.argv[2] if len(sys.argv) > 2 else sys.argv[1],
         *[v.numpy() for v in model.trainable_variables])
"""


@pytest.mark.slow
def test_two_process_multi_worker_equals_one_process(tmp_path):
    """Two MWMS workers on 127.0.0.1 with a custom loop end with the same weights as one process
    (synchronized BatchNormalization, so batch statistics are global in both)."""
    script = tmp_path / "worker.py"
    script.write_text(_MWMS_WORKER)
    run_python(f"import sys; sys.argv = ['w', {str(tmp_path / 'single.npz')!r}]; exec(open({str(script)!r}).read())")
    run_workers(str(script), str(tmp_path / "worker"))
    single = np.load(tmp_path / "single.npz")
    workers = [np.load(tmp_path / f"worker{i}.npz") for i in range(2)]
    for key in single.files:
        np.testing.assert_array_equal(workers[0][key], workers[1][key])
    for key in single.files:
        np.testing.assert_allclose(workers[0][key], single[key], rtol=1e-4, atol=1e-5)


def test_fit_trains_mnist_like_digits_to_93_percent(mnist):
    """6 epochs of a 256-unit MLP on the suite's MNIST-format digits (conftest); measured 94.7 % here (SGD
    0.1: 96.6 %), the bar leaves room for platform noise."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((28, 28)), keras.layers.Flatten(),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=LARS(learning_rate=2.0, momentum=0.9, weight_decay=1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(mnist["x_train"], mnist["y_train"], batch_size=256, epochs=6, verbose=0)
    _, accuracy = model.evaluate(mnist["x_test"], mnist["y_test"], verbose=0)
    assert accuracy >= 0.93, accuracy


def test_mixed_float16_trains():
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2, dtype="float32")])
    model.compile(optimizer=LARS(1.0, trust_coefficient=0.01), loss="sparse_categorical_crossentropy")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    history = model.fit(x, y, batch_size=32, epochs=5, verbose=0).history["loss"]
    assert np.all(np.isfinite(history)) and history[-1] < 0.7 * history[0], history


_RELOAD = """
import json, numpy as np, keras
from tf_elastic import LARS  # registers LARS for deserialisation (the package itself loads lazily)
model = keras.saving.load_model("model.keras")
saved = np.load("state.npz")
assert json.dumps(model.optimizer.get_config(), sort_keys=True) == open("config.json").read()
for i, v in enumerate(model.optimizer.variables):
    np.testing.assert_array_equal(v.numpy(), saved[f"v{i}"])
data = np.load("batch.npz")
model.fit(data["x"], data["y"], batch_size=16, epochs=1, shuffle=False, verbose=0)
np.savez("continued.npz", *[v.numpy() for v in model.trainable_variables])
"""


@pytest.mark.slow
def test_keras_save_load_in_fresh_process_is_bit_exact(tmp_path):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 6)).astype(np.float32), rng.integers(0, 3, 32)
    model = _model()
    model.compile(optimizer=LARS(0.5, weight_decay=1e-3, trust_coefficient=0.02, exclude_from_weight_decay=["bn"]),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model.save(tmp_path / "model.keras")
    np.savez(tmp_path / "state.npz", **{f"v{i}": v.numpy() for i, v in enumerate(model.optimizer.variables)})
    (tmp_path / "config.json").write_text(json.dumps(model.optimizer.get_config(), sort_keys=True))
    np.savez(tmp_path / "batch.npz", x=x, y=y)
    run_python(_RELOAD, cwd=tmp_path)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    continued = np.load(tmp_path / "continued.npz")
    for i, v in enumerate(model.trainable_variables):
        np.testing.assert_array_equal(v.numpy(), continued[f"arr_{i}"])


_JAX_CHECK = """
import itertools, keras
assert keras.backend.backend() == "jax", keras.backend.backend()
from lars_reference import check_optimizer_against_reference
for classic, nesterov, wd in itertools.product([True, False], [False, True], [0.0, 1e-2]):
    check_optimizer_against_reference(dict(learning_rate=0.5, weight_decay=wd, trust_coefficient=0.01,
                                           epsilon=1e-3, nesterov=nesterov, classic_momentum=classic))
print("jax ok")
"""


@pytest.mark.slow
def test_math_on_jax_backend_matches_reference():
    proc = run_python(_JAX_CHECK, env={"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"})
    assert "jax ok" in proc.stdout


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(learning_rate=-0.1), "`learning_rate` must be a finite number >= 0"),
    (dict(learning_rate=float("nan")), "`learning_rate` must be a finite number >= 0"),
    (dict(learning_rate=float("inf")), "`learning_rate` must be a finite number >= 0"),
    (dict(momentum=1.0), "`momentum` must be a finite number in [0, 1)"),
    (dict(momentum=-0.1), "`momentum` must be a finite number in [0, 1)"),
    (dict(weight_decay=-1e-4), "`weight_decay` must be a finite number >= 0"),
    (dict(trust_coefficient=0.0), "`trust_coefficient` must be a finite number > 0"),
    (dict(trust_coefficient=-1.0), "`trust_coefficient` must be a finite number > 0"),
    (dict(epsilon=-1e-9), "`epsilon` must be a finite number >= 0"),
    (dict(momentum="0.9"), "`momentum` must be a finite number in [0, 1)"),
    (dict(exclude_from_weight_decay=[3]), "`exclude_from_weight_decay` entries must be regex strings or callables"),
    (dict(exclude_from_layer_adaptation=42), "`exclude_from_layer_adaptation` must be None, a regex string"),
    (dict(exclude_from_weight_decay=["(unclosed"]), "`exclude_from_weight_decay` has an invalid regex"),
    (dict(not_an_argument=1), "not recognized"),
])
def test_invalid_arguments_are_named(kwargs, fragment):
    with pytest.raises(ValueError) as error:
        LARS(**kwargs)
    assert fragment in str(error.value)
    name = next(iter(kwargs))
    assert name in str(error.value)


def test_exported_at_top_level_and_registered():
    assert tf_elastic.LARS is LARS
    assert keras.saving.get_registered_object("tf_elastic>LARS") is LARS
    restored = LARS.from_config(LARS(0.2, exclude_from_weight_decay=["bias"]).get_config())
    assert restored.get_config()["exclude_from_weight_decay"] == ["bias"]
