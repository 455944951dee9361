"""Offline example datasets for `launch/train.py`: MNIST from a local `mnist.npz`, scikit-learn's digits,
a synthetic set and datasets prepared for TFDS."""
from pathlib import Path
from typing import NamedTuple

import numpy as np

# ../shared/data beside the repository root, whatever the current directory.
DEFAULT_DATA_DIR = str(Path(__file__).resolve().parents[3].parent / "shared" / "data")
DATASETS = ("mnist", "digits", "synthetic", "tfds:NAME")


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
    elif name == "synthetic":
        # Learnable noise: the label is which of 10 fixed patterns the image is closest to.
        rng = np.random.default_rng(0)
        patterns = rng.random((10, 28, 28))
        labels = rng.integers(0, 10, 6000)
        images = 0.6 * patterns[labels] + 0.4 * rng.random((6000, 28, 28))
        x_train, y_train, x_test, y_test = images[:5000], labels[:5000], images[5000:], labels[5000:]
        scale = 1.0
    elif name.startswith("tfds:"):
        return _tfds(name[len("tfds:"):], data_dir)
    else:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}.")
    prepare = lambda x: (x.astype(np.float32) / scale)[..., None]
    return Dataset(prepare(x_train), y_train.astype(np.int32), prepare(x_test), y_test.astype(np.int32), 10)


def _tfds(name: str, data_dir: str) -> Dataset:
    """An image-classification dataset already prepared in TFDS's data dir (nothing is downloaded): its
    supervised pair, or its `image` and `label` features."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise ValueError(f"--dataset=tfds:{name} needs tensorflow-datasets (pip install tensorflow-datasets)") from None
    try:
        builder = tfds.builder(name, data_dir=None if data_dir == DEFAULT_DATA_DIR else data_dir)
        image, label = builder.info.supervised_keys or ("image", "label")
        splits = tfds.as_numpy(builder.as_dataset(split=["train", "test"], batch_size=-1))
        (x_train, y_train), (x_test, y_test) = [(s[image], s[label]) for s in splits]
    except (tfds.core.registered.DatasetNotFoundError, AssertionError, KeyError, ValueError) as error:
        raise ValueError(f"--dataset=tfds:{name}: no prepared train and test splits with {name}'s image and label "
                         f"in --data_dir={data_dir!r} ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
                         ) from None
    prepare = lambda x: x.astype(np.float32) / 255.0
    return Dataset(prepare(x_train), y_train.astype(np.int32), prepare(x_test), y_test.astype(np.int32),
                   int(max(y_train.max(), y_test.max())) + 1)
