"""BatchResizeSchedule against a plain-Python reference, in traced code, checkpoints and strategies."""
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_elastic
from tf_elastic import LARS, BatchResizeSchedule


def reference_lr(step, base, reference, history, scaling="linear", transition="linear", transition_steps=None,
                 momentum=None, per_factor=8.0, smooth_decreases=False):
    """The issue's rules, simulated segment by segment in float64."""
    target = lambda b: {"linear": b / reference, "sqrt": math.sqrt(b / reference), "none": 1.0}[scaling]
    samples, scale_from, scale_to, start, kind, ramp = 0.0, target(history[0][1]), target(history[0][1]), 0, "none", 0

    def scale_at(t):
        e = t - start
        if kind == "momentum":
            w = momentum ** (e + 1)
            return w * scale_from + (1 - w) * scale_to
        if kind == "linear" and ramp > 0:
            return scale_from + (scale_to - scale_from) * min(e / ramp, 1.0)
        return scale_to

    for (s0, b0), (s1, b1) in zip(history, history[1:] + [(math.inf, None)]):
        if step < s1:
            progress = (samples + (step - s0) * b0) / reference
            break
        samples += (s1 - s0) * b0
        current = scale_at(s1)
        grows = b1 > b0
        kind = transition if transition != "none" and (grows or smooth_decreases) else "none"
        ramp = transition_steps if transition_steps is not None else round(per_factor * max(b0, b1) / min(b0, b1))
        scale_from, scale_to, start = current, target(b1), s1
    base_value = float(base(progress)) if callable(base) else base
    return base_value * scale_at(step)


WARMUP_COSINE = keras.optimizers.schedules.CosineDecay(0.0, decay_steps=400, warmup_target=0.4, warmup_steps=50)
CASES = {
    "no_resize": dict(history=[(0, 64)]),
    "increase": dict(history=[(0, 32), (40, 256)]),
    "decrease": dict(history=[(0, 256), (40, 64)]),
    "decrease_smooth": dict(history=[(0, 256), (40, 64)], smooth_decreases=True, transition_steps=20),
    "second_inside_first_ramp": dict(history=[(0, 32), (30, 256), (50, 512)]),
    "up_then_down_inside_ramp": dict(history=[(0, 32), (30, 256), (45, 64), (90, 128)]),
    "sqrt": dict(history=[(0, 32), (40, 512)], scaling="sqrt"),
    "none_scaling": dict(history=[(0, 32), (40, 512)], scaling="none"),
    "momentum": dict(history=[(0, 32), (40, 256), (60, 512), (100, 64)], transition="momentum", momentum=0.9),
    "momentum_smooth_decrease": dict(history=[(0, 256), (40, 32)], transition="momentum", momentum=0.95,
                                     smooth_decreases=True),
    "instant": dict(history=[(0, 32), (40, 256), (80, 64)], transition="none"),
    "fixed_ramp": dict(history=[(0, 32), (40, 256)], transition_steps=25),
    "per_factor": dict(history=[(0, 32), (40, 128)], per_factor=3.0),
}


@pytest.mark.parametrize("base", [0.1, WARMUP_COSINE], ids=["constant", "warmup_cosine"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case, base):
    spec = dict(CASES[case])
    history = spec.pop("history")
    per_factor = spec.pop("per_factor", 8.0)
    schedule = BatchResizeSchedule.from_history(base, 64, history, ramp_steps_per_factor=per_factor, **spec)
    assert schedule.history == history
    steps = np.arange(0, 200)
    evaluate = tf.function(lambda steps: tf.map_fn(schedule, steps, fn_output_signature=tf.float32))
    got = evaluate(tf.constant(steps, tf.int64)).numpy()
    expected = np.array([reference_lr(int(s), base, 64, history, per_factor=per_factor, **spec) for s in steps])
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-7)


def test_progress_in_samples_keeps_the_base_schedule_aligned_with_epochs():
    """At 4x the reference batch, the base schedule advances 4 reference steps per step."""
    base = keras.optimizers.schedules.PolynomialDecay(1.0, decay_steps=100, end_learning_rate=0.0)
    schedule = BatchResizeSchedule(base, 32, batch_size=128, scaling="none")
    assert float(schedule(10)) == pytest.approx(float(base(40)))


def test_resize_takes_effect_in_traced_code_without_retracing():
    schedule = BatchResizeSchedule(0.1, 32, transition="none")
    traces = []

    @tf.function
    def learning_rate(step):
        traces.append(1)
        return schedule(step)

    assert float(learning_rate(tf.constant(50, tf.int64))) == pytest.approx(0.1)
    schedule.resize(10, 128)
    assert float(learning_rate(tf.constant(50, tf.int64))) == pytest.approx(0.4)
    schedule.resize(60, 64)
    assert float(learning_rate(tf.constant(70, tf.int64))) == pytest.approx(0.2)
    assert len(traces) == 1


def test_resize_inside_fit_train_function_without_retracing():
    """A Keras train function traced before the resize takes the new learning rate without a retrace: the
    tracing count stays, and one more step moves the weights by exactly the new rate times the gradient."""
    import tensorflow as tf

    class CountsTraces(keras.layers.Layer):
        traces = 0  # Python runs `call` only while tracing a graph

        def call(self, inputs):
            CountsTraces.traces += 1
            return inputs

    keras.utils.set_random_seed(0)
    schedule = BatchResizeSchedule(0.05, 16, transition="none")
    model = keras.Sequential([keras.Input((4,)), CountsTraces(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    y = np.zeros((16, 1), np.float32)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    schedule.resize(int(model.optimizer.iterations.numpy()), 32)  # the same batch shape: only the rate changes
    before = [w.numpy() for w in model.trainable_weights]
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x))  # (an eager call: counted once, here)
    grads = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
    traces = CountsTraces.traces
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert CountsTraces.traces == traces
    for w0, g, w1 in zip(before, grads, model.trainable_weights):
        np.testing.assert_allclose(w1.numpy() - w0, -0.1 * g, rtol=1e-4, atol=1e-7)


def test_the_default_ramp_is_8_steps_per_factor_of_growth():
    """Batch 32 -> 128 (a factor of 4) at step 10: a 32-step linear ramp from 0.1 to 0.4, by hand."""
    schedule = BatchResizeSchedule(0.1, 32, batch_size=32)
    schedule.resize(10, 128)
    assert float(schedule(10)) == pytest.approx(0.1)
    assert float(schedule(26)) == pytest.approx(0.1 * (1 + 3 * 16 / 32))  # half way: 0.25
    assert float(schedule(41)) < 0.4 and float(schedule(42)) == pytest.approx(0.4)


def _configured():
    schedule = BatchResizeSchedule(WARMUP_COSINE, 64, batch_size=32, transition="momentum", momentum=0.9,
                                   smooth_decreases=True, name="elastic")
    schedule.resize(30, 256)
    schedule.resize(45, 128)
    return schedule


def _values(schedule):
    return [float(schedule(s)) for s in range(0, 120, 7)]


def test_config_round_trip_rebuilds_the_same_schedule():
    schedule = _configured()
    clone = BatchResizeSchedule.from_config(schedule.get_config())
    assert clone.history == schedule.history == [(0, 32), (30, 256), (45, 128)]
    assert _values(clone) == _values(schedule)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert _values(restored) == _values(schedule)


def test_checkpoint_round_trip(tmp_path):
    schedule = _configured()
    path = tf.train.Checkpoint(schedule=schedule.state).save(str(tmp_path / "ckpt"))
    fresh = BatchResizeSchedule(WARMUP_COSINE, 64, batch_size=32, transition="momentum", momentum=0.9,
                                smooth_decreases=True)
    tf.train.Checkpoint(schedule=fresh.state).restore(path).assert_consumed()
    assert fresh.history == schedule.history
    assert _values(fresh) == _values(schedule)
    fresh.resize(60, 512)  # continues from the restored history
    assert fresh.history[-1] == (60, 512)


def test_keras_file_round_trip(tmp_path):
    schedule = _configured()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=LARS(schedule, trust_coefficient=0.01), loss="mse")
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    loaded_schedule = loaded.optimizer._learning_rate
    assert isinstance(loaded_schedule, BatchResizeSchedule)
    assert loaded_schedule.history == schedule.history
    assert _values(loaded_schedule) == _values(schedule)


@pytest.mark.parametrize("make_optimizer", [
    lambda s: LARS(s, trust_coefficient=0.01, weight_decay=1e-4),
    lambda s: keras.optimizers.SGD(s, momentum=0.9),
], ids=["lars", "sgd"])
def test_under_mirrored_strategy(two_cpu_strategy, make_optimizer):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((128, 4)).astype(np.float32), rng.integers(0, 2, 128)
    with two_cpu_strategy.scope():
        schedule = BatchResizeSchedule(0.1, 16, transition="linear")
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=make_optimizer(schedule), loss=keras.losses.SparseCategoricalCrossentropy(True))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    step = int(model.optimizer.iterations.numpy())
    schedule.resize(step, 64)
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0).history["loss"]
    iterations = int(model.optimizer.iterations.numpy())
    assert iterations == step + 2 and np.isfinite(history[-1])
    expected = reference_lr(iterations, 0.1, 16, [(0, 16), (step, 64)])
    assert float(model.optimizer.learning_rate) == pytest.approx(expected)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(reference_batch_size=0), "`reference_batch_size` must be an int > 0"),
    (dict(reference_batch_size=-32), "`reference_batch_size` must be an int > 0"),
    (dict(batch_size=0), "`batch_size` must be an int > 0"),
    (dict(batch_size=12.5), "`batch_size` must be an int > 0"),
    (dict(scaling="cubic"), "`scaling` must be one of 'linear', 'sqrt', 'none'"),
    (dict(transition="cosine"), "`transition` must be one of 'linear', 'momentum', 'none'"),
    (dict(transition="momentum"), '`momentum` in [0, 1)'),
    (dict(transition="momentum", momentum=1.0), '`momentum` in [0, 1)'),
    (dict(momentum=-0.5), "`momentum` must be None or in [0, 1)"),
    (dict(transition_steps=-1), "`transition_steps` must be None or an int >= 0"),
    (dict(base="fast"), "`base` must be a float or a LearningRateSchedule"),
    (dict(history=[(10, 0)]), "`batch_size` must be an int > 0"),
])
def test_invalid_arguments_are_named(kwargs, fragment):
    arguments = dict(base=0.1, reference_batch_size=32)
    arguments.update(kwargs)
    with pytest.raises(ValueError) as error:
        BatchResizeSchedule(**arguments)
    assert fragment in str(error.value)


def test_resize_errors_leave_history_untouched():
    schedule = BatchResizeSchedule(0.1, 32)
    schedule.resize(100, 64)
    with pytest.raises(ValueError, match=r"`step` must be an int >= the last resize step 100"):
        schedule.resize(50, 128)
    with pytest.raises(ValueError, match=r"`batch_size` must be an int > 0"):
        schedule.resize(150, -4)
    small = BatchResizeSchedule(0.1, 32, max_resizes=1)
    small.resize(10, 64)
    with pytest.raises(ValueError, match="max_resizes=1"):
        small.resize(20, 128)
    assert schedule.history == [(0, 32), (100, 64)]
    assert tf_elastic.BatchResizeSchedule is BatchResizeSchedule


def test_warmup_polynomial_decay():
    from tf_elastic import WarmupPolynomialDecay

    schedule = WarmupPolynomialDecay(2.0, warmup_steps=10, decay_steps=100, end=0.1, power=2.0)
    expected = lambda s: 2.0 * s / 10 if s < 10 else (2.0 - 0.1) * (1 - min((s - 10) / 100, 1)) ** 2 + 0.1
    for step in (0, 5, 10, 60, 110, 200):
        assert float(schedule(step)) == pytest.approx(expected(step), rel=1e-6)
    clone = WarmupPolynomialDecay.from_config(schedule.get_config())
    assert float(clone(42)) == float(schedule(42))
    with pytest.raises(ValueError, match="`decay_steps` must be > 0"):
        WarmupPolynomialDecay(1.0, 10, 0)
