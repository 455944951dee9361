"""The datasets of `launch/train.py`: in-memory examples (MNIST from a local `mnist.npz` or Keras's
download, scikit-learn's digits, a synthetic set) and file-backed sources (an image folder, TFRecord
shards, a prepared TFDS dataset), each as a (train, evaluation) pair of `data.Source`s."""
import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Optional, Tuple

import numpy as np

if TYPE_CHECKING:
    from tf_elastic.elastic.worker.data import Source

# Keras's own dataset cache (`$KERAS_HOME/datasets`, else `~/.keras/datasets`): where
# `keras.datasets.mnist.load_data()` keeps the mnist.npz it downloads, so one download serves every run.
DEFAULT_DATA_DIR = os.path.join(os.path.expanduser(os.environ.get("KERAS_HOME", os.path.join("~", ".keras"))),
                                "datasets")
DATASETS = ("mnist", "digits", "synthetic", "folder:PATH", "tfrecord:DIR", "tfds:NAME")
FILE_KINDS = ("folder:", "tfrecord:", "tfds:")


def valid_name(name: str) -> bool:
    return name in DATASETS[:3] or any(name.startswith(k) and len(name) > len(k) for k in FILE_KINDS)


def sources(name: str, data_dir: str = DEFAULT_DATA_DIR, channels: int = 3,
            cache_dir: Optional[str] = None) -> Tuple["Source", "Source"]:
    """(training, evaluation) sources of `name`; file-backed ones hold only names and offsets in memory
    (`cache_dir`: where TFRecord shard indexes are cached, see `TFRecordSource`)."""
    from tf_elastic.elastic.worker import data

    kind, _, where = name.partition(":")
    if kind == "folder":
        train = data.ImageFolder(str(Path(where) / "train"), channels)
        return train, data.ImageFolder(str(Path(where) / "validation"), channels, class_names=train.class_names)
    if kind == "tfrecord":
        train = data.TFRecordSource(str(Path(where) / "train-*"), channels=channels, cache_dir=cache_dir)
        return train, data.TFRecordSource(str(Path(where) / "validation-*"), channels=channels,
                                          num_classes=lambda: train.num_classes, cache_dir=cache_dir)
    if kind == "tfds":
        tfds_dir = None if data_dir == DEFAULT_DATA_DIR else data_dir
        train = data.TFDSSource(where, "train", tfds_dir)
        return train, data.TFDSSource(where, "test" if "test" in train.data.dataset_info.splits else "validation",
                                      tfds_dir)
    arrays = load(name, data_dir)
    return (data.ArraySource(arrays.x_train, arrays.y_train, arrays.num_classes),
            data.ArraySource(arrays.x_test, arrays.y_test, arrays.num_classes))


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
        if path.is_file():
            with np.load(path) as data:
                arrays = [data[k] for k in ("x_train", "y_train", "x_test", "y_test")]
        else:
            arrays = _download_mnist(data_dir)
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
    else:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}.")
    prepare = lambda x: (x.astype(np.float32) / scale)[..., None]
    return Dataset(prepare(x_train), y_train.astype(np.int32), prepare(x_test), y_test.astype(np.int32), 10)


def _download_mnist(data_dir: str):
    """Keras's MNIST download, for users without a local copy; says so, and names the local file it looked for."""
    import keras

    missing = f"--data_dir={data_dir!r} has no mnist.npz (keras.datasets.mnist format)"
    print(f"{missing}: falling back to keras.datasets.mnist.load_data() (a download)", flush=True)
    try:
        (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
    except Exception as error:  # noqa: BLE001 - offline, a proxy, a full disk: all mean "no MNIST here"
        raise FileNotFoundError(f"{missing}, and keras.datasets.mnist.load_data() failed: {error}") from None
    return x_train, y_train, x_test, y_test
