"""How a worker's planned batches reach its replicas, exactly, at every world size.

`strategy.experimental_distribute_dataset`, which `model.fit` applies to any `tf.data.Dataset`, takes a
dataset's batch for the *global* batch and re-splits it into `num_replicas_in_sync` pieces. Fed a worker's
own share under MultiWorkerMirroredStrategy, each worker's replicas would train 1/W of every batch (and
`AutoShardPolicy.OFF` turns off sharding, not that split). `distribute_datasets_from_function` takes each
worker's pipeline as it is: its elements are per-replica batches, dealt to the worker's local replicas in
order, so replica j of a step trains element `step * local + j`: a worker batch split as the plan splits it.
"""
import math
import threading
import time
from typing import Callable, Iterable, List

import tensorflow as tf
from absl import logging


def local_replicas(strategy: tf.distribute.Strategy, world_size: int) -> int:
    """The replicas this worker runs (its devices): every worker of a world runs the same number."""
    return max(1, strategy.num_replicas_in_sync // world_size)


def to_replicas(strategy: tf.distribute.Strategy, world_size: int, worker_batch: int,
                batched: Callable[[int], tf.data.Dataset]) -> tf.distribute.DistributedDataset:
    """`batched(per_replica_batch)` (this worker's whole share, batched per replica) fed to its replicas.

    Its length is hidden (pass `steps_per_epoch` to `model.fit`): where Keras 3 knows it and it equals the
    steps (one replica a worker), `model.fit` opens the next epoch's iterator as its epoch ends, for an epoch
    a call of one epoch never trains. With several workers that is a MultiDeviceIterator, which starts
    reading at once and instantiates the pipeline's functions through grappler on the main thread (seen in
    native stacks at the epochs' ends in `bench_straggler`), then is dropped with the call."""
    local = local_replicas(strategy, world_size)
    if worker_batch % local:
        raise ValueError(f"a worker batch of {worker_batch} does not split over {local} local replicas")
    return strategy.distribute_datasets_from_function(
        lambda context: batched(worker_batch // local).filter(lambda *_: True))


# A read alone that has not ended after this many seconds (its first element included) is too slow to time
# (`math.inf`): the group waits for it at the next collective.
LONGEST_READ_SECONDS = 5.0


def seconds_per_step(elements: Iterable, per_step: int, seconds: float,
                     limit: float = LONGEST_READ_SECONDS) -> float:
    """Seconds per step of reading `elements` (`per_step` of them a step) alone, in its steady state: how fast
    a worker's input could go, which its full prefetch buffer hides while it waits for the group (a feed's
    `time_input`). Read for `seconds` after the first element (which starts the read: files opened, a
    shuffle's buffer filled), and timed over the second half of that time only: what the pipeline's own
    buffers filled while the first element was made comes out at once, and counted would make a slow disk
    look quick (it read 16 records a step in 0.06 s that took 1.5 s). 0 where the read fails or ends before a
    step was read; `math.inf` where it runs past `limit` (too slow to time: it is left to end at its next
    element)."""
    arrivals: List[float] = []
    stop = threading.Event()

    def read() -> None:
        began = None
        for _ in elements:
            now = time.perf_counter()
            began = now if began is None else began
            arrivals.append(now - began)
            if stop.is_set() or (len(arrivals) > per_step and now - began >= seconds):
                return

    reader = threading.Thread(target=_quietly(read), daemon=True, name="tf_elastic-read-alone")
    reader.start()
    reader.join(limit)
    stop.set()
    if reader.is_alive():
        return math.inf
    if len(arrivals) <= per_step:
        return 0.0
    last = len(arrivals) - 1
    half = min(last - 1, next(i for i, t in enumerate(arrivals) if t >= arrivals[last] / 2))
    return (arrivals[last] - arrivals[half]) / (last - half) * per_step


def _quietly(read: Callable[[], None]) -> Callable[[], None]:
    """`read`, its failure logged (a pipeline a second iterator cannot open: a `cache` file in use) and
    swallowed: a read alone that fails times nothing."""
    def run() -> None:
        try:
            read()
        except Exception as error:  # noqa: BLE001 - the user's pipeline may fail in any way
            logging.warning("the input could not be read alone (%s: %s): it is not weighed", type(error).__name__,
                            error)
    return run
