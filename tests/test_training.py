"""Tests `tf_elastic/elastic/worker/training.py`: `elastic.fit` in one process."""
import json
import os
import re
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import run_python, run_workers
from tf_elastic import LARS, BatchResizeSchedule, elastic
from tf_elastic.elastic.events import read_events
from tf_elastic.elastic.protocol import ExitCode
from tf_elastic.elastic.worker import training
from tf_elastic.elastic.worker import world as world_module
from tf_elastic.elastic.worker.commit import CommittedState
from tf_elastic.elastic.worker.data import ArraySource
from tf_elastic.elastic.worker.data_plan import DataPlan
from tf_elastic.elastic.worker.world import World


def _training_setup():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    schedule = BatchResizeSchedule(0.1, 16, batch_size=32, transition="momentum", momentum=0.9)
    model.compile(optimizer=LARS(schedule, trust_coefficient=0.02), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model, schedule


def test_a_commit_less_than_a_global_batch_before_the_epoch_end_resumes_at_the_next_epoch(tmp_path):
    """Committed 5 samples before the end of epoch 0 (say at a smaller world size): at batch 16 nothing of
    that epoch is left to train. fit skips that remainder and trains on from epoch 1. It used to hand
    Keras an empty epoch, which under MWMS dies of StopIteration, in a restart loop (found by the
    50-fault soak); a single process only warns, so the test checks that Keras never sees that epoch."""
    from tf_elastic import elastic

    class EpochsBegun(keras.callbacks.Callback):
        begun = []

        def on_epoch_begin(self, epoch, logs=None):
            self.begun.append(epoch)

    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model, _ = _training_setup()
    model.compile(optimizer=model.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    from tf_elastic.elastic.worker.data.source import ArraySource, fingerprint_number

    CommittedState(World(), str(tmp_path), model).commit(epoch=0, samples=59, step=7, global_batch=8,
                                                         data=(fingerprint_number(ArraySource(x, y)), 64))
    elastic.fit(model, x, y, world=World(), strategy=tf.distribute.get_strategy(), run_dir=str(tmp_path),
                epochs=2, per_replica_batch_size=16, callbacks=[EpochsBegun()], verbose=0)
    assert EpochsBegun.begun == [1]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["epoch"], e["samples"]) for e in events if e["event"] == "remainder_skipped"][0] == (0, 5)
    commits = [e for e in events if e["event"] == "commit"]
    assert commits[-1]["epoch"] == 2 and commits[-1]["step"] == 7 + 64 // 16


def test_sigterm_commits_at_a_step_boundary_and_a_rerun_resumes_there_with_user_callbacks(tmp_path):
    """A preemption notice (SIGTERM) mid-epoch: fit commits at the next agreed step and raises
    StopRequested; a second fit resumes at exactly that step and epoch and finishes. The user's callback
    sees every trained batch, in both runs."""
    import os
    import signal

    from tf_elastic import elastic

    x = np.random.default_rng(0).standard_normal((200, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    class UserCallback(keras.callbacks.Callback):
        def __init__(self, preempt_at=None):
            super().__init__()
            self.batches, self.epochs, self.preempt_at = 0, [], preempt_at

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1
            if self.batches == self.preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append(epoch)

    def run(callback):
        model, schedule = _training_setup()
        model.compile(optimizer=model.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        config = elastic.FitConfig(commit_every_steps=0, sync_every_steps=5)
        elastic.fit(model, x, y, world=World(), strategy=tf.distribute.get_strategy(), run_dir=str(tmp_path),
                    epochs=3, per_replica_batch_size=16, config=config, schedule=schedule, callbacks=[callback],
                    verbose=0)
        return model

    first = UserCallback(preempt_at=17)  # epoch 1, its 5th batch; the next agreement is at step 20
    with pytest.raises(elastic.StopRequested, match="after committing step 20"):
        run(first)
    assert first.batches == 20 and first.epochs == [0, 1]  # Keras ends the stopped epoch too
    second = UserCallback()
    model = run(second)
    from tf_elastic.elastic.events import read_events

    restore = [e for e in read_events(tmp_path) if e["event"] == "restore"][-1]
    assert (restore["step"], restore["epoch"], restore["samples"]) == (20, 1, 8 * 16)
    assert second.batches == 36 - 20 and second.epochs == [1, 2]
    assert int(model.optimizer.iterations.numpy()) == 36  # 12 steps an epoch (200 // 16), 3 epochs


def test_workers_always_stop_gracefully_on_sigterm_whatever_the_notice_signals(tmp_path):
    """The agent stops its workers with SIGTERM: with --preemption_signals=SIGUSR1 alone they used to die
    of it, uncommitted. A worker whose notice signal is SIGUSR1 alone still takes SIGTERM in `fit` as a
    request to stop: it commits at the next agreed step and raises StopRequested. (SIGTERM's default, death,
    is stood in for by a handler that records it: a worker that would die fails here instead of pytest.)"""
    world = World.from_env({"TF_ELASTIC_STOP_SIGNALS": "SIGUSR1"})
    assert world.stop_signals == (signal.SIGTERM, signal.SIGUSR1)
    assert World.from_env({}).stop_signals == (signal.SIGTERM,)
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model, _ = _training_setup()
    model.compile(optimizer=model.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class AgentStop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # the agent's graceful stop, after step 1

    died = []

    def death(*_):
        died.append(True)

    outside = signal.signal(signal.SIGTERM, death)
    try:
        with pytest.raises(elastic.StopRequested, match="after committing step 2"):  # the next agreement
            elastic.fit(model, x, y, world=world, strategy=tf.distribute.get_strategy(), run_dir=str(tmp_path),
                        epochs=2, per_replica_batch_size=16, callbacks=[AgentStop()], verbose=0,
                        config=elastic.FitConfig(commit_every_steps=0, sync_every_steps=2))
        assert not died and signal.getsignal(signal.SIGTERM) is death  # fit's handler took it, then gave it back
    finally:
        signal.signal(signal.SIGTERM, outside)
    exits = [(e["code"], e["step"]) for e in read_events(tmp_path) if e["event"] == "worker_exit"]
    assert exits == [(int(ExitCode.STOPPED), 2)]
    assert os.path.basename(tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))).split("-")[2] == "2"


def test_data_smaller_than_one_global_batch_is_a_clear_error(tmp_path):
    """Otherwise every epoch has no step, and the job "trains" to the end and exits 0 having learned nothing."""
    model, _ = _training_setup()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    from tf_elastic import elastic
    from tf_elastic.elastic.worker.errors import ConfigurationError

    x, y = np.zeros((12, 4), np.float32), np.zeros(12, np.int64)
    with pytest.raises(ConfigurationError, match=re.escape(
            "the training data has 12 examples, fewer than one global batch of 16 (1 replicas)")):
        elastic.fit(model, x, y, world=World(), strategy=tf.distribute.get_strategy(), run_dir=str(tmp_path),
                    epochs=2, per_replica_batch_size=16, verbose=0)
    assert not (tmp_path / "checkpoints").exists()


def test_fits_validation_counts_as_progress_and_is_bracketed_by_events(tmp_path):
    """An ImageNet validation inside `fit` takes minutes: the watchdog must see each batch, and the report
    must count its time apart from training (an event before and after each evaluation)."""
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model, _ = _training_setup()
    model.compile(optimizer=model.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    elastic.fit(model, x, y, batch_size=16, epochs=2, validation_data=(x[:20], y[:20]), run_dir=str(tmp_path),
                verbose=0)
    marks = [e for e in read_events(tmp_path) if e["event"].startswith("evaluation_")]
    assert [e["event"] for e in marks] == ["evaluation_begin", "evaluation_end"] * 2, marks
    assert {(e["round"], e["rank"]) for e in marks} == {(0, 0)}, marks
    validation = training._Validation(tf.data.Dataset.from_tensor_slices((x[:20], y[:20])).batch(8), 1)
    before = world_module.PULSE.progress
    validation.run(model, training.ProgressCallback())
    assert world_module.PULSE.progress == before + 3  # 20 rows in batches of 8


def test_fit_takes_what_model_fit_takes_and_returns_its_history(tmp_path):
    """class_weight reaches the loss (all-zero weights: a zero loss), validation runs at the epochs
    validation_freq names, from arrays or a tf.data.Dataset, and the History holds every epoch."""
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model, _ = _training_setup()
    model.compile(optimizer=model.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = elastic.fit(model, x, y, batch_size=16, epochs=3, validation_data=(x[:20], y[:20]), validation_freq=2,
                          class_weight={0: 0.0, 1: 0.0}, run_dir=str(tmp_path / "a"), verbose=0)
    assert history.epoch == [0, 1, 2] and history.history["loss"] == [0.0, 0.0, 0.0], history.history
    assert len(history.history["val_loss"]) == 1 and "val_accuracy" in history.history
    validation = tf.data.Dataset.from_tensor_slices((x[:20], y[:20])).batch(10)
    history = elastic.fit(model, x, y, per_replica_batch_size=16, epochs=2, validation_data=validation,
                          run_dir=str(tmp_path / "b"), verbose=2)  # with Keras's progress bar
    assert len(history.history["val_loss"]) == 2 and history.history["loss"][0] > 0, history.history


def test_validation_split_steps_and_batch_size_are_honoured_as_model_fit_honours_them(tmp_path):
    """The last quarter validates (and is not trained on), in batches of 4, two of them: the epoch's val_loss
    is the loss of examples 48 to 55 under the weights the epoch ended with."""
    x = np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32)
    y = (x[:, 1] > 0).astype(np.int32)
    model, _ = _training_setup()
    model.compile(optimizer=model.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = elastic.fit(model, x, y, batch_size=16, epochs=2, validation_split=0.25, validation_steps=2,
                          validation_batch_size=4, run_dir=str(tmp_path), verbose=0)
    expected = model.evaluate(x[48:56], y[48:56], batch_size=8, verbose=0)
    assert history.history["val_loss"][-1] == pytest.approx(expected, rel=1e-5), history.history
    trained = [e["examples"] for e in read_events(str(tmp_path)) if e.get("examples")]
    assert trained and set(trained) == {48}, trained


def test_fit_refuses_bad_arguments_naming_them_before_anything_is_written(tmp_path):
    model, _ = _training_setup()
    x, y = np.zeros((64, 4), np.float32), np.zeros(64, np.int64)
    from tf_elastic.elastic.worker.errors import ConfigurationError

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    generated = tf.data.Dataset.from_generator(lambda: iter(x), output_signature=tf.TensorSpec([4], tf.float32))
    cases = [(dict(x=dataset), "^y is not taken with a tf.data.Dataset or PyDataset x"),
             (dict(x=dataset, y=None, batch_size=8), "^batch_size is not taken with a tf.data.Dataset"),
             (dict(x=dataset, y=None, class_weight={0: 1.0}), "^class_weight is not taken"),
             (dict(x=generated.batch(8), y=None), "^x: tf.data cannot save .*PyFunc"),
             (dict(batch_size=16, per_replica_batch_size=8), "batch_size .* or per_replica_batch_size"),
             (dict(epochs=0), "epochs must be a whole number >= 1"), (dict(epochs=2.5), "epochs must be"),
             (dict(batch_size=0), "batch_size must be a whole number >= 1"), (dict(batch_size="8"), "batch_size"),
             (dict(validation_freq=0), "validation_freq must be"), (dict(validation_freq=True), "validation_freq"),
             (dict(validation_data="val.csv"), "validation_data must be"), (dict(y=None), "y: targets are needed"),
             (dict(x=dataset, y=None, sample_weight=np.ones(64)), "^sample_weight is not taken with a tf.data"),
             (dict(x=ArraySource(x, y), y=None, sample_weight=np.ones(64)),
              r"^sample_weight is taken with in-memory arrays only: a Source's examples carry their own"),
             (dict(sample_weight=np.ones(64), class_weight={0: 2.0}), "^class_weight is not taken with sample weights"),
             (dict(y={"a": y, "b": y}, class_weight={0: 2.0}), "^class_weight is taken for a model with one output"),
             (dict(sample_weight=np.ones(63)), r"^x, y and sample_weight need one, non-zero length .*\[63, 64\]"),
             (dict(sample_weight={"a": np.ones(64)}), "^sample_weight must be one array for a model with one output"),
             (dict(y={"a": y, "b": y}, sample_weight=np.ones((64, 3))), r"^sample_weight: one array .*got \(64, 3\)"),
             (dict(y={"a": y, "b": y}, sample_weight={"a": np.ones(64)}), "^sample_weight must be one array, or one"),
             (dict(x=[x, x[:32]]), r"^x and y need one, non-zero length .*\(a list of arrays is several inputs"),
             (dict(x=[[1.0, 2.0], [3.0]] * 32), r"^x must be an array of numbers .*got a ragged list \(ragged"),
             (dict(x={"a": x, "b": [[1.0], [2.0, 3.0]] * 32}), r"^x\['b'\] must be an array of numbers"),
             (dict(shuffle=False), r"shuffle=False .*\(only True\): every epoch is shuffled"),
             (dict(initial_epoch=2), "initial_epoch=2 .*its last commit"),
             (dict(steps_per_epoch=3), "steps_per_epoch=3 .*one pass over the data"),
             (dict(validation_split=1.0), r"validation_split must be a number in \[0, 1\)"),
             (dict(validation_split=0.99), "leaves no example on one side of 64"),
             (dict(x=[("a.png", 0)] * 64, y=None, validation_split=0.5), "validation_split takes in-memory arrays"),
             (dict(validation_data=(x, y, np.ones(63))), "x, y and sample_weight need one, non-zero length"),
             (dict(validation_steps=0), "validation_steps must be a whole number >= 1"),
             (dict(validation_batch_size=2.5), "validation_batch_size must be")]
    for given, message in cases:
        arguments = {"x": x, "y": y, "run_dir": str(tmp_path), "verbose": 0, **given}
        with pytest.raises(ConfigurationError, match=message):
            elastic.fit(model, **arguments)
    for seed in (-1, 1.5, True):
        with pytest.raises(ConfigurationError, match=r"^seed must be a whole number >= 0 .*got " + repr(seed)):
            elastic.FitConfig(seed=seed)
    assert not (tmp_path / "checkpoints").exists()


def test_each_epoch_trains_on_its_own_planned_order(tmp_path):
    """The examples each step reads are the plan's for that epoch (not the first epoch's, again)."""
    seen = []

    class Record(keras.layers.Layer):
        def call(self, x):
            done = tf.py_function(lambda t: seen.append(sorted(t.numpy().ravel().astype(int).tolist())) or 0,
                                  [x], tf.int32)
            done.set_shape([])
            return x + 0.0 * tf.cast(done, x.dtype)

        def compute_output_shape(self, input_shape):
            return input_shape

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), Record(), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.arange(8, dtype=np.float32)[:, None], np.zeros(8, np.int64)
    elastic.fit(model, x, y, batch_size=4, epochs=3, run_dir=str(tmp_path), verbose=0)
    plan = DataPlan(8, 0)
    planned = [sorted(b.tolist()) for e in range(3) for b in plan.replica_batches(e, 0, 1, 0, 4)]
    assert seen == planned and planned[:2] != planned[2:4], (seen, planned)


def _id_model(examples: int, steps_per_execution: int = 1) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(examples)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


@pytest.mark.parametrize("replicas", [1, 2])
def test_steps_per_execution_counts_every_step_and_steps_train_what_was_planned(tmp_path, replicas,
                                                                                  two_cpu_strategy):
    """`compile(steps_per_execution=3)` with 8 steps an epoch (the last execution of each is short): every
    step is counted, commits land at the epoch ends, each epoch has its own order, and what each replica's
    step consumed (test mode's record from inside the step) is the plan's, with class weights too."""
    from tf_elastic.elastic import audit

    strategy = two_cpu_strategy if replicas == 2 else tf.distribute.get_strategy()
    with strategy.scope():
        model = _id_model(64, steps_per_execution=3)
    ids = np.arange(64)
    run_dir = str(tmp_path)
    elastic.fit(model, ids[:, None].astype(np.float32), ids, batch_size=8, epochs=3, verbose=0, strategy=strategy,
                world=World(run_dir=run_dir, index_log=True), run_dir=run_dir, class_weight={0: 2.0},
                config=elastic.FitConfig(commit_every_steps=0, durable_every_commits=0))
    commits = [(e["epoch"], e["samples"], e["step"]) for e in read_events(tmp_path) if e["event"] == "commit"]
    assert commits == [(1, 0, 8), (2, 0, 16), (3, 0, 24)] and int(model.optimizer.iterations.numpy()) == 24
    assert audit.exactly_once(run_dir, 64, 8) == {"epochs": 3, "repeated": 0, "skipped": 0, "off_plan": 0}
    steps = audit.index_records(run_dir)
    assert len(steps) == 24 and {len(r["indices"]) for r in steps} == {8}
    assert steps[0]["indices"] != steps[8]["indices"]  # epoch 1 is not epoch 0 again


def test_a_pipeline_under_steps_per_execution_trains_as_plain_model_fit(tmp_path):
    """`compile(steps_per_execution=5)` over a user's tf.data pipeline (23 batches an epoch: the last call
    short): a call reads 5 global batches before its end, more than the feed keeps ahead of the trained
    ones unless told (a hang, ended here by a traceback and the process's exit); the weights are plain
    `model.fit`'s over the same pipeline, bit for bit."""
    import faulthandler

    from tf_elastic import elastic

    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((92, 3)).astype(np.float32), rng.standard_normal((92, 2)).astype(np.float32)

    def model():
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", steps_per_execution=5)
        return net

    plain, mine = model(), model()
    plain.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), epochs=2, verbose=0)
    faulthandler.dump_traceback_later(300, exit=True)
    try:
        elastic.fit(mine, tf.data.Dataset.from_tensor_slices((x, y)).batch(4), epochs=2, verbose=0, world=World(),
                    strategy=tf.distribute.get_strategy(), run_dir=str(tmp_path),
                    config=elastic.FitConfig(durable_every_commits=0))
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert int(mine.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 46
    for theirs, ours in zip(plain.weights, mine.weights):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_a_restart_from_an_epoch_end_of_a_pipeline_of_unknown_length_counts_the_iterations_trained(tmp_path):
    """Keras counts an optimizer iteration more than it trains where a pipeline of unknown length runs out
    (`keras_compat.IterationsThatCountSteps`): taken back before the epoch-end commit, so a run that lost its
    host at the next epoch's first step (Adam: the counter is in its bias correction) and one whose `epochs`
    grew after its end both go on with the counter, the updates and the weights of a run without faults."""
    def data():  # 30 examples of 40: 4 batches an epoch, the length unknown until read
        kept = tf.data.Dataset.range(40).filter(lambda i: i % 4 != 3)
        return kept.map(lambda i: (tf.cast(i, tf.float32)[None] / 40.0, tf.cast(i % 2, tf.float32)[None])).batch(8)

    def run(run_dir, epochs=3, fail_at=None):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
        begun, steps = [], [0]

        def step_end(batch, logs=None):
            steps[0] += 1
            if steps[0] == fail_at:
                raise RuntimeError("the host is lost")

        counts = keras.callbacks.LambdaCallback(on_train_batch_end=step_end, on_epoch_begin=lambda epoch, logs=None:
                                                begun.append((epoch, int(model.optimizer.iterations.numpy()))))
        try:
            elastic.fit(model, data(), epochs=epochs, verbose=0, world=World(), strategy=tf.distribute.get_strategy(),
                        run_dir=str(tmp_path / run_dir), callbacks=[counts],
                        config=elastic.FitConfig(commit_every_steps=0, durable_every_commits=0))
        except RuntimeError:
            pass
        return model, begun

    clean, begun = run("clean")
    assert begun == [(0, 0), (1, 4), (2, 8)] and int(clean.optimizer.iterations.numpy()) == 12
    assert run("lost", fail_at=5)[1] == [(0, 0), (1, 4)]  # committed the first epoch's end, then lost
    for resumed, begun in (run("lost"), (run("grown", epochs=1) and run("grown", epochs=3))):
        assert begun == [(1, 4), (2, 8)] and int(resumed.optimizer.iterations.numpy()) == 12
        for theirs, ours in zip(clean.weights, resumed.weights):
            np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_an_epoch_a_users_callback_stops_mid_way_is_validated_as_model_fit_validates_it(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 3)).astype(np.float32), rng.standard_normal((32, 1)).astype(np.float32)

    class StopAtTheSecondStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = self.model.stop_training or batch == 1

    def model():
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        net.compile(optimizer="sgd", loss="mse")
        return net

    given = dict(epochs=2, verbose=0, validation_data=(x[:8], y[:8]), callbacks=[StopAtTheSecondStep()])
    plain = model().fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), **given).history
    mine = elastic.fit(model(), tf.data.Dataset.from_tensor_slices((x, y)).batch(8), **given, world=World(),
                       strategy=tf.distribute.get_strategy(), run_dir=str(tmp_path),
                       config=elastic.FitConfig(durable_every_commits=0)).history
    assert sorted(mine) == sorted(plain) == ["loss", "val_loss"] and len(mine["val_loss"]) == 1
    np.testing.assert_allclose(mine["val_loss"], plain["val_loss"], rtol=1e-6)


def test_the_audit_sees_a_step_that_trained_other_examples_than_planned(tmp_path):
    """The index log's audit counts what steps consumed: a consumption record that is not the plan's (as
    when a strategy re-split a worker's batch) shows as off_plan and as skipped examples."""
    from tf_elastic.elastic import audit
    from tf_elastic.elastic.protocol import RunDir

    layout = RunDir(tmp_path)
    layout.indices.mkdir(parents=True)
    planned = [list(range(0, 4)), list(range(4, 8))]
    layout.index_log(0, 0).write_text("".join(
        json.dumps({"round": 0, "rank": 0, "epoch": 0, "step": s + 1, "indices": p}) + "\n"
        for s, p in enumerate(planned)))
    layout.consumed_log(0, 0).write_text("1 [0 1]\n2 [4 5]\n")  # half of each planned batch
    assert audit.exactly_once(str(tmp_path), 8, 4) == {"epochs": 1, "repeated": 0, "skipped": 1, "off_plan": 2}
    layout.consumed_log(0, 0).write_text("1 [0 1 2 3]\n2 [4 5 6 7]\n")
    assert audit.exactly_once(str(tmp_path), 8, 4) == {"epochs": 1, "repeated": 0, "skipped": 0, "off_plan": 0}


def test_the_audit_of_a_job_stopped_mid_epoch_leaves_out_only_that_epochs_missing_rest(tmp_path):
    """`stopped=True` (every host left before the end): the last epoch's untrained rest is no skip, but its
    repeats still count, and so does what an earlier epoch missed."""
    from tf_elastic.elastic import audit
    from tf_elastic.elastic.protocol import RunDir

    layout = RunDir(tmp_path)
    layout.indices.mkdir(parents=True)

    def steps(*epochs_and_indices):
        layout.index_log(0, 0).write_text("".join(
            json.dumps({"round": 0, "rank": 0, "epoch": epoch, "step": n + 1, "indices": indices}) + "\n"
            for n, (epoch, indices) in enumerate(epochs_and_indices)))
        layout.consumed_log(0, 0).write_text("".join(
            f"{n + 1} [{' '.join(map(str, indices))}]\n" for n, (_, indices) in enumerate(epochs_and_indices)))

    steps((0, [0, 1, 2, 3]), (0, [4, 5, 6, 7]), (1, [4, 5, 6, 7]))  # epoch 1 stopped after its first step
    assert audit.exactly_once(str(tmp_path), 8, 4) == {"epochs": 2, "repeated": 0, "skipped": 1, "off_plan": 0}
    assert audit.exactly_once(str(tmp_path), 8, 4, stopped=True) == {"epochs": 2, "repeated": 0, "skipped": 0,
                                                                        "off_plan": 0}
    steps((0, [0, 1, 2, 3]), (1, [4, 5, 6, 7]), (1, [4, 5, 6, 7]))  # epoch 0 misses 4 examples; 1 repeats them
    assert audit.exactly_once(str(tmp_path), 8, 4, stopped=True) == {"epochs": 2, "repeated": 4, "skipped": 1,
                                                                        "off_plan": 0}


def test_a_stop_agreed_at_an_epochs_last_step_keeps_that_epochs_validation_and_end(tmp_path):
    """SIGTERM at the third of four steps of epoch 1, agreed at step 8 (the epoch's last): the epoch ends
    with its validation and an epoch-end commit before the stop, and the restart trains epoch 2."""
    x, y = np.random.default_rng(0).random((64, 1), np.float32), np.arange(64) % 4

    class Preempt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations) == 7:
                os.kill(os.getpid(), signal.SIGTERM)

    def run():
        model = _id_model(4)
        elastic.fit(model, x, y, batch_size=16, epochs=3, verbose=0, validation_data=(x[:16], y[:16]),
                    callbacks=[Preempt()], world=World(run_dir=str(tmp_path)), run_dir=str(tmp_path),
                    config=elastic.FitConfig(commit_every_steps=0, sync_every_steps=2, durable_every_commits=0))

    with pytest.raises(elastic.StopRequested, match="after committing step 8"):
        run()
    run()
    events = read_events(tmp_path)
    assert [e["epoch"] for e in events if e["event"] == "epoch_end"] == [0, 1, 2]
    assert sum(e["event"] == "evaluation_begin" for e in events) == 3
    assert [(e["epoch"], e["samples"]) for e in events if e["event"] == "commit"] == [(1, 0), (2, 0), (3, 0)]


def test_a_restart_on_other_data_is_refused_in_one_line_naming_both(tmp_path):
    """The commit holds the data's fingerprint and size: a restart whose data differs (a file missing, one
    added, other bytes) is refused before it trains, and the commit is kept."""
    from tf_elastic.elastic.worker.errors import ConfigurationError

    x, y = np.random.default_rng(0).random((64, 1), np.float32), np.arange(64) % 4

    def run(x, y, epochs):
        return elastic.fit(_id_model(4), x, y, batch_size=16, epochs=epochs, verbose=0, run_dir=str(tmp_path),
                           world=World(run_dir=str(tmp_path)),
                           config=elastic.FitConfig(commit_every_steps=0, durable_every_commits=0))

    run(x, y, 1)
    for other in ((x[:63], y[:63]), (x + 1, y)):
        with pytest.raises(ConfigurationError) as refused:
            run(*other, 2)
        message = str(refused.value)
        assert "\n" not in message and re.search(r"has \d+ examples \(fingerprint [0-9a-f]{12}\), the commit 64 "
                                                  r"examples \(fingerprint [0-9a-f]{12}\)", message), message
    assert run(x, y, 2).epoch == [1]  # the same data goes on from the commit


def test_when_every_kept_commit_is_unreadable_and_nobody_holds_another_fit_says_so(tmp_path):
    """A commit that cannot be read is skipped for an older one, and a group member may hold it; where none
    is left anywhere, fit refuses to start from scratch beside them."""
    from tf_elastic.elastic.worker.errors import ConfigurationError

    x, y = np.random.default_rng(0).random((64, 1), np.float32), np.arange(64) % 4
    run = lambda: elastic.fit(_id_model(4), x, y, batch_size=16, epochs=2, verbose=0,  # noqa: E731
                              run_dir=str(tmp_path), world=World(run_dir=str(tmp_path)),
                              config=elastic.FitConfig(commit_every_steps=0, durable_every_commits=0))
    run()
    for data in (tmp_path / "checkpoints").glob("*.data-*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ConfigurationError, match="no readable commit in .* and no other worker holds one: "):
        run()


def test_the_end_of_fit_is_in_the_commit_ema_weights_and_a_users_early_stop(tmp_path):
    """A restart of a finished run trained nothing and skipped `model.fit`'s finalize: a `use_ema` model
    came back with raw weights. A user's early stop (at an epoch end, as EarlyStopping does) was not in
    the commit: a restart trained on (8 steps became 16)."""
    x = np.random.default_rng(0).standard_normal((128, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    def model():
        keras.utils.set_random_seed(0)
        made = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
        made.compile(optimizer=keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return made

    class StopAfterFirstEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    def run(name, callbacks=()):
        trained = model()
        elastic.fit(trained, x, y, epochs=5 if callbacks else 2, batch_size=16, verbose=0, callbacks=list(callbacks),
                    world=World(), strategy=tf.distribute.get_strategy(), run_dir=str(tmp_path / name),
                    config=elastic.FitConfig(commit_every_steps=4, durable_every_commits=0))
        return trained

    first, again = run("ema"), run("ema")
    for finished, restarted in zip(first.weights, again.weights):
        np.testing.assert_array_equal(finished.numpy(), restarted.numpy())
    stopped, after = run("stop", [StopAfterFirstEpoch()]), run("stop", [StopAfterFirstEpoch()])
    assert int(stopped.optimizer.iterations.numpy()) == int(after.optimizer.iterations.numpy()) == 8


class _TwoOutputs(keras.utils.PyDataset):
    """The same batches as `_two_output_dataset`'s, unshuffled: a PyDataset of dict features and targets."""

    def __init__(self, arrays):
        super().__init__()
        self.arrays = arrays

    @property
    def num_batches(self):
        return -(-len(self.arrays[0]["a"]) // 8)

    def __getitem__(self, index):
        return tf.nest.map_structure(lambda a: a[index * 8:(index + 1) * 8], self.arrays)


def test_a_pydataset_is_shuffled_by_default_and_read_in_order_with_shuffle_false_as_by_model_fit(tmp_path):
    """`shuffle=False`: the batches in order, the weights plain `model.fit(shuffle=False)`'s bit for bit; the
    default shuffles each epoch's batches (in an order drawn from the seed: `PyDatasetFeed`)."""
    def run(shuffle, run_dir):
        model = _two_output_model()
        elastic.fit(model, _TwoOutputs(_two_output_data()[:2]), shuffle=shuffle, epochs=2, verbose=0, world=World(),
                    strategy=tf.distribute.get_strategy(), run_dir=str(tmp_path / run_dir),
                    config=elastic.FitConfig(durable_every_commits=0))
        return [w.numpy() for w in model.weights]

    plain = _two_output_model()
    plain.fit(_TwoOutputs(_two_output_data()[:2]), shuffle=False, epochs=2, verbose=0)
    for theirs, ours in zip(plain.weights, run(False, "in-order")):
        np.testing.assert_array_equal(ours, theirs.numpy())
    shuffled = run(True, "shuffled")
    assert not all(np.array_equal(a, b.numpy()) for a, b in zip(shuffled, plain.weights))
    assert all(np.array_equal(a, b) for a, b in zip(shuffled, run(True, "shuffled-again")))


def test_a_pydataset_restarted_in_another_order_than_its_commits_is_refused_naming_shuffle(tmp_path):
    """A commit of a PyDataset read in order (shuffle=False, or a version that never shuffled), resumed in a
    shuffled order, would train some of the epoch's batches twice and others never: refused in one line."""
    import signal

    def run(shuffle, stop_at=None):
        model, steps = _two_output_model(), [0]

        def step_end(batch, logs=None):
            steps[0] += 1
            if steps[0] == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)

        elastic.fit(model, _TwoOutputs(_two_output_data()[:2]), shuffle=shuffle, epochs=2, verbose=0, world=World(),
                    strategy=tf.distribute.get_strategy(), run_dir=str(tmp_path),
                    callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=step_end)],
                    config=elastic.FitConfig(commit_every_steps=0, sync_every_steps=1, durable_every_commits=0))

    with pytest.raises(elastic.StopRequested):
        run(False, stop_at=3)
    with pytest.raises(elastic.ConfigurationError, match=r"training data differs .*shuffle, FitConfig.seed"):
        run(True)
    run(False)  # the order it committed in: goes on


def _two_output_data():
    rng = np.random.default_rng(1)
    features = {"a": rng.standard_normal((60, 3)).astype(np.float32), "b": rng.standard_normal((60, 2)).astype(
        np.float32)}
    targets = {"kind": rng.integers(0, 4, 60), "size": rng.standard_normal((60, 1)).astype(np.float32)}
    weights = {"kind": rng.random(60).astype(np.float32), "size": rng.random(60).astype(np.float32)}
    return features, targets, weights


def _two_output_model():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, {"kind": keras.layers.Dense(4, name="kind")(hidden),
                                           "size": keras.layers.Dense(1, name="size")(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss={"kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "size": "mse"})
    return model


@pytest.mark.parametrize("kind", ["dataset", "pydataset", "arrays"])
def test_a_dict_feature_two_output_model_with_weights_resumes_from_a_sigterm_bit_exact(tmp_path, kind):
    """A tf.data pipeline (shuffled, a short last batch), a PyDataset, or in-memory arrays with
    `sample_weight`, of dict features, two targets and their sample weights: preempted mid-epoch, then
    resumed, training ends with the bits of a run never stopped (the global batches of each step and the
    optimizer's counter included)."""
    import os
    import signal

    from tf_elastic import elastic

    def data():
        arrays = _two_output_data()
        if kind == "arrays":
            features, targets, weights = arrays
            return dict(x=features, y=targets, sample_weight=weights, batch_size=8)
        if kind == "pydataset":
            return dict(x=_TwoOutputs(arrays))
        tf.random.set_seed(3)  # what elastic.run does: the unseeded shuffle repeats
        return dict(x=tf.data.Dataset.from_tensor_slices(arrays).shuffle(60).batch(8))

    trained = {}  # run -> {optimizer step: the first kernel's sum}: a failure names the step where runs part

    def run(run_dir, preempt_at=None, name=None):
        model, seen = _two_output_model(), [0]
        sums = trained.setdefault(name or run_dir.name, {})

        def count(batch, logs=None):
            seen[0] += 1
            sums[int(model.optimizer.iterations.numpy())] = float(np.sum(model.weights[0].numpy()))
            if seen[0] == preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)

        elastic.fit(model, **data(), world=World(), strategy=tf.distribute.get_strategy(), run_dir=str(run_dir),
                    epochs=3, verbose=0, callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=count)],
                    config=elastic.FitConfig(commit_every_steps=0, sync_every_steps=2, durable_every_commits=0))
        return model

    never_stopped = run(tmp_path / "whole")
    with pytest.raises(elastic.StopRequested, match="after committing step 12"):
        run(tmp_path / "stopped", preempt_at=11)  # epoch 1 (8 steps an epoch), agreed at step 12
    resumed = run(tmp_path / "stopped", name="resumed")
    whole = trained["whole"]
    parted = {name: min((step for step, value in sums.items() if whole.get(step) != value), default=None)
              for name, sums in trained.items() if name != "whole"}
    assert parted == {"stopped": None, "resumed": None}, f"the first step where each run parts from 'whole': {parted}"
    steps = 3 * (60 // 8 if kind == "arrays" else 60 // 8 + 1)  # arrays: whole global batches, as planned
    assert int(resumed.optimizer.iterations.numpy()) == int(never_stopped.optimizer.iterations.numpy()) == steps
    for mine, theirs in zip(resumed.weights, never_stopped.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_in_memory_arrays_in_any_structure_take_sample_weights_and_split_as_model_fit(tmp_path):
    """Dict features, two targets and per-output sample weights as arrays: zero weights make a zero loss;
    `validation_split` holds out the last part of every array, weights included, and the epoch's val_loss is
    `model.evaluate`'s of those examples with their weights under the weights the epoch ended with. A
    string input (a lookup layer in the model) is taken as model.fit takes it."""
    features, targets, weights = _two_output_data()
    model = _two_output_model()
    zero = {name: np.zeros(60, np.float32) for name in weights}
    history = elastic.fit(model, features, targets, sample_weight=zero, batch_size=8, epochs=2,
                          run_dir=str(tmp_path / "zero"), verbose=0)
    assert history.history["loss"] == [0.0, 0.0], history.history
    model = _two_output_model()
    history = elastic.fit(model, features, targets, sample_weight=weights, batch_size=8, epochs=2,
                          validation_split=0.2, run_dir=str(tmp_path / "split"), verbose=0)
    held_out = lambda tree: tf.nest.map_structure(lambda a: a[48:], tree)  # noqa: E731
    expected = model.evaluate(held_out(features), held_out(targets), sample_weight=held_out(weights), batch_size=12,
                              verbose=0, return_dict=True)
    assert history.history["val_loss"][-1] == pytest.approx(expected["loss"], rel=1e-5), (history.history, expected)
    trained = {e["examples"] for e in read_events(str(tmp_path / "split")) if e.get("examples")}
    assert trained == {48}, trained

    words = np.array(["red", "green", "blue", "red"] * 8)
    text = keras.Input((), dtype="string")
    keras.utils.set_random_seed(0)
    ids = keras.layers.StringLookup(vocabulary=["red", "green", "blue"])(text)
    model = keras.Model(text, keras.layers.Dense(2)(keras.layers.CategoryEncoding(4, "one_hot")(ids)))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = elastic.fit(model, words, (words == "red").astype(np.int32), batch_size=8, epochs=1,
                          run_dir=str(tmp_path / "words"), verbose=0)
    assert np.isfinite(history.history["loss"][0]), history.history


def test_a_bad_record_in_a_users_pipeline_ends_fit_in_one_line_and_a_rerun_loses_nothing(tmp_path):
    """A record of a user's tf.data pipeline that does not parse (the 162nd of 200, in the 41st batch of 4) is
    bad input, as in a `Source`: `fit` ends with `ConfigurationError` naming the pipeline's own error (Keras
    saw `UnknownError`, the type a Python function's error takes in a graph, which a worker would meet
    again after every restart). The feed reads ahead of the step: no commit after the failed read may hold
    the iterator (past the rows it failed on, or holding the error in a fused map-and-batch's buffer), so
    the rerun on mended data trains what a run without the bad record trains, bit for bit."""
    def fit(twenty_one: str, run_dir):
        text = [str(i) for i in range(200)]
        text[161] = twenty_one
        pipeline = tf.data.Dataset.from_tensor_slices(text).map(
            lambda s: (tf.reshape(tf.strings.to_number(s), [1]), tf.zeros([1]))).batch(4)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        elastic.fit(model, pipeline, epochs=1, verbose=0, world=World(), strategy=tf.distribute.get_strategy(),
                    run_dir=str(run_dir), config=elastic.FitConfig(commit_every_steps=1, durable_every_commits=0))
        return model

    with pytest.raises(elastic.ConfigurationError, match=r"^bad input at step \d+: StringToNumberOp could not "
                                                         r"correctly convert string: twenty-one$"):
        fit("twenty-one", tmp_path / "mended")
    mended, plain = fit("161", tmp_path / "mended"), fit("161", tmp_path / "plain")
    restored = [e["step"] for e in read_events(tmp_path / "mended") if e["event"] == "restore"]
    assert len(restored) == 2 and 0 < restored[1] <= 40, restored  # the rerun went on from a commit of the first
    assert [e["step"] for e in read_events(tmp_path / "mended") if e["event"] == "worker_exit"] == [50]
    for theirs, ours in zip(plain.weights, mended.weights):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


_VALIDATING_WORKER = """
import os, sys
import numpy as np, tensorflow as tf, keras
from tf_elastic import elastic

def train():
    files = sorted(tf.io.gfile.glob(os.path.join(sys.argv[1], "val-*")))
    parse = lambda r: (lambda v: (v, v))(tf.io.parse_single_example(
        r, {"v": tf.io.FixedLenFeature([1], tf.float32)})["v"])
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    ones = np.ones((8, 1), np.float32)
    history = elastic.fit(model, tf.data.Dataset.from_tensor_slices((ones, ones)).batch(4), epochs=1, verbose=0,
                          validation_data=tf.data.TFRecordDataset(files).map(parse).batch(4), validation_steps=2,
                          config=elastic.FitConfig(durable_every_commits=0))
    print("val_loss", history.history["val_loss"][0], flush=True)

elastic.run(train, run_dir=sys.argv[2])
"""


def test_only_a_validation_pipeline_cut_by_validation_steps_is_shared_by_global_batch():
    """With `validation_steps`, DATA (the first global batches at every world size, below); the whole set keeps
    TensorFlow's AUTO (each file read by one worker); a policy the user set stays."""
    policy = tf.data.experimental.AutoShardPolicy
    dataset = tf.data.Dataset.range(8).batch(2)
    shared = lambda d, steps: training._validation_dataset(d, 2, None, steps).options(  # noqa: E731
        ).experimental_distribute.auto_shard_policy
    assert shared(dataset, None) == policy.AUTO and shared(dataset, 3) == policy.DATA
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy.OFF
    assert shared(dataset.with_options(options), 3) == policy.OFF


@pytest.mark.slow
def test_validation_steps_of_a_users_file_pipeline_evaluate_its_first_global_batches_at_every_world_size(tmp_path):
    """TensorFlow shards a file reader's validation set by file under MWMS (AUTO): each worker evaluated
    `validation_steps` batches of its own files, at 2 workers the first 8 records of two files instead of the
    first file's 8. Shared by global batch (`_shared_by_global_batch`), 2 workers report one worker's loss."""
    for f in range(4):  # four files of 8 records: the value f * 100 + i, its own target (a zero model's loss)
        with tf.io.TFRecordWriter(str(tmp_path / f"val-{f}")) as writer:
            for i in range(8):
                feature = tf.train.Feature(float_list=tf.train.FloatList(value=[f * 100.0 + i]))
                writer.write(tf.train.Example(features=tf.train.Features(feature={"v": feature})).SerializeToString())
    script = tmp_path / "worker.py"
    script.write_text(_VALIDATING_WORKER)
    one = run_python(f"import sys; sys.argv = ['w', {str(tmp_path)!r}, {str(tmp_path / 'one')!r}]; "
                     f"exec(open({str(script)!r}).read())").stdout
    two = run_workers(str(script), str(tmp_path), str(tmp_path / "two"))
    losses = [[float(out.split("val_loss ")[-1].split()[0]) for out in outputs] for outputs in ([one], two)]
    assert losses[0] == [np.mean(np.arange(8.0) ** 2)]  # the first file's 8 records
    np.testing.assert_allclose(losses[1], losses[0] * 2, rtol=1e-6)

