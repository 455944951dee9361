"""`run(main)`: the one entry point that owns a worker's life, so that a Keras script changes by a few lines.

    def main():
        ...                                  # a plain Keras script: build, compile, then
        elastic.fit(model, dataset, epochs=5, validation_data=(x_val, y_val))

    if __name__ == "__main__":
        elastic.run(main)                    # was: main()

`run` reads the world (the agent's environment; else `TF_CONFIG`, Slurm or Kubernetes; else one
process), starts the heartbeat the agent watches, creates the strategy before any other TensorFlow work
(MultiWorkerMirroredStrategy must configure the runtime first), calls `main()` inside `strategy.scope()`
and ends the process with the exit code the agent understands: 0 done, 3 stopped after a commit, 75 a
peer failed, 78 bad input (one line, no restart), 1 anything else (with its traceback). A multi-worker
process ends at once (`exit_now`: MWMS has no clean shutdown). `elastic.fit` and `current()` find the
world and strategy `run` made.
"""
import dataclasses
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable, Optional

import keras
import tensorflow as tf

from tf_elastic.elastic.protocol import Env, error_line
from tf_elastic.elastic.worker import errors
from tf_elastic.elastic.worker.cluster import resolve_world_and_export_tf_config
from tf_elastic.elastic.worker.strategy import make_strategy
from tf_elastic.elastic.worker.world import World, exit_now, start_heartbeat

# What a collective raises when a peer died or hung: TensorFlow's runtime in this process is then unusable.
COLLECTIVE_FAILURES = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError,
                       tf.errors.AbortedError, tf.errors.InternalError)


@dataclasses.dataclass(frozen=True)
class Context:
    """The world and strategy of the process `run` started, and the run dir (the agent's, else `run_dir`)."""
    world: World
    strategy: tf.distribute.Strategy
    run_dir: str


_current: dict = {}  # "context": the process's one `run` (see `world.Pulse` for the worker's process-wide state)


def current() -> Optional[Context]:
    """What `run` set up in this process (None outside `run`)."""
    return _current.get("context")


def run(main: Callable[..., Any], *, prepare: Optional[Callable[[], Any]] = None, strategy: str = "auto",
        collective: str = "auto", cluster_resolver: str = "tf_config", port_base: int = 8888,
        k8s_selector: Optional[str] = None, tpu: Optional[str] = None, run_dir: str = "runs/train",
        seed: Optional[int] = 0) -> None:
    """Runs `main()` as one worker of the job, then ends the process with the agent's exit code.

    Args:
        main: the training function, called inside `strategy.scope()`: `main()`, or `main(prepare())`.
        prepare: optional work that does not depend on the world (listing files, indexing shards), done
            before it is known: a warm-started worker does it while it waits for its round. It must make
            no tensor (MWMS must configure TensorFlow's runtime first). Default None.
        strategy: `auto` (default: MWMS for several workers, MirroredStrategy over several local GPUs,
            else the default strategy), `one_device`, `mirrored`, `mwms` or `tpu`.
        collective: MWMS's all-reduce, `auto` (default), `ring` or `nccl`.
        cluster_resolver: without the agent, where a fixed-size world comes from: `tf_config` (default),
            `slurm` or `kubernetes`.
        port_base: slurm: the first TF server port on each node; kubernetes: the pods' TF port (8888).
        k8s_selector: kubernetes: the worker pods' label selector (None).
        tpu: a TPU name or grpc://HOST:PORT for `strategy="tpu"` (None).
        run_dir: where commits go without an agent (default `runs/train`); the agent's otherwise.
        seed: the seed of Python's, NumPy's and TensorFlow's generators, set before `main`
            (`keras.utils.set_random_seed`), so that an unseeded `Dataset.shuffle` and the file order of
            `image_dataset_from_directory` (NumPy-drawn) are the same on every worker and in every run of
            the job; default 0, None leaves them unset (the group's check of the next batch then refuses
            workers that read different streams).
    """
    faulthandler.enable()  # a crash in native code (TensorFlow) still leaves every thread's stack in the log
    # The agent's SIGQUIT before it kills a stalled worker, or one that ignored SIGTERM: where it was stuck.
    faulthandler.register(signal.SIGQUIT, all_threads=True)
    code, world = 1, None
    try:
        prepared = (prepare(),) if prepare is not None else ()
        world = resolve_world_and_export_tf_config(cluster_resolver, port_base, k8s_selector)
        start_heartbeat(world)
        made = make_strategy(world, strategy, collective, tpu)
        _current["context"] = Context(world, made, world.run_dir or run_dir)
        if seed is not None:
            keras.utils.set_random_seed(seed)
        with made.scope():
            main(*prepared)
        code = 0
    except BaseException as error:  # noqa: BLE001 - every way out of main becomes an exit code
        code = _report(error)
    finally:
        _current.pop("context", None)
    if world is not None and (world.elastic or world.size > 1):
        exit_now(code)
    sys.stdout.flush()
    sys.exit(code)


def _report(error: BaseException) -> int:
    """Prints what ended `main` (one line for what the agent handles, a traceback otherwise) and writes it
    to the agent's error file; returns its exit code."""
    if isinstance(error, COLLECTIVE_FAILURES):  # outside fit (an evaluation after it): a peer is gone
        error = errors.PeerFailure(-1, error_line(error, 300))
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    if not isinstance(error, errors.StopRequested):
        _write_error_file(error)
    if isinstance(error, (errors.StopRequested, errors.PeerFailure)):
        print(f"tf_elastic: {error}", file=sys.stderr, flush=True)
    elif isinstance(error, (ValueError, FileNotFoundError)):
        print(f"tf_elastic: error: {error}", file=sys.stderr, flush=True)
    else:
        traceback.print_exception(error)
        sys.stderr.flush()
    return errors.exit_code(error)


def _write_error_file(error: BaseException) -> None:
    """`Env.ERROR_FILE` (set by the agent): the exception's type, message and last traceback lines."""
    path = os.environ.get(Env.ERROR_FILE)
    if not path:
        return
    lines = "".join(traceback.format_exception(error)).rstrip().splitlines()
    record = {"type": type(error).__name__, "message": str(error)[:2000], "traceback": lines[-ERROR_FILE_LINES:],
              "time": time.time()}
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)  # whole or absent: the agent may read it as soon as we exit
    except OSError:
        pass  # the agent falls back to the last line of stderr


ERROR_FILE_LINES = 15
