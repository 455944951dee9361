"""Committed state without a shared filesystem: each host keeps its own commits, the group hands the
newest to workers that lack it, durable copies go to any tf.io.gfile filesystem, off the training path."""
import ctypes
import json
import os
import posixpath
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

from launch import report
from tf_elastic.elastic.protocol import Event, RunDir
from tf_elastic.elastic.worker import group
from tf_elastic.elastic.worker.commit import CommittedState
from tf_elastic.elastic.worker.durable import NO_COMMIT, CommitId, DurableCopies, commit_id
from tf_elastic.elastic.worker.errors import ConfigurationError
from tf_elastic.elastic.worker.world import World
from tf_elastic.optimizers import LARS
from tf_elastic.schedules import BatchResizeSchedule
from tf_elastic.elastic import audit
from tf_elastic.testing import faults
from tf_elastic.testing.local_job import REPO, LocalJob, repo_env, signal_pid


def _setup(width: int = 8):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width), keras.layers.Dense(2)])
    schedule = BatchResizeSchedule(0.1, 16, batch_size=32, transition="momentum", momentum=0.9)
    model.compile(optimizer=LARS(schedule, trust_coefficient=0.02), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model, schedule


def _trained():
    model, schedule = _setup()
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    model.fit(x, x[:, :2], batch_size=16, epochs=1, verbose=0)
    return model, schedule


def _events(run_dir: Path):
    path = RunDir(run_dir).events
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_bits_survive_the_integer_packing_of_the_broadcast():
    """-0.0, NaN payloads, half floats, 64-bit and boolean values come back bit for bit."""
    values = [np.array([-0.0, np.nan, 1e-45, -3.5], np.float32), np.array([[-0.0, 65504.0]], np.float16),
              tf.constant([-0.0, 1.5], tf.bfloat16), np.array([-(2 ** 62), 7], np.int64),
              np.array([np.pi, -0.0], np.float64), np.array([True, False]), np.array([-128, 127], np.int8)]
    for value in values:
        variable = tf.Variable(value)
        bits = group.to_int32(tf.convert_to_tensor(variable))
        assert bits.dtype == tf.int32 and bits.shape[0] == group.words(variable)
        back = group.from_int32(bits + tf.zeros_like(bits), variable)
        raw = lambda t: tf.io.serialize_tensor(tf.convert_to_tensor(t)).numpy()  # noqa: E731
        assert raw(back) == raw(variable), value


def test_the_newest_commit_is_the_highest_generation_then_the_highest_step():
    """A host that trained on alone in an abandoned round (generation 3, step 900) loses to the group's
    newer round (generation 5, step 400); within a generation the higher step wins; ties go to the
    lowest rank; a worker without a commit never wins over one with."""
    assert group.newest_holder([CommitId(5, 400), CommitId(3, 900)]) == 0
    assert group.newest_holder([CommitId(3, 900), NO_COMMIT, CommitId(5, 400)]) == 2
    assert group.newest_holder([CommitId(5, 400), CommitId(5, 410), CommitId(5, 410)]) == 1
    assert group.newest_holder([NO_COMMIT, CommitId(0, 0)]) == 1
    assert group.newest_holder([NO_COMMIT, NO_COMMIT]) == 0
    assert commit_id("ckpt-5-400-2-96") == CommitId(5, 400) and commit_id("ckpt-5-x-2-96") is None
    assert commit_id("checkpoint") is None and commit_id("GENERATION") is None


def test_a_round_commits_under_a_generation_above_its_start_plus_its_round(tmp_path):
    """The generation is the start's generation plus one, plus the round's number (a new rendezvous store
    counts rounds from 0 again); the chief prefers a durable copy of a newer generation to a local commit
    with a higher step, and names commits by generation."""
    model, schedule = _trained()
    remote = str(tmp_path / "remote")
    state = CommittedState(World(round=7), str(tmp_path / "old"), model, schedule, durable=DurableCopies(remote),
                           durable_every_commits=1)
    state.begin_generation(NO_COMMIT)
    state.commit(epoch=0, samples=16, step=1, global_batch=16)
    restarted = CommittedState(World(round=1), str(tmp_path / "new"), *_setup(), durable=DurableCopies(remote),
                               durable_every_commits=1)
    restarted.restore()
    assert restarted.held == CommitId(7, 1)
    restarted.begin_generation(restarted.held)
    assert restarted.generation == 9
    restarted.commit(epoch=0, samples=32, step=2, global_batch=16)
    assert DurableCopies(remote).newest().id == CommitId(9, 2)
    # The old host's commit with a higher step, from generation 7: the chief takes the newer durable copy.
    state.commit(epoch=0, samples=160, step=10, global_batch=16)
    old = CommittedState(World(round=2), str(tmp_path / "old"), *_setup(), durable=DurableCopies(remote),
                         durable_every_commits=1)
    path, _ = old.restore()
    assert path == DurableCopies(remote).newest().prefix and old.held == CommitId(9, 2), path


def test_a_job_restarted_from_an_older_durable_copy_outranks_the_old_jobs_later_commits(tmp_path):
    """The old job's chief marks each generation it begins in the durable directory. Its last round (9)
    committed only on its host (no copy yet) under generation 15 (6 + 9); the job restarted under a new
    store (round 1) from the older copy (generation 5) must commit above 15, or the old host's step 50
    would take the group back to a history it no longer follows when that host joins."""
    model, schedule = _trained()
    remote = DurableCopies(str(tmp_path / "remote"))
    old = CommittedState(World(round=5), str(tmp_path / "old"), model, schedule, durable=remote,
                         durable_every_commits=1)
    old.begin_generation(NO_COMMIT, old.generation_floor())
    old.commit(epoch=0, samples=16, step=1, global_batch=16)
    late = CommittedState(World(round=9), str(tmp_path / "old"), model, schedule, durable=remote,
                          durable_every_commits=100)
    late.restore()
    late.begin_generation(late.held, late.generation_floor())
    late.commit(epoch=0, samples=800, step=50, global_batch=16)
    assert remote.newest().id == CommitId(5, 1) and remote.generation_mark() == 15

    restarted = CommittedState(World(round=1), str(tmp_path / "new"), *_setup(), durable=remote,
                               durable_every_commits=1)
    restarted.restore()
    assert restarted.held == CommitId(5, 1)
    restarted.begin_generation(restarted.held, restarted.generation_floor())
    assert restarted.generation == 17 and remote.generation_mark() == 17
    restarted.commit(epoch=0, samples=32, step=2, global_batch=16)
    assert group.newest_holder([CommitId(17, 2), CommitId(15, 50)]) == 0
    # Only the chief reads the mark (the agreement hands its floor to the others).
    assert CommittedState(World(round=1, rank=1, size=2), str(tmp_path / "w1"), *_setup(), durable=remote,
                          durable_every_commits=1).generation_floor() == 0
    # Marks only grow: a chief cut off from the store that begins a lower generation later cannot lower it.
    remote.mark_generation(4)
    assert remote.generation_mark() == 17 and restarted.generation_floor() == 18
    assert sorted(p.name for p in (tmp_path / "remote").glob("GENERATION*")) == ["GENERATION-17"]


def test_a_host_cut_off_alone_and_the_group_that_went_on_never_share_a_generation(tmp_path):
    """Under a new store (rounds from 0, generations far above): host H, cut off, trains alone in round 1;
    the group goes on without it in round 2, both from the commit all held (generation 21). Each chief's
    durable mark is its own (the default per-host `RUN_DIR/durable`). They shared generation 22, and at
    the rejoin H's longer abandoned history won the agreement: the group's work was dropped."""
    agreed = CommitId(21, 150)
    alone = CommittedState(World(round=1), str(tmp_path / "h"), *_setup(), durable=DurableCopies(
        str(tmp_path / "h" / "durable")), durable_every_commits=10)
    alone.begin_generation(agreed, alone.generation_floor())
    marked = DurableCopies(str(tmp_path / "a" / "durable"))
    marked.mark_generation(21)
    went_on = CommittedState(World(round=2), str(tmp_path / "a"), *_setup(), durable=marked, durable_every_commits=10)
    went_on.begin_generation(agreed, went_on.generation_floor())
    assert went_on.generation > alone.generation
    rejoin = [CommitId(went_on.generation, 400), CommitId(went_on.generation, 400), CommitId(alone.generation, 900)]
    assert group.newest_holder(rejoin) == 0  # the group's history, not H's longer one


def test_commits_named_before_generations_are_refused_not_ignored(tmp_path):
    """A run dir or durable directory of the previous format (`ckpt-STEP-EPOCH-SAMPLES`, a 4-element
    progress variable) is refused with an error naming the commit, never passed over for a fresh start
    (that would lose every committed step) nor read as "another model"."""
    model, schedule = _trained()
    state = CommittedState(World(), str(tmp_path / "run"), model, schedule)
    state.commit(epoch=1, samples=0, step=120, global_batch=16)
    directory = Path(state.directory)
    for path in directory.glob("ckpt-*"):
        path.rename(directory / path.name.replace("ckpt-0-120-", "ckpt-120-"))
    text = (directory / "checkpoint").read_text().replace("ckpt-0-120-", "ckpt-120-")
    (directory / "checkpoint").write_text(text)
    with pytest.raises(ConfigurationError, match="ckpt-120-1-0 was written by a tf_elastic before commit gen"):
        CommittedState(World(), str(tmp_path / "run"), *_setup()).restore()
    remote = tmp_path / "remote"
    (remote / "ckpt-120-1-0").mkdir(parents=True)
    (remote / "ckpt-120-1-0" / "COMPLETE").write_text("ckpt-120-1-0")
    fresh = CommittedState(World(), str(tmp_path / "fresh"), *_setup(), durable=DurableCopies(remote),
                           durable_every_commits=1)
    with pytest.raises(ConfigurationError, match="ckpt-120-1-0 was written by a tf_elastic before"):
        fresh.restore()


@pytest.fixture(params=["ram", "gs", "s3"])
def remote(request, tmp_path, monkeypatch):
    """A durable-copy directory on ram://, on gs:// through TensorFlow's own GCS filesystem and a local
    emulator (`tf_elastic.testing.gcs`: TF has no endpoint setting, so a proxy takes its requests), or on
    s3:// through boto3 and moto's S3 server (the `s3` fixture)."""
    if request.param == "ram":
        yield f"ram://durable-{uuid.uuid4().hex}"
        return
    if request.param == "s3":
        request.getfixturevalue("s3")
        yield f"s3://bucket/durable-{uuid.uuid4().hex}"
        return
    for module in ("gcp_storage_emulator", "cryptography"):
        pytest.importorskip(module, reason=f"gs:// is tested against a local emulator: pip install "
                                           f"gcp-storage-emulator cryptography (the test extra); {module} is missing")
    from tf_elastic.testing.gcs import emulated_gcs

    with emulated_gcs(tmp_path, "bucket") as env:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        yield f"gs://bucket/durable-{uuid.uuid4().hex}"


@pytest.mark.slow  # a storage server in a process of its own: beside an alone job the gs:// case took 46 s
def test_durable_copies_on_any_filesystem_restore_a_whole_job_bit_exact(tmp_path, remote):
    """Durable copies end to end on ram://, gs:// and s3://: every 2nd commit and the last are copied, old
    copies are collected, a partial copy is never taken, and fresh hosts (empty run dirs) resume from it."""
    model, schedule = _trained()
    state = CommittedState(World(), str(tmp_path / "host"), model, schedule, durable=DurableCopies(remote, keep=2),
                           durable_every_commits=2, background=True)
    for step in range(1, 6):
        state.commit(epoch=0, samples=16 * step, step=step, global_batch=16)
    state.close(final=True)
    copies = DurableCopies(remote).copies()
    assert [(c.step, c.complete) for c in copies] == [(4, True), (5, True)]
    # A copy cut short (no marker), newer than any complete one: never taken.
    partial, storage = posixpath.join(remote, "ckpt-0-9-0-144"), DurableCopies(remote).storage
    storage.makedirs(partial)
    for path in (tmp_path / "host" / "checkpoints").glob("ckpt-0-5-0-80.*"):
        storage.upload(str(path), posixpath.join(partial, path.name.replace("ckpt-0-5-0-80", "ckpt-0-9-0-144")))
    assert DurableCopies(remote).newest().step == 5

    fresh, fresh_schedule = _setup()
    restored = CommittedState(World(), str(tmp_path / "new-host"), fresh, fresh_schedule,
                              durable=DurableCopies(remote), durable_every_commits=2)
    path, skipped = restored.restore()
    assert path == posixpath.join(remote, "ckpt-0-5-0-80", "ckpt-0-5-0-80") and skipped == []
    assert (restored.step, restored.samples) == (5, 80)
    for a, b in zip([*model.weights, *model.optimizer.variables], [*fresh.weights, *fresh.optimizer.variables]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # The next copy collects the partial one (older than the newest complete) and the oldest complete.
    restored.commit(epoch=0, samples=16 * 12, step=12, global_batch=16)
    restored.commit(epoch=0, samples=16 * 13, step=13, global_batch=16)
    assert [(c.step, c.complete) for c in DurableCopies(remote).copies()] == [(5, True), (13, True)]


def test_a_local_commit_is_preferred_to_an_older_durable_copy(tmp_path):
    remote = str(tmp_path / "remote")
    model, schedule = _trained()
    state = CommittedState(World(), str(tmp_path / "run"), model, schedule, durable=DurableCopies(remote),
                           durable_every_commits=3)
    for step in range(1, 5):
        state.commit(epoch=0, samples=step, step=step, global_batch=16)
    assert DurableCopies(remote).newest().step == 3
    path, _ = CommittedState(World(), str(tmp_path / "run"), *_setup(), durable=DurableCopies(remote),
                             durable_every_commits=3).restore()
    assert path.endswith("checkpoints/ckpt-0-4-0-4")


@pytest.mark.parametrize("where", ["file", "scheme"])
def test_a_checkpoint_dir_that_cannot_be_written_is_a_clear_error(tmp_path, where):
    (tmp_path / "a-file").write_text("x")
    directory = str(tmp_path / "a-file" / "durable") if where == "file" else "nope://bucket/durable"
    model, schedule = _setup()
    with pytest.raises(ConfigurationError, match=r"--checkpoint_dir=.* cannot be written .*--durable_every_commits=0"):
        CommittedState(World(), str(tmp_path / "run"), model, schedule, durable=DurableCopies(directory),
                       durable_every_commits=1)


def _obey_file_modes() -> None:
    """Runs in the child before exec. Root ignores file modes (CAP_DAC_OVERRIDE), so a chmod 555 directory
    is not read-only to a test run as root; a child whose capability bounding set lacks CAP_DAC_OVERRIDE
    and CAP_DAC_READ_SEARCH execs without them and meets the modes as any user would."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, capability, 0, 0, 0):  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed: no CAP_SETPCAP")


def _train_obeying_file_modes(args, env=None, module_args=(sys.executable, "-m", "launch.train")) -> subprocess.Popen:
    command = [*module_args, "--dataset=digits", "--optimizer=sgd", "--threads=1",
               "--commit_every_steps=10", "--durable_every_commits=1", *args]
    try:
        return subprocess.Popen(command, cwd=REPO, env=repo_env(**(env or {})), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=_obey_file_modes)
    except subprocess.SubprocessError as error:
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE for a child process here ({error}): no real read-only directory")


@pytest.mark.slow
def test_a_read_only_checkpoint_dir_fails_at_start_and_a_copy_failing_later_does_not_stop_training(tmp_path):
    """A real read-only directory (the worker runs without root's override of file modes): at start, exit
    78 naming it; turned read-only in the middle of a copy, that copy and the later ones fail, are
    logged, and training goes on to the end with every commit in force on the host."""
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    read_only.chmod(0o555)
    proc = _train_obeying_file_modes(["--epochs=1", f"--run_dir={tmp_path / 'first'}", f"--checkpoint_dir={read_only}"])
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 78, stderr[-3000:]
    assert f"--checkpoint_dir={read_only} cannot be written" in stderr and "--durable_every_commits=0" in stderr

    durable, pause, run = tmp_path / "durable", tmp_path / "pause", tmp_path / "run"
    pause.mkdir()
    (pause / "durable").touch()
    proc = _train_obeying_file_modes(["--epochs=2", f"--run_dir={run}", f"--checkpoint_dir={durable}"],
                                     env={faults.PAUSE_DIR: str(pause)}, module_args=faults.command("launch.train"))
    try:
        deadline = time.time() + 180
        while not (pause / "durable.reached-rank0").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert (pause / "durable.reached-rank0").exists(), proc.communicate()[1][-3000:]
        for folder in (durable, *durable.iterdir()):
            folder.chmod(0o555)  # the first copy's files are there, its marker not yet
        (pause / "durable").unlink()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    events = _events(run)
    failed = [e for e in events if e["event"] == Event.DURABLE_COPY and "error" in e]
    assert failed and all("Permission denied" in e["error"] for e in failed), failed
    assert f"{durable}/ckpt-0-10-0-320" in failed[0]["error"] + failed[0]["path"], failed[0]
    commits = [e["step"] for e in events if e["event"] == Event.COMMIT]
    assert len(commits) > 2 and commits == sorted(commits), commits
    assert tf.train.latest_checkpoint(str(RunDir(run).checkpoints)).split("/")[-1].split("-")[2] == str(commits[-1])
    assert DurableCopies(str(durable)).newest() is None


def test_a_durable_copy_of_another_model_is_a_clear_error_and_stays(tmp_path):
    remote = str(tmp_path / "remote")
    model, schedule = _trained()
    CommittedState(World(), str(tmp_path / "run"), model, schedule, durable=DurableCopies(remote),
                   durable_every_commits=1).commit(epoch=0, samples=1, step=1, global_batch=16)
    other, other_schedule = _setup(width=3)
    with pytest.raises(ConfigurationError, match=r"ckpt-0-1-0-1 does not fit this model .*--checkpoint_dir"):
        CommittedState(World(), str(tmp_path / "empty"), other, other_schedule, durable=DurableCopies(remote),
                       durable_every_commits=1).restore()
    assert DurableCopies(remote).newest().step == 1


def test_a_full_local_disk_keeps_the_previous_commit_in_force(tmp_path, monkeypatch):
    """The write of a commit fails (ENOSPC reaches TF as ResourceExhausted): reported, training goes on,
    the state file still names the previous commit, and the next commit works again."""
    from tf_elastic.elastic.events import EventLog

    model, schedule = _trained()
    state = CommittedState(World(), str(tmp_path), model, schedule, events=EventLog(tmp_path, "worker:0"))
    state.commit(epoch=0, samples=16, step=1, global_batch=16)
    write = state._write

    def full(prefix):
        raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")

    monkeypatch.setattr(state, "_write", full)
    state.commit(epoch=0, samples=32, step=2, global_batch=16)
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-0-1-0-16")
    failed = [e for e in _events(tmp_path) if e["event"] == Event.COMMIT_FAILED]
    assert len(failed) == 1 and "No space left on device" in failed[0]["error"] and failed[0]["step"] == 2
    monkeypatch.setattr(state, "_write", write)
    state.commit(epoch=0, samples=48, step=3, global_batch=16)
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-0-3-0-48")


# Real processes: hosts with run dirs of their own, an S3 bucket (moto's server) as the "remote" ---------
COMMIT_EVERY = 10
TRAIN = ["--dataset=mnist", "--train_examples=3000", "--per_replica_batch_size=16", "--threads=1",
         f"--commit_every_steps={COMMIT_EVERY}", "--optimizer=sgd", "--durable_every_commits=2"]
AGENT = ["--min_workers=1", "--max_workers=2", "--index_log", "--heartbeat_timeout=5", "--last_call=1"]


def _round_host(job, round_, rank):
    return [e for e in job.events(Event.WORKER_START, round=round_, rank=rank)][-1]["source"].split(":", 1)[1]


def _restored(job, round_):
    return [e for e in job.events(Event.RESTORE, round=round_, rank=0)][0]["step"]


def _last_commit_before(job, round_):
    """The newest step committed (in force on the chief's host) in an earlier round."""
    return max(e["step"] for e in job.events(Event.COMMIT) if e["round"] < round_)


def _first_step(job, after_round, world_size):
    return job.wait_for(lambda: [e for e in job.events(Event.FIRST_STEP, rank=0)
                                 if e["round"] > after_round and e["world_size"] == world_size],
                        what=f"a first step after round {after_round} at world size {world_size}")[0]


def _written_steps(directory) -> list:
    """Steps of the commits whose files are written there (in force or not)."""
    return [commit_id(p.name[: -len(".index")]).step for p in Path(directory).glob("ckpt-*.index")]


def _in_force_step(directory) -> int:
    path = tf.train.latest_checkpoint(str(directory))
    return commit_id(posixpath.basename(path)).step if path else -1


def _pause_and_kill(job, pause: Path, point: str, rank: int, while_held: Callable[[], object] = lambda: None):
    """Holds every commit at `point`, calls `while_held` once the worker of `rank` is there, SIGKILLs that worker
    and lets go; returns the round it trained in (a round change may come between the test's look at the
    events and the hold) and what `while_held` returned."""
    reached = pause / f"{point}.reached-rank{rank}"
    reached.unlink(missing_ok=True)  # an earlier hold's
    (pause / point).touch()
    job.wait_for(reached.exists, what=f"rank {rank} at {point}")
    pid = int(reached.read_text())
    assert pid in job.worker_pids_alive(), (pid, "not a worker of this job")
    round_ = [e["round"] for e in job.events(Event.WORKER_START) if e["worker_pid"] == pid][-1]  # before a reuse
    seen = while_held()
    signal_pid(pid, signal.SIGKILL)
    (pause / point).unlink()
    return round_, seen


@pytest.mark.slow
@pytest.mark.alone(minutes=2)
def test_hosts_sharing_no_directory_survive_losing_the_chief_host_and_a_joiner_with_an_empty_disk(tmp_path,
                                                                                                  mnist_dir, s3):
    """Hosts a and b (own run dirs; durable copies in an S3 bucket, moto's server): the chief's host is killed;
    c joins with an empty disk and receives the state; a worker is SIGKILLed in the middle of its local
    commit, the chief in the middle of a durable copy; then every host is lost and a fresh host resumes
    from the newest complete durable copy. No committed step is lost, replicas hold the same bits after
    every recovery, and committed work used every example once per epoch."""
    remote, pause = "s3://bucket/remote", tmp_path / "pause"
    pause.mkdir()
    env = {**s3, faults.PAUSE_DIR: str(pause)}
    job = LocalJob(tmp_path / "job", TRAIN + ["--epochs=200", f"--checkpoint_dir={remote}", f"--data_dir={mnist_dir}"],
                   AGENT,
                   host_run_dirs=True, trainer="launch.train")
    (tmp_path / "job").mkdir()
    try:
        job.start_agent("a", env=env, faults=True)
        job.start_agent("b", env=env, faults=True)
        survivor = _lose_the_chief_host_while_the_other_holds_a_commit(job, pause)
        joined = _join_with_an_empty_disk(job, env, survivor["round"])
        after_local = _kill_a_worker_in_its_local_commit(job, pause, joined["round"])
        partial, after_durable = _kill_the_chief_in_a_durable_copy(job, pause, remote, after_local["round"])
        _lose_every_host_and_check_the_job(job, remote, partial, after_durable["round"])
    finally:
        job.cleanup()
    _resume_from_the_newest_durable_copy(tmp_path, remote, mnist_dir, s3)


def _lose_the_chief_host_while_the_other_holds_a_commit(job, pause: Path) -> dict:
    """Once a and b committed at world size 2, the chief's host is killed while the other host holds a
    commit that the chief's host completed; returns the survivor's first step at world size 1."""
    pair = job.wait_for(lambda: [e for e in job.events(Event.COMMIT) if e["world_size"] == 2
                                 and e["step"] >= COMMIT_EVERY], what="a commit at world size 2")[0]
    chief = _round_host(job, pair["round"], 0)
    # The next commit is held on the other host before its state file names it, and completes on the
    # chief's: it is in force on one host only, so it must not be announced, and losing the chief's host
    # then loses nothing that was announced.
    (pause / "local.rank1").touch()
    job.wait_for(lambda: (pause / "local.reached-rank1").exists(), what="rank 1 holding a commit")
    other = _round_host(job, pair["round"], 1)
    other_commits = RunDir(job.run_dir_of(other)).host_commits(other)
    held = min(step for step in _written_steps(other_commits) if step > _in_force_step(other_commits))
    chief_commits = RunDir(job.run_dir_of(chief)).host_commits(chief)
    job.wait_for(lambda: _in_force_step(chief_commits) >= held, what="the held commit in force on the chief's")
    # Commits are made at agreed steps: a later one written on the chief's host means the group agreed at
    # least once since the held commit went in force there, when the chief would have announced it.
    job.wait_for(lambda: any(step > held for step in _written_steps(chief_commits)), what="a later commit")
    assert all(e["step"] < held for e in job.events(Event.COMMIT)), ("announced on one host only", held)
    job.kill_host(chief)
    (pause / "local.rank1").unlink()
    survivor = _first_step(job, pair["round"], 1)
    assert _restored(job, survivor["round"]) >= _last_commit_before(job, survivor["round"]), "lost a commit"
    return survivor


def _join_with_an_empty_disk(job, env: dict, survivor_round: int) -> dict:
    """Host c joins the survivor with an empty run dir and receives the state from rank 0 as rank 1;
    returns the chief's first step of that round."""
    job.start_agent("c", env=env, faults=True)
    joined = _first_step(job, survivor_round, 2)
    assert _restored(job, joined["round"]) == _last_commit_before(job, joined["round"]), "a join lost steps"
    received = job.events(Event.STATE_TRANSFER, round=joined["round"])
    assert [(e["rank"], e["source_rank"]) for e in received] == [(1, 0)] and received[0]["bytes"] > 0, received
    assert _round_host(job, joined["round"], 1) == "c"
    return joined


def _kill_a_worker_in_its_local_commit(job, pause: Path, joined_round: int) -> dict:
    """c's worker (rank 1) is SIGKILLed with a commit's files written and its state file not naming it yet;
    returns the chief's first step of the next round of two."""
    job.wait_for(lambda: job.events(Event.COMMIT, round=joined_round), what="a commit with c")
    killed_round, _ = _pause_and_kill(job, pause, "local", 1)  # c: files written, state file not yet
    after_local = _first_step(job, killed_round, 2)
    assert _restored(job, after_local["round"]) >= _last_commit_before(job, after_local["round"])
    # c restarts from its previous commit and receives the newer one, if the group holds one: the chief
    # was held at the same point, and its commit is cut too when its worker is stopped first (under load).
    mine = job.events(Event.RESTORE, round=after_local["round"], rank=1)[0]
    held = commit_id(posixpath.basename(mine["path"] or "")) or NO_COMMIT
    assert held.step == mine["step"] or job.events(Event.STATE_TRANSFER, round=after_local["round"], rank=1)
    return after_local


def _kill_the_chief_in_a_durable_copy(job, pause: Path, remote: str, after_local_round: int):
    """The chief is SIGKILLed with a durable copy's files up and its marker not yet written (the copies are
    listed while it is held there); returns the copies without a marker and the chief's first step of the next
    round of two."""
    job.wait_for(lambda: job.events(Event.DURABLE_COPY, round=after_local_round), what="a durable copy")

    def held_copies():  # the chief at the marker: its copy's files are up
        copies = DurableCopies(remote).copies()
        return [c for c in copies if not c.complete], [c for c in copies if c.complete]

    killed_round, (partial, complete) = _pause_and_kill(job, pause, "durable", 0, held_copies)
    assert partial, "the copy cut short is there, without its marker"
    assert complete[-1].step < partial[-1].step, (complete, partial)
    after_durable = _first_step(job, killed_round, 2)
    assert _restored(job, after_durable["round"]) >= _last_commit_before(job, after_durable["round"])
    return partial, after_durable


def _lose_every_host_and_check_the_job(job, remote: str, partial: list, after_durable_round: int) -> None:
    """Once a durable copy of the round after the restart is up, every host is killed; then the job's records
    are checked: replicas, every example once per epoch, the cut copy collected, the report's rounds."""
    job.wait_for(lambda: [e for e in job.events(Event.DURABLE_COPY, round=after_durable_round)
                          if "bytes" in e], what="a durable copy after the restart")
    for host in ("a", "b", "c"):
        if job.agents[host].poll() is None:
            job.kill_host(host)
    # Replicas agreed bit for bit in every round of two.
    for round_ in {e["round"] for e in job.events(Event.RESTORE) if e["world_size"] == 2}:
        digests = {e["rank"]: e["state_digest"] for e in job.events(Event.RESTORE, round=round_)}
        assert len(digests) == 2 and len(set(digests.values())) == 1, (round_, digests)
    # Every example once in every epoch that committed work completed (the last is cut by the kills).
    by_epoch = audit.uses_by_epoch(job.run_dirs)
    done = [e for e in sorted(by_epoch) if e < max(c["epoch"] for c in job.events(Event.COMMIT))]
    assert len(done) >= 2
    for epoch in done:
        counts = by_epoch[epoch]
        assert max(counts.values()) == 1 and len(counts) > 3000 - 32, epoch
    assert partial[-1].step not in [c.step for c in DurableCopies(remote).copies()], "not collected"
    # launch.report reads every host's run dir: a table row for each round that trained.
    table = [line for line in report.summary(job.run_dirs).splitlines() if line.startswith("| ")][1:]
    assert len(table) == len({e["round"] for e in job.events(Event.RESTORE, rank=0)}), table


def _resume_from_the_newest_durable_copy(tmp_path: Path, remote: str, mnist_dir, s3: dict) -> None:
    """The whole job is lost. Host d (two workers, an empty run dir) and host s resume it from the newest
    complete copy: s holds a stale commit, 1000 steps further than the copy but of an older generation
    (a host cut off from the store that trained on alone), which must lose. d's second worker keeps no
    commits: it receives the state at every round start (here two: s's worker is killed once)."""
    newest = DurableCopies(remote).newest()
    epoch = int(posixpath.basename(newest.prefix).split("-")[3])
    again = LocalJob(tmp_path / "again", TRAIN + [f"--epochs={epoch + 3}", f"--checkpoint_dir={remote}",
                                                  f"--data_dir={mnist_dir}"],
                     AGENT + ["--min_workers=3", "--max_workers=3"], host_run_dirs=True, trainer="launch.train")
    (tmp_path / "again").mkdir()
    assert newest.id.generation >= 1, newest
    old_mark = DurableCopies(remote).generation_mark()
    assert old_mark >= newest.id.generation, (old_mark, newest)
    stale = _plant_commit(DurableCopies(remote).readable(newest, str(tmp_path / "fetched")),
                          RunDir(again.run_dir_of("s")).host_commits("s"),
                          CommitId(newest.id.generation - 1, newest.step + 1000))
    try:
        again.start_agent("d", env=s3, nproc=2)
        again.start_agent("s", env=s3)
        first = _first_step(again, -1, 3)
        restore = again.events(Event.RESTORE, round=first["round"], rank=0)[0]  # the chief, d's or s's
        assert (restore["step"], restore["path"]) == (newest.step, newest.prefix), restore
        # The new store counts rounds from 0: every worker commits above the old job's mark, the chief's
        # floor having reached the others through the agreement.
        generations = {e["commit_generation"] for e in again.events(Event.RESTORE, round=first["round"])}
        assert len(generations) == 1 and min(generations) > old_mark, (generations, old_mark)
        again.wait_for(lambda: again.events(Event.COMMIT, round=first["round"]), what="a commit of d and s")
        again.kill_worker("s", first["round"])
        second = _first_step(again, first["round"], 3)
        assert _restored(again, second["round"]) >= _last_commit_before(again, second["round"]), "lost a commit"
        assert again.wait_agents() == {"d": 0, "s": 0}, again.describe()
        _check_the_resumed_rounds(again, (first["round"], second["round"]), stale)
        by_epoch = audit.uses_by_epoch(again.run_dirs)
        for done in (epoch + 1, epoch + 2):  # trained by this job alone
            assert max(by_epoch[done].values()) == 1 and len(by_epoch[done]) > 3000 - 48, done
    finally:
        again.cleanup()


def _check_the_resumed_rounds(again, rounds, stale: CommitId) -> None:
    """In each of the resumed job's two rounds, one rank sent the state (never the stale commit's) and d's
    second worker received it; the ranks are bit-identical at each round's start, and at the second's end
    (the first round is cut by the kill and has no end)."""
    for round_ in rounds:
        transfers = again.events(Event.STATE_TRANSFER, round=round_)
        second_worker = [e["rank"] for e in again.events(Event.WORKER_START, round=round_, source="agent:d")
                         if e["local_rank"] == 1]
        assert len({(e["source_rank"], e["step"]) for e in transfers}) == 1, transfers
        assert transfers[0]["step"] == _restored(again, round_), transfers
        assert second_worker[0] in [e["rank"] for e in transfers], (second_worker, transfers)
        assert all(e["generation"] > stale.generation for e in transfers), (transfers, stale)
        # Bit-identical at the start of each round, and at the end (a round cut by the kill has no end).
        for name in (Event.RESTORE, Event.WORKER_EXIT)[:1 + (round_ == rounds[1])]:
            digests = {e["rank"]: e["state_digest"] for e in again.events(name, round=round_)}
            assert sorted(digests) == [0, 1, 2] and len(set(digests.values())) == 1, (name, digests)


def _plant_commit(source: str, directory: Path, id_: CommitId) -> CommitId:
    """Writes the commit at `source` into `directory` as that host's only commit, with another id."""
    reader = tf.train.load_checkpoint(source)
    names = sorted(reader.get_variable_to_shape_map())
    tensors = [reader.get_tensor(name) for name in names]
    key = "progress/.ATTRIBUTES/VARIABLE_VALUE"
    progress = tensors[names.index(key)]
    progress[2], progress[4] = id_.step, id_.generation
    prefix = str(directory / f"ckpt-{id_.generation}-{id_.step}-{progress[0]}-{progress[1]}")
    directory.mkdir(parents=True)
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
    tf.compat.v1.train.update_checkpoint_state(str(directory), prefix, all_model_checkpoint_paths=[prefix],
                                               all_model_checkpoint_timestamps=[time.time()])
    return id_
