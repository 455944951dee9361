"""Exact data position: which examples each replica trains on, across any number of resizes.

Every epoch visits a seeded permutation of the example indices. Committed progress is the number of
samples of that permutation consumed so far; after a restart at a new world size the rest of the
epoch is split into global batches again, each global batch into per-replica slices by rank. So every
example is used exactly once per epoch, except a final remainder smaller than one global batch.
"""
from typing import Callable, List, Optional

import numpy as np

BATCH_POLICIES = ("per_replica", "global")


def replica_batch_size(policy: str, replicas: int, per_replica: Optional[int], global_batch: Optional[int]) -> int:
    """The per-replica batch for `replicas`; `global` keeps the global batch and must divide evenly."""
    if policy == "per_replica":
        if not per_replica or per_replica <= 0:
            raise ValueError(f"--per_replica_batch_size must be > 0 with --batch_policy=per_replica; "
                             f"got {per_replica}.")
        return per_replica
    if policy == "global":
        if not global_batch or global_batch <= 0:
            raise ValueError(f"--global_batch_size must be > 0 with --batch_policy=global; got {global_batch}.")
        if global_batch % replicas:
            raise ValueError(f"--global_batch_size={global_batch} is not divisible by the {replicas} replicas of "
                             f"this world (--batch_policy=global needs equal per-replica batches). Give the "
                             f"agents --world_size_divides={global_batch} divided by the replicas per worker, so "
                             f"that only worlds that divide the global batch form.")
        return global_batch // replicas
    raise ValueError(f"--batch_policy must be one of {', '.join(BATCH_POLICIES)}; got {policy!r}.")


class DataPlan:
    def __init__(self, num_examples: int, seed: int, order: Optional[Callable[[int], Optional[np.ndarray]]] = None):
        """`order(epoch)`: a source's own seeded order of the epoch (shard by shard for TFRecords), or None."""
        self.num_examples, self.seed, self.order = num_examples, seed, order

    def permutation(self, epoch: int) -> np.ndarray:
        own = self.order(epoch) if self.order else None
        return own if own is not None else np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def replica_batches(self, epoch: int, start: int, world_size: int, rank: int, batch: int) -> List[np.ndarray]:
        """The index batches replica `rank` trains on for the rest of `epoch`, from sample `start` on."""
        remaining = self.permutation(epoch)[start:]
        global_batch = world_size * batch
        return [remaining[k * global_batch + rank * batch: k * global_batch + (rank + 1) * batch]
                for k in range(len(remaining) // global_batch)]

    def remainder(self, start: int, global_batch: int) -> int:
        """Samples of the epoch left unused because they do not fill a global batch."""
        return (self.num_examples - start) % global_batch
