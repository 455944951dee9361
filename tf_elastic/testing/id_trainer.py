"""A worker whose steps write the example ids they really train and evaluate: what a step consumed, not
what was planned or logged.

Each example's features and label are its id; the model's `train_step` and `test_step` write, from inside
the step on every replica, a line `STEP ID ID ...` (`STEP`: the optimizer step trained, or the step at
which the evaluation ran) to `RECORD_DIR/{train,eval}-round{R}-rank{K}.txt`. `read_records` reads them
back. Run by the agent as a user's own script would be (`elastic.run` + `elastic.fit`):

    python -m tf_elastic.testing.id_trainer --record_dir=DIR --examples=96 --batch_size=16 --epochs=3
"""
import argparse
import os
import time
from pathlib import Path
from typing import Dict, List, Tuple

from tf_elastic.elastic import audit


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record_dir", required=True)
    parser.add_argument("--examples", type=int, default=96)
    parser.add_argument("--train_examples", type=int, default=None, help="Train on the first N (default: all).")
    parser.add_argument("--validation_examples", type=int, default=24)
    parser.add_argument("--batch_size", type=int, default=16, help="The global batch.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--local_replicas", type=int, default=1, help="> 1: MirroredStrategy over logical CPUs.")
    parser.add_argument("--steps_per_execution", type=int, default=1)
    parser.add_argument("--commit_every_steps", type=int, default=4)
    parser.add_argument("--step_seconds", type=float, default=0.0, help="Sleep after each step (a slower job).")
    parser.add_argument("--pipeline", choices=("arrays", "dataset", "pydataset"), default="arrays",
                        help="dataset: a tf.data pipeline of global batches mixing three input shapes (see "
                             "`_pipeline`; its files in --data_dir, `write_pipeline_data`); pydataset: a "
                             "keras.utils.PyDataset reshuffled every epoch; both with dict features, two outputs "
                             "and sample weights.")
    parser.add_argument("--data_dir", default=None, help="Where `write_pipeline_data` wrote --pipeline=dataset's.")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    from tf_elastic import elastic

    world = elastic.current().world
    record = Path(args.record_dir)

    class Recording(keras.Model):
        def train_step(self, data):
            tf.print(self.optimizer.iterations + 1, _ids(data), summarize=-1,
                     output_stream=f"file://{record / f'train-round{world.round}-rank{world.rank}.txt'}")
            return super().train_step(data)

        def test_step(self, data):
            tf.print(self.optimizer.iterations, _ids(data), summarize=-1,
                     output_stream=f"file://{record / f'eval-round{world.round}-rank{world.rank}.txt'}")
            return super().test_step(data)

    ids = np.arange(args.train_examples or args.examples)
    inputs = keras.Input((1,), name="id")
    sparse = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    slow = [keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs=None: time.sleep(args.step_seconds))]
    validation = np.arange(args.validation_examples)
    if args.pipeline == "arrays":
        model = Recording(inputs, keras.layers.Dense(args.examples)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.01), steps_per_execution=args.steps_per_execution,
                      loss=sparse, metrics=["accuracy"])
        data = dict(x=ids[:, None].astype(np.float32), y=ids, batch_size=args.batch_size)
        validation_data = (validation[:, None].astype(np.float32), validation)
    else:
        outputs = {"id": keras.layers.Dense(args.examples, name="id_logits")(inputs),
                   "parity": keras.layers.Dense(2, name="parity_logits")(inputs)}
        model = Recording({"id": inputs}, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.01), steps_per_execution=args.steps_per_execution,
                      loss={"id": sparse, "parity": sparse}, metrics={"id": ["accuracy"]})
        data = dict(x=_pipeline(Path(args.data_dir), args.batch_size) if args.pipeline == "dataset" else
                    _IdBatches([i for i in ids if in_pipeline(i)], args.batch_size))
        validation_data = tf.data.Dataset.from_tensor_slices(_element(validation)[:2]).batch(args.batch_size)
    elastic.fit(model, **data, epochs=args.epochs, verbose=0, callbacks=slow if args.step_seconds else [],
                validation_data=validation_data,
                config=elastic.FitConfig(commit_every_steps=args.commit_every_steps, durable_every_commits=0))


def _ids(data):
    """The ids of a batch: its target, or the target named "id"."""
    return data[1]["id"] if isinstance(data[1], dict) else data[1]


def _element(ids, cast=lambda a, dtype: a.astype(dtype)):
    """The example of each id (NumPy, or TensorFlow with `cast=tf.cast`): the id as a feature, two targets
    (the id and its parity) and their sample weights."""
    one = cast(ids * 0 + 1, "float32")
    return {"id": cast(ids, "float32")[..., None]}, {"id": ids, "parity": ids % 2}, {"id": one, "parity": one / 2}


def _pipeline(data_dir: Path, batch: int):
    """What Keras users build, mixed by sample_from_datasets with weights: TFRecord shards + parse + a shuffle
    buffer (ids 0 modulo 3), `image_dataset_from_directory` over PNGs (unseeded: the job's seed; ids 1
    modulo 3) and `tfds.load` of a TFDS dataset (ids 2 modulo 3), each less the ids `in_pipeline` drops
    (a filter); then the element of each id, batched, a short last batch."""
    import keras
    import tensorflow as tf
    import tensorflow_datasets as tfds

    def pixel_id(image):
        return tf.cast(image[0, 0, 0], tf.int64) * 256 + tf.cast(image[0, 0, 1], tf.int64)

    feature = {"id": tf.io.FixedLenFeature([], tf.int64)}
    records = tf.data.TFRecordDataset(sorted(str(p) for p in (data_dir / "records").glob("*.tfrecord")))
    records = records.map(lambda record: tf.io.parse_single_example(record, feature)["id"]).shuffle(16)
    images = keras.utils.image_dataset_from_directory(str(data_dir / "images"), labels=None, image_size=(1, 1),
                                                      batch_size=None, interpolation="nearest", verbose=False)
    loaded = tfds.load("ids", split="train", data_dir=str(data_dir / "tfds"))
    streams = [stream.filter(lambda i: tf.logical_or(i % 2 == 0, i % 7 != 3)) for stream in
               (records, images.map(pixel_id), loaded.map(lambda example: pixel_id(example["image"])))]
    mixed = tf.data.Dataset.sample_from_datasets(streams, weights=[0.4, 0.3, 0.3])
    return mixed.map(lambda i: _element(i, tf.cast)).batch(batch)


def write_pipeline_data(data_dir: Path, examples: int) -> None:
    """`_pipeline`'s files for ids 0 to `examples` - 1: TFRecord shards, PNGs whose pixel spells the id, and a
    TFDS dataset "ids" of such images (in the TFRecord format `tfds.load` reads)."""
    import numpy as np
    import tensorflow as tf

    from tf_elastic.testing import data_files

    ids = np.arange(examples)
    pixels = np.stack([ids // 256, ids % 256, ids * 0], -1).astype(np.uint8)[:, None, None, :]
    (data_dir / "records").mkdir(parents=True)
    for shard in range(2):
        with tf.io.TFRecordWriter(str(data_dir / "records" / f"ids-{shard}.tfrecord")) as writer:
            for i in ids[(ids % 3 == 0) & (ids % 2 == shard)]:
                feature = tf.train.Feature(int64_list=tf.train.Int64List(value=[int(i)]))
                writer.write(tf.train.Example(features=tf.train.Features(feature={"id": feature})).SerializeToString())
    (data_dir / "images").mkdir()
    for i in ids[ids % 3 == 1]:
        (data_dir / "images" / f"{i}.png").write_bytes(data_files.png(pixels[i]))
    tfds_ids = ids[ids % 3 == 2]
    data_files.write_tfds(data_dir / "tfds", "ids", (pixels[tfds_ids], tfds_ids % 10), (pixels[:1], ids[:1] % 10),
                          file_format="tfrecord")


class _IdBatches:
    """Made a `keras.utils.PyDataset` on first use (Keras is imported late): batches of `ids`' elements,
    reshuffled at each epoch's end from a generator seeded by the epoch."""

    def __new__(cls, ids, batch: int):
        import keras
        import numpy as np

        class IdBatches(keras.utils.PyDataset):
            def __init__(self):
                super().__init__()
                self.order, self.epoch = np.asarray(ids), 0

            @property
            def num_batches(self):
                return -(-len(self.order) // batch)

            def __getitem__(self, index):
                return _element(self.order[index * batch:(index + 1) * batch])

            def on_epoch_end(self):
                self.epoch += 1
                self.order = np.random.default_rng(self.epoch).permutation(self.order)

        return IdBatches()


def in_pipeline(example_id: int) -> bool:
    """Whether `--pipeline=dataset` or `pydataset` trains this id."""
    return example_id % 2 == 0 or example_id % 7 != 3


def read_records(record_dir: Path, kind: str) -> List[Tuple[int, int, int, List[int]]]:
    """(round, rank, step, ids) of every replica's `kind` ("train" or "eval") step, in file order."""
    rows = []
    for path in sorted(Path(record_dir).glob(f"{kind}-round*-rank*.txt")):
        round_, rank = (int(n) for n in path.stem[len(kind) + len("-round"):].split("-rank"))
        rows += [(round_, rank, step, ids) for step, ids in audit.step_lines(path)]
    return rows


def by_step(rows: List[Tuple[int, int, int, List[int]]]) -> Dict[Tuple[int, int], List[int]]:
    """(round, step) -> every id its replicas consumed, over all ranks."""
    steps: Dict[Tuple[int, int], List[int]] = {}
    for round_, _, step, ids in rows:
        steps.setdefault((round_, step), []).extend(ids)
    return steps


def _prepare(args: argparse.Namespace) -> None:
    """Before any TensorFlow work: the logical CPUs that stand in for a worker's local devices."""
    Path(args.record_dir).mkdir(parents=True, exist_ok=True)
    if args.local_replicas > 1:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] *
                                                   args.local_replicas)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    ARGS = parse_args()
    _prepare(ARGS)
    from tf_elastic import elastic

    elastic.run(lambda: main(ARGS), strategy="mirrored" if ARGS.local_replicas > 1 else "auto")
