"""The worker side: strategy, committed state, and `fit` that survives restarts at any world size.

Commit / restore is the one vocabulary for what survives a failure (like Horovod elastic's `State`):
model, optimizer slots and `iterations`, the batch-resize history, epoch, samples consumed in the
epoch and the global step are written together (in the layout `tf.train.CheckpointManager` reads) and
read back bit-exact.
"""
import json
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import keras
from absl import logging

from tf_elastic.elastic import keras_compat
from tf_elastic.elastic import world as contract
from tf_elastic.elastic.data_plan import DataPlan, replica_batch_size
from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.world import World
from tf_elastic.schedules import BatchResizeSchedule

COLLECTIVE_FAILURES = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError,
                       tf.errors.AbortedError, tf.errors.InternalError)
CHECKPOINT_DIR = "checkpoints"


RESOLVERS = ("tf_config", "slurm", "kubernetes")
STRATEGIES = ("auto", "one_device", "mirrored", "mwms", "tpu")
COLLECTIVES = ("auto", "ring", "nccl")


def resolve_world(resolver: str = "tf_config", port_base: int = 8888, k8s_selector: Optional[str] = None,
                  k8s_client=None) -> World:
    """This worker's world. Under the agent, or with `tf_config`: the `TF_CONFIG` it finds (none: one worker).

    Without an agent, `slurm` and `kubernetes` ask TF's cluster resolver and write what it says to
    `TF_CONFIG`, which MultiWorkerMirroredStrategy reads. Such a world has a fixed size: the scheduler
    restarts a failed job (Slurm `--requeue`, a Kubernetes restart policy) and `fit` resumes from the
    last commit in the run dir, as Keras' `BackupAndRestore` does. `k8s_client`: a Kubernetes `CoreV1Api`
    (default: the pod's service account, else the kubeconfig).
    """
    if resolver not in RESOLVERS:
        raise ValueError(f"--cluster_resolver must be one of {', '.join(RESOLVERS)}; got {resolver!r}.")
    if resolver == "tf_config":
        return World.from_env()
    if any(name in os.environ for name in (contract.ENV_WARM, contract.ENV_HEARTBEAT_FILE)):
        raise ValueError(f"--cluster_resolver={resolver}: the elastic agent gives this worker its world; "
                         f"use tf_config under launch.elastic_run.")
    if resolver == "slurm":
        # The resolver gives a node only as many tasks as it has GPUs (it asks nvidia-smi). On a CPU node,
        # let every task of the step fit, and leave CUDA_VISIBLE_DEVICES alone.
        cpu_only = {} if shutil.which("nvidia-smi") else {
            "gpus_per_node": int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)), "gpus_per_task": 1, "auto_set_gpu": False}
        try:
            found = tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=port_base, **cpu_only)
        except RuntimeError as error:  # outside a job step, or more tasks than the step has
            raise ValueError(f"--cluster_resolver=slurm: {error} (start the workers with srun)") from None
        cluster = found.cluster_spec().as_dict()  # (this also sets task_type and task_id)
        task = {"type": found.task_type, "index": found.task_id}
    else:
        if not k8s_selector:
            raise ValueError("--cluster_resolver=kubernetes needs --k8s_selector (the workers' pod label selector, "
                             "for example job-name=my-job).")
        try:
            found = tf.distribute.cluster_resolver.KubernetesClusterResolver(
                {"worker": [k8s_selector]}, tf_server_port=port_base, override_client=k8s_client or _kubernetes_api())
            cluster = found.cluster_spec().as_dict()
        except RuntimeError as error:  # a selected pod is not running (yet): the restart policy tries again
            raise ValueError(f"--cluster_resolver=kubernetes: {error}") from None
        # The resolver lists the pods' node addresses (so: hostNetwork pods, one per node), sorted by pod
        # name ("w-10" before "w-2"): find ourselves by address, not by ordinal.
        mine = f"{socket.gethostbyname(socket.gethostname())}:{port_base}"
        workers = cluster.get("worker", [])
        if workers.count(mine) != 1:
            raise ValueError(f"--k8s_selector={k8s_selector!r} selects {workers}, which should hold this pod's node "
                             f"address {mine} once (hostNetwork pods, one per node).")
        task = {"type": "worker", "index": workers.index(mine)}
    os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})
    return World.from_env()


def _kubernetes_api():
    """The pod's own API access (its service account), else a kubeconfig. (TF's resolver would read a
    kubeconfig only, which a pod does not have.)"""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ValueError("--cluster_resolver=kubernetes needs the kubernetes package: pip install kubernetes") from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()


def make_strategy(world: World, kind: str = "auto", collective: str = "auto",
                  tpu: Optional[str] = None) -> tf.distribute.Strategy:
    """The strategy for this world.

    `auto`: MultiWorkerMirroredStrategy when the world has several workers, MirroredStrategy over
    several local GPUs, else the default strategy. Before MWMS is created, the coordination service's
    heartbeat is set from the agent's heartbeat timeout (MWMS keeps a configuration it finds), so a hung
    peer is detected in seconds, not 10+ s. `collective` picks MWMS's all-reduce (`nccl` for GPUs).
    `tpu` connects to `--tpu` through `TPUClusterResolver` (a fixed-size, single-worker path).
    """
    if kind not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}; got {kind!r}.")
    if collective not in COLLECTIVES:
        raise ValueError(f"--collective must be one of {', '.join(COLLECTIVES)}; got {collective!r}.")
    if world.size > 1 and kind not in ("auto", "mwms"):
        raise ValueError(f"--strategy={kind} is single-worker, but this world has {world.size} workers; use mwms.")
    # Physical devices only: listing logical ones initialises the runtime, after which MWMS can no
    # longer configure its collectives.
    several_gpus = len(tf.config.list_physical_devices("GPU")) > 1
    if kind == "tpu":
        if not tpu:
            raise ValueError("--strategy=tpu needs --tpu (a TPU name or grpc://HOST:PORT).")
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    if kind == "one_device":
        return tf.distribute.OneDeviceStrategy("/gpu:0" if tf.config.list_physical_devices("GPU") else "/cpu:0")
    if kind == "mirrored":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.MirroredStrategy([d.name for d in gpus or tf.config.list_logical_devices("CPU")])
    if kind == "auto" and world.size == 1:
        return tf.distribute.MirroredStrategy() if several_gpus else tf.distribute.get_strategy()
    if world.size > 1:
        from tensorflow.python.eager import context

        CoordinatedJob = context.coordination_config_pb2.CoordinatedJob  # wherever this TF version keeps it
        context.context().configure_coordination_service(
            "standalone", service_leader="/job:worker/replica:0/task:0",
            heartbeat_timeout_in_ms=int(world.heartbeat_timeout * 1000),
            coordinated_jobs=[CoordinatedJob(name="worker", num_tasks=world.size)])
    implementation = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
                      "ring": tf.distribute.experimental.CommunicationImplementation.RING,
                      "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}[collective]
    return tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation))


class CommittedState:
    """What survives a failure, saved atomically: chief to RUN_DIR/checkpoints, others to a temp dir.

    A commit is a traced `Checkpoint.write` followed by the `checkpoint` state file that
    `tf.train.CheckpointManager` and `tf.train.latest_checkpoint` read. The manager's own `save`
    re-serialises the object graph in Python on every call (measured 20-35 ms against 4 ms traced for
    mnist_cnn: 3 % of training at 50-step commits). The state file is replaced atomically once the files
    it names are complete, so a worker killed mid-commit leaves the previous commit in force.
    """

    def __init__(self, world: World, run_dir: str, model: keras.Model,
                 schedule: Optional[BatchResizeSchedule] = None, max_to_keep: int = 3):
        self.world = world
        self.progress = tf.Variable(np.zeros(4, np.int64), trainable=False, name="elastic_progress")
        items = {"model": model, "optimizer": model.optimizer, "progress": self.progress}
        if schedule is not None:
            items["batch_history"] = schedule.state
        self.checkpoint = tf.train.Checkpoint(**items)
        self.directory = str(Path(run_dir) / CHECKPOINT_DIR)
        # A non-chief writes too (saving may run collectives) but keeps nothing: into a scratch dir that
        # the agent deletes even when this process is killed, or a temp dir of our own.
        self._write_dir = self.directory if world.is_chief else (
            world.scratch_dir or tempfile.mkdtemp(prefix=f"tf_elastic-rank{world.rank}-"))
        self._temp_dir = None if world.is_chief else self._write_dir
        Path(self._write_dir).mkdir(parents=True, exist_ok=True)
        self._max_to_keep = max_to_keep
        kept = tf.train.get_checkpoint_state(self._write_dir)
        # (path, time) pairs: with the times, `tf.train.CheckpointManager` also lists these commits.
        self._kept = list(zip(kept.all_model_checkpoint_paths, kept.all_model_checkpoint_timestamps)) if kept else []
        # Traced on the first commit, once every variable (optimizer slots included) exists.
        self._write = tf.function(lambda prefix: self.checkpoint.write(prefix))

    @property
    def epoch(self) -> int:
        return int(self.progress[0])

    @property
    def samples(self) -> int:
        return int(self.progress[1])

    @property
    def step(self) -> int:
        return int(self.progress[2])

    def restore(self) -> Tuple[Optional[str], List[Tuple[str, str]]]:
        """Restores the newest readable commit (every worker reads the chief's).

        Returns its path (None when nothing was committed yet) and the newer ones skipped as unreadable
        (truncated or corrupted files), each with the error. A commit of another model is an error."""
        kept = tf.train.get_checkpoint_state(self.directory)
        skipped = []
        for path in reversed(kept.all_model_checkpoint_paths if kept else []):
            try:
                self.checkpoint.read(path).assert_existing_objects_matched()
                return path, skipped
            except (tf.errors.OpError, IndexError) as error:  # the reader raises IndexError on a short file
                skipped.append((path, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"))
            except (AssertionError, ValueError) as error:
                raise ValueError(f"the committed state {path} does not fit this model or optimizer "
                                 f"({str(error).splitlines()[0][:300]}); use another --run_dir or the "
                                 f"configuration it was written with") from None
        if skipped:
            raise ValueError(f"no readable commit in {self.directory}: " + "; ".join(e for _, e in skipped))
        return None, skipped

    def commit(self, epoch: int, samples: int, step: int, global_batch: int) -> None:
        """All workers call this at the same step: saving may run collectives (SyncOnRead variables)."""
        self.progress.assign(np.array([epoch, samples, step, global_batch], np.int64))
        # Named by the whole position: a commit never overwrites the files the state file names.
        prefix = str(Path(self._write_dir) / f"ckpt-{step}-{epoch}-{samples}")
        self._write(tf.constant(prefix))
        if self._temp_dir:
            for path in Path(self._temp_dir).glob("*"):
                path.unlink() if path.is_file() else shutil.rmtree(path)
            return
        self._kept.append((prefix, time.time()))
        expired, self._kept = self._kept[:-self._max_to_keep], self._kept[-self._max_to_keep:]
        paths, times = zip(*self._kept)
        tf.compat.v1.train.update_checkpoint_state(self._write_dir, prefix, all_model_checkpoint_paths=paths,
                                                   all_model_checkpoint_timestamps=times)
        for old, _ in expired:
            for path in Path(old).parent.glob(Path(old).name + ".*"):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


class _ElasticCallback(keras.callbacks.Callback):
    """Feeds exact data positions, commits on cadence, and stops all workers at the same step."""

    def __init__(self, trainer: "_ElasticFit"):
        super().__init__()
        self.t = trainer

    def on_epoch_begin(self, epoch, logs=None):
        self.t.begin_epoch(epoch)

    def on_train_batch_end(self, batch, logs=None):
        self.t.end_step(logs or {})

    def on_epoch_end(self, epoch, logs=None):
        self.t.end_epoch(epoch)


class _ElasticFit:
    def __init__(self, model, x, y, world, strategy, state, plan, batch, commit_every_steps, commit_every_seconds,
                 sync_every_steps, events):
        self.model, self.x, self.y, self.world, self.strategy = model, x, y, world, strategy
        self.state, self.plan, self.batch, self.events = state, plan, batch, events
        self.global_batch = batch * world.size
        self.commit_every_steps, self.commit_every_seconds = commit_every_steps, commit_every_seconds
        self.sync_every_steps = sync_every_steps
        self.epoch, self.epoch_start, self.batches, self.k = state.epoch, state.samples, [], 0
        self.step = state.step
        self.last_commit = time.time()
        self.stop_requested = self.stopped = False
        self.first_step_logged = False
        self.last_loss = None
        self._sum = None
        self._index_log = None
        if world.index_log and world.run_dir:
            path = Path(world.run_dir) / "indices" / f"round{world.round}-rank{world.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._index_log = open(path, "a", encoding="utf-8")
        self.set_batches(self.epoch, self.epoch_start)

    def set_batches(self, epoch: int, start: int) -> None:
        self.epoch, self.epoch_start, self.k = epoch, start, 0
        self.batches = self.plan.replica_batches(epoch, start, self.world.size, self.world.rank, self.batch)

    def dataset(self) -> tf.data.Dataset:
        def generate():
            for index in self.batches:
                yield self.x[index], self.y[index]

        spec = (tf.TensorSpec((self.batch, *self.x.shape[1:]), tf.as_dtype(self.x.dtype)),
                tf.TensorSpec((self.batch, *self.y.shape[1:]), tf.as_dtype(self.y.dtype)))
        dataset = tf.data.Dataset.from_generator(generate, output_signature=spec)
        # A known length: with an unknown one Keras 3.15 counts one extra optimizer iteration per epoch.
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(len(self.batches))).prefetch(2)
        options = tf.data.Options()
        # Each worker feeds exactly its own slices: no automatic sharding on top.
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return dataset.with_options(options)

    # Callback hooks ------------------------------------------------------------------------------
    def begin_epoch(self, epoch: int) -> None:
        self.epoch_began = time.time()
        if epoch != self.epoch:
            self.set_batches(epoch, 0)
        else:
            self.k = 0

    def end_step(self, logs: Dict) -> None:
        self.last_loss = logs.get("loss")
        if self._index_log is not None:
            self._index_log.write(json.dumps({"round": self.world.round, "rank": self.world.rank, "epoch": self.epoch,
                                              "step": self.step + 1,
                                              "indices": self.batches[self.k].tolist()}) + "\n")
            self._index_log.flush()
        self.k += 1
        self.step += 1
        contract.report_progress(self.step)
        if not self.first_step_logged:
            self.first_step_logged = True
            self.events.write("first_step", round=self.world.round, rank=self.world.rank, step=self.step,
                              world_size=self.world.size)
        commit = self.commit_every_steps and self.step % self.commit_every_steps == 0
        if self.step % self.sync_every_steps == 0:
            stop, due = self._agree(self.stop_requested, self._commit_due())
            commit, self.stopped = commit or due or stop, stop
        if commit:
            self.commit(self.epoch, self.epoch_start + self.k * self.global_batch)
        if self.stopped:
            self.model.stop_training = True

    def end_epoch(self, epoch: int) -> None:
        if self.stopped:
            return  # Keras still calls on_epoch_end after a stop mid-epoch; that state is committed already.
        if self.world.is_chief:
            seconds = time.time() - self.epoch_began
            self.events.write("epoch_end", round=self.world.round, epoch=epoch, steps=self.k,
                              seconds=round(seconds, 4), world_size=self.world.size)
            logging.info("epoch %d done: world size %d, global batch %d, learning rate %.4g, loss %.4f, %.1fs",
                         epoch + 1, self.world.size, self.global_batch, float(self.model.optimizer.learning_rate),
                         float(self.last_loss or 0.0), seconds)
        start = self.epoch_start + self.k * self.global_batch
        skipped = self.plan.remainder(start, self.global_batch) if start < self.plan.num_examples else 0
        if skipped:
            self.events.write("remainder_skipped", epoch=epoch, samples=skipped, rank=self.world.rank)
        self.commit(epoch + 1, 0)
        self.set_batches(epoch + 1, 0)

    # Commit and agreement ------------------------------------------------------------------------
    def commit(self, epoch: int, samples: int) -> None:
        started = time.time()
        self.state.commit(epoch, samples, self.step, self.global_batch)
        self.last_commit = time.time()
        if self.world.is_chief:
            loss = None if self.last_loss is None else float(self.last_loss)
            self.events.write("commit", round=self.world.round, step=self.step, epoch=epoch, samples=samples,
                              seconds=round(self.last_commit - started, 4), loss=loss,
                              learning_rate=float(self.model.optimizer.learning_rate),
                              world_size=self.world.size, global_batch=self.global_batch)

    def _commit_due(self) -> bool:
        return bool(self.commit_every_seconds) and time.time() - self.last_commit >= self.commit_every_seconds

    def _agree(self, stop: bool, commit: bool):
        """If any worker wants to stop or commit, all do, at this same step."""
        stops, commits = self.sum_over_workers([float(stop), float(commit)])
        return stops > 0, commits > 0

    def sum_over_workers(self, values: List[float]) -> np.ndarray:
        if self.world.size == 1:
            return np.asarray(values, np.float64)
        if self._sum is None:
            strategy = self.strategy

            @tf.function
            def total(local):
                per_replica = strategy.run(lambda: tf.identity(local))
                return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

            self._sum = total
        return self._sum(tf.constant(values, tf.float64)).numpy()

    def close(self) -> None:
        if self._index_log is not None:
            self._index_log.close()


def fit(model: keras.Model, x: np.ndarray, y: np.ndarray, *, world: World, strategy: tf.distribute.Strategy,
        epochs: int, run_dir: str, per_replica_batch_size: Optional[int] = None,
        global_batch_size: Optional[int] = None, batch_policy: str = "per_replica",
        schedule: Optional[BatchResizeSchedule] = None, commit_every_steps: int = 100,
        commit_every_seconds: Optional[float] = None, sync_every_steps: int = 5, seed: int = 0,
        callbacks: Sequence[keras.callbacks.Callback] = (), verbose="auto") -> int:
    """Trains a compiled model with `model.fit` from the last committed state; returns the exit code.

    `contract.EXIT_DONE` when `epochs` are done, `contract.EXIT_STOPPED` after a SIGTERM (committed at
    the next agreed step boundary). A failed collective (a peer died or hung) exits the process with
    `contract.EXIT_PEER_FAILURE`: the TF runtime cannot be reused in-process, the agent restarts us.
    """
    keras_compat.install_fit_fix()
    events = EventLog(run_dir, source=f"worker:{world.rank}")
    replicas = strategy.num_replicas_in_sync
    # Data positions are per worker; a worker with several local replicas feeds them one larger batch.
    batch = replica_batch_size(batch_policy, replicas, per_replica_batch_size, global_batch_size) * (
        replicas // world.size)
    state = CommittedState(world, run_dir, model, schedule)
    restored, skipped = state.restore()
    for path, error in skipped:
        events.write("checkpoint_skipped", round=world.round, rank=world.rank, path=path, error=error)
        logging.warning("skipped the unreadable commit %s: %s", path, error)
    events.write("restore", round=world.round, rank=world.rank, restored=restored is not None, path=restored,
                 step=state.step, epoch=state.epoch, samples=state.samples, world_size=world.size)
    trainer = _ElasticFit(model, x, y, world, strategy, state, DataPlan(len(x), seed), batch, commit_every_steps,
                          commit_every_seconds, max(1, sync_every_steps), events)
    if schedule is not None:
        schedule.resize(state.step, trainer.global_batch)
    previous = signal.signal(signal.SIGTERM, lambda *_: setattr(trainer, "stop_requested", True))
    # A restart mid-epoch trains the rest of that epoch in its own `fit` call: Keras needs every epoch
    # of one call to have the same length.
    first, partial = state.epoch, state.samples > 0
    if partial and not trainer.batches:
        # Less than one global batch of the epoch is left at this world size (a commit at the epoch's last
        # step restored into a larger world, or the epoch-end commit lost): the remainder every epoch skips.
        events.write("remainder_skipped", epoch=first, samples=trainer.plan.remainder(state.samples,
                                                                                    trainer.global_batch),
                     rank=world.rank)
        first, partial = first + 1, False
        trainer.set_batches(first, 0)
    spans = [(first, first + 1)] if partial else []
    spans += [(first + int(partial), epochs)]
    try:
        if trainer.sum_over_workers([state.step])[0] != state.step * world.size:
            # A worker of the previous round was still committing while we restored: start the round again.
            events.write("restore_mismatch", round=world.round, rank=world.rank, step=state.step)
            logging.flush()
            contract.exit_now(contract.EXIT_PEER_FAILURE)
        for begin, end in spans:
            if begin >= end or trainer.stopped:
                continue
            model.fit(trainer.dataset(), epochs=end, initial_epoch=begin, verbose=verbose, shuffle=False,
                      callbacks=[_ElasticCallback(trainer), *callbacks])
    except COLLECTIVE_FAILURES as error:
        events.write("collective_failure", round=world.round, rank=world.rank, error=type(error).__name__,
                     step=trainer.step)
        logging.error("collective failure at step %d (%s): %s", trainer.step, type(error).__name__,
                      str(error).splitlines()[0] if str(error) else "")
        logging.flush()
        contract.exit_now(contract.EXIT_PEER_FAILURE)  # the runtime is unusable: skip TF's teardown
    finally:
        signal.signal(signal.SIGTERM, previous)
        trainer.close()
        state.close()
    code = contract.EXIT_STOPPED if trainer.stopped else contract.EXIT_DONE
    events.write("worker_exit", round=world.round, rank=world.rank, code=code, step=trainer.step)
    return code
