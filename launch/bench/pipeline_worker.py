"""One worker of `bench_input`'s tf.data comparison: a TFRecord + parse + shuffle + batch pipeline trained for
two epochs under `elastic.fit` (every worker reads it whole; commits at the epochs' ends, and every
`--commit_every_steps`), or under plain MultiWorkerMirroredStrategy `model.fit` with `AutoShardPolicy.DATA` or
`FILE`; or the same records as a `data.TFRecordSource` under `elastic.fit` (each worker reads only its share,
by index); or (`--mode=transfer`) the pipeline's committed position handed from the chief to every worker, as
a joiner receives it; the world comes from `TF_CONFIG`. The chief prints `steps_per_second S
first_step_seconds F` for the second epoch (the first traces and fills buffers): S from its first step's end
on, F its first step.

    TF_CONFIG=... python -m launch.bench.pipeline_worker --mode=elastic --records='DIR/train-*'
"""
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

# bench_input's flags are this worker's too: --batch_size, --image_size, --commit_every_steps.
from launch.bench.bench_input import user_pipeline  # noqa: E402

flags.DEFINE_enum("mode", "elastic", ["elastic", "source", "data", "file", "transfer"], "elastic.fit of the "
                  "pipeline, elastic.fit of a TFRecordSource, plain model.fit sharded by DATA or by FILE, or "
                  "the transfer of the pipeline's committed position from the chief to every worker.")
flags.DEFINE_string("records", None, "The TFRecord shards (a glob).", required=True)
flags.DEFINE_integer("shuffle", 1000, "Shuffle buffer (examples).", lower_bound=1)
flags.DEFINE_string("run_dir", None, "elastic: where commits go.")
FLAGS = flags.FLAGS


def _pipeline(auto_shard: str = ""):
    return user_pipeline(FLAGS.records, FLAGS.batch_size, FLAGS.shuffle, FLAGS.image_size, auto_shard)


def _labels_from_zero(record):
    """The records' labels start at 1 (`bench_input.write_tfrecords`), as the pipeline's parse takes them."""
    from tf_elastic.elastic.worker import data

    encoded, label = data.default_parse(record)
    return encoded, label - 1


_labels_from_zero.batched = True  # as default_parse: a run of records parsed in one op


def model():
    import keras

    net = keras.Sequential([keras.Input((FLAGS.image_size, FLAGS.image_size, 3)),
                            keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
                            keras.layers.Dense(10)])
    net.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return net


def transfer() -> None:
    """The chief's pipeline state (`DatasetFeed.state`, its shuffle buffer full) handed to every worker as a
    joiner receives it (`GroupState.hand_on`: one all-reduce of its bytes); the chief prints the median of 3
    `transfer_seconds S bytes B` (the first, which traces, left out), and every worker `received SHA256`."""
    import hashlib
    import json

    import tensorflow as tf

    from tf_elastic.elastic.worker.data.dataset_feed import DatasetFeed
    from tf_elastic.elastic.worker.group import GroupState, sum_over_workers
    from tf_elastic.elastic.worker.world import World

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    config = json.loads(os.environ["TF_CONFIG"])
    world = World(rank=config["task"]["index"], size=len(config["cluster"]["worker"]), cluster=config["cluster"])
    feed = DatasetFeed(_pipeline())
    feed.start(b"", 0)
    feed.first_rows()  # the shuffle buffer filled
    state = feed.state() if world.is_chief else b""  # the chief's is sent
    group = GroupState(strategy, world, [], [], sum_over_workers(strategy, world))
    seconds = []
    for _ in range(4):
        began = time.perf_counter()
        received = group.hand_on(state, 0)
        seconds.append(time.perf_counter() - began)
    print(f"received {hashlib.sha256(received).hexdigest()}", flush=True)
    if world.is_chief:
        print(f"transfer_seconds {sorted(seconds[1:])[1]:.4f} bytes {len(state)}", flush=True)


def main(argv):
    del argv
    import json

    if FLAGS.mode == "transfer":
        transfer()
        return

    import keras

    # The second epoch's steps from its first step's end to its last step's end: what an epoch of thousands of
    # steps runs at. Its first step (a new iterator, its shuffle buffer filled; elastic.fit's last epoch-end
    # commit still writing) is printed apart: at ~90 steps an epoch it was a fifth of the epoch, and plain
    # DATA's took 0.17 s in some runs and 1.3 s in others (what made its rate bimodal here).
    epoch_began, step_ends = [], []

    def begin(epoch, logs=None):
        epoch_began.append(time.perf_counter())
        step_ends.clear()

    timing = keras.callbacks.LambdaCallback(on_epoch_begin=begin, on_train_batch_end=lambda batch, logs=None:
                                            step_ends.append(time.perf_counter()))
    chief = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0

    def report():
        if chief:
            steady = (len(step_ends) - 1) / (step_ends[-1] - step_ends[0])
            print(f"steps_per_second {steady:.3f} first_step_seconds {step_ends[0] - epoch_began[-1]:.4f}",
                  flush=True)

    if FLAGS.mode in ("elastic", "source"):
        from tf_elastic import elastic
        from tf_elastic.elastic.worker import data

        def train():
            given = dict(x=data.TFRecordSource(FLAGS.records, parse=_labels_from_zero), batch_size=FLAGS.batch_size) \
                if FLAGS.mode == "source" else dict(x=_pipeline())
            elastic.fit(model(), **given, epochs=2, verbose=0, callbacks=[timing],
                        config=elastic.FitConfig(commit_every_steps=FLAGS.commit_every_steps,
                                                 durable_every_commits=0))
            report()

        elastic.run(train, run_dir=FLAGS.run_dir)
    else:
        import tensorflow as tf

        from tf_elastic.elastic.worker import keras_compat

        keras_compat.install_fit_fix()  # Keras 3.15's model.fit fails under MWMS without it (keras#20585)
        with tf.distribute.MultiWorkerMirroredStrategy().scope():
            model().fit(_pipeline(FLAGS.mode.upper()), epochs=2, verbose=0, callbacks=[timing])
        report()


if __name__ == "__main__":
    app.run(main)
