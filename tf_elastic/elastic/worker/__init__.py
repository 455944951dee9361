"""The worker side: `run` (a worker's life), world, strategy, committed state and `fit`. Everything here
but `world`, `errors` and `data_plan` imports TensorFlow, so names load on first use."""
import importlib

_NAMES = {
    "World": "world", "start_heartbeat": "world", "exit_now": "world",
    "ConfigurationError": "errors", "PeerFailure": "errors", "StopRequested": "errors", "exit_code": "errors",
    "resolve_world_and_export_tf_config": "cluster", "RESOLVERS": "cluster",
    "make_strategy": "strategy", "STRATEGIES": "strategy", "COLLECTIVES": "strategy",
    "CommittedState": "commit", "run": "entry", "current": "entry",
    "fit": "training", "FitConfig": "training", "ProgressCallback": "training", "global_batch_size": "training",
    "install_fit_fix": "keras_compat",
    "BATCH_POLICIES": "data_plan",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
