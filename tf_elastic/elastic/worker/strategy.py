"""The tf.distribute strategy for a world, with MWMS's hang detection tied to the agent's heartbeat."""
from typing import Optional

import tensorflow as tf
from tensorflow.python.eager import context

from tf_elastic.choices import COLLECTIVES, STRATEGIES
from tf_elastic.elastic.worker.errors import ConfigurationError
from tf_elastic.elastic.worker.world import World


def make_strategy(world: World, kind: str = "auto", collective: str = "auto",
                  tpu: Optional[str] = None) -> tf.distribute.Strategy:
    """The strategy for this world.

    `auto`: MultiWorkerMirroredStrategy when the world has several workers, MirroredStrategy over
    several local GPUs, else the default strategy. Before MWMS is created, the coordination service's
    heartbeat is set from the agent's heartbeat timeout (MWMS keeps a configuration it finds), so a hung
    peer is detected in seconds, not 10+ s. `collective` picks MWMS's all-reduce (`nccl` for GPUs).
    `tpu` connects to `--tpu` through `TPUClusterResolver` (a fixed-size, single-worker path).
    """
    if kind not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}; got {kind!r}.")
    if collective not in COLLECTIVES:
        raise ValueError(f"--collective must be one of {', '.join(COLLECTIVES)}; got {collective!r}.")
    if world.size > 1 and kind not in ("auto", "mwms"):
        raise ValueError(f"--strategy={kind} is single-worker, but this world has {world.size} workers; use mwms.")
    if world.elastic and kind in ("auto", "mwms") and context.context()._initialized:
        # Under the agent any round may have several workers, and MWMS configures TensorFlow's collectives,
        # which TensorFlow takes only before the process's first op: refused in every round, not only in the
        # first with several workers (where it would fail on every try, with TensorFlow's own words).
        raise ConfigurationError("TensorFlow ran an op before elastic.run made the strategy (a tensor, a dataset or "
                                 "a model built at import or before elastic.run): build them in the function you "
                                 "pass to elastic.run, which TensorFlow's collectives must precede.")
    # Physical devices only: listing logical ones initialises the runtime, after which MWMS can no
    # longer configure its collectives.
    several_gpus = len(tf.config.list_physical_devices("GPU")) > 1
    if kind == "tpu":
        if not tpu:
            raise ValueError("--strategy=tpu needs --tpu (a TPU name or grpc://HOST:PORT).")
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    if kind == "one_device":
        return tf.distribute.OneDeviceStrategy("/gpu:0" if tf.config.list_physical_devices("GPU") else "/cpu:0")
    if kind == "mirrored":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.MirroredStrategy([d.name for d in gpus or tf.config.list_logical_devices("CPU")])
    if kind == "auto" and world.size == 1:
        return tf.distribute.MirroredStrategy() if several_gpus else tf.distribute.get_strategy()
    if world.size > 1:
        CoordinatedJob = context.coordination_config_pb2.CoordinatedJob  # wherever this TF version keeps it
        context.context().configure_coordination_service(
            "standalone", service_leader="/job:worker/replica:0/task:0",
            heartbeat_timeout_in_ms=int(world.heartbeat_timeout * 1000),
            coordinated_jobs=[CoordinatedJob(name="worker", num_tasks=world.size)])
    implementation = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
                      "ring": tf.distribute.experimental.CommunicationImplementation.RING,
                      "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}[collective]
    return tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation))


