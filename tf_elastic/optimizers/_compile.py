"""The one place that knows how to XLA-compile optimizer math, per Keras backend.

Whole-step `jit_compile` fails under tf.distribute strategies on CPU (see PLATFORM.md), so the optimizer
compiles only its own per-variable math. On the JAX backend Keras already jits the whole train step, so
there is nothing to add.
"""
from typing import Callable

import keras


def maybe_xla(fn: Callable, enabled: bool, name: str) -> Callable:
    """`fn` XLA-compiled when `enabled` and the backend is TensorFlow, else `fn` itself."""
    if not enabled or keras.backend.backend() != "tensorflow":
        return fn
    import tensorflow as tf

    def compiled(*args):
        return fn(*args)

    compiled.__name__ = name  # XLA names its module after the function: readable dumps and profiles.
    xla_fn = tf.function(compiled, jit_compile=True)

    def call(*args):
        # Variables are read here: the compiled function sees tensors only, the same on one device,
        # under MirroredStrategy (the replica's local copy) and under MultiWorkerMirroredStrategy.
        return xla_fn(*(tf.convert_to_tensor(a) if isinstance(a, (tf.Variable, keras.Variable)) else a for a in args))

    return call
