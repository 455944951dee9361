"""The elastic runtime's pieces on their own: store, data plan, committed state, Keras fix, imports."""
import json
import re
import socket
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import run_python
from tf_elastic import LARS, BatchResizeSchedule, elastic
from tf_elastic.elastic.events import read_events
from tf_elastic.elastic.worker import keras_compat, training
from tf_elastic.elastic.worker import world as world_module
from tf_elastic.elastic.worker.world import World
from tf_elastic.elastic.worker.data_plan import DataPlan, replica_batch_size
from tf_elastic.elastic.agent.round import Round
from tf_elastic.elastic.store import StoreError, open_store
from tf_elastic.elastic.store.file import FileStore
from tf_elastic.elastic.worker.cluster import resolve_world
from tf_elastic.elastic.worker.commit import CommittedState


def test_agent_side_never_imports_tensorflow():
    modules = ["tf_elastic", "tf_elastic.elastic", "tf_elastic.elastic.protocol", "tf_elastic.elastic.events",
               *[f"tf_elastic.elastic.agent.{m}" for m in ("agent", "cli", "decisions", "job_record", "ports",
                                                            "rendezvous", "round")],
               "tf_elastic.elastic.store.file", "tf_elastic.elastic.store.etcd",
               "tf_elastic.elastic.worker.world", "tf_elastic.elastic.worker.errors"]
    proc = run_python(f"import sys, {', '.join(modules)}\n"
                      "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    assert proc.stdout.strip() == "False False"


def test_file_store_rejects_malformed_content(tmp_path):
    store = FileStore(str(tmp_path))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "round.json").write_text("not json")
    with pytest.raises(StoreError, match="malformed store file"):
        store.get("/job/round")
    with pytest.raises(StoreError, match="malformed rendezvous round record"):
        Round.from_json(json.dumps({"version": 99}))


def test_unknown_store_scheme_is_named():
    with pytest.raises(ValueError, match=r"--rdzv='zk://x': unknown store scheme 'zk'"):
        open_store("zk://x")


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


def test_world_reads_tf_config():
    world = World.from_env({"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                                     "task": {"type": "worker", "index": 1}})})
    assert (world.rank, world.size, world.is_chief) == (1, 2, False)
    tfjob_with_chief = {"cluster": {"chief": ["c:1"], "worker": ["w:1"]}, "task": {"type": "chief", "index": 0}}
    with pytest.raises(ValueError, match="a chief task .*TFJob with a Chief replica.* is not supported"):
        World.from_env({"TF_CONFIG": json.dumps(tfjob_with_chief)})
    with pytest.raises(ValueError, match="TF_CONFIG is not a valid worker cluster spec"):
        World.from_env({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"index": 5}})})


def test_keras_fit_fix_is_installed_only_where_the_bug_is():
    """Each fix is installed exactly where the detector finds its bug in the installed Keras's source; where
    the bug is there, a copy patched the way an upstream fix would (the local results for the build,
    axis=None for scalars, all replicas' finiteness) switches that fix off alone. On a Keras that fixed
    them, nothing is installed and the patched copies have nothing left to change."""
    import inspect

    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.optimizers import loss_scale_optimizer

    real, source = inspect.getsource(tf_trainer), inspect.getsource(loss_scale_optimizer)
    found = dict(keras_compat.bugs_in(real), loss_scale_finite=keras_compat.local_finite_bug_in(source))
    assert keras_compat.install_fit_fix() == found, keras.__version__
    fixes = {"symbolic_build": ('data_batch = self.distribute_strategy.reduce(\n                        "MEAN",\n'
                                '                        maybe_distributed_data_batch,',
                                'data_batch = self.distribute_strategy.experimental_local_results(\n'
                                '                        maybe_distributed_data_batch,'),
             "scalar_reduce": ('return strategy.reduce("MEAN", v, axis=0)',
                               'return strategy.reduce("MEAN", v, axis=0 if v.shape.rank else None)')}
    for name, (bug, fix) in fixes.items():
        if found[name]:
            assert bug in real, f"Keras's source moved: update the patched copy for {name}"
            assert keras_compat.bugs_in(real.replace(bug, fix)) == dict(keras_compat.bugs_in(real), **{name: False})
    if found["loss_scale_finite"]:
        fixed = source.replace("finite = distribution.experimental_local_results(", "finite = all_replicas_finite(")
        assert fixed != source and not keras_compat.local_finite_bug_in(fixed)
    # The detectors themselves, on the two forms of each line (so a detector that never fires fails here too):
    assert keras_compat.bugs_in(fixes["symbolic_build"][0] + "\n" + fixes["scalar_reduce"][0]) == \
        {"symbolic_build": True, "scalar_reduce": True}
    assert keras_compat.bugs_in(fixes["symbolic_build"][1] + "\n" + fixes["scalar_reduce"][1]) == \
        {"symbolic_build": False, "scalar_reduce": False}
    assert keras_compat.local_finite_bug_in("finite = distribution.experimental_local_results(finite_per_replica)[0]")
    assert not keras_compat.local_finite_bug_in("finite = all_replicas_finite(finite_per_replica)[0]")


def _training_setup():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    schedule = BatchResizeSchedule(0.1, 16, batch_size=32, transition="momentum", momentum=0.9)
    model.compile(optimizer=LARS(schedule, trust_coefficient=0.02), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model, schedule


def test_commit_then_restore_is_bit_exact(tmp_path):
    model, schedule = _training_setup()
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    model.fit(x, x[:, :2], batch_size=16, epochs=2, verbose=0)
    schedule.resize(int(model.optimizer.iterations.numpy()), 64)
    state = CommittedState(World(), str(tmp_path), model, schedule)
    state.commit(epoch=2, samples=48, step=8, global_batch=64)

    fresh, fresh_schedule = _training_setup()
    restored = CommittedState(World(), str(tmp_path), fresh, fresh_schedule)
    assert restored.restore() == (str(tmp_path / "checkpoints" / "ckpt-0-8-2-48"), [])
    assert (restored.epoch, restored.samples, restored.step) == (2, 48, 8)
    assert fresh_schedule.history == schedule.history == [(0, 32), (8, 64)]
    for a, b in zip(model.optimizer.variables, fresh.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    for a, b in zip(model.weights, fresh.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


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
    CommittedState(World(), str(tmp_path), model).commit(epoch=0, samples=59, step=7, global_batch=8)
    elastic.fit(model, x, y, world=World(), strategy=tf.distribute.get_strategy(), run_dir=str(tmp_path),
                epochs=2, per_replica_batch_size=16, callbacks=[EpochsBegun()], verbose=0)
    assert EpochsBegun.begun == [1]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["epoch"], e["samples"]) for e in events if e["event"] == "remainder_skipped"][0] == (0, 5)
    commits = [e for e in events if e["event"] == "commit"]
    assert commits[-1]["epoch"] == 2 and commits[-1]["step"] == 7 + 64 // 16


def test_commits_keep_the_newest_three_in_a_state_file_tensorflow_reads(tmp_path):
    model, schedule = _training_setup()
    state = CommittedState(World(), str(tmp_path), model, schedule)
    for step in range(1, 6):
        state.commit(epoch=0, samples=32 * step, step=step, global_batch=32)
    directory = tmp_path / "checkpoints"
    names = [f"ckpt-0-{s}-0-{32 * s}" for s in (3, 4, 5)]
    assert tf.train.latest_checkpoint(str(directory)) == str(directory / names[-1])
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(), str(directory), max_to_keep=3)
    assert manager.checkpoints == [str(directory / n) for n in names]
    assert sorted({p.name.split(".")[0] for p in directory.glob("ckpt-*")}) == names


def test_the_chief_sweeps_what_killed_commits_left(tmp_path):
    """A SIGKILL mid-write leaves TF's `_temp` directory; one between the state file's update and the
    deletion of the expired commit leaves that commit's files. The next chief removes both, and keeps
    every commit the state file names."""
    model, schedule = _training_setup()
    state = CommittedState(World(), str(tmp_path), model, schedule)
    for step in range(1, 4):
        state.commit(epoch=0, samples=32 * step, step=step, global_batch=32)
    directory = tmp_path / "checkpoints"
    kept = sorted(p.name for p in directory.iterdir())
    (directory / "ckpt-9-0-288_temp").mkdir()
    (directory / "ckpt-9-0-288_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"x")
    (directory / "ckpt-0-0-0.index").write_bytes(b"expired")
    CommittedState(World(), str(tmp_path), model, schedule)
    assert sorted(p.name for p in directory.iterdir()) == kept


def test_a_corrupted_newest_commit_is_skipped_for_the_previous_one(tmp_path):
    model, schedule = _training_setup()
    state = CommittedState(World(), str(tmp_path), model, schedule)
    state.commit(epoch=0, samples=32, step=1, global_batch=32)
    state.commit(epoch=0, samples=64, step=2, global_batch=32)
    for data in (tmp_path / "checkpoints").glob("ckpt-0-2-*.data-*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    fresh, fresh_schedule = _training_setup()
    path, skipped = CommittedState(World(), str(tmp_path), fresh, fresh_schedule).restore()
    assert path.endswith("ckpt-0-1-0-32") and len(skipped) == 1 and skipped[0][0].endswith("ckpt-0-2-0-64")
    assert "Read less bytes than requested" in skipped[0][1], skipped


def test_a_commit_of_another_model_is_a_clear_error_and_stays_on_disk(tmp_path):
    model, schedule = _training_setup()
    CommittedState(World(), str(tmp_path), model, schedule).commit(epoch=0, samples=32, step=1, global_batch=32)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    other.compile(optimizer=LARS(0.1), loss="mse")
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match=r"ckpt-0-1-0-32 does not fit this model or optimizer .*--run_dir"):
        CommittedState(World(), str(tmp_path), other).restore()
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-0-1-0-32")


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


def test_warm_worker_waits_for_its_world_on_stdin():
    import subprocess
    import sys

    from conftest import REPO

    code = ("from tf_elastic.elastic.worker.cluster import resolve_world\n"  # the path elastic.run takes
            "w = resolve_world('tf_config', 8888, None)\nprint(w.rank, w.size, w.round, flush=True)")
    env = {"PYTHONPATH": str(REPO), "TF_ELASTIC_WARM": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    world = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]},
                                      "task": {"type": "worker", "index": 2}}), "TF_ELASTIC_ROUND": "7"}
    out, _ = proc.communicate(json.dumps(world) + "\n", timeout=120)
    assert out.split() == ["2", "3", "7"]
    unused = subprocess.run([sys.executable, "-c", code], env=env, input="", capture_output=True, text=True,
                            timeout=120)
    assert unused.returncode == 0 and unused.stdout == ""  # the agent closed it unused: a quiet exit


def test_a_kubernetes_pod_finds_its_index_by_address_not_by_name(monkeypatch):
    """TF's KubernetesClusterResolver against a stand-in for the Kubernetes API (its `override_client`; no
    cluster here): it lists pods sorted by name, so worker w-10 comes before w-2. Each pod must find
    its own index from its node address."""
    monkeypatch.setenv("TF_CONFIG", "")  # restored (unset) afterwards: resolve_world writes it
    mine = "10.0.0.2"  # pinned: computing it the way the code does would hide a wrong lookup
    monkeypatch.setattr(socket, "gethostname", lambda: "w-2")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: {"w-2": mine}[name])
    addresses = {"w-0": "10.0.0.1", "w-2": mine, "w-10": "10.0.0.3"}

    monkeypatch.setenv("POD_NAMESPACE", "team-a")

    class PodsApi:
        """Answers for namespace team-a only: listing every namespace (TF's default) would need a
        ClusterRole and could match another namespace's pods with the same labels."""

        def __init__(self, phase="Running"):
            self.phase = phase

        def list_namespaced_pod(self, namespace, label_selector):
            assert (namespace, label_selector) == ("team-a", "job-name=w")
            return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name=name),
                                                          status=SimpleNamespace(phase=self.phase, host_ip=ip))
                                          for name, ip in addresses.items()])

    world = resolve_world("kubernetes", 2222, "job-name=w", k8s_client=PodsApi())
    assert world.cluster == {"worker": ["10.0.0.1:2222", "10.0.0.3:2222", f"{mine}:2222"]}
    assert (world.rank, world.size) == (2, 3)
    with pytest.raises(ValueError, match='--cluster_resolver=kubernetes: Pod "w-0" is not running; phase: "Pending"'):
        resolve_world("kubernetes", 2222, "job-name=w", k8s_client=PodsApi("Pending"))
    addresses["w-2"] = "10.0.0.9"
    with pytest.raises(ValueError, match="should hold this pod's node address"):
        resolve_world("kubernetes", 2222, "job-name=w", k8s_client=PodsApi())


def test_the_async_checkpoint_fix_is_installed_only_where_keras_creates_a_variable_per_copy(tmp_path):
    """Keras 3.15's `Variable._copy_trackable_to_cpu` makes a new tf.Variable on every call, which TF's
    async checkpoint (a tf.function) refuses after its first trace; with the fix, repeated async writes
    work and read back bit-exact."""
    installed = keras_compat.install_async_checkpoint_fix()
    assert installed, keras.__version__
    assert not keras_compat._ASYNC_COPY_BUG.search("object_map[self] = object_map[self.value]")
    model, schedule = _training_setup()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, history=schedule.state)
    options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
    for step in range(3):
        model.weights[0].assign(model.weights[0] + 1.0)
        checkpoint.write(str(tmp_path / f"ckpt-{step}"), options=options)
    checkpoint.sync()
    fresh, fresh_schedule = _training_setup()
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer, history=fresh_schedule.state).read(
        str(tmp_path / "ckpt-2")).assert_existing_objects_matched()
    for a, b in zip(model.weights, fresh.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


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


def test_a_global_batch_the_world_does_not_divide_names_the_agents_flag():
    with pytest.raises(ValueError, match="--world_size_divides=12 divided by the replicas per worker"):
        replica_batch_size("global", 8, None, 12)


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


def test_fit_refuses_a_training_dataset_and_bad_arguments_naming_them(tmp_path):
    model, _ = _training_setup()
    x, y = np.zeros((64, 4), np.float32), np.zeros(64, np.int64)
    from tf_elastic.elastic.worker.errors import ConfigurationError

    cases = [(dict(x=tf.data.Dataset.from_tensor_slices((x, y)), y=None), "x: a tf.data.Dataset.*ImageFiles"),
             (dict(batch_size=16, per_replica_batch_size=8), "batch_size .* or per_replica_batch_size"),
             (dict(epochs=0), "epochs must be a whole number >= 1"), (dict(epochs=2.5), "epochs must be"),
             (dict(batch_size=0), "batch_size must be a whole number >= 1"), (dict(batch_size="8"), "batch_size"),
             (dict(validation_freq=0), "validation_freq must be"), (dict(validation_freq=True), "validation_freq"),
             (dict(validation_data="val.csv"), "validation_data must be"), (dict(y=None), "y: labels are needed")]
    for given, message in cases:
        arguments = {"x": x, "y": y, "run_dir": str(tmp_path), "verbose": 0, **given}
        with pytest.raises(ConfigurationError, match=message):
            elastic.fit(model, **arguments)
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
