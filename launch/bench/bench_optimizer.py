"""Update-only step time of LARS against SGD(momentum), Model Garden's LARS and optax.lars.

Measures `optimizer.apply(grads, variables)` over the trainable variables of
`keras.applications.ResNet50(weights=None)` (214 variables, 25.6 M parameters), all contenders side by
side in one process, and prints a markdown table with ratios to SGD(momentum, XLA).

    python -m launch.bench.bench_optimizer --repeats=15
"""
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

from absl import app, flags, logging

flags.DEFINE_integer("repeats", 15, "Timed steps per contender (the median is reported).", lower_bound=3)
flags.DEFINE_integer("warmup", 3, "Untimed steps per contender before timing (tracing, compilation).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the random weights and gradients.")
FLAGS = flags.FLAGS

MOMENTUM, LEARNING_RATE, WEIGHT_DECAY, ETA = 0.9, 0.1, 1e-4, 0.001


def _median_ms(step: Callable[[], object], sync: Callable[[object], None]) -> Tuple[float, float]:
    for _ in range(FLAGS.warmup):
        sync(step())
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        sync(step())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), max(times)


def _keras_contenders(shapes) -> Dict[str, Callable[[], Tuple[float, float]]]:
    import numpy as np
    import tensorflow as tf
    import keras

    from tf_elastic import LARS

    rng = np.random.default_rng(FLAGS.seed)
    grads = [tf.constant(rng.standard_normal(s, dtype=np.float32) * 0.01) for s in shapes]

    def timed(make_optimizer: Callable, xla_whole_step: bool) -> Callable[[], Tuple[float, float]]:
        def run():
            variables = [keras.Variable(rng.standard_normal(s, dtype=np.float32) * 0.05) for s in shapes]
            optimizer = make_optimizer()
            optimizer.build(variables)  # eagerly, before tracing (keras#23085)
            step = tf.function(lambda: optimizer.apply(grads, variables), jit_compile=xla_whole_step)
            return _median_ms(step, lambda _: variables[-1].numpy())

        return run

    sgd = lambda: keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    lars = lambda jit: (
        lambda: LARS(LEARNING_RATE, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, trust_coefficient=ETA,
                     jit_compile=jit)
    )
    return {
        "Keras SGD(momentum), tf.function": timed(sgd, False),
        "Keras SGD(momentum), XLA": timed(sgd, True),
        "tf_elastic LARS, tf.function (jit_compile=False)": timed(lars(False), False),
        "tf_elastic LARS, XLA per variable (jit_compile=True)": timed(lars(True), False),
        "tf_elastic LARS, XLA whole update": timed(lars(False), True),
    }


def _model_garden_contender(shapes) -> Optional[Callable[[], Tuple[float, float]]]:
    try:
        from official.modeling.optimization.lars import LARS as GardenLARS
    except ImportError:
        return None
    import numpy as np
    import tensorflow as tf

    def run():
        rng = np.random.default_rng(FLAGS.seed)
        variables = [tf.Variable(rng.standard_normal(s, dtype=np.float32) * 0.05) for s in shapes]
        grads = [tf.constant(rng.standard_normal(s, dtype=np.float32) * 0.01) for s in shapes]
        optimizer = GardenLARS(LEARNING_RATE, momentum=MOMENTUM, weight_decay_rate=WEIGHT_DECAY, eeta=ETA)
        @tf.function
        def step():
            optimizer.apply_gradients(zip(grads, variables))  # returns an Operation, which tf.function rejects

        return _median_ms(step, lambda _: variables[-1].numpy())

    return run


def _optax_contender(shapes) -> Optional[Callable[[], Tuple[float, float]]]:
    try:
        import jax
        import optax
    except ImportError:
        return None

    def run():
        keys = jax.random.split(jax.random.PRNGKey(FLAGS.seed), 2 * len(shapes))
        params = [jax.random.normal(k, s) * 0.05 for k, s in zip(keys[::2], shapes)]
        grads = [jax.random.normal(k, s) * 0.01 for k, s in zip(keys[1::2], shapes)]
        optimizer = optax.lars(LEARNING_RATE, weight_decay=WEIGHT_DECAY, trust_coefficient=ETA, momentum=MOMENTUM)
        state = {"params": params, "opt": optimizer.init(params)}

        @jax.jit
        def update(params, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        update = jax.jit(update, donate_argnums=(0, 1))

        def step():
            state["params"], state["opt"] = update(state["params"], state["opt"], grads)
            return state["params"]

        return _median_ms(step, lambda p: jax.block_until_ready(p))

    return run


def main(argv: List[str]) -> None:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    shapes = [tuple(v.shape) for v in keras.applications.ResNet50(weights=None).trainable_variables]
    parameters = sum(int(__import__("math").prod(s)) for s in shapes)
    contenders = _keras_contenders(shapes)
    missing = []
    for name, make, how in (
        ("Model Garden LARS (tf_keras legacy)", _model_garden_contender,
         "pip install tf-keras==2.21.0 pyyaml gin-config && pip install --no-deps tf-models-official==2.20.0"),
        ("optax.lars, jax.jit", _optax_contender, "pip install jax optax"),
    ):
        run = make(shapes)
        if run is None:
            missing.append(f"{name}: not installed ({how})")
        else:
            contenders[name] = run
    results = {}
    for name, run in contenders.items():
        logging.info("timing %s", name)
        results[name] = run()
    baseline = results["Keras SGD(momentum), XLA"][0]
    print(f"\nUpdate-only step, ResNet-50 trainable variables ({len(shapes)} variables, {parameters / 1e6:.1f} M "
          f"parameters), median of {FLAGS.repeats} after {FLAGS.warmup} warm-up steps\n")
    print("| optimizer | median ms | max ms | × SGD(momentum, XLA) |\n|---|---:|---:|---:|")
    for name, (median, worst) in results.items():
        print(f"| {name} | {median:.1f} | {worst:.1f} | {median / baseline:.2f} |")
    for line in missing:
        print(f"\n- {line}")
    lars_xla = results["tf_elastic LARS, XLA per variable (jit_compile=True)"][0]
    print(f"\nTarget LARS(XLA) <= 1.3 x SGD(momentum, XLA): {lars_xla / baseline:.2f} x "
          f"({'met' if lars_xla <= 1.3 * baseline else 'NOT met'})")
    for name, bound in (("Model Garden LARS (tf_keras legacy)", 1.0), ("optax.lars, jax.jit", 1.1)):
        if name in results:
            ratio = lars_xla / results[name][0]
            print(f"Target LARS(XLA) <= {bound} x {name}: {ratio:.2f} x ({'met' if ratio <= bound else 'NOT met'})")


if __name__ == "__main__":
    app.run(main)
