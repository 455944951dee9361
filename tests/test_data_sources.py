"""Data sources of `fit` over files written at test time: the pipeline yields exactly the plan's
examples, sources of any structure keep it, augmentation is reproducible, bad data is named, and each
source trains. (A kill, a join and a leave mid-epoch over TFRecord shards keep every example exactly once
per epoch among committed work: test_elastic_runtime.py.)"""
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO
from tf_elastic.elastic.protocol import RunDir
from tf_elastic.elastic.worker import data
from tf_elastic.elastic.worker.data import tfrecord_format
from tf_elastic.elastic.worker.data.parse_key import parse_key
from tf_elastic.elastic.worker.data_plan import DataPlan
from tf_elastic.elastic.worker.errors import ConfigurationError
from tf_elastic.testing import data_files
from tf_elastic.testing.local_job import repo_env

pytestmark = pytest.mark.xdist_group("data_sources")  # its module fixtures: built once, on one worker

KINDS = ("folder", "tfrecord", "tfds")


@pytest.fixture(scope="module")
def files(tmp_path_factory, machine_slots):
    root = tmp_path_factory.mktemp("data")
    with machine_slots.held():
        return {"root": root, **data_files.write_all(root)}


@pytest.fixture(scope="module")
def digits():
    return data_files.digits()


def _train_source(kind, files):
    return {"folder": lambda: data.ImageFolder(f"{files['folder']}/train", channels=1),
            "tfrecord": lambda: data.TFRecordSource(f"{files['tfrecord']}/train-*", channels=1),
            "tfds": lambda: data.TFDSSource("digits_files", "train", str(files["tfds"]))}[kind]()


def _example_numbers(kind, source):
    """Which written example (its position in `digits`) each source index is."""
    if kind == "folder":
        return np.array([int(Path(p).stem) for p in source.paths])
    return np.arange(source.num_examples)  # shards and the TFDS split keep the written order


@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_yields_the_planned_examples_in_order(kind, files, digits):
    """What the index log records (the plan's indices) is what the pipeline reads: a mid-epoch share
    of rank 1 in a world of 3 decodes to exactly those written images and labels."""
    (images, labels), _ = digits
    source = _train_source(kind, files)
    assert source.num_examples == len(labels)
    plan = DataPlan(source.num_examples, 5, lambda epoch: source.epoch_order(5, epoch))  # as fit makes it
    batches = plan.replica_batches(epoch=2, start=96, world_size=3, rank=1, batch=8)
    planned = np.concatenate(batches)
    keep = lambda x, y, seed: (x, y)  # noqa: E731 - raw pixels
    got = list(data.pipeline(source, planned, 8, preprocess=keep, seed=5, epoch=2).as_numpy_iterator())
    assert len(got) == len(batches)
    numbers = _example_numbers(kind, source)[planned]
    np.testing.assert_array_equal(np.concatenate([x for x, _ in got]), images[numbers])
    offset = 1 if kind == "tfrecord" else 0  # the shards hold ImageNet-style 1-based labels
    np.testing.assert_array_equal(np.concatenate([y for _, y in got]), labels[numbers] + offset)


@pytest.mark.parametrize("kind", ["folder", "tfrecord"])
def test_file_sources_read_any_tensorflow_filesystem(kind, files):
    """ram:// stands in for gs:// and s3://: the same files copied there list, index and read the same."""
    local, remote = str(files[kind]), f"ram://sources-{kind}"
    for directory, _, names in tf.io.gfile.walk(local):
        for name in names:
            target = remote + f"{directory}/{name}"[len(local):]
            tf.io.gfile.makedirs(target.rsplit("/", 1)[0])
            tf.io.gfile.copy(f"{directory}/{name}", target, overwrite=True)
    files_there = dict(files, **{kind: remote})
    here, there = _train_source(kind, files), _train_source(kind, files_there)
    assert there.num_examples == here.num_examples and there.num_classes == here.num_classes
    indices = np.arange(0, 64, 3)
    keep = lambda x, y, seed: (x, y)  # noqa: E731 - raw pixels
    read = [list(data.pipeline(s, indices, 8, preprocess=keep).as_numpy_iterator()) for s in (here, there)]
    for (x_here, y_here), (x_there, y_there) in zip(*read):
        np.testing.assert_array_equal(x_here, x_there)
        np.testing.assert_array_equal(y_here, y_there)


def test_the_tfrecord_order_is_a_seeded_permutation_in_runs_of_records(files):
    source = _train_source("tfrecord", files)
    order = source.epoch_order(5, 2)
    assert sorted(order) == list(range(source.num_examples))
    np.testing.assert_array_equal(order, source.epoch_order(5, 2))
    assert not np.array_equal(order, source.epoch_order(5, 3))
    assert len(source._runs(order[96:96 + 8])[0]) <= 2  # one worker's share of a batch: one run, two across shards


def test_tfrecord_labels_may_start_at_one_without_a_class_count(files):
    assert _train_source("tfrecord", files).num_classes == 11  # labels 1..10, 0 reserved
    assert _train_source("folder", files).num_classes == 10


def test_augmentation_is_the_same_for_the_same_seed_epoch_and_example(digits):
    from tf_elastic.elastic.worker.data import preprocess

    (images, labels), _ = digits
    source = data.ArraySource(np.repeat(images[:16], 3, axis=-1), labels[:16])
    crop = preprocess.imagenet(12, training=True)
    run = lambda seed, epoch, order: np.concatenate([x for x, _ in data.pipeline(  # noqa: E731
        source, order, 4, preprocess=crop, seed=seed, epoch=epoch).as_numpy_iterator()])
    order = np.arange(16)
    first = run(1, 0, order)
    np.testing.assert_array_equal(first, run(1, 0, order))
    np.testing.assert_array_equal(first[::-1], run(1, 0, order[::-1]))  # per example, not per position
    assert not np.array_equal(first, run(1, 1, order))
    assert not np.array_equal(first, run(2, 0, order))


class _Readings(data.Source):
    """No classification: token ids, a uint8 pixel and a float reading in a dict, a float target, and a sample
    weight per example (`weight` times the index's parity)."""

    def __init__(self, weight: float = 1.0):
        self.num_examples, self.weight = 24, weight

    def read(self, index):
        features = {"tokens": tf.stack([index, index + 1, index + 2]), "pixel": tf.cast(index * 10, tf.uint8),
                    "reading": tf.cast(index, tf.float32) / 4}
        return features, tf.cast(index, tf.float32) * 2, self.weight * tf.cast(index % 2, tf.float32)


def test_a_source_of_any_structure_keeps_it_and_its_sample_weights_reach_the_loss(tmp_path):
    from tf_elastic import elastic

    features, target, weight = next(iter(data.pipeline(_Readings(), np.array([5, 4, 9, 0]), 2)))
    assert features["tokens"].dtype == tf.int64 and features["tokens"].numpy().tolist() == [[5, 6, 7], [4, 5, 6]]
    np.testing.assert_allclose(features["pixel"], [50 / 255, 40 / 255])  # uint8 only: images, to [0, 1]
    np.testing.assert_array_equal(features["reading"], [1.25, 1.0])
    np.testing.assert_array_equal(target, [10.0, 8.0])
    np.testing.assert_array_equal(weight, [1.0, 0.0])
    tokens, pixel, reading = keras.Input((3,), dtype="int64"), keras.Input(()), keras.Input(())
    merged = keras.layers.Concatenate()([keras.ops.cast(tokens, "float32"), pixel[:, None], reading[:, None]])
    model = keras.Model({"tokens": tokens, "pixel": pixel, "reading": reading}, keras.layers.Dense(1)(merged))
    model.compile(optimizer="sgd", loss="mse")
    loss = lambda weight, run: elastic.fit(model, _Readings(weight), batch_size=8, epochs=1, verbose=0,  # noqa: E731
                                           run_dir=str(tmp_path / run)).history["loss"][0]
    assert loss(0.0, "zero") == 0.0 and loss(1.0, "one") > 0.0


def test_array_sources_count_classes_of_integer_ids_only_and_fingerprint_as_before():
    """The fingerprint of (x, y) arrays is what commits made before structures were taken (a run resumes
    under it); a structure's fingerprint follows its leaves' paths, not a dict's key order."""
    from tf_elastic.elastic.worker.data.source import digest

    x, y = np.arange(12, dtype=np.float32).reshape(6, 2), np.array([0, 3, 1, 255, 2, 0], np.uint8)
    assert data.ArraySource(x, y).fingerprint() == digest(x.shape, x.dtype.str, y.shape, y.dtype.str, x, y)
    assert data.ArraySource(x, y).num_classes == 256  # uint8 ids: the count does not wrap
    assert data.ArraySource(x, y.astype(np.float32)).num_classes is None  # regression targets
    assert data.ArraySource(x, {"a": y, "b": y}).num_classes is None
    one, other = data.ArraySource({"a": x, "b": x[:, :1]}, y), data.ArraySource({"b": x[:, :1], "a": x}, y)
    assert one.fingerprint() == other.fingerprint() != data.ArraySource([x, x[:, :1]], y).fingerprint()


def test_missing_and_empty_folders_are_named(tmp_path):
    with pytest.raises(ConfigurationError, match=re.escape(f"{tmp_path / 'nope'} does not exist")):
        data.ImageFolder(str(tmp_path / "nope"))
    (tmp_path / "images" / "cat").mkdir(parents=True)
    (tmp_path / "images" / "dog").mkdir()
    (tmp_path / "images" / "cat" / "1.png").write_bytes(data_files.png(np.zeros((4, 4, 1), np.uint8)))
    with pytest.raises(ConfigurationError, match=re.escape(f"class folder {tmp_path / 'images' / 'dog'} is missing")):
        data.ImageFolder(str(tmp_path / "images"))
    with pytest.raises(ConfigurationError, match="no TFRecord files match"):
        data.TFRecordSource(str(tmp_path / "train-*"))


def test_a_validation_folder_with_classes_the_training_folder_lacks_is_refused_naming_them(tmp_path):
    """A misspelt or extra class folder in validation was dropped without a word (4 of 13 files evaluated)."""
    from tf_elastic.elastic.worker import datasets

    png = data_files.png(np.zeros((4, 4, 3), np.uint8))
    for split, classes in {"train": ["cat", "dog"], "validation": ["cat", "dog", "Dog", "fox"]}.items():
        for name in classes:
            (tmp_path / split / name).mkdir(parents=True)
            (tmp_path / split / name / "0.png").write_bytes(png)
    with pytest.raises(ConfigurationError, match=re.escape(
            f"image folder {tmp_path / 'validation'} has class folders that are not among the 2 classes given: "
            "Dog, fox (classes: cat, dog).")):
        datasets.sources(f"folder:{tmp_path}")
    for extra in ("Dog", "fox"):
        (tmp_path / "validation" / extra / "0.png").unlink()
        (tmp_path / "validation" / extra).rmdir()
    assert datasets.sources(f"folder:{tmp_path}")[1].num_examples == 2


def test_a_record_that_does_not_parse_is_named(tmp_path):
    path = tmp_path / "train-00000-of-00001"
    with tf.io.TFRecordWriter(str(path)) as writer:
        writer.write(data_files.example(data_files.png(np.zeros((4, 4, 1), np.uint8)), 1))
        writer.write(b"not a tf.train.Example")
    source = data.TFRecordSource(str(tmp_path / "train-*"))
    with pytest.raises(ConfigurationError, match=re.escape(f"TFRecord file {path} has a record that does not parse")):
        source.num_classes  # found on first use, by a pass over the labels


# A user's parse functions over the records `data_files.example` writes, the label as a sparse feature:
# record by record (`_sparse_label`, `_cropped`), or over a run's vector (`_batched`).
_FEATURES = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
             "image/class/label": tf.io.VarLenFeature(tf.int64)}


def _sparse_label(record):
    parsed = tf.io.parse_single_example(record, _FEATURES)
    return parsed["image/encoded"], parsed["image/class/label"].values[0] - 1  # 0-based


def _cropped(record):
    encoded, label = _sparse_label(record)
    return tf.io.decode_png(encoded, channels=1)[:16, :16], label


def _batched(records):
    parsed = tf.io.parse_example(records, dict(_FEATURES, **{
        "image/class/label": tf.io.FixedLenFeature([], tf.int64)}))
    return parsed["image/encoded"], parsed["image/class/label"] - 1


_batched.batched = True


def _counting_source(tries: list) -> type:
    """A `TFRecordSource` class that appends to `tries` the first record of every run it tries again."""
    class Counted(data.TFRecordSource):
        def _inspect_run(self, first, count):
            tries.append(first)
            return super()._inspect_run(first, count)

    return Counted


def _write_odd_sized_digits(directory: Path, images, labels) -> list:
    """Writes the first 40 digits as two TFRecord shards of 20 (labels from 1), every other one padded to
    17 x 17; returns the images written."""
    sizes = [16 if n % 2 else 17 for n in range(40)]  # odd-sized images, cut back to 16 by `_cropped`
    written = [np.pad(image, ((0, size - 16), (0, size - 16), (0, 0))) for image, size in zip(images[:40], sizes)]
    with tf.io.TFRecordWriter(str(directory / "train-00000-of-00002")) as first, \
            tf.io.TFRecordWriter(str(directory / "train-00001-of-00002")) as second:
        for n, image in enumerate(written):
            (first if n < 20 else second).write(data_files.example(data_files.png(image), labels[n] + 1))
    return written


def test_parse_functions_per_record_or_batched_read_the_same_and_name_a_bad_record(tmp_path, digits):
    """A user's parse function runs record by record (here: a sparse feature, and images of different
    sizes decoded and cropped in `parse`, which tf.vectorized_map cannot convert); one marked `batched`
    takes the run's vector itself. Each reads what was written without a second try of any run, and a
    record that does not parse is named by its byte; the shard's cached index stays (its bytes are fine)."""
    tries = []
    Counted = _counting_source(tries)
    (images, labels), _ = digits
    written = _write_odd_sized_digits(tmp_path, images, labels)
    order, keep = np.random.default_rng(0).permutation(40), (lambda x, y, seed: (x[:16, :16], y))
    for parse, decode in ((_sparse_label, True), (_cropped, False), (_batched, True)):
        source = Counted(str(tmp_path / "train-*"), parse=parse, channels=1, decode_images=decode)
        got = list(data.pipeline(source, order, 8, preprocess=keep).as_numpy_iterator())
        expected = [image[:16, :16] for image in written]
        np.testing.assert_array_equal(np.concatenate([x for x, _ in got]), np.stack(expected)[order])
        np.testing.assert_array_equal(np.concatenate([y for _, y in got]), labels[:40][order])
    assert tries == []
    _a_bad_record_is_named_by_its_byte(tmp_path, Counted, keep)


def _a_bad_record_is_named_by_its_byte(tmp_path: Path, Counted: type, keep) -> None:
    """The second shard's fourth record replaced by bytes that do not parse: both kinds of parse function
    name it by its shard and byte, the index cache keeps both shards, and the label pass gives the reason."""
    bad = tmp_path / "train-00001-of-00002"
    records = list(tf.data.TFRecordDataset(str(bad)).as_numpy_iterator())
    with tf.io.TFRecordWriter(str(bad)) as writer:
        for n, record in enumerate(records):
            writer.write(b"not a tf.train.Example" if n == 3 else record)
    offset, cache = tfrecord_format.record_offsets(str(bad))[0][3], tmp_path / "cache"
    for parse in (_sparse_label, _batched):
        source = Counted(str(tmp_path / "train-*"), parse=parse, channels=1, num_classes=10, cache_dir=str(cache))
        with pytest.raises(tf.errors.InvalidArgumentError) as error:
            list(data.pipeline(source, np.arange(40), 8, preprocess=keep))
        assert data.describe_error(error.value) == f"[a record that does not parse in TFRecord file] [{bad}] " \
                                                    f"[at byte] [{offset}]"
        assert len(list(cache.glob("*.npz"))) == 2
    with pytest.raises(ConfigurationError, match=re.escape(
            f"TFRecord file {bad} has a record that does not parse: Could not parse example input, "
            "value: 'not a tf.train.Example'")):
        data.TFRecordSource(str(bad), parse=_batched).num_classes  # the label pass: the reason, not TF's prefix


def test_a_label_outside_the_class_range_is_named(tmp_path, digits):
    (images, labels), _ = digits
    data_files.write_tfrecords(tmp_path, "train", images[:8], np.full(8, 12), shards=1)
    source = data.TFRecordSource(str(tmp_path / "train-*"), channels=1, num_classes=10)
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        list(data.pipeline(source, np.arange(8), 4))
    message = data.describe_error(error.value)
    assert "[13] [outside [0, 10)] [in]" in message and str(tmp_path / "train-00000-of-00001") in message


def _fit(shards: Path, run_dir: Path, epochs: int, source=None) -> None:
    import keras

    from tf_elastic import elastic
    from tf_elastic.elastic.worker.world import World

    model = keras.Sequential([keras.Input((16, 16, 1)), keras.layers.Flatten(), keras.layers.Dense(11)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    source = source or data.TFRecordSource(f"{shards}/train-*", channels=1, num_classes=11)
    elastic.fit(model, source, world=World(), strategy=tf.distribute.get_strategy(), run_dir=str(run_dir),
                epochs=epochs, per_replica_batch_size=8, verbose=0)


def test_a_record_that_does_not_parse_in_training_stops_fit_naming_its_shard(tmp_path, digits):
    """With a class count given nothing reads the labels up front: training meets the bad record, and
    `fit` raises ConfigurationError (exit 78 from a worker) naming the shard and the record's byte;
    committed work is untouched."""
    (images, labels), _ = digits
    shards, run_dir = tmp_path / "tfrecord", tmp_path / "run"
    data_files.write_tfrecords(shards, "train", images[:64], labels[:64], shards=2)
    _fit(shards, run_dir, 1)
    before = _digest(RunDir(run_dir).checkpoints)
    bad = shards / "train-00001-of-00002"
    records = list(tf.data.TFRecordDataset(str(bad)).as_numpy_iterator())
    with tf.io.TFRecordWriter(str(bad)) as writer:
        for n, record in enumerate(records):
            # (as long as the record it replaces: the shard keeps its size, so the data's fingerprint holds)
            writer.write(b"not a tf.train.Example".ljust(len(record), b"!") if n == 5 else record)
    offset = tfrecord_format.record_offsets(str(bad))[0][5]
    named = re.escape(f"a record that does not parse in TFRecord file] [{bad}] [at byte] [{offset}]")
    with pytest.raises(ConfigurationError, match=named):
        _fit(shards, run_dir, 2)
    assert _digest(RunDir(run_dir).checkpoints) == before


def _shard(directory: Path, digits, records: int = 16) -> Path:
    (images, labels), _ = digits
    data_files.write_tfrecords(directory, "train", images[:records], labels[:records], shards=1)
    return directory / "train-00000-of-00001"


def _cut(path: Path, how: str) -> type:
    """Changes a shard under a source that indexed it; the error its read must then raise."""
    offsets, size = tfrecord_format.record_offsets(str(path))
    if how == "removed":
        path.unlink()
        return tf.errors.NotFoundError
    with open(path, "r+b") as f:
        f.truncate(offsets[-1] if how == "cut at a record" else size - 10)
    return tf.errors.FailedPreconditionError if how == "cut at a record" else tf.errors.DataLossError


@pytest.mark.parametrize("how", ["removed", "cut at a record", "cut inside a record"])
def test_a_shard_that_changes_after_indexing_fails_with_its_read_error_not_as_bad_input(how, tmp_path, digits):
    """A shard removed or cut short between indexing and reading is what a dataset being copied again, or
    a failed read from an object store, looks like: the next process indexes it again, so it must not be
    bad input (exit 78 ends the job). The read's own error comes out, not InvalidArgumentError, which
    `fit` makes ConfigurationError; `fit` lets it through (a plain failure: the agent restarts the group)."""
    path = _shard(tmp_path / "tfrecord", digits)
    source = data.TFRecordSource(str(path), channels=1, num_classes=11)
    expected = _cut(path, how)
    with pytest.raises(tf.errors.OpError) as error:
        list(data.pipeline(source, np.arange(16), 8))
    assert type(error.value) is expected, error.value


def test_a_read_that_fails_once_is_tried_again_and_gives_every_record(tmp_path, digits):
    """A transient failure (here the first read of every run fails) costs a second read, not the data:
    the pipeline yields exactly what an undisturbed one does."""
    path = _shard(tmp_path / "tfrecord", digits, 64)
    failed = []

    class FailsOnce(data.TFRecordSource):
        def _records(self, path, count, offset, size):
            def gate(first_offset):
                if int(first_offset) not in failed:
                    failed.append(int(first_offset))
                    raise OSError("a transient read error")
                return np.int32(0)

            with tf.control_dependencies([tf.numpy_function(gate, [offset], tf.int32, stateful=True)]):
                return tf.identity(data.TFRecordSource._records(path, count, offset, size))

    order = np.random.default_rng(0).permutation(64)
    flaky = list(data.pipeline(FailsOnce(str(path), channels=1, num_classes=11), order, 8))
    plain = list(data.pipeline(data.TFRecordSource(str(path), channels=1, num_classes=11), order, 8))
    assert failed and len(flaky) == len(plain) == 8
    for (x, y), (x0, y0) in zip(flaky, plain):
        np.testing.assert_array_equal(x, x0)
        np.testing.assert_array_equal(y, y0)


def test_fit_lets_a_read_error_through_as_no_configuration_error(tmp_path, digits):
    path = _shard(tmp_path / "tfrecord", digits, 64)
    source = data.TFRecordSource(str(path), channels=1, num_classes=11)
    _cut(path, "cut inside a record")
    with pytest.raises(tf.errors.DataLossError):
        _fit(path.parent, tmp_path / "run", 1, source)


def test_a_corrupt_record_is_bad_input_naming_its_shard_and_byte(tmp_path, digits):
    """A record whose checksum fails in a shard of the indexed size is bad data: InvalidArgumentError,
    which `fit` makes ConfigurationError, naming the shard and the record's byte."""
    path = _shard(tmp_path / "tfrecord", digits)
    source = data.TFRecordSource(str(path), channels=1, num_classes=11)
    offset = int(source.offsets[5])
    contents = bytearray(path.read_bytes())
    contents[offset + 40] ^= 0x10  # inside the record's data: the size stays
    path.write_bytes(bytes(contents))
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        list(data.pipeline(source, np.arange(16), 8))
    assert (f"[corrupt record (checksum mismatch) in TFRecord file {path} at byte {offset}]"
            == data.describe_error(error.value))


def test_a_corrupt_record_header_is_named_with_its_byte(tmp_path, digits):
    """A length whose header checksum fails is not taken as a length (it would mis-index the rest)."""
    path = _shard(tmp_path / "tfrecord", digits)
    offset = tfrecord_format.record_offsets(str(path))[0][3]
    contents = bytearray(path.read_bytes())
    contents[offset] ^= 0x01  # a length one off: without the checksum, a plausible record
    path.write_bytes(bytes(contents))
    with pytest.raises(ConfigurationError, match=re.escape(
            f"TFRecord file {path}: the header of record 3 at byte {offset} is corrupt (checksum mismatch)")):
        data.TFRecordSource(str(path))


def test_the_tfrecord_checksum_is_tensorflows(tmp_path):
    path = tmp_path / "one"
    with tf.io.TFRecordWriter(str(path)) as writer:
        writer.write(b"some record")
    raw = path.read_bytes()
    assert tfrecord_format.masked_crc32c(raw[:8]) == int.from_bytes(raw[8:12], "little")
    assert tfrecord_format.masked_crc32c(raw[12:-4]) == int.from_bytes(raw[-4:], "little")


@pytest.mark.parametrize("kind", [*KINDS, "arrays"])
def test_an_empty_share_is_an_empty_dataset(kind, files, digits):
    """A worker's share of a batch or an epoch may be empty."""
    source = data.ArraySource(*digits[0]) if kind == "arrays" else _train_source(kind, files)
    assert list(source.examples(np.zeros(0, np.int64))) == []
    assert list(data.pipeline(source, np.zeros(0, np.int64), 8)) == []


def test_the_index_cache_serves_unchanged_shards_and_indexes_changed_ones_again(tmp_path, digits):
    """A restarted worker reads no shard it indexed before (its offsets nor its labels), unless the shard
    changed (size, modification time); a cache file that is damaged is not trusted."""
    (images, labels), _ = digits
    shards, cache = tmp_path / "tfrecord", str(tmp_path / "cache")
    data_files.write_tfrecords(shards, "train", images[:96], labels[:96], shards=3)
    make = lambda: data.TFRecordSource(f"{shards}/train-*", channels=1, cache_dir=cache)  # noqa: E731
    first = make()
    assert first.shard_reads == 3 and first.num_classes == labels[:96].max() + 2 and first.shard_reads == 6
    again = make()
    assert again.num_classes == first.num_classes and again.shard_reads == 0
    np.testing.assert_array_equal(again.offsets, first.offsets)
    np.testing.assert_array_equal(again.ends, first.ends)

    changed = shards / "train-00001-of-00003"
    data_files.write_tfrecords(tmp_path / "other", "train", images[:20], labels[:20], shards=1)
    changed.write_bytes((tmp_path / "other" / "train-00000-of-00001").read_bytes())
    after = make()
    assert after.shard_reads == 1 and after.num_examples == 64 + 20
    assert after.num_classes == first.num_classes and after.shard_reads == 2  # its labels too

    entries = sorted(Path(cache).glob("*.npz"))
    assert len(entries) == 3
    entries[0].write_bytes(entries[0].read_bytes()[:100])  # cut short, as by a full disk
    with np.load(entries[1]) as entry:  # well-formed, matching the shard, but offsets out of order
        np.savez(entries[1], offsets=entry["offsets"][::-1], meta=entry["meta"])
    damaged = make()
    assert damaged.shard_reads == 2
    np.testing.assert_array_equal(damaged.offsets, after.offsets)

    # Rewritten in place with its size and modification time kept (tar, rsync -a do that): indexed again.
    kept = shards / "train-00002-of-00003"
    times = kept.stat()
    kept.write_bytes(kept.read_bytes())
    import os
    os.utime(kept, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert make().shard_reads == 1
    # A shard that fails to read loses its cache entry (if the index were stale, the next start must not
    # meet the same failure).
    source = make()
    assert source.num_classes  # (labels found now, so that the failure below is the pipeline's read)
    with open(kept, "r+b") as f:
        f.truncate(kept.stat().st_size - 10)
    with pytest.raises(tf.errors.DataLossError):
        list(data.pipeline(source, np.arange(source.num_examples), 8))
    assert len(list(Path(cache).glob("*.npz"))) == 2
    with pytest.raises(ConfigurationError, match="must be a local"):
        data.TFRecordSource(f"{shards}/train-*", channels=1, cache_dir="gs://bucket/cache")


def test_the_index_cache_of_a_remote_shard_rewritten_at_the_same_size_and_mtime_is_not_trusted(tmp_path, digits):
    """Through a `scheme://` path only size and mtime were the key: a same-size rewrite with its mtime
    kept (`cp -p`, `rsync -a`) reused the old index and class count, failing every restart with exit 78."""
    import os

    (images, labels), _ = digits
    shards, cache = tmp_path / "tfrecord", str(tmp_path / "cache")
    keep = np.asarray(labels[:16]).copy()
    keep[keep == 9] = 8
    data_files.write_tfrecords(shards, "train", images[:16], keep, shards=1)
    make = lambda: data.TFRecordSource(f"file://{shards}/train-*", channels=1, cache_dir=cache)  # noqa: E731
    before = make().num_classes
    assert make().shard_reads == 0
    shard, other = shards / "train-00000-of-00001", keep.copy()
    times = shard.stat()
    other[-1] = 9  # the same record sizes, a new largest label
    data_files.write_tfrecords(shards, "train", images[:16], other, shards=1)
    os.utime(shard, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert shard.stat().st_size == times.st_size and shard.stat().st_mtime_ns == times.st_mtime_ns
    again = make()
    assert again.shard_reads >= 1 and again.num_classes == before + 1


def _train(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "launch.train", "--epochs=3", "--optimizer=sgd", "--threads=1",
                           "--image_size=16", *args], cwd=REPO, env=repo_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_each_source_trains_to_a_sensible_accuracy(kind, files, tmp_path):
    where = {"folder": f"folder:{files['folder']}", "tfrecord": f"tfrecord:{files['tfrecord']}",
             "tfds": "tfds:digits_files"}[kind]
    proc = _train([f"--dataset={where}", f"--data_dir={files['tfds']}", f"--run_dir={tmp_path / 'run'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split("test accuracy ")[1].split()[0]) > 0.85, proc.stdout[-2000:]


@pytest.mark.slow
def test_imagenet_preprocessing_trains_to_a_sensible_accuracy(files, tmp_path):
    """Random-resized crops and flips in training, resize and center crop in evaluation: still learns digits."""
    proc = _train([f"--dataset=folder:{files['folder']}", "--preprocess=imagenet", "--epochs=8",
                   f"--run_dir={tmp_path / 'run'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]  # (0.71-0.73 over seeds here; chance is 0.1)
    assert float(proc.stdout.split("test accuracy ")[1].split()[0]) > 0.5, proc.stdout[-2000:]


def _digest(directory: Path) -> str:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()


@pytest.mark.slow
def test_a_corrupt_image_exits_78_naming_it_and_leaves_commits_alone(files, tmp_path):
    import shutil

    shutil.copytree(files["folder"], tmp_path / "folder")
    run = tmp_path / "run"
    assert _train([f"--dataset=folder:{tmp_path / 'folder'}", "--epochs=1", f"--run_dir={run}"]).returncode == 0
    before = _digest(RunDir(run).checkpoints)
    bad = sorted((tmp_path / "folder" / "train" / "class_4").iterdir())[3]
    bad.write_bytes(b"this is not a PNG")
    proc = _train([f"--dataset=folder:{tmp_path / 'folder'}", "--epochs=2", f"--run_dir={run}"])
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert f"not an image file (corrupt?):] [{bad}]" in proc.stderr
    assert _digest(RunDir(run).checkpoints) == before


def test_mnist_without_a_local_file_falls_back_to_keras_and_says_so(tmp_path, monkeypatch, capsys):
    import keras

    from tf_elastic.elastic.worker import datasets

    tiny = np.zeros((4, 28, 28), np.uint8), np.arange(4)
    monkeypatch.setattr(keras.datasets.mnist, "load_data", lambda: (tiny, tiny))
    loaded = datasets.load("mnist", str(tmp_path))
    assert loaded.x_train.shape == (4, 28, 28, 1)
    assert "falling back to keras.datasets.mnist.load_data()" in capsys.readouterr().out



def test_the_label_cache_key_changes_with_the_parse_functions_code():
    """Cached largest labels belong to one parse function: an edited function (same module and name, other
    code) must not reuse them; a lambda or a local function (no stable name) is not cached at all."""
    def version(body: str):
        namespace = {"data": data, "tf": tf, "__name__": "user_parsers"}
        exec(f"def parse(record):\n    encoded, label = data.default_parse(record)\n    return {body}", namespace)
        return namespace["parse"]

    original, edited = parse_key(version("encoded, label")), parse_key(version("encoded, label - 1"))
    assert original is not None and original.startswith("user_parsers.parse:")
    assert original == parse_key(version("encoded, label")) != edited
    # Edits of names only, and inside a comprehension (a nested code object, hashed by its contents).
    assert parse_key(version("encoded, tf.int32")) != parse_key(version("encoded, tf.int64"))
    assert parse_key(version("[encoded for _ in [0]][0], label")) == parse_key(
        version("[encoded for _ in [0]][0], label")) != parse_key(version("[label for _ in [0]][0], label"))
    assert parse_key(lambda r: r) is None and parse_key(version) is None
    bound = data.TFRecordSource.__init__.__get__(object())  # a bound method: depends on its instance
    assert parse_key(bound) is None


def test_a_list_of_path_label_pairs_trains_as_image_files(tmp_path, digits):
    """fit(model, [(path, label), ...]) reads the listed images (ImageFiles, decoded with 3 channels)."""
    import keras

    from tf_elastic import elastic
    from tf_elastic.testing.data_files import write_folder

    (images, labels), _ = digits
    write_folder(tmp_path / "images", images[:64], labels[:64], [str(c) for c in range(10)])
    pairs = [(str(p), int(p.parent.name)) for p in sorted((tmp_path / "images").glob("*/*.png"))]
    source = data.ImageFiles([p for p, _ in pairs], [label for _, label in pairs], channels=1)
    assert source.num_examples == 64 and source.num_classes == max(labels[:64]) + 1
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = elastic.fit(model, pairs, batch_size=16, epochs=1, run_dir=str(tmp_path / "run"), verbose=0)
    assert len(history.history["loss"]) == 1 and np.isfinite(history.history["loss"][0])
    with pytest.raises(ConfigurationError, match="paths and labels need the same"):
        data.ImageFiles(["a.png"], [0, 1])
