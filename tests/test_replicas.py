"""Replicas hold the same bits of every variable: statistics averaged before each commit, every variable checked."""
import pytest

from tf_elastic.elastic.protocol import Event
from tf_elastic.testing.local_job import LocalJob, assert_replicas_identical, lose_the_chief_then_join

# The registry's ResNet-20 (plain BatchNorm) with LARS, its EMA, and mixed_float16 (a LossScaleOptimizer).
TRAIN = ["--dataset=digits", "--model=resnet20", "--optimizer=lars", "--dtype_policy=mixed_float16",
         "--ema_momentum=0.9", "--train_examples=512", "--per_replica_batch_size=16", "--threads=1",
         "--commit_every_steps=8", "--epochs=22"]
AGENT = ["--min_workers=1", "--max_workers=2", "--heartbeat_timeout=5", "--last_call=1"]


@pytest.mark.slow
def test_batchnorm_lars_ema_and_loss_scale_stay_identical_through_a_kill_and_an_empty_disk_join(tmp_path):
    """Every commit of the job passed the per-variable check across workers (a difference ends the job with
    exit 78), every round of two started from the same bits, and the last one ended with them."""
    (tmp_path / "job").mkdir()
    job = LocalJob(tmp_path / "job", TRAIN, AGENT, host_run_dirs=True)
    try:
        seen = lose_the_chief_then_join(job)
        received = job.events(Event.STATE_TRANSFER, round=seen["joined"])
        assert [e["rank"] for e in received] == [1] and received[0]["bytes"] > 0, received
        assert job.wait_agents(timeout=600) == {seen["chief"]: -9, seen["survivor"]: 0, "c": 0}, job.describe()
    finally:
        job.cleanup()
    assert job.events(Event.COMMIT, round=seen["first"]) and job.events(Event.COMMIT, round=seen["joined"])
    for round_ in (seen["first"], seen["joined"]):
        assert_replicas_identical(job, round_)
    assert job.events(Event.WORKER_EXIT, round=seen["joined"]), "the joined round trained to the end"
