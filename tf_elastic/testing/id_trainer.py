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
    parser.add_argument("--pipeline", choices=("arrays", "dataset"), default="arrays",
                        help="dataset: a tf.data pipeline of global batches (dict features, two streams mixed by "
                             "sample_from_datasets, an unseeded shuffle, a filter, sample weights) instead of arrays.")
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
            tf.print(self.optimizer.iterations + 1, data[1], summarize=-1,
                     output_stream=f"file://{record / f'train-round{world.round}-rank{world.rank}.txt'}")
            return super().train_step(data)

        def test_step(self, data):
            tf.print(self.optimizer.iterations, data[1], summarize=-1,
                     output_stream=f"file://{record / f'eval-round{world.round}-rank{world.rank}.txt'}")
            return super().test_step(data)

    ids = np.arange(args.train_examples or args.examples)
    inputs = keras.Input((1,), name="id")
    dataset = args.pipeline == "dataset"
    model = Recording({"id": inputs} if dataset else inputs, keras.layers.Dense(args.examples)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.01), steps_per_execution=args.steps_per_execution,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    slow = [keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs=None: time.sleep(args.step_seconds))]
    validation = np.arange(args.validation_examples)
    x, y, batch_size = ids[:, None].astype(np.float32), ids, args.batch_size
    validation_data = (validation[:, None].astype(np.float32), validation)
    if dataset:
        x, y, batch_size = _pipeline(x, y, args.batch_size), None, None
        validation_data = tf.data.Dataset.from_tensor_slices(({"id": validation_data[0]}, validation))
        validation_data = validation_data.batch(args.batch_size)
    elastic.fit(model, x, y, batch_size=batch_size, epochs=args.epochs,
                verbose=0, callbacks=slow if args.step_seconds else [], validation_data=validation_data,
                config=elastic.FitConfig(commit_every_steps=args.commit_every_steps, durable_every_commits=0))


def _pipeline(x, y, batch: int):
    """Dict features and sample weights from two streams mixed at random (unseeded: the job's seed): the even
    ids reshuffled every epoch, the odd ones less those that are 3 modulo 7 (`in_pipeline`)."""
    import tensorflow as tf

    ids = tf.data.Dataset.from_tensor_slices(({"id": x}, y))
    evens = ids.filter(lambda _, label: label % 2 == 0).shuffle(32)
    odds = ids.filter(lambda _, label: tf.logical_and(label % 2 == 1, label % 7 != 3))
    mixed = tf.data.Dataset.sample_from_datasets([evens, odds], weights=[0.6, 0.4])
    return mixed.map(lambda features, label: (features, label, tf.ones([]))).batch(batch)


def in_pipeline(example_id: int) -> bool:
    """Whether `--pipeline=dataset` trains this id."""
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
