"""What a commit holds: every variable that affects training, each once, named, and saved by the checkpoint."""
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from test_training import _training_setup
from tf_elastic import LARS, BatchResizeSchedule
from tf_elastic.elastic.worker import commit
from tf_elastic.elastic.worker.commit import CommittedState
from tf_elastic.elastic.worker.errors import ConfigurationError
from tf_elastic.elastic.worker.training import schedule_of
from tf_elastic.elastic.worker.world import World


def _model(dtype_policy: str = "float32"):
    """LARS with EMA (inside a LossScaleOptimizer under mixed_float16), plain BatchNorm and dropout."""
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(dtype_policy)
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                                  keras.layers.Dropout(0.2), keras.layers.Dense(2)])
        schedule = BatchResizeSchedule(0.1, 16, batch_size=32, momentum=0.9)
        model.compile(optimizer=LARS(schedule, momentum=0.9, use_ema=True), loss="mse")
        model.optimizer.build(model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, schedule


@pytest.mark.parametrize("dtype_policy", ["float32", "mixed_float16"])
def test_a_commit_holds_every_variable_once_and_the_checkpoint_saves_each(tmp_path, dtype_policy):
    """Slots, EMA copies, `iterations`, the loss scale and its counter, BatchNorm statistics, dropout's seed
    state and the schedule's history: dropping any one from the state is what this test is for."""
    model, schedule = _model(dtype_policy)
    state = CommittedState(World(), str(tmp_path), model, schedule_of(model.optimizer))
    expected = {v.path for v in [*model.variables, *model.optimizer.variables]} | {"elastic_progress:0"}
    assert set(state.names) == expected and len(state.names) == len(state.variables)
    assert len({id(v) for v in state.variables}) == len(state.variables)
    names = set(state.names)
    assert {"sequential/batch_normalization/moving_mean", "seed_generator/seed_generator_state"} <= names
    assert any(n.endswith("_average") for n in names) and any(n.endswith("_momentum") for n in names)
    if dtype_policy == "mixed_float16":
        assert {"loss_scale_optimizer/dynamic_scale", "loss_scale_optimizer/step_counter"} <= names
    saved = {id(commit._tf_variable(v)) for v in commit._saved_variables(state.checkpoint)}
    assert all(id(v) in saved for v in state.variables), [n for v, n in zip(state.variables, state.names)
                                                         if id(v) not in saved]


def test_every_variable_comes_back_bit_exact_from_a_commit(tmp_path):
    model, schedule = _model()
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    model.fit(x, x[:, :2], batch_size=16, epochs=2, verbose=0)
    state = CommittedState(World(), str(tmp_path), model, schedule)
    state.commit(epoch=2, samples=0, step=8, global_batch=16)
    fresh, fresh_schedule = _model()
    restored = CommittedState(World(), str(tmp_path), fresh, fresh_schedule)
    restored.restore()
    for name, a, b in zip(state.names, state.variables, restored.variables):
        assert tf.io.serialize_tensor(a).numpy() == tf.io.serialize_tensor(b).numpy(), name


def test_a_variable_created_after_the_state_was_captured_is_an_error_naming_it(tmp_path):
    model, _ = _model()
    state = CommittedState(World(), str(tmp_path), model)
    state.check_unchanged()
    model.optimizer.add_variable((3,), name="late_slot")
    with pytest.raises(ConfigurationError, match="1 variable.*appeared after fit.*late_slot"):
        state.check_unchanged()


def test_the_schedule_is_found_on_the_optimizer_and_a_different_one_is_refused():
    model, schedule = _model()
    assert schedule_of(model.optimizer) is schedule
    assert schedule_of(keras.optimizers.LossScaleOptimizer(model.optimizer)) is schedule
    assert schedule_of(keras.optimizers.SGD(0.1)) is None
    with pytest.raises(ConfigurationError, match="schedule is not the optimizer's learning rate"):
        schedule_of(model.optimizer, BatchResizeSchedule(0.1, 16, batch_size=32))


def test_an_error_in_the_background_finish_is_raised_at_the_next_commit_and_at_close(tmp_path):
    """Beyond the errors a commit reports and outlives (a full disk), what the commit thread raises (here a
    bug naming the commit in the state file) comes back in the training thread instead of vanishing with
    its future."""
    model, schedule = _model()

    def broken(prefix, paths, times):
        raise RuntimeError("state file bug")

    state = CommittedState(World(), str(tmp_path / "next"), model, schedule, background=True)
    state._name_in_state_file = broken
    state.commit(epoch=0, samples=16, step=1, global_batch=16)
    for future in list(state._finishing):
        future.exception()  # wait for the finish to fail, without consuming what it raised
    with pytest.raises(RuntimeError, match="state file bug"):
        state.commit(epoch=0, samples=32, step=2, global_batch=16)
    assert state.log.in_force == 0  # the broken commit was never put in force
    state.close()

    state = CommittedState(World(), str(tmp_path / "close"), model, schedule, background=True)
    state._name_in_state_file = broken
    state.commit(epoch=0, samples=16, step=1, global_batch=16)
    with pytest.raises(RuntimeError, match="state file bug"):
        state.close()


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


def _three_commits(run_dir, **kwargs):
    model, schedule = _training_setup()
    state = CommittedState(World(), str(run_dir), model, schedule, **kwargs)
    for step in (1, 2, 3):
        state.commit(epoch=0, samples=32 * step, step=step, global_batch=32)
    state.close()
    return model


def _restored_step(run_dir, **kwargs):
    fresh, schedule = _training_setup()
    state = CommittedState(World(), str(run_dir), fresh, schedule, **kwargs)
    path, _ = state.restore()
    return path, state.step


@pytest.mark.parametrize("damage", ["transient read error", "NUL bytes", "garbage", "empty"])
def test_an_unreadable_state_file_deletes_no_commit_and_the_newest_still_restores(tmp_path, damage, monkeypatch):
    """`get_checkpoint_state` returned None on any read or parse error, the sweep then deleted every commit
    of the host, and every later start failed with "no readable commit"."""
    _three_commits(tmp_path)
    directory = tmp_path / "checkpoints"
    on_disk = sorted(p.name for p in directory.iterdir())
    state_file = directory / "checkpoint"
    if damage == "NUL bytes":
        state_file.write_bytes(b"\0" * state_file.stat().st_size)
    elif damage == "garbage":
        state_file.write_text("model_checkpoint_path: \"ckpt-0-3-0-96\n###")
    elif damage == "empty":  # what a crash between its write and its sync leaves on many filesystems
        state_file.write_bytes(b"")
    else:
        from tensorflow.python.lib.io import file_io  # what TensorFlow reads the state file with

        real, failed = file_io.read_file_to_string, []

        def flaky(path, *args, **kwargs):  # a transient NFS error (EIO), once
            if str(path).endswith("/checkpoint") and not failed:
                failed.append(path)
                raise tf.errors.UnavailableError(None, None, f"{path}: Input/output error")
            return real(path, *args, **kwargs)

        monkeypatch.setattr(file_io, "read_file_to_string", flaky)
    path, step = _restored_step(tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == on_disk
    assert path.endswith("ckpt-0-3-0-96") and step == 3


def test_a_run_dir_tensorflow_would_read_as_a_pattern_is_refused_and_no_copy_of_nothing_is_marked(tmp_path):
    """Under `sweep[lr=0.1]` TensorFlow's checkpoint reader finds no commit (it matches the path as a
    pattern), and `glob(prefix + ".*")` found no file: empty durable copies were marked complete, then
    deleted the good ones, and expired commits were never deleted. Such a path is refused, naming it;
    and a durable copy of a commit without files is an error, never marked complete."""
    from tf_elastic.elastic.worker.durable import DurableCopies
    from tf_elastic.elastic.worker.storage import StorageError

    model, schedule = _training_setup()
    for run_dir, remote, argument in ((tmp_path / "sweep[lr=0.1]", None, "commit directory"),
                                      (tmp_path / "run", tmp_path / "copies*", "--checkpoint_dir")):
        durable = DurableCopies(str(remote)) if remote else None
        with pytest.raises(ConfigurationError, match=re.escape(argument) + r".*a path with .*could not be restored"):
            CommittedState(World(), str(run_dir), model, schedule, durable=durable, durable_every_commits=1)
        assert not run_dir.exists() and not (remote and remote.exists())
    remote = DurableCopies(str(tmp_path / "remote"))
    with pytest.raises(StorageError, match="has no index file to copy"):
        remote.copy(str(tmp_path / "nothing" / "ckpt-0-1-0-32"))
    assert remote.copies() == [] or not any(c.complete for c in remote.copies())


def test_a_damaged_newest_durable_copy_falls_back_to_the_older_complete_one(tmp_path):
    from tf_elastic.elastic.worker.durable import DurableCopies

    remote = tmp_path / "remote"
    _three_commits(tmp_path / "run", durable=DurableCopies(str(remote)), durable_every_commits=1)
    newest = DurableCopies(str(remote)).copies()[-1].prefix
    for data in (remote / newest.split("/")[-1]).glob("*.data-*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    path, step = _restored_step(tmp_path / "fresh", durable=DurableCopies(str(remote)), durable_every_commits=1)
    assert step == 2 and path.endswith("ckpt-0-2-0-64") and str(remote) in path


def test_a_failed_background_write_does_not_drop_the_next_commit(tmp_path):
    """TensorFlow's asynchronous writer raises a failed write's error at the next write: commit 1 failing on
    a full disk also dropped commit 2, which nothing was wrong with."""
    from tf_elastic.elastic.events import EventLog, read_events

    model, schedule = _training_setup()
    state = CommittedState(World(), str(tmp_path), model, schedule, events=EventLog(str(tmp_path), "worker:0"),
                           background=True)
    writer = state.checkpoint._async_checkpointer().checkpointer()  # what TensorFlow's writer thread calls
    real, failed = writer._write, []

    def full_disk_once(prefix, options=None):
        if "ckpt-0-1-" in prefix and not failed:
            failed.append(prefix)
            raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")
        return real(prefix, options=options)

    writer._write = full_disk_once
    for step in (1, 2, 3):
        state.commit(epoch=0, samples=16 * step, step=step, global_batch=16)
        for future in list(state._finishing):
            future.exception()
    state.close()
    on_disk = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.index"))
    assert on_disk == ["ckpt-0-2-0-32.index", "ckpt-0-3-0-48.index"], on_disk
    failures = [e["path"] for e in read_events(tmp_path) if e["event"] == "commit_failed"]
    assert len(failures) == 1 and failures[0].endswith("ckpt-0-1-0-16"), failures


def test_a_commit_is_on_the_disk_before_the_state_file_names_it(tmp_path, monkeypatch):
    """Data files, index, state file and its directory are fsynced, the data before the state file: after a
    crash of the host, the state file never names what the page cache alone held."""
    import os

    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    model, schedule = _training_setup()
    CommittedState(World(), str(tmp_path), model, schedule).commit(epoch=0, samples=32, step=1, global_batch=32)
    directory = str(tmp_path / "checkpoints")
    names = [os.path.relpath(p, directory) for p in synced]
    assert "ckpt-0-1-0-32.index" in names and any(n.startswith("ckpt-0-1-0-32.data-") for n in names), names
    assert "checkpoint" in names and names.index("checkpoint") > names.index("ckpt-0-1-0-32.index")
    assert names.count(".") >= 2  # the directory: after the data files, and after the state file's rename
