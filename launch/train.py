"""Trains a model, elastically when an agent started us, as a single process otherwise.

    python -m launch.train --dataset=digits --epochs=3                       # one process
    python -m launch.elastic_run --nproc=1 -- python -m launch.train ...      # under the elastic agent
    python -m launch.train --flagfile=my_run.flags                           # flags from a file
    python -m launch.train --helpfull                                        # every flag, absl's too
"""
import os
import sys
from typing import List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

# Only what TensorFlow does not need: `--help` answers before TF's import (seconds); train() imports the rest.
from tf_elastic import choices  # noqa: E402
from tf_elastic.elastic.events import EventLog  # noqa: E402
from tf_elastic.elastic.flag_checks import require_finite_floats, run_program  # noqa: E402
from tf_elastic.elastic.protocol import Event, ExitCode, RunDir  # noqa: E402
from tf_elastic.elastic.worker import data_plan, datasets, errors  # noqa: E402
from tf_elastic.elastic.worker.world import World  # noqa: E402

# Model and data.
flags.DEFINE_enum("model", "mnist_cnn", choices.MODELS, "Model of the registry (tf_elastic.models).")
flags.DEFINE_string("dataset", "digits", "digits (ships with scikit-learn), mnist (--data_dir, else Keras's download), "
                    "synthetic, folder:PATH (PATH/train/<class>/*, PATH/validation/<class>/*), tfrecord:DIR "
                    "(DIR/train-*, DIR/validation-*), or tfds:NAME (prepared as ArrayRecord in --data_dir).")
flags.DEFINE_string("data_dir", None, "Directory holding mnist.npz or TFDS data (default: Keras's cache, "
                    "~/.keras/datasets).")
# Host-local, outside the run dir: a warm-started worker makes its sources before the agent tells it the run dir.
flags.DEFINE_string("index_cache_dir", os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                 "tf_elastic", "tfrecord_index"),
                    "Host-local cache of TFRecord shard indexes, keyed by path, size and mtime: a restarted worker "
                    "skips the pass over unchanged shards (empty: no cache).")
flags.DEFINE_integer("image_size", 0, "Resize images to this square size (0: keep; imagenet preprocessing: 224).",
                     lower_bound=0)
flags.DEFINE_enum("preprocess", "simple", choices.PREPROCESSING,
                  "simple: resize and scale to [0, 1]; imagenet: random-resized crop + flip for training, resize + "
                  "center crop for evaluation.")
flags.DEFINE_integer("train_examples", 0, "Use only this many training examples (0: all).", lower_bound=0)
flags.DEFINE_integer("epochs", 3, "Epochs to train.", lower_bound=1)
# Batch and optimisation.
flags.DEFINE_enum("batch_policy", "per_replica", data_plan.BATCH_POLICIES,
                  "per_replica: the global batch follows the world size; global: constant global batch.")
flags.DEFINE_integer("per_replica_batch_size", 32, "Batch per replica (batch_policy=per_replica).", lower_bound=1)
flags.DEFINE_integer("global_batch_size", None, "Global batch (batch_policy=global).", lower_bound=1)
flags.DEFINE_integer("reference_batch_size", 32, "Global batch that --learning_rate is meant for.", lower_bound=1)
flags.DEFINE_enum("optimizer", "lars", ["lars", "sgd", "adam", "lamb"], "Optimizer (adam and lamb from Keras).")
flags.DEFINE_float("learning_rate", None, "Peak learning rate at the reference batch (default: lars 0.1, sgd 0.05, "
                   "adam/lamb 0.001).", lower_bound=0.0)
flags.DEFINE_float("momentum", 0.9, "Momentum (lars, sgd).", lower_bound=0.0, upper_bound=0.999)
flags.DEFINE_float("trust_coefficient", 0.05, "LARS trust coefficient (eta).", lower_bound=0.0)
flags.DEFINE_float("ema_momentum", 0.0, "Keep an exponential moving average of the weights with this momentum "
                   "(Keras's use_ema; the model ends with the averages); 0: none.", lower_bound=0.0, upper_bound=0.9999)
flags.DEFINE_float("weight_decay", 5e-4, "Weight decay (LARS: inside the trust ratio).", lower_bound=0.0)
flags.DEFINE_enum("base_schedule", "constant", ["constant", "warmup_cosine", "warmup_poly"],
                  "Base schedule in reference-batch steps (warmup_poly: LARS/MLPerf).")
flags.DEFINE_float("warmup_epochs", 1.0, "Warm-up of warmup_* schedules, in epochs.", lower_bound=0.0)
flags.DEFINE_enum("scaling", "linear", choices.SCALINGS, "LR scale for the global batch (BatchResizeSchedule).")
flags.DEFINE_enum("transition", "linear", choices.TRANSITIONS, "LR transition after a batch resize.")
flags.DEFINE_integer("transition_steps", None, "Fixed ramp length for transition=linear (default: 8 per factor).",
                     lower_bound=0)
# Distribution.
flags.DEFINE_enum("strategy", "auto", choices.STRATEGIES,
                  "auto: MWMS under the agent, MirroredStrategy over several local GPUs, else one device.")
flags.DEFINE_enum("cluster_resolver", "tf_config", choices.RESOLVERS,
                  "Without the agent: where the fixed-size world comes from (TF_CONFIG, TF's SlurmClusterResolver "
                  "or KubernetesClusterResolver). Under the agent: tf_config.")
flags.DEFINE_integer("port_base", 8888, "slurm: first TF server port on each node; kubernetes: the pods' TF port.",
                     lower_bound=1024, upper_bound=65535)
flags.DEFINE_string("k8s_selector", None, "kubernetes: label selector of the job's worker pods (job-name=my-job).")
flags.DEFINE_string("tpu", None, "TPU name or grpc://HOST:PORT for --strategy=tpu (TPUClusterResolver).")
flags.DEFINE_enum("collective", "auto", choices.COLLECTIVES, "MWMS all-reduce (nccl: GPUs only).")
flags.DEFINE_string("dtype_policy", "float32", "Keras dtype policy: float32, mixed_float16, mixed_bfloat16.")
flags.DEFINE_integer("cpu_devices", 1, "Split the CPU into this many logical devices (mirrored on a CPU machine).",
                     lower_bound=1)
flags.DEFINE_integer("threads", 0, "TF intra/inter-op threads per worker (0: TensorFlow's default).", lower_bound=0)
# State.
flags.DEFINE_string("run_dir", None,
                    "Where checkpoints, events and TensorBoard go (default: the agent's, else runs/train).")
flags.DEFINE_integer("commit_every_steps", 100, "Commit state every N steps (0: only at epoch ends).", lower_bound=0)
flags.DEFINE_float("commit_every_seconds", None, "Also commit when this many seconds passed.", lower_bound=0.1)
flags.DEFINE_string("checkpoint_dir", None, "Durable copies of commits: a local or NFS path, gs://, "
                    "s3://BUCKET/PREFIX (boto3: pip install tf_elastic[s3]; AWS_ENDPOINT_URL for S3-compatible "
                    "stores), ram://; default RUN_DIR/durable.")
flags.DEFINE_integer("durable_every_commits", 10, "The chief copies every N-th commit (and the last) to "
                     "--checkpoint_dir (0: no durable copies).", lower_bound=0)
flags.DEFINE_integer("seed", 0, "Seed for weights and the data order.")
FLAGS = flags.FLAGS
require_finite_floats(__name__)

flags.register_validator("dtype_policy", lambda v: v in ("float32", "mixed_float16", "mixed_bfloat16", "bfloat16",
                                                          "float16"),
                         "--dtype_policy must be float32, mixed_float16, mixed_bfloat16, bfloat16 or float16")
flags.register_validator("dataset", datasets.valid_name,
                         f"--dataset must be one of {', '.join(datasets.DATASETS)}")
flags.register_multi_flags_validator(
    ["strategy", "tpu"], lambda f: f["strategy"] != "tpu" or bool(f["tpu"]), "--strategy=tpu needs --tpu")
flags.register_multi_flags_validator(
    ["batch_policy", "global_batch_size"], lambda f: f["batch_policy"] != "global" or bool(f["global_batch_size"]),
    "--batch_policy=global needs --global_batch_size")


def build_optimizer(schedule, keras):
    from tf_elastic import LARS

    ema = dict(use_ema=True, ema_momentum=FLAGS.ema_momentum) if FLAGS.ema_momentum else {}
    if FLAGS.optimizer == "lars":
        return LARS(schedule, momentum=FLAGS.momentum, weight_decay=FLAGS.weight_decay,
                    trust_coefficient=FLAGS.trust_coefficient, **ema)
    if FLAGS.optimizer == "sgd":
        return keras.optimizers.SGD(schedule, momentum=FLAGS.momentum, weight_decay=FLAGS.weight_decay or None, **ema)
    if FLAGS.optimizer == "adam":
        return keras.optimizers.Adam(schedule, **ema)
    return keras.optimizers.Lamb(schedule, **ema)


def base_schedule(peak: float, steps_per_epoch: int, keras):
    from tf_elastic import WarmupPolynomialDecay

    total = max(1, FLAGS.epochs * steps_per_epoch)
    warmup = int(FLAGS.warmup_epochs * steps_per_epoch)
    if FLAGS.base_schedule == "constant":
        return peak
    if FLAGS.base_schedule == "warmup_poly":
        return WarmupPolynomialDecay(peak, warmup, max(1, total - warmup))
    return keras.optimizers.schedules.CosineDecay(0.0, max(1, total - warmup), warmup_target=peak, warmup_steps=warmup)


class SummaryCallback:
    """TensorBoard scalars at each epoch end, written by the chief: loss, accuracy, LR, batch, world, restarts."""

    def __new__(cls, run_dir: str, world: World, global_batch: int, keras, tf):
        class _Summaries(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.writer = tf.summary.create_file_writer(str(RunDir(run_dir).tensorboard))

            def on_epoch_end(self, epoch, logs=None):
                step = int(self.model.optimizer.iterations.numpy())
                scalars = {k: float(v) for k, v in (logs or {}).items()}
                scalars.update(learning_rate=float(self.model.optimizer.learning_rate), global_batch=global_batch,
                               world_size=world.size, restarts=world.restarts)
                with self.writer.as_default():
                    for name, value in scalars.items():
                        tf.summary.scalar(name, value, step=step)
                self.writer.flush()

        return _Summaries()


def prepare():
    """What does not depend on the world (a warm-started worker does it before its round): TF's threads and
    devices, the dtype policy, the data sources. Nothing here may touch TF's runtime (a tensor, a dataset)."""
    import keras
    import tensorflow as tf

    from tf_elastic.elastic.worker import data

    if FLAGS.threads:
        tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
        tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    if FLAGS.cpu_devices > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * FLAGS.cpu_devices)
    keras.mixed_precision.set_global_policy(FLAGS.dtype_policy)
    train, test = datasets.sources(FLAGS.dataset, FLAGS.data_dir or datasets.DEFAULT_DATA_DIR,
                                   cache_dir=FLAGS.index_cache_dir or None)
    if FLAGS.train_examples:
        train = data.Head(train, FLAGS.train_examples)
    return train, test


SHAPE_SAMPLE = 64  # examples read to learn the input shape where the pipeline does not know it


def input_shape_of(source, preprocess, dataset: str) -> tuple:
    """One example's shape after preprocessing: the pipeline's static shape where it knows it; otherwise
    (images decoded from files have no static size) that of the first `SHAPE_SAMPLE` examples, which must
    agree. Images that differ later fail at batching, where TensorFlow names the shapes."""
    import numpy as np
    import tensorflow as tf

    from tf_elastic.elastic.worker import data

    count = min(SHAPE_SAMPLE, source.num_examples)
    batches = data.pipeline(source, np.arange(count), count, preprocess=preprocess)
    shape = batches.element_spec[0].shape[1:]
    if shape.is_fully_defined():
        return tuple(shape)
    try:
        features, _ = next(iter(batches))
    except tf.errors.InvalidArgumentError:
        raise ValueError(f"--dataset={dataset}: the first {count} images are not all the same size: set "
                         "--image_size to resize them") from None
    return tuple(features.shape[1:])


def train(sources) -> None:
    """Builds, trains and evaluates inside `elastic.run` (the world and strategy are its)."""
    import keras
    import tensorflow as tf

    from tf_elastic import BatchResizeSchedule, elastic, models
    from tf_elastic.elastic.worker import data
    from tf_elastic.elastic.worker.data import preprocess as preprocessing

    train_source, test = sources
    context = elastic.current()
    world, strategy, run_dir = context.world, context.strategy, FLAGS.run_dir or context.run_dir
    train_preprocess = preprocessing.get(FLAGS.preprocess, FLAGS.image_size, training=True)
    input_shape = input_shape_of(train_source, train_preprocess, FLAGS.dataset)
    keras.utils.set_random_seed(FLAGS.seed)
    batches = dict(batch_size=FLAGS.global_batch_size) if FLAGS.batch_policy == "global" else dict(
        per_replica_batch_size=FLAGS.per_replica_batch_size)
    # (in this trainer's flags: fit's own refusal speaks of its arguments)
    data_plan.replica_batch_size(FLAGS.batch_policy, strategy.num_replicas_in_sync,
                                 FLAGS.per_replica_batch_size, FLAGS.global_batch_size)
    global_batch = elastic.global_batch_size(strategy.num_replicas_in_sync, **batches)
    peak = FLAGS.learning_rate if FLAGS.learning_rate is not None else {
        "lars": 0.1, "sgd": 0.05, "adam": 0.001, "lamb": 0.001}[FLAGS.optimizer]
    model = models.get(FLAGS.model, tuple(input_shape), train_source.num_classes)
    schedule = BatchResizeSchedule(
        base_schedule(peak, train_source.num_examples // FLAGS.reference_batch_size, keras),
        FLAGS.reference_batch_size, batch_size=global_batch, scaling=FLAGS.scaling, transition=FLAGS.transition,
        transition_steps=FLAGS.transition_steps, momentum=FLAGS.momentum)
    model.compile(optimizer=build_optimizer(schedule, keras),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    config = elastic.FitConfig(
        commit_every_steps=FLAGS.commit_every_steps, commit_every_seconds=FLAGS.commit_every_seconds, seed=FLAGS.seed,
        checkpoint_dir=FLAGS.checkpoint_dir, durable_every_commits=FLAGS.durable_every_commits)
    callbacks = [SummaryCallback(run_dir, world, global_batch, keras, tf)] if world.is_chief else []
    elastic.fit(model, train_source, epochs=FLAGS.epochs, **batches, config=config, run_dir=run_dir,
                preprocess=train_preprocess, callbacks=callbacks,
                verbose="auto" if sys.stdout.isatty() and not world.elastic else 2)
    # The workers share the test split (each example once) and sum the metrics: every one reports the whole split's.
    evaluation = data.evaluation(test, 256, preprocessing.get(FLAGS.preprocess, FLAGS.image_size, training=False))
    try:
        _, accuracy = model.evaluate(evaluation, verbose=0, callbacks=[elastic.ProgressCallback()])
    except tf.errors.InvalidArgumentError as error:
        raise errors.ConfigurationError(f"bad evaluation input: {data.describe_error(error)}") from None
    if world.is_chief:
        steps = int(model.optimizer.iterations.numpy())
        EventLog(run_dir, "worker:0").write(Event.EVALUATION, test_accuracy=float(accuracy), step=steps)
        print(f"test accuracy {accuracy:.4f} after {steps} steps", flush=True)


def main(argv: List[str]) -> None:
    """Runs the trainer as one worker of the job (`elastic.run`: world, heartbeat, strategy, exit code)."""
    del argv
    from tf_elastic import elastic

    elastic.run(train, prepare=prepare, strategy=FLAGS.strategy, collective=FLAGS.collective,
                cluster_resolver=FLAGS.cluster_resolver, port_base=FLAGS.port_base, k8s_selector=FLAGS.k8s_selector,
                tpu=FLAGS.tpu, run_dir=FLAGS.run_dir or "runs/train")


SYNOPSIS = """usage: tf-elastic-train [FLAGS]   (or: python -m launch.train [FLAGS])

Trains a model of the registry on a dataset, elastically when an agent started it, else as one process.

examples:
  tf-elastic-train --dataset=digits --epochs=3
  tf-elastic-run --min_workers=1 --max_workers=4 --rdzv=etcd://10.0.0.5:2379 --job_id=j1 -- \\
      tf-elastic-train --model=resnet20 --dataset=tfrecord:/data/cifar --optimizer=lars --epochs=90
"""


def run() -> None:
    """The console script's entry point (`tf-elastic-train`): `--help` answers without TensorFlow, exits 0."""
    run_program(main, "tf-elastic-train", SYNOPSIS, __name__, usage_exit=ExitCode.CONFIG_ERROR)


if __name__ == "__main__":
    run()
