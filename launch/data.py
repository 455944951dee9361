"""Offline datasets for the launch scripts: MNIST from a local `mnist.npz`, scikit-learn's digits."""
from pathlib import Path
from typing import NamedTuple

import numpy as np

# ../shared/data beside the repository root, whatever the current directory.
DEFAULT_DATA_DIR = str(Path(__file__).resolve().parents[1].parent / "shared" / "data")
DATASETS = ("mnist", "digits")


class Dataset(NamedTuple):
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int


def load(name: str, data_dir: str = DEFAULT_DATA_DIR) -> Dataset:
    """Images as float32 in [0, 1] with a channel axis, labels as int32."""
    if name == "mnist":
        path = Path(data_dir) / "mnist.npz"
        if not path.is_file():
            raise FileNotFoundError(f"--data_dir={data_dir!r} has no mnist.npz (keras.datasets.mnist format).")
        with np.load(path) as data:
            arrays = [data[k] for k in ("x_train", "y_train", "x_test", "y_test")]
        x_train, y_train, x_test, y_test = arrays
        scale = 255.0
    elif name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        order = np.random.default_rng(0).permutation(len(digits.target))
        x, y = digits.images[order], digits.target[order]
        split = int(0.8 * len(y))
        x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]
        scale = 16.0
    else:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}.")
    prepare = lambda x: (x.astype(np.float32) / scale)[..., None]
    return Dataset(prepare(x_train), y_train.astype(np.int32), prepare(x_test), y_test.astype(np.int32), 10)
