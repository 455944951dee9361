"""What `fit` raises instead of ending the process, and the exit code each means to the agent.

`elastic.run(main)` ends a worker process with `exit_code(error)` for whatever `main` raised; a script
that runs without it catches these like any Keras error.
"""
from tf_elastic.elastic.protocol import ExitCode


class ConfigurationError(ValueError):
    """Bad input (flags, data, committed state of another model): a restart cannot help."""


class StopRequested(Exception):
    """A stop was asked for (SIGTERM: a preemption notice or a membership change); the group committed
    at an agreed step first, so nothing is lost."""

    def __init__(self, step: int):
        super().__init__(f"stopped on request after committing step {step}")
        self.step = step


class PeerFailure(Exception):
    """A collective failed: another worker died or hung. TensorFlow's runtime cannot be reused in this
    process: MultiWorkerMirroredStrategy cannot be built again with another cluster (its first collective fails
    or hangs, and its gRPC server has no clean shutdown); end it and let the agent restart the group from the
    last commit."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"peer failure at step {step}: {reason}")
        self.step, self.reason = step, reason


def exit_code(error: BaseException) -> int:
    """The worker exit code the agent expects for `error` (any other exception is a plain failure: 1)."""
    if isinstance(error, StopRequested):
        return ExitCode.STOPPED
    if isinstance(error, PeerFailure):
        return ExitCode.PEER_FAILURE
    if isinstance(error, (ValueError, FileNotFoundError)):
        return ExitCode.CONFIG_ERROR
    return 1
