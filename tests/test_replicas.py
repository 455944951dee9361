"""Replicas hold the same bits of every variable: statistics averaged before each commit, every variable checked."""
import sys

import pytest

from conftest import run_python
from tf_elastic.elastic.protocol import Event
from tf_elastic.testing.local_job import LocalJob, assert_replicas_identical, lose_the_chief_to_a_standby

_AVERAGE = """
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tf_elastic.elastic.worker.replicas import StatisticsAverage
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    v = tf.Variable(np.zeros(5, np.float32), aggregation=tf.VariableAggregation.NONE)

@tf.function
def set_apart():
    def local():
        i = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        nan = tf.bitcast(tf.constant(0x7FC00123, tf.int32), tf.float32)  # a NaN with a payload
        v.assign(tf.stack([1.0 + i, np.inf, -0.0, 0.1, nan]))
    strategy.run(local)

from tf_elastic.elastic.worker.errors import ConfigurationError
from tf_elastic.elastic.worker.group import GroupState, sum_over_workers
from tf_elastic.elastic.worker.world import World
with strategy.scope():
    w = tf.Variable(np.ones(3, np.float32))
step = tf.Variable(7, dtype=tf.int64)  # outside the strategy: one copy, as fit's progress counters
group = GroupState(strategy, World(), [w, v, step], ["w", "stats", "step"], sum_over_workers(strategy, World()))
group.check("before")
set_apart()
try:
    group.check("at the test's commit")
    raise AssertionError("the local replicas' difference was not seen")
except ConfigurationError as error:
    assert "of 1 variable(s) at the test's commit: stats." in str(error), error
StatisticsAverage(strategy, [v])()
group.check("after averaging")
bits = [tf.bitcast(t, tf.int32).numpy().tolist() for t in strategy.experimental_local_results(v)]
expected = tf.bitcast(tf.constant([1.5, np.inf, -0.0, 0.1, 0.0], tf.float32), tf.int32).numpy().tolist()
expected[4] = 0x7FC00123
assert bits == [expected, expected], (bits, expected)
"""


def test_statistics_are_averaged_where_replicas_differ_and_kept_bit_for_bit_where_they_agree():
    """Two replicas: 1 and 2 average to 1.5; an infinity, -0.0, 0.1 and a NaN's payload equal on both keep
    their bits (a plain mean would make inf NaN, -0.0 +0.0, and 0.1 may not survive (x + x) / 2 in float64).
    The group's check sees the local replicas apart, naming the variable, and equal once averaged; a variable
    outside the strategy (one copy) is checked beside them."""
    run_python(_AVERAGE)


# A residual block with plain BatchNorm, LARS and its EMA under mixed_float16 (a LossScaleOptimizer), class
# weights and validation: a user's script under `elastic.run`. (The registry's ResNet-20 trained a step a
# second here under mixed_float16, 10-15 s an epoch: the same checks at a tenth of the time.)
SCRIPT = """
import keras
from sklearn.datasets import load_digits
from tf_elastic import LARS, BatchResizeSchedule, elastic


def residual_bn_model():
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(16, 3, padding="same")(inputs)))
    y = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(16, 3, padding="same")(x)))
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.Add()([x, keras.layers.BatchNormalization()(y)]))
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def main():
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    digits = load_digits()
    x, y = digits.images[..., None].astype("float32") / 16.0, digits.target
    model = residual_bn_model()
    schedule = BatchResizeSchedule(0.05, 32, batch_size=32, momentum=0.9)
    model.compile(optimizer=LARS(schedule, momentum=0.9, use_ema=True, ema_momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = elastic.fit(model, x[:512], y[:512], per_replica_batch_size=16, epochs=EPOCHS,
                          class_weight={c: 1.0 + c / 10 for c in range(10)}, validation_data=(x[1500:], y[1500:]),
                          config=elastic.FitConfig(commit_every_steps=8), verbose=0)
    print("history", history.history, flush=True)


elastic.run(main)
"""
EPOCHS = 24  # 2-3 s an epoch at two workers: c stood by after 4 epochs alone here; beside the soak, 2-4x that
AGENT = ["--min_workers=1", "--max_workers=2", "--heartbeat_timeout=5", "--last_call=1"]


@pytest.mark.slow(minutes=1.5)
def test_batchnorm_lars_ema_and_loss_scale_stay_identical_through_a_kill_and_a_standby_joining(tmp_path):
    """Every commit of the job passed the per-variable check across workers (a difference ends the job with
    exit 78), every round of two started from the same bits, and the last one ended with them; class
    weights and validation ran under the agent."""
    script = tmp_path / "resnet_digits.py"
    script.write_text(SCRIPT.replace("EPOCHS", str(EPOCHS)))
    (tmp_path / "job").mkdir()
    job = LocalJob(tmp_path / "job", [], AGENT, host_run_dirs=True, trainer="launch.train")
    try:
        seen = lose_the_chief_to_a_standby(job, command=[sys.executable, str(script)])
        received = job.events(Event.STATE_TRANSFER, round=seen["joined"])
        assert [e["rank"] for e in received] == [1] and received[0]["bytes"] > 0, received
        assert job.wait_agents(timeout=600) == {seen["chief"]: -9, seen["survivor"]: 0, "c": 0}, job.describe()
    finally:
        job.cleanup()
    assert job.events(Event.COMMIT, round=seen["first"]) and job.events(Event.COMMIT, round=seen["joined"])
    for round_ in (seen["first"], seen["joined"]):
        assert_replicas_identical(job, round_)
    assert job.events(Event.WORKER_EXIT, round=seen["joined"]), "the joined round trained to the end"
    logs = "".join(job.worker_log(host, seen["joined"]) for host in (seen["survivor"], "c"))
    histories = [line for line in logs.splitlines() if line.startswith("history {")]
    assert len(histories) == 2 and histories[0] == histories[1] and "val_accuracy" in histories[0], histories
