"""The one place that knows how to XLA-compile optimizer math, per Keras backend.

Whole-step `jit_compile` fails under tf.distribute strategies on CPU (MirroredStrategy: "Trying to access
resource .../replica_1 ... from device CPU:0"; MWMS: "Only compiling NCCL/auto collective is supported"),
while a `tf.function(jit_compile=True)` around one variable's update works under both, so the optimizer
compiles only its own per-variable math. On the JAX backend Keras already jits the whole train step, so
there is nothing to add.
"""
from typing import Callable, Sequence

import keras

# update(assign, states, inputs, flags): computes fn(*states, *inputs, *flags) -> new states, writes them.
Update = Callable[[Callable, Sequence, Sequence, Sequence], None]


def compile_update(fn: Callable, enabled: bool, name: str) -> Update:
    """Wraps per-variable update math `fn`, XLA-compiled when `enabled` on the TensorFlow backend.

    Compiled, the new values are assigned inside the XLA function, so XLA updates the variables in
    place: one launch per variable and no extra copies (measured 24% faster on ResNet-50's variables
    than returning new tensors and assigning them outside).
    """
    if not enabled or keras.backend.backend() != "tensorflow":
        def update(assign, states, inputs, flags):
            for state, value in zip(states, fn(*states, *inputs, *flags)):
                assign(state, value)

        return update

    import tensorflow as tf

    def compiled(states, inputs, flags):
        for state, value in zip(states, fn(*states, *inputs, *flags)):
            state.assign(tf.cast(value, state.dtype))

    compiled.__name__ = name  # XLA names its module after the function: readable dumps and profiles.
    xla_fn = tf.function(compiled, jit_compile=True)

    def update(assign, states, inputs, flags):
        del assign
        first = _tf_variable(states[0])
        local = [first] + [_local_copy(_tf_variable(s), first.device) for s in states[1:]]
        xla_fn(local, list(inputs), tuple(flags))

    return update


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _local_copy(variable, device: str):
    """Under a strategy, the component of a mirrored slot that lives beside the variable being updated."""
    import tensorflow as tf

    if not isinstance(variable, tf.distribute.DistributedValues):
        return variable
    for component in tf.distribute.get_strategy().experimental_local_results(variable):
        if component.device == device:
            return component
    raise ValueError(f"no component of {variable.name} on {device}")
