"""Tests `tf_elastic/elastic/worker/data_plan.py`: each example once an epoch, and batch sizes per replica."""
import numpy as np
import pytest

from tf_elastic.elastic.worker.data_plan import DataPlan, replica_batch_size


def test_data_plan_uses_every_example_once_across_resizes():
    plan = DataPlan(1000, seed=3)
    used, start = [], 0
    for world, batch in ((2, 16), (3, 16), (1, 16), (4, 8)):  # resize after a few global steps each
        batches = [plan.replica_batches(0, start, world, rank, batch) for rank in range(world)]
        steps = min(5, len(batches[0]))
        for k in range(steps):
            for rank in range(world):
                used += batches[rank][k].tolist()
        start += steps * world * batch
    tail = [plan.replica_batches(0, start, 2, r, 16) for r in range(2)]
    used += [i for r in range(2) for b in tail[r] for i in b.tolist()]
    assert len(used) == len(set(used)) and 1000 - len(used) == plan.remainder(start, 32) < 32
    assert not np.array_equal(plan.permutation(0), plan.permutation(1))


def test_global_batch_policy_needs_a_divisible_world():
    assert replica_batch_size("global", 4, None, 64) == 16
    with pytest.raises(ValueError, match=r"--global_batch_size=64 is not divisible by the 3 replicas of this world"):
        replica_batch_size("global", 3, None, 64)


def test_a_global_batch_the_world_does_not_divide_names_the_agents_flag():
    with pytest.raises(ValueError, match="--world_size_divides=12 divided by the replicas per worker"):
        replica_batch_size("global", 8, None, 12)
