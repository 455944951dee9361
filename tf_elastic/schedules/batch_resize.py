"""Dynamic mini-batch SGD's learning rate: follow the global batch size smoothly (Lin et al. 2019).

An elastic job's global batch changes with its world when each replica keeps its batch
(`elastic.fit(per_replica_batch_size=...)`); `fit` then calls `resize` at each round's start with the
world's global batch, from the step the round resumes at, and commits the history with the model. The
state is one fixed-size variable so that a resize reaches a train step that is already compiled
(tf.function, `jit_compile`, tf.distribute, and on JAX `keras.distribution.DataParallel`: see `attach`).
`tests/test_keras_conformance.py` runs Keras 3.15's own schedule tests against it;
`launch/papers/reproduce_dynamic_sgd.py` compares the transitions on a small task.
"""
import math
from typing import List, Optional, Sequence, Tuple, Union

import keras
import numpy as np
from keras import ops

from tf_elastic.choices import SCALINGS, TRANSITIONS

# Columns of the history table; one row a segment of constant global batch.
_START, _BATCH, _PROGRESS, _FROM, _TO, _RAMP, _SMOOTH = range(7)
_WIDTH = 7
_EMPTY_START = np.float32(np.inf)  # unused rows start "never"


@keras.saving.register_keras_serializable(package="tf_elastic")
class BatchResizeSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Scales a base schedule with the global batch size and moves smoothly to each new scale.

    When the number of workers changes, the global batch changes. Jumping the learning rate to the new
    linear-scaling value at once hurts, because the momentum buffer still holds gradients computed at
    the old batch size; Dynamic SGD (Lin et al. 2019) moves it over a transition instead:

    ```
    lr(step) = base(progress(step)) * scale(step)
    progress(step) = samples seen before `step` / reference_batch_size
    ```

    `progress` is in reference-batch steps, so a base schedule written for the reference batch
    (warm-up, cosine, polynomial decay) stays aligned with epochs whatever the batch history.

    The scale's target for global batch B is `B / B_ref` ("linear", the paper's rule), `sqrt(B / B_ref)`
    ("sqrt", for Adam-type optimizers) or 1 ("none"). At a resize the scale moves from the value it had
    reached (a resize during a transition starts from the partial scale) to the new target:

    - `"linear"`: a straight ramp over `transition_steps` steps; by default `ramp_steps_per_factor * k`
      steps for an increase of the batch by a factor k (8k, what two independent public
      implementations of the paper use).
    - `"momentum"`: parameter-free. With heavy-ball momentum `v_t = m * v_{t-1} + g_t`, the buffer is a
      sum of past gradients with weights m^(t-j); in steady state they add up to 1 / (1 - m). After a
      resize at step s, the part that still comes from gradients of the old batch weighs
      m^(t-s+1) / (1 - m) at step t, a share m^(t-s+1) of the whole. The linear scaling rule holds
      for each gradient at its own batch size, so the single learning rate that treats the mix fairly
      weights old and new targets by those shares:
      `scale(t) = m^(t-s+1) * scale_old + (1 - m^(t-s+1)) * target`.
      Needs `momentum`, the optimizer's momentum coefficient.
    - `"none"`: jump at once (the linear-scaling baseline the paper compares against).

    Decreases apply at once unless `smooth_decreases=True`: the momentum buffer then holds gradients
    that are *less* noisy than the new ones, and a smaller step cannot overshoot, so there is nothing
    to protect against and waiting would only slow training.

    `resize(step, batch_size)` takes effect inside an already-compiled train step, without retracing:
    the history lives in one fixed-size variable (`state`, also `variables`), read by the step and
    written by `resize`. On TensorFlow (tf.function, XLA, tf.distribute) the step reads any variable
    at run time. On JAX a compiled step sees only the model's and the optimizer's variables and bakes
    everything else in as a constant, so `state` must be one of the optimizer's variables: `LARS` adds
    it in `build()`; for another optimizer call `attach(optimizer)` before the first `fit`. On JAX,
    resize between `fit` calls, or in a callback after reading `self.model` (that makes Keras write
    back the state it holds and re-read it before the next step; a resize without it is overwritten).
    Add `state` to a `tf.train.Checkpoint` to keep the history with the training state (an optimizer
    it is attached to saves it too); `get_config()` carries it as well, so `.keras` files and
    `from_config` rebuild the exact same schedule.

    Args:
        base: a float or a `LearningRateSchedule`, in reference-batch steps.
        reference_batch_size: int > 0, the global batch that `base` was written for.
        batch_size: int > 0, the global batch at step 0. Defaults to `reference_batch_size`.
        scaling: "linear", "sqrt" or "none". Defaults to "linear".
        transition: "linear", "momentum" or "none". Defaults to "linear".
        transition_steps: int >= 0, fixed ramp length for `"linear"`. Defaults to None (scaled with k).
        momentum: float in [0, 1), required by `"momentum"`. Defaults to None.
        ramp_steps_per_factor: float >= 0, default ramp length per unit of batch growth factor.
            Defaults to 8.0.
        smooth_decreases: bool, also move smoothly when the batch shrinks. Defaults to False.
        max_resizes: int >= 1, capacity of the history. Defaults to 1024.
        history: list of `(step, batch_size)` resizes to replay after the initial batch. Defaults to None.
        name: str, optional name.

    References:
        - [Lin et al., 2019](https://arxiv.org/abs/1904.12043), Dynamic Mini-batch SGD for Elastic
          Distributed Training: Learning in the Limbo of Resources.
    """

    def __init__(
        self,
        base: Union[float, keras.optimizers.schedules.LearningRateSchedule],
        reference_batch_size: int,
        batch_size: Optional[int] = None,
        scaling: str = "linear",
        transition: str = "linear",
        transition_steps: Optional[int] = None,
        momentum: Optional[float] = None,
        ramp_steps_per_factor: float = 8.0,
        smooth_decreases: bool = False,
        max_resizes: int = 1024,
        history: Optional[Sequence[Tuple[int, int]]] = None,
        name: Optional[str] = None,
    ):
        super().__init__()
        if isinstance(base, dict):
            base = keras.saving.deserialize_keras_object(base)
        if not (callable(base) or _is_number(base)):
            raise ValueError(f"`base` must be a float or a LearningRateSchedule; received base={base!r}.")
        self.base = float(base) if _is_number(base) else base
        self.reference_batch_size = _positive_int("reference_batch_size", reference_batch_size)
        batch_size = reference_batch_size if batch_size is None else batch_size
        self.initial_batch_size = _positive_int("batch_size", batch_size)
        self.scaling = _choice("scaling", scaling, SCALINGS)
        self.transition = _choice("transition", transition, TRANSITIONS)
        if transition_steps is not None and (not _is_int(transition_steps) or transition_steps < 0):
            raise ValueError(f"`transition_steps` must be None or an int >= 0; received {transition_steps!r}.")
        self.transition_steps = transition_steps
        if transition == "momentum" and (not _is_number(momentum) or not 0 <= momentum < 1):
            raise ValueError(f'transition="momentum" needs `momentum` in [0, 1); received momentum={momentum!r}.')
        if momentum is not None and (not _is_number(momentum) or not 0 <= momentum < 1):
            raise ValueError(f"`momentum` must be None or in [0, 1); received momentum={momentum!r}.")
        self.momentum = momentum
        if not _is_number(ramp_steps_per_factor) or ramp_steps_per_factor < 0:
            raise ValueError(f"`ramp_steps_per_factor` must be >= 0; received {ramp_steps_per_factor!r}.")
        self.ramp_steps_per_factor = float(ramp_steps_per_factor)
        self.smooth_decreases = bool(smooth_decreases)
        self.max_resizes = _positive_int("max_resizes", max_resizes)
        self.name = name
        table = np.zeros((self.max_resizes + 1, _WIDTH), np.float32)
        table[:, _START] = _EMPTY_START
        first = self._target(self.initial_batch_size)
        table[0] = (0, self.initial_batch_size, 0.0, first, first, 0, 0)
        with keras.name_scope(name or "batch_resize_schedule"):
            self.state = keras.Variable(table, trainable=False, name="history", dtype="float32")
        for step, size in history or ():
            self.resize(step, size)

    @classmethod
    def from_history(cls, base, reference_batch_size: int, history: Sequence[Tuple[int, int]], **kwargs):
        """Rebuilds a schedule from `[(0, initial_batch), (step, batch), ...]` as `history` returns it."""
        (start, initial), *resizes = [tuple(entry) for entry in history]
        if start != 0:
            raise ValueError(f"`history` must start at step 0; received {history!r}.")
        return cls(base, reference_batch_size, batch_size=initial, history=resizes, **kwargs)

    @property
    def variables(self) -> List[keras.Variable]:
        """The schedule's state, for an optimizer to track (`LARS` does in `build()`)."""
        return [self.state]

    def attach(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Makes `state` one of `optimizer`'s variables, so that a JAX train step reads it at run time.

        Needed on JAX for optimizers other than `LARS`; harmless on TensorFlow. Call it before the first
        `fit` (before Keras compiles the train step); calling it twice adds nothing.
        """
        if all(variable is not self.state for variable in optimizer.variables):
            optimizer._track_variable(self.state)

    @property
    def history(self) -> List[Tuple[int, int]]:
        """`[(step, global_batch), ...]` from step 0 on."""
        return [(int(row[_START]), int(row[_BATCH])) for row in self._rows()]

    def resize(self, step: int, batch_size: int) -> None:
        """Records that from `step` on the global batch is `batch_size` (eagerly, outside traced code)."""
        batch_size = _positive_int("batch_size", batch_size)
        rows = self._rows()
        last = rows[-1]
        if not _is_int(step) or step < last[_START]:
            raise ValueError(f"`step` must be an int >= the last resize step {int(last[_START])}; "
                             f"received step={step!r}.")
        if int(batch_size) == int(last[_BATCH]):
            return
        index = len(rows) - 1 if step == last[_START] and len(rows) > 1 else len(rows)
        if step == last[_START] and len(rows) > 1:
            last = rows[-2]  # a second resize at the same step replaces the first
        if index > self.max_resizes:
            raise ValueError(f"more than max_resizes={self.max_resizes} resizes; "
                             "construct with a larger `max_resizes`.")
        previous_batch = float(last[_BATCH])
        progress = float(last[_PROGRESS]) + (step - float(last[_START])) * previous_batch / self.reference_batch_size
        current = _scale_at(last, float(step), self.momentum)
        target = self._target(batch_size)
        smooth = self.transition != "none" and (batch_size > previous_batch or self.smooth_decreases)
        ramp = 0.0
        if smooth and self.transition == "linear":
            factor = max(batch_size, previous_batch) / min(batch_size, previous_batch)
            ramp = (self.transition_steps if self.transition_steps is not None
                    else round(self.ramp_steps_per_factor * factor))
        mode = (2.0 if self.transition == "momentum" else 1.0) if smooth else 0.0
        table = np.array(self.state.numpy())
        table[index] = (step, batch_size, progress, current, target, ramp, mode)
        table[index + 1:, _START] = _EMPTY_START
        self.state.assign(table)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        table = ops.convert_to_tensor(self.state)
        # Rows are sorted by start step and unused ones start at +inf: the segment is the last started.
        index = ops.sum(ops.cast(table[:, _START] <= step, "int32")) - 1
        row = ops.take(table, index, axis=0)
        elapsed = step - row[_START]
        progress = row[_PROGRESS] + elapsed * row[_BATCH] / float(self.reference_batch_size)
        momentum = 0.0 if self.momentum is None else float(self.momentum)
        ramp_share = ops.where(row[_RAMP] > 0, ops.minimum(elapsed / ops.maximum(row[_RAMP], 1.0), 1.0), 1.0)
        momentum_share = 1.0 - ops.power(momentum, elapsed + 1.0)
        share = ops.where(row[_SMOOTH] == 2.0, momentum_share, ops.where(row[_SMOOTH] == 1.0, ramp_share, 1.0))
        scale = row[_FROM] + (row[_TO] - row[_FROM]) * share
        base = self.base(progress) if callable(self.base) else self.base
        return ops.cast(base, "float32") * scale

    def get_config(self):
        return {
            "base": self.base if isinstance(self.base, float) else keras.saving.serialize_keras_object(self.base),
            "reference_batch_size": self.reference_batch_size,
            "batch_size": self.initial_batch_size,
            "scaling": self.scaling,
            "transition": self.transition,
            "transition_steps": self.transition_steps,
            "momentum": self.momentum,
            "ramp_steps_per_factor": self.ramp_steps_per_factor,
            "smooth_decreases": self.smooth_decreases,
            "max_resizes": self.max_resizes,
            "history": [list(entry) for entry in self.history[1:]],
            "name": self.name,
        }

    def _target(self, batch_size: int) -> float:
        ratio = batch_size / self.reference_batch_size
        return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[self.scaling]

    def _rows(self) -> np.ndarray:
        table = self.state.numpy()
        return table[np.isfinite(table[:, _START])]


def _scale_at(row: np.ndarray, step: float, momentum: Optional[float]) -> float:
    """The scale that segment `row` gives at `step`, in float64 (mirrors `__call__`)."""
    elapsed = step - float(row[_START])
    if row[_SMOOTH] == 2.0:
        share = 1.0 - float(momentum) ** (elapsed + 1.0)
    elif row[_SMOOTH] == 1.0 and row[_RAMP] > 0:
        share = min(elapsed / float(row[_RAMP]), 1.0)
    else:
        share = 1.0
    return float(row[_FROM]) + (float(row[_TO]) - float(row[_FROM])) * share


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _positive_int(argument: str, value) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"`{argument}` must be an int > 0; received {argument}={value!r}.")
    return int(value)


def _choice(argument: str, value, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"`{argument}` must be one of {', '.join(map(repr, choices))}; received {argument}={value!r}.")
    return value
