"""What the paper reproductions share: the harder image task, the validation split, the statistics that let a
table tell methods apart (95 % intervals over seeds, paired comparisons on the same seeds), and Dynamic SGD's
resize-plan training loop (`reproduce_dynamic_sgd` and `sweep_dynamic_sgd` both train through it)."""
import hashlib
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

TASK_SEED = 1234  # the task is one fixed dataset; training seeds vary, the images do not


def colour_digits(images: np.ndarray, seed: int = TASK_SEED) -> np.ndarray:
    """28x28 grey digits in [0, 1] -> a harder 10-class 32x32 RGB task: each digit is placed at a random offset
    in a 32x32 canvas, painted in a random colour on a random background colour (at least 0.5 apart in RGB,
    so the digit stays visible), covered with Gaussian noise (sigma 0.15), clipped to [0, 1], and
    standardized per image and channel."""
    rng = np.random.default_rng(seed)
    count = len(images)
    canvas = np.zeros((count, 32, 32), np.float32)
    offsets = rng.integers(0, 5, (count, 2))
    for n, (dy, dx) in enumerate(offsets):
        canvas[n, dy:dy + 28, dx:dx + 28] = images[n, ..., 0] if images.ndim == 4 else images[n]
    background = rng.random((count, 3), dtype=np.float32)
    foreground = rng.random((count, 3), dtype=np.float32)
    while True:  # redraw the foregrounds too close to their background
        close = np.linalg.norm(foreground - background, axis=1) < 0.5
        if not close.any():
            break
        foreground[close] = rng.random((int(close.sum()), 3), dtype=np.float32)
    mask = canvas[..., None]
    out = background[:, None, None, :] * (1 - mask) + foreground[:, None, None, :] * mask
    out += rng.normal(0.0, 0.15, out.shape).astype(np.float32)
    out = np.clip(out, 0.0, 1.0)
    # Each image standardized per channel (what tf.image.per_image_standardization does per image): without it a
    # ResNet-20 sat at chance for the first 15,000 samples, its colours drowning the digit.
    mean, std = out.mean(axis=(1, 2), keepdims=True), out.std(axis=(1, 2), keepdims=True)
    return (out - mean) / np.maximum(std, 1e-3)


def split_validation(x: np.ndarray, y: np.ndarray, validation: int) -> Tuple[tuple, tuple]:
    """(train, validation): the last `validation` examples are held out for choosing hyperparameters, so the
    test set is used only for the final numbers."""
    if not 0 < validation < len(x):
        raise ValueError(f"--validation_examples must be in (0, {len(x)}); received {validation}.")
    return (x[:-validation], y[:-validation]), (x[-validation:], y[-validation:])


class Interval(NamedTuple):
    mean: float
    half_width: float  # of the 95 % Student-t interval of the mean; nan with one value
    n: int

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:.2f} (1 seed)"
        return f"{self.mean:.2f} ± {self.half_width:.2f}"


def interval(values: Sequence[float]) -> Interval:
    from scipy import stats

    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return Interval(float(values.mean()), float("nan"), len(values))
    half = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return Interval(float(values.mean()), float(half), len(values))


class Paired(NamedTuple):
    difference: Interval  # of a - b, seed by seed
    wins: int  # seeds where a > b
    p_value: float  # two-sided paired t-test; nan with fewer than 2 pairs or no spread

    def row(self, name: str) -> str:
        p = "n/a" if np.isnan(self.p_value) else f"{self.p_value:.3f}"
        return f"| {name} | {self.difference} | {self.wins}/{self.difference.n} | {p} |"

    @property
    def significant(self) -> bool:
        """Whether the 95 % interval of the difference excludes 0 (never with fewer than 2 pairs)."""
        half = self.difference.half_width
        return bool(np.isfinite(half) and abs(self.difference.mean) > half)


def paired(a: Sequence[float], b: Sequence[float]) -> Paired:
    """a vs b where a[i] and b[i] come from the same seed (same initial weights, same data order)."""
    from scipy import stats

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths; received {len(a)} and {len(b)}.")
    differences = a - b
    p = float("nan")
    if len(a) >= 2 and differences.std() > 0:
        p = float(stats.ttest_rel(a, b).pvalue)
    return Paired(interval(differences), int((differences > 0).sum()), p)


PAIRED_HEADER = ("| comparison (same seeds) | mean difference ± 95 % CI | seeds where the first is higher | "
                 "p (paired t) |\n|---|---:|---:|---:|")


# Dynamic SGD (Lin et al. 2019) in miniature: a plan of global batch sizes, trained with the same seeds (same initial
# weights, same example stream) under each learning-rate transition.

MOMENTUM = 0.9
TRANSITIONS = {"static": "none", "immediate": "none", "ramp": "linear", "momentum": "momentum"}


class Design(NamedTuple):
    """What every configuration of one Dynamic-SGD experiment shares."""
    model: str
    plan: Sequence[int]  # global batch per phase, as multiples of base_batch
    phase_samples: Sequence[int]  # training samples per phase
    base_batch: int
    learning_rate: float  # SGD's at the base batch (cosine decay over the run)
    ramp_per_factor: float  # the ramp's steps per factor of batch growth
    weight_decay: float


class Run(NamedTuple):
    samples: List[int]  # seen after each step; a run stops at its first non-finite loss
    losses: List[float]
    learning_rates: List[float]
    batches: List[int]
    test_accuracy: float
    weights_digest: str  # of the initial weights: equal across configurations of a seed
    data_digest: str  # of the planned example stream: likewise


def phases(design: Design, config: str = "resized") -> List[Tuple[int, int]]:
    """(global batch, steps) per phase of the plan: whole batches only, each phase its `phase_samples` long. The
    static configuration sees the same samples in base-batch steps."""
    out, seen, end = [], 0, 0
    for multiple, samples in zip(design.plan, design.phase_samples):
        batch = design.base_batch * int(multiple)
        end += int(samples)
        steps = max(0, (end - seen) // batch)
        seen += steps * batch
        out.append((design.base_batch, steps * int(multiple)) if config == "static" else (batch, steps))
    return out


def schedule_for(design: Design, config: str):
    """The learning-rate schedule of `config` (one of TRANSITIONS), its resizes already recorded (the plan is known
    in advance)."""
    import keras

    from tf_elastic import BatchResizeSchedule

    plan = phases(design, config)
    total = sum(batch * steps for batch, steps in plan) // design.base_batch
    base = keras.optimizers.schedules.CosineDecay(design.learning_rate, total, alpha=0.01)
    schedule = BatchResizeSchedule(base, design.base_batch, batch_size=plan[0][0], transition=TRANSITIONS[config],
                                   momentum=MOMENTUM, ramp_steps_per_factor=design.ramp_per_factor)
    step = 0
    for batch, steps in plan:
        schedule.resize(step, batch)
        step += steps
    return schedule


def ramp_lengths(design: Design) -> List[Tuple[int, int]]:
    """(ramp steps, phase steps) for each batch increase of the plan: the ramp must fit in its phase."""
    plan = phases(design)
    return [(round(design.ramp_per_factor * new / old), steps)
            for (old, _), (new, steps) in zip(plan, plan[1:]) if new > old]


def ramp_check(design: Design) -> str:
    """Whether every ramp finishes inside its phase, and how long the phase trains at the full scale after it."""
    if design.ramp_per_factor == 0:
        return "ramp: 0 steps (the ramp configuration jumps at once)"
    lengths = ramp_lengths(design)
    done = all(ramp <= steps for ramp, steps in lengths)
    lines = [f"{ramp} of {steps} steps" + ("" if ramp <= steps else " (UNFINISHED)") for ramp, steps in lengths]
    verdict = "every ramp finishes inside its phase" if done else "NOT every ramp finishes: lengthen the phases"
    return f"ramp check: {verdict} (ramp per batch increase: {', '.join(lines) or 'none'})"


def example_stream(seed: int, examples: int, total: int) -> np.ndarray:
    """The indices of the `total` training samples seed `seed` sees, in order: back-to-back permutations, whatever
    the batch sizes, so every configuration of a seed reads the same examples in the same order."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.permutation(examples) for _ in range(-(-total // examples))])[:total]


def train(design: Design, plan: List[Tuple[int, int]], schedule, seed: int, train_data, test_data) -> Run:
    """Trains `design.model` through `plan` with SGD (momentum 0.9) on `schedule`; stops at a non-finite loss."""
    import keras
    import tensorflow as tf

    from tf_elastic import models

    keras.utils.set_random_seed(seed)
    x, y = train_data
    model = models.get(design.model, x.shape[1:], 10)
    optimizer = keras.optimizers.SGD(schedule, momentum=MOMENTUM, weight_decay=design.weight_decay)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(input_signature=[tf.TensorSpec([None, *x.shape[1:]]), tf.TensorSpec([None], tf.int32)])
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        lr = optimizer.learning_rate
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss, lr

    weights = _digest(np.concatenate([w.numpy().ravel() for w in model.weights]))
    stream = example_stream(seed, len(x), sum(batch * steps for batch, steps in plan))
    batches = [batch for batch, steps in plan for _ in range(steps)]
    seen, samples, losses, lrs = 0, [], [], []
    for batch in batches:
        loss, lr = step(x[stream[seen: seen + batch]], y[stream[seen: seen + batch]])
        seen += batch
        samples.append(seen)
        losses.append(float(loss))
        lrs.append(float(lr))
        if not np.isfinite(losses[-1]):
            break
    logits = np.concatenate([model(test_data[0][i: i + 500], training=False) for i in range(0, len(test_data[0]), 500)])
    accuracy = float(np.mean(np.argmax(logits, axis=1) == test_data[1]))
    return Run(samples, losses, lrs, batches[: len(samples)], accuracy, weights, _digest(stream))


def _digest(array: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def resize_samples(design: Design) -> List[int]:
    """Sample counts at which the plan resizes: where every configuration's spikes are read, static included."""
    plan, out, seen = phases(design), [], 0
    for (old, steps), (new, _) in zip(plan, plan[1:]):
        seen += old * steps
        if new != old:
            out.append(seen)
    return out


def spikes(run: Run, design: Design, window: int, smoothing: int, after: Optional[int] = None) -> List[float]:
    """Per resize the run reached: the highest running mean of the loss in the `after` (default `window`) steps
    after it, less the mean of the running mean over the `window` steps before it; inf where the loss went
    non-finite after the resize."""
    smooth = np.convolve(run.losses, np.ones(smoothing) / smoothing, mode="full")[: len(run.losses)]  # causal
    out = []
    for boundary in resize_samples(design):
        at = int(np.searchsorted(run.samples, boundary, side="right"))
        if window <= at < len(smooth):
            rise = smooth[at: at + (after or window)].max() - smooth[at - window: at].mean()
            out.append(float(rise) if np.isfinite(rise) else float("inf"))
    return out


def load_task(task: str, data_dir: Optional[str], train_examples: int, test_examples: int):
    """(train, test) arrays of `task` ("mnist" or "colour_digits"): images in [0, 1], int32 labels."""
    from tf_elastic.elastic.worker import datasets

    data = datasets.load("mnist", data_dir or datasets.DEFAULT_DATA_DIR)
    x, y = data.x_train[:train_examples], data.y_train[:train_examples]
    xt, yt = data.x_test[:test_examples], data.y_test[:test_examples]
    if task == "colour_digits":  # train and test get different draws of the same distortions
        x, xt = colour_digits(x), colour_digits(xt, TASK_SEED + 1)
    return (x, y), (xt, yt)
