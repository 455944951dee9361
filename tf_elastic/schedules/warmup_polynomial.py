"""Linear warm-up then polynomial decay: the base schedule of the LARS paper and MLPerf's ResNet-50."""
from typing import Optional

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tf_elastic")
class WarmupPolynomialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """`peak * step / warmup_steps` during warm-up, then `(peak - end) * (1 - t)^power + end`, with t the
    fraction of the decay steps done; `end` after `warmup_steps + decay_steps`.

    Large-batch training needs the warm-up: the first steps' gradients are large relative to the
    weights, and a full learning rate from step 0 diverges (Goyal et al. 2017; You et al. 2017).

    Args:
        peak: float > 0, the learning rate reached at the end of warm-up.
        warmup_steps: int >= 0.
        decay_steps: int > 0, steps of decay after the warm-up.
        end: float >= 0, the final learning rate. Defaults to 0.
        power: float > 0; 2 is the LARS paper's. Defaults to 2.0.
        name: str, optional name.
    """

    def __init__(self, peak: float, warmup_steps: int, decay_steps: int, end: float = 0.0, power: float = 2.0,
                 name: Optional[str] = None):
        super().__init__()
        for argument, value, ok, accepted in (("peak", peak, peak > 0, "> 0"),
                                              ("warmup_steps", warmup_steps, warmup_steps >= 0, ">= 0"),
                                              ("decay_steps", decay_steps, decay_steps > 0, "> 0"),
                                              ("end", end, end >= 0, ">= 0"), ("power", power, power > 0, "> 0")):
            if not ok:
                raise ValueError(f"`{argument}` must be {accepted}; received {argument}={value!r}.")
        self.peak, self.warmup_steps, self.decay_steps = float(peak), int(warmup_steps), int(decay_steps)
        self.end, self.power, self.name = float(end), float(power), name

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warmup = self.peak * step / max(self.warmup_steps, 1)
        done = ops.clip((step - self.warmup_steps) / self.decay_steps, 0.0, 1.0)
        decay = (self.peak - self.end) * ops.power(1.0 - done, self.power) + self.end
        return ops.where(step < self.warmup_steps, warmup, decay)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps,
                "end": self.end, "power": self.power, "name": self.name}
