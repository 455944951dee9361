"""Small image datasets written at test time, in each layout `launch/train.py` reads: an image folder,
TFRecord shards of tf.train.Example, a TFDS dataset in ArrayRecord. Shared by tests and bench_input."""
from pathlib import Path
from typing import Sequence

import numpy as np
import tensorflow as tf


def digits(size: int = 16):
    """scikit-learn's 1797 digits as uint8 size x size x 1 images (train: first 1400, validation: the rest)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = np.round(data.images / 16.0 * 255).astype(np.uint8)[..., None]
    images = tf.image.resize(images, (size, size), method="nearest").numpy().astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], data.target[order].astype(np.int64)
    return (images[:1400], labels[:1400]), (images[1400:], labels[1400:])


def write_mnist_like(directory: Path, train: int = 12000, test: int = 2000, seed: int = 0) -> Path:
    """`directory/mnist.npz` in keras.datasets.mnist's format (28x28 uint8 images, uint8 labels), made from
    scikit-learn's digits (upscaled 3x, shifted up to 2 pixels): what the tests train where MNIST itself
    would be needed, so that no test depends on a download or on ../shared/data. Training and test
    images come from disjoint digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    big = np.pad(np.kron(data.images / 16.0, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2)))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(big))

    def make(indices: np.ndarray, count: int):
        pick = rng.choice(indices, count)
        shifts = rng.integers(-2, 3, (count, 2))
        images = np.stack([np.roll(big[i], tuple(shift), axis=(0, 1)) for i, shift in zip(pick, shifts)])
        return np.round(images * 255).astype(np.uint8), data.target[pick].astype(np.uint8)

    (x_train, y_train), (x_test, y_test) = make(order[:1437], train), make(order[1437:], test)
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / "mnist.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return directory


def png(image: np.ndarray) -> bytes:
    return tf.io.encode_png(image).numpy()


def write_folder(root: Path, images: np.ndarray, labels: Sequence[int], class_names: Sequence[str]) -> None:
    """root/<class name>/<n>.png."""
    for name in class_names:
        (root / name).mkdir(parents=True, exist_ok=True)
    for n, (image, label) in enumerate(zip(images, labels)):
        (root / class_names[label] / f"{n:06d}.png").write_bytes(png(image))


def example(encoded: bytes, label: int) -> bytes:
    feature = {"image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded])),
               "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))}
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_tfrecords(directory: Path, prefix: str, images: np.ndarray, labels: Sequence[int], shards: int,
                    label_offset: int = 1) -> None:
    """directory/prefix-0000n-of-0000N, ImageNet's keys and (by default) 1-based labels."""
    directory.mkdir(parents=True, exist_ok=True)
    for shard, part in enumerate(np.array_split(np.arange(len(images)), shards)):
        with tf.io.TFRecordWriter(str(directory / f"{prefix}-{shard:05d}-of-{shards:05d}")) as writer:
            for n in part:
                writer.write(example(png(images[n]), labels[n] + label_offset))


def write_tfds(data_dir: Path, name: str, train, test, file_format: str = "array_record") -> None:
    """A TFDS dataset `name` with `image` and `label`, in ArrayRecord (what tfds.data_source reads) or
    `file_format="tfrecord"` (what `tfds.load` reads as a tf.data pipeline)."""
    import tensorflow_datasets as tfds

    features = tfds.features.FeaturesDict({"image": tfds.features.Image(shape=train[0].shape[1:], dtype=np.uint8),
                                           "label": tfds.features.ClassLabel(num_classes=10)})
    splits = {split: tf.data.Dataset.from_tensor_slices({"image": x, "label": y})
              for split, (x, y) in (("train", train), ("test", test))}
    tfds.dataset_builders.store_as_tfds_dataset(name=name, version="1.0.0", features=features, split_datasets=splits,
                                                data_dir=data_dir, file_format=file_format, disable_shuffling=True)


def write_all(root: Path, size: int = 16) -> dict:
    """All three layouts of the same digits under root: {"folder": PATH, "tfrecord": DIR, "tfds": data_dir}."""
    train, test = digits(size)
    names = [f"class_{c}" for c in range(10)]
    write_folder(root / "folder" / "train", *train, names)
    write_folder(root / "folder" / "validation", *test, names)
    write_tfrecords(root / "tfrecord", "train", *train, shards=4)
    write_tfrecords(root / "tfrecord", "validation", *test, shards=2)
    write_tfds(root / "tfds", "digits_files", train, test)
    return {"folder": root / "folder", "tfrecord": root / "tfrecord", "tfds": root / "tfds"}
