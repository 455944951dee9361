"""LARS: layer-wise adaptive rate scaling (You, Gitman & Ginsburg 2017).

A native Keras 3 optimizer because there is none to reuse: TensorFlow Addons, the usual home of such
optimizers for tf.keras, is end-of-life and does not work with Keras 3, and never had a LARS (its LAMB
moved into Keras as `keras.optimizers.Lamb`). The math is `keras.ops`, so it runs on the TensorFlow and
JAX backends (`tests/test_keras_conformance.py` runs Keras 3.15's own optimizer tests against it on both);
on TensorFlow the per-variable update is XLA-compiled (`_compile.py`). The class is registered as
serializable, so saved `.keras` files load once `tf_elastic.LARS` has been imported.

Tuning: variables excluded from adaptation (by default biases and normalization parameters) take the
global learning rate unscaled, so `learning_rate` must suit them and `trust_coefficient` the layers:
`launch/train.py` defaults to 0.1 and 0.05 rather than ResNet-style 1.0 and 0.001. The paper's
Algorithm 1 adapts every variable (`exclude_from_layer_adaptation=[]`): `launch/papers/reproduce_lars.py` runs it
so, with eta = 0.001 and global rates from 5 to 80.
"""
import math
import re
from typing import Callable, Optional, Sequence, Union

import keras
from keras import ops
from keras.src.optimizers.optimizer import base_optimizer_keyword_args

from tf_elastic.optimizers._compile import compile_update

Exclusion = Union[None, str, Callable, Sequence[Union[str, Callable]]]


@keras.saving.register_keras_serializable(package="tf_elastic")
class LARS(keras.optimizers.Optimizer):
    """Layer-wise Adaptive Rate Scaling, for very large batches.

    Each variable `w` (a layer's kernel, say) gets its own local learning rate from the ratio of its
    weight norm to its gradient norm, so that no layer takes steps that are large relative to its
    weights, which is what makes batches of 8K-32K trainable with SGD (You et al. 2017, Algorithm 1):

    ```
    d     = g + beta * w                                   # beta = 0 if w is excluded from weight decay
    trust = eta * |w| / (|g| + beta * |w| + epsilon)        # 1 if excluded from adaptation, |w| = 0 or |g| = 0
    v     = momentum * v + lr * trust * d
    w     = w - v                                          # nesterov: w - (momentum * v + lr * trust * d)
    ```

    With `classic_momentum=False` the momentum accumulates the raw direction and the trust ratio is
    taken on the momentum-smoothed update instead (the TF TPU reference implementation's variant):
    `v = momentum * v + d`, `u = v` (nesterov: `momentum * v + d`),
    `trust = eta * |w| / (|u| + epsilon)`, `w = w - lr * trust * u`.

    Weight decay lives inside the trust ratio: `weight_decay` is the base class's attribute, so Keras's
    `exclude_from_weight_decay(var_list=..., var_names=...)` works as for any Keras optimizer (on top of
    this class's own `exclude_from_weight_decay` argument), but the base class's decoupled decay step is
    skipped. Norms are taken per variable after the base class's gradient clipping. Sparse gradients
    (`tf.IndexedSlices`, JAX `BCOO`) are densified before the update, since momentum and weight decay
    touch every row anyway.

    With `jit_compile=True` on TensorFlow, the XLA function writes the new weights and momentum into the
    variables itself (in place, one launch per variable), not through `self.assign`: an override of
    `assign`/`assign_add` does not see LARS's updates. Everything Keras does around `update_step` (EMA,
    gradient accumulation, `LossScaleOptimizer`'s skipped steps, constraints) is unaffected; use
    `jit_compile=False` to route every write through `self.assign`.

    A learning-rate schedule with state of its own (`BatchResizeSchedule`) has its `variables` added to
    the optimizer's in `build()`: on JAX only optimizer variables reach a compiled train step, anything
    else is baked in as a constant when the step is traced.

    Args:
        learning_rate: float >= 0, a `keras.optimizers.schedules.LearningRateSchedule` or a callable;
            the global learning rate (gamma). Defaults to `1.0`.
        momentum: float in [0, 1). Defaults to `0.9`.
        weight_decay: float >= 0, the L2 coefficient beta applied inside the trust ratio (also
            `optimizer.weight_decay`). Defaults to `0.0`.
        trust_coefficient: float > 0, eta: how far a layer may move relative to its weight norm.
            Defaults to `0.001`.
        epsilon: float >= 0 added to the trust ratio's denominator. Defaults to `0.0`.
        nesterov: bool, Nesterov momentum. Defaults to `False`.
        classic_momentum: bool, the paper's form (True) or momentum-before-trust (False).
            Defaults to `True`.
        exclude_from_weight_decay: which variables get no weight decay: a regex string matched
            against the variable path (`re.search`; the name for a plain `tf.Variable`), a callable
            `variable -> bool`, or a list of those. `None` excludes every variable of rank <= 1
            (biases, normalisation scales and offsets). Defaults to `None`.
        exclude_from_layer_adaptation: which variables get trust ratio 1, in the same forms. `None`
            means the same default set as weight decay's (rank <= 1). Defaults to `None`.
        jit_compile: bool, XLA-compile the per-variable update (TensorFlow backend; JAX compiles the
            whole train step anyway). Defaults to `True`.
        {{base_optimizer_keyword_args}}

    References:
        - [You et al., 2017](https://arxiv.org/abs/1708.03888)
    """

    def __init__(
        self,
        learning_rate: Union[float, Callable] = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        epsilon: float = 0.0,
        nesterov: bool = False,
        classic_momentum: bool = True,
        exclude_from_weight_decay: Exclusion = None,
        exclude_from_layer_adaptation: Exclusion = None,
        jit_compile: bool = True,
        clipnorm: Optional[float] = None,
        clipvalue: Optional[float] = None,
        global_clipnorm: Optional[float] = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: Optional[int] = None,
        loss_scale_factor: Optional[float] = None,
        gradient_accumulation_steps: Optional[int] = None,
        name: Optional[str] = None,
        **kwargs,
    ):
        if isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool):
            learning_rate = float(_check_range("learning_rate", learning_rate, ">= 0", lambda x: x >= 0))
        super().__init__(
            learning_rate=learning_rate,
            weight_decay=_check_range("weight_decay", weight_decay, ">= 0", lambda x: x >= 0),
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            **kwargs,
        )
        self.momentum = _check_range("momentum", momentum, "in [0, 1)", lambda x: 0 <= x < 1)
        self.trust_coefficient = _check_range("trust_coefficient", trust_coefficient, "> 0", lambda x: x > 0)
        self.epsilon = _check_range("epsilon", epsilon, ">= 0", lambda x: x >= 0)
        self.nesterov = bool(nesterov)
        self.classic_momentum = bool(classic_momentum)
        self.weight_decay_exclusions = _check_exclusion("exclude_from_weight_decay", exclude_from_weight_decay)
        self.adaptation_exclusions = _check_exclusion(
            "exclude_from_layer_adaptation", exclude_from_layer_adaptation
        )
        self.jit_compile = bool(jit_compile)
        self._update = compile_update(self._update_math, self.jit_compile, name="lars_update")

    def build(self, variables):
        """Creates the momentum slots and decides, once, which variables decay and adapt.

        Exclusions are decided here from the Keras variables (their paths): inside `update_step`
        under a strategy the variable is a per-device `tf.Variable` with no path. A variable decays
        unless this class's `exclude_from_weight_decay` or Keras's `exclude_from_weight_decay()` excludes
        it. The learning-rate schedule's own variables are tracked last, so that slot indices (and
        checkpoints written before schedules had state) stay where they were.
        """
        if self.built:
            return
        super().build(variables)
        self.momentums = self.add_optimizer_variables(variables, "momentum")
        self._decays = [not _excluded(self.weight_decay_exclusions, v) and self._use_weight_decay(v)
                        for v in variables]
        self._adapts = [not _excluded(self.adaptation_exclusions, v) for v in variables]
        tracked = {id(v) for v in self.variables}
        for variable in getattr(self._learning_rate, "variables", ()):
            if id(variable) not in tracked:
                self._track_variable(variable)

    def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
        """Keras's method; LARS decides exclusions in `build()`, so later calls would be silently lost."""
        if self.built:
            raise ValueError("`exclude_from_weight_decay()` can only be configured before the optimizer is built.")
        super().exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def _apply_weight_decay(self, variables):
        """LARS decays inside the trust ratio (`update_step`), never as the base class's decoupled step."""

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        momentum = self.momentums[index]
        gradient = ops.cast(_dense(gradient, variable), variable.dtype)
        learning_rate = ops.cast(learning_rate, variable.dtype)
        self._update(self.assign, (variable, momentum), (gradient, learning_rate),
                     (self._decays[index], self._adapts[index]))

    def _update_math(self, w, v, g, lr, decays: bool, adapts: bool):
        """Returns (new w, new v); `decays`/`adapts` are Python flags, so each combination traces once."""
        beta = self.weight_decay if decays else 0.0
        d = g + beta * w if beta else g
        if self.classic_momentum:
            trust = self._trust_ratio(w, g, beta) if adapts else 1.0
            scaled = (lr * trust) * d
            v = self.momentum * v + scaled
            step = self.momentum * v + scaled if self.nesterov else v
        else:
            v = self.momentum * v + d
            u = self.momentum * v + d if self.nesterov else v
            trust = self._trust_ratio(w, u, 0.0) if adapts else 1.0
            step = (lr * trust) * u
        return w - step, v

    def _trust_ratio(self, w, g, beta: float):
        w_norm, g_norm = _norm(w), _norm(g)
        usable = ops.logical_and(w_norm > 0, g_norm > 0)
        denominator = ops.where(usable, g_norm + beta * w_norm + self.epsilon, 1.0)
        return ops.where(usable, self.trust_coefficient * w_norm / denominator, 1.0)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "momentum": self.momentum,
                "trust_coefficient": self.trust_coefficient,
                "epsilon": self.epsilon,
                "nesterov": self.nesterov,
                "classic_momentum": self.classic_momentum,
                "exclude_from_weight_decay": _serialize_exclusion(self.weight_decay_exclusions),
                "exclude_from_layer_adaptation": _serialize_exclusion(self.adaptation_exclusions),
                "jit_compile": self.jit_compile,
            }
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for key in ("exclude_from_weight_decay", "exclude_from_layer_adaptation"):
            config[key] = _deserialize_exclusion(config.get(key), custom_objects)
        return super().from_config(config, custom_objects=custom_objects)


# Keras documents its shared keyword arguments in one text; reuse it as Keras' own optimizers do.
LARS.__doc__ = LARS.__doc__.replace("{{base_optimizer_keyword_args}}", base_optimizer_keyword_args)


def _dense(gradient, variable):
    """The dense gradient. Sparse ones are summed into rows (duplicate indices add up, as in Keras's own
    densification); on TensorFlow `ops.convert_to_tensor` would pass `tf.IndexedSlices` through."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if isinstance(gradient, tf.IndexedSlices):
            return tf.math.unsorted_segment_sum(gradient.values, tf.convert_to_tensor(gradient.indices),
                                                variable.shape[0])
    return ops.convert_to_tensor(gradient, sparse=False)


def _norm(x):
    # A dot product rather than sum(square(x)): XLA:CPU lowers dots to Eigen's vectorised kernels but
    # emits a scalar loop for full reductions, measured 3.5x slower on ResNet-50's variables.
    return ops.sqrt(ops.vdot(x, x))


def _check_range(argument: str, value, accepted: str, ok: Callable) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"LARS `{argument}` must be a finite number {accepted}; received {argument}={value!r}.")
    return float(value)


def _check_exclusion(argument: str, value: Exclusion) -> Optional[list]:
    """Normalises an exclusion spec to None or a list of compiled regexes and callables."""
    if value is None:
        return None
    entries = [value] if isinstance(value, str) or callable(value) else value
    if not isinstance(entries, (list, tuple)):
        raise ValueError(
            f"LARS `{argument}` must be None, a regex string, a callable(variable) -> bool or a list of "
            f"those; received {argument}={value!r}."
        )
    normalised = []
    for entry in entries:
        if callable(entry):
            normalised.append(entry)
        elif isinstance(entry, str):
            try:
                normalised.append(re.compile(entry))
            except re.error as error:
                raise ValueError(f"LARS `{argument}` has an invalid regex {entry!r}: {error}.") from None
        else:
            raise ValueError(
                f"LARS `{argument}` entries must be regex strings or callables; received {entry!r} "
                f"({type(entry).__name__})."
            )
    return normalised


def _excluded(exclusions: Optional[list], variable) -> bool:
    if exclusions is None:
        return len(variable.shape) <= 1
    return any(
        bool(entry.search(getattr(variable, "path", variable.name))) if isinstance(entry, re.Pattern)
        else bool(entry(variable))
        for entry in exclusions
    )


def _serialize_exclusion(exclusions: Optional[list]):
    if exclusions is None:
        return None
    return [
        entry.pattern if isinstance(entry, re.Pattern) else keras.saving.serialize_keras_object(entry)
        for entry in exclusions
    ]


def _deserialize_exclusion(config, custom_objects):
    if config is None:
        return None
    return [
        entry if isinstance(entry, str) else keras.saving.deserialize_keras_object(entry, custom_objects)
        for entry in config
    ]
