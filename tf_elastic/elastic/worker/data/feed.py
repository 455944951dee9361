"""How a worker's planned batches reach its replicas, exactly, at every world size.

`strategy.experimental_distribute_dataset`, which `model.fit` applies to any `tf.data.Dataset`, takes a
dataset's batch for the *global* batch and re-splits it into `num_replicas_in_sync` pieces. Fed a worker's
own share under MultiWorkerMirroredStrategy, each worker's replicas would train 1/W of every batch (and
`AutoShardPolicy.OFF` turns off sharding, not that split). `distribute_datasets_from_function` takes each
worker's pipeline as it is: its elements are per-replica batches, dealt to the worker's local replicas in
order, so replica j of a step trains element `step * local + j`: a worker batch split as the plan splits it.
"""
from typing import Callable

import tensorflow as tf


def local_replicas(strategy: tf.distribute.Strategy, world_size: int) -> int:
    """The replicas this worker runs (its devices): every worker of a world runs the same number."""
    return max(1, strategy.num_replicas_in_sync // world_size)


def to_replicas(strategy: tf.distribute.Strategy, world_size: int, worker_batch: int,
                batched: Callable[[int], tf.data.Dataset]) -> tf.distribute.DistributedDataset:
    """`batched(per_replica_batch)` (this worker's whole share, batched per replica) fed to its replicas.

    Its cardinality counts per-replica batches, not steps: pass `steps_per_epoch` to `model.fit`."""
    local = local_replicas(strategy, world_size)
    if worker_batch % local:
        raise ValueError(f"a worker batch of {worker_batch} does not split over {local} local replicas")
    return strategy.distribute_datasets_from_function(lambda context: batched(worker_batch // local))
