"""What both paper reproductions share: the harder image task, the validation split, and the statistics that
let a table tell methods apart (95 % intervals over seeds, paired comparisons on the same seeds)."""
from typing import NamedTuple, Sequence, Tuple

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
