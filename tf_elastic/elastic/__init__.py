"""The elastic runtime: agent, rendezvous stores, and the worker side of MultiWorkerMirroredStrategy.

Agent-side modules (`agent`, `rendezvous`, `store`, `events`, `world`) never import TensorFlow; the
worker side (`worker`, `keras_compat`) does, and loads only when asked for.
"""
import importlib

from tf_elastic.elastic.world import (EXIT_CONFIG_ERROR, EXIT_DONE, EXIT_PEER_FAILURE, EXIT_STOPPED, World, exit_now,
                                     start_heartbeat)

_WORKER = {"fit": "worker", "make_strategy": "worker", "resolve_world": "worker", "CommittedState": "worker",
           "install_fit_fix": "keras_compat"}
__all__ = ["World", "exit_now", "start_heartbeat", "EXIT_DONE", "EXIT_STOPPED", "EXIT_PEER_FAILURE", "EXIT_CONFIG_ERROR", *sorted(_WORKER)]


def __getattr__(name: str):
    if name in _WORKER:
        return getattr(importlib.import_module(f"tf_elastic.elastic.{_WORKER[name]}"), name)
    raise AttributeError(f"module 'tf_elastic.elastic' has no attribute {name!r}")
