"""Version-guarded fixes for stock Keras 3: `model.fit` under MultiWorkerMirroredStrategy (keras#20585), a
`LossScaleOptimizer` (mixed_float16) that lets workers take different branches under it, and TensorFlow's
asynchronous checkpoint of Keras variables.

`fit`: two failure points in Keras 3.15: `TensorFlowTrainer._maybe_symbolic_build` MEAN-reduces a tuple of
PerReplica input batches ("Attempt to convert a value (PerReplica...) to a Tensor"; under MirroredStrategy, a
first batch the replicas do not divide: "AddN must have the same size and shape", which ended with exit 78 a
round restarted at a short last batch), and `reduce_per_replica`
reduces scalar logs with `axis=0` ("Invalid reduction dimension 0 for input with 0 dimensions"). The fix
builds from the dataset's element spec (one local replica's) and reduces scalars with `axis=None`; losses are
then the same on every worker. Keras's own build also opens an iterator for one batch and drops it at once,
and TensorFlow crashes (SIGSEGV) when a MultiDeviceIterator is dropped while its prefetch thread runs: the fix
opens none. Async checkpoint: TF copies every variable to the
host in a `tf.function` on each write; Keras's `Variable._copy_trackable_to_cpu` creates a new
`tf.Variable` on every call, which a `tf.function` refuses after its first trace ("only supports singleton
tf.Variables"). Each patch is installed only when the installed Keras still has the faulty code, detected
in its source, so the fix turns itself off once Keras is fixed.
"""
import contextlib
import inspect
import re
from typing import Callable, Dict, Iterator

import keras
from absl import logging

_SYMBOLIC_BUILD_BUG = re.compile(r'distribute_strategy\.reduce\(\s*"MEAN",\s*maybe_distributed_data_batch')
_SCALAR_REDUCE_BUG = re.compile(r'strategy\.reduce\("MEAN",\s*v,\s*axis=0\)')
# LossScaleOptimizer decides "finite gradients?" from the first local replica's gradients, taken to be all-reduced
# already; under MWMS they are this worker's own, so workers may take different branches: one all-reduces its
# gradients in the inner optimizer's apply, the other skips it, and both hang (or, with a timeout, diverge).
_LOCAL_FINITE_BUG = re.compile(r"finite = distribution\.experimental_local_results\(\s*finite_per_replica\s*\)\[0\]")
_ASYNC_COPY_BUG = re.compile(r'object_map\[self\]\s*=\s*tf\.Variable\(object_map\[self\.value\]\)')
# Once per process (a patch of Keras's modules affects the whole process; installing it twice would wrap the
# wrapped): which fixes are in, by name. See `world.Pulse` for the worker side's other process-wide state.
_installed: Dict[str, bool] = {}
_async_fix: Dict[str, bool] = {}


def install_async_checkpoint_fix() -> bool:
    """Lets `CheckpointOptions(experimental_enable_async_checkpoint=True)` write Keras variables: a Keras
    variable's host copy is its TensorFlow variable's host copy (which TF creates once, then assigns).
    Returns whether the patch was needed. Idempotent."""
    if _async_fix:
        return _async_fix["installed"]
    from keras.src.backend.tensorflow import core

    needed = bool(_ASYNC_COPY_BUG.search(inspect.getsource(core.Variable._copy_trackable_to_cpu)))
    if needed:
        def _copy_trackable_to_cpu(self, object_map):
            self.value._copy_trackable_to_cpu(object_map)
            object_map[self] = object_map[self.value]

        core.Variable._copy_trackable_to_cpu = _copy_trackable_to_cpu
    _async_fix["installed"] = needed
    return needed


# Keras 3.15's multi-step loop (`compile(steps_per_execution=k)`, k > 1) fails under any strategy of several
# replicas, MirroredStrategy and MWMS alike: "You must feed a value for placeholder tensor 'while/cond/...'".
MULTI_STEP_FAILS_UNDER_REPLICAS = tuple(int(n) for n in keras.__version__.split(".")[:2]) <= (3, 15)


@contextlib.contextmanager
def steps_per_execution_that_runs(model: "keras.Model", strategy) -> Iterator[None]:
    """Runs one step per execution where Keras's multi-step loop fails (same steps, same results; only the
    host round trips differ), with a warning; anywhere else it leaves `steps_per_execution` as compiled."""
    compiled = model.steps_per_execution
    fallback = MULTI_STEP_FAILS_UNDER_REPLICAS and compiled > 1 and strategy.num_replicas_in_sync > 1
    if fallback:
        logging.log_first_n(logging.WARNING, "steps_per_execution=%d runs as 1 under %d replicas: Keras %s's "
                            "multi-step loop fails under a distribution strategy", 1, compiled,
                            strategy.num_replicas_in_sync, keras.__version__)
        model.steps_per_execution = 1
    try:
        yield
    finally:
        model.steps_per_execution = compiled


class IterationsThatCountSteps:
    """Keras 3 counts one optimizer iteration more than it trains at the end of every epoch of unknown length:
    the call that finds the data ended still adds 1 (measured with plain `model.fit` on a filtered dataset:
    6 iterations per epoch of 5 batches, the weights as after 5 steps). Learning-rate schedules and Adam's
    bias correction read that counter, so that one is taken back (`steps()`: the trainer's count of steps
    trained), at the epoch's end (`take_back`, before the epoch-end commit saves the counter and a restart
    from it counts one more than a run without faults) and, for a `model.fit` that ended otherwise, on
    leaving; a counter that is not a variable (gradient accumulation) or that moved otherwise (a loss-scale
    skip) is left as it is. Used around one `model.fit` of one epoch."""

    def __init__(self, optimizer: "keras.optimizers.Optimizer", steps: Callable[[], int], unknown_length: bool):
        self.counter, self.steps = optimizer.iterations, steps
        self.active = unknown_length and hasattr(self.counter, "assign_sub")
        self.start = self.trained = 0

    def __enter__(self) -> "IterationsThatCountSteps":
        if self.active:
            self.start, self.trained = int(self.counter.numpy()), self.steps()
        return self

    def take_back(self) -> None:
        """Takes the extra iteration back if Keras counted it (again: a no-op)."""
        if self.active and int(self.counter.numpy()) - self.start == self.steps() - self.trained + 1:
            self.counter.assign_sub(1)

    def __exit__(self, *exc) -> None:
        self.take_back()


def bugs_in(trainer_source: str) -> Dict[str, bool]:
    """Which of the two faults the source of Keras's TensorFlow trainer module still has."""
    return {"symbolic_build": bool(_SYMBOLIC_BUILD_BUG.search(trainer_source)),
            "scalar_reduce": bool(_SCALAR_REDUCE_BUG.search(trainer_source))}


def install_fit_fix() -> Dict[str, bool]:
    """Patches what is broken in the installed Keras; returns {fix name: installed}. Idempotent."""
    if _installed:
        return dict(_installed)
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from tensorflow.python.distribute import values as values_lib

    trainer_cls = tf_trainer.TensorFlowTrainer
    bugs = bugs_in(inspect.getsource(tf_trainer))  # the module's file: never a function we patched
    needs_build_fix, needs_reduce_fix = bugs["symbolic_build"], bugs["scalar_reduce"]

    if needs_build_fix:
        original_build = trainer_cls._maybe_symbolic_build

        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            strategy = self._distribute_strategy
            several = strategy is not None and (strategy.num_replicas_in_sync > 1 or
                                                tf_trainer._collective_all_reduce_multi_worker(strategy))
            if iterator is None or not several:
                return original_build(self, iterator=iterator, data_batch=data_batch)
            # Shapes are all the build needs, and the dataset's element spec has them (one replica's, under
            # several local replicas). No iterator is opened to read a batch: Keras drops it at once, and
            # dropping a MultiDeviceIterator while its prefetch thread runs crashes TensorFlow (SIGSEGV).
            spec = iterator._distributed_dataset.element_spec
            data_batch = tree.map_structure(
                lambda s: s._value_specs[0] if isinstance(s, values_lib.PerReplicaSpec) else s, spec)
            with strategy.scope():
                self._symbolic_build(data_batch=data_batch)

        trainer_cls._maybe_symbolic_build = _maybe_symbolic_build

    if needs_reduce_fix:
        original_reduce = tf_trainer.reduce_per_replica

        def reduce_per_replica(values, strategy, reduction):
            if reduction not in ("mean", "auto") or not tf_trainer._collective_all_reduce_multi_worker(strategy):
                return original_reduce(values, strategy, reduction)

            def _mean(v):
                rank = strategy.experimental_local_results(v)[0].shape.rank
                return strategy.reduce("MEAN", v, axis=0 if rank else None)

            return tree.map_structure(_mean, values)

        tf_trainer.reduce_per_replica = reduce_per_replica

    _installed.update(symbolic_build=needs_build_fix, scalar_reduce=needs_reduce_fix,
                      loss_scale_finite=_install_loss_scale_fix())
    return dict(_installed)


def local_finite_bug_in(loss_scale_source: str) -> bool:
    """Does the source of Keras's loss_scale_optimizer module decide finiteness from local gradients?"""
    return bool(_LOCAL_FINITE_BUG.search(loss_scale_source))


def _install_loss_scale_fix() -> bool:
    """Makes `LossScaleOptimizer.check_finite` true only where every replica's gradients are finite (one
    all-reduce of a flag), so that every worker takes the same branch at every step."""
    import tensorflow as tf
    from keras.src.optimizers import loss_scale_optimizer

    if not local_finite_bug_in(inspect.getsource(loss_scale_optimizer)):
        return False
    optimizer_cls = loss_scale_optimizer.LossScaleOptimizer
    original_check = optimizer_cls.check_finite

    def check_finite(self, grads):
        finite = original_check(self, grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        bad = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(bad, 0.0)

    optimizer_cls.check_finite = check_finite
    return True
