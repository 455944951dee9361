"""Trains a model, elastically when an agent started us, as a single process otherwise.

    python -m launch.train --dataset=digits --epochs=3                       # one process
    python -m launch.elastic_run --nproc=1 -- python -m launch.train ...      # under the elastic agent
"""
import os
import sys
from typing import List

from absl import app, flags

from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.world import World, start_heartbeat

flags.DEFINE_string("model", "mnist_cnn", "Model name from the models registry.")
flags.DEFINE_enum("dataset", "digits", ["digits", "mnist"], "digits ships with scikit-learn; mnist reads --data_dir.")
flags.DEFINE_string("data_dir", None, "Directory holding mnist.npz (default: ../shared/data beside the repo).")
flags.DEFINE_integer("train_examples", 0, "Use only this many training examples (0: all).", lower_bound=0)
flags.DEFINE_integer("epochs", 3, "Epochs to train.", lower_bound=1)
flags.DEFINE_enum("batch_policy", "per_replica", ["per_replica", "global"],
                  "per_replica: the global batch follows the world size; global: constant global batch.")
flags.DEFINE_integer("per_replica_batch_size", 32, "Batch per worker (batch_policy=per_replica).", lower_bound=1)
flags.DEFINE_integer("global_batch_size", None, "Global batch (batch_policy=global).", lower_bound=1)
flags.DEFINE_integer("reference_batch_size", 32, "Global batch that --learning_rate is meant for.", lower_bound=1)
flags.DEFINE_enum("optimizer", "lars", ["lars", "sgd"], "Optimizer.")
flags.DEFINE_float("learning_rate", None, "Learning rate at the reference batch (default: lars 0.1, sgd 0.05).",
                   lower_bound=0.0)
flags.DEFINE_float("trust_coefficient", 0.05, "LARS trust coefficient (eta).", lower_bound=0.0)
flags.DEFINE_float("momentum", 0.9, "Momentum.", lower_bound=0.0, upper_bound=0.999)
flags.DEFINE_enum("transition", "linear", ["linear", "momentum", "none"], "LR transition after a batch resize.")
flags.DEFINE_string("run_dir", None, "Where checkpoints and events go (default: the agent's, else runs/train).")
flags.DEFINE_integer("commit_every_steps", 50, "Commit state every N steps (0: only at epoch ends).", lower_bound=0)
flags.DEFINE_float("commit_every_seconds", None, "Also commit when this many seconds passed.", lower_bound=0.1)
flags.DEFINE_integer("seed", 0, "Seed for weights and the data order.")
flags.DEFINE_integer("threads", 0, "TF intra/inter-op threads per worker (0: TensorFlow's default).", lower_bound=0)
FLAGS = flags.FLAGS


def main(argv: List[str]) -> int:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import models
    from launch import data as datasets
    from tf_elastic import LARS, BatchResizeSchedule
    from tf_elastic import elastic

    if FLAGS.threads:
        tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
        tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    data = datasets.load(FLAGS.dataset, FLAGS.data_dir or datasets.DEFAULT_DATA_DIR)
    x, y = data.x_train, data.y_train
    if FLAGS.train_examples:
        x, y = x[: FLAGS.train_examples], y[: FLAGS.train_examples]
    # Everything above is independent of the world: a warm-started worker has done it before its round.
    world = World.from_env()
    start_heartbeat(world)
    run_dir = FLAGS.run_dir or world.run_dir or "runs/train"
    strategy = elastic.make_strategy(world)
    keras.utils.set_random_seed(FLAGS.seed)
    global_batch = (FLAGS.per_replica_batch_size * world.size if FLAGS.batch_policy == "per_replica"
                    else FLAGS.global_batch_size)
    learning_rate = FLAGS.learning_rate if FLAGS.learning_rate is not None else {"lars": 0.1, "sgd": 0.05}[FLAGS.optimizer]
    with strategy.scope():
        model = models.get(FLAGS.model, x.shape[1:], data.num_classes)
        schedule = BatchResizeSchedule(learning_rate, FLAGS.reference_batch_size, batch_size=global_batch or 1,
                                       transition=FLAGS.transition, momentum=FLAGS.momentum)
        optimizer = (LARS(schedule, momentum=FLAGS.momentum, weight_decay=5e-4,
                                                         trust_coefficient=FLAGS.trust_coefficient) if FLAGS.optimizer == "lars"
                     else keras.optimizers.SGD(schedule, momentum=FLAGS.momentum))
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        optimizer.build(model.trainable_variables)  # eagerly, before tracing (keras#23085)
    code = elastic.fit(model, x, y, world=world, strategy=strategy, epochs=FLAGS.epochs, run_dir=run_dir,
                       per_replica_batch_size=FLAGS.per_replica_batch_size, global_batch_size=FLAGS.global_batch_size,
                       batch_policy=FLAGS.batch_policy, schedule=schedule, commit_every_steps=FLAGS.commit_every_steps,
                       commit_every_seconds=FLAGS.commit_every_seconds, seed=FLAGS.seed,
                       verbose=2 if world.elastic else "auto")
    if code == elastic.EXIT_DONE:  # every worker evaluates: under MWMS evaluation runs collectives
        _, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=256, verbose=0)
        if world.is_chief:
            EventLog(run_dir, "worker:0").write("evaluation", test_accuracy=float(accuracy),
                                                step=int(model.optimizer.iterations.numpy()))
            print(f"test accuracy {accuracy:.4f} after {int(model.optimizer.iterations.numpy())} steps", flush=True)
    return code


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
