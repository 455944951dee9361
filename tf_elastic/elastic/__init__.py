"""The elastic runtime, in three packages and one contract:

- `store/`: the rendezvous stores (a small key-value interface; file and etcd backends);
- `agent/`: one agent per host: rendezvous rounds, worker processes, the `tf-elastic-run` CLI;
- `worker/`: what runs inside each worker: world, strategy, committed state and `fit`;
- `protocol`: what the agent and its workers agree on (run directory, events, exit codes, environment).

`store`, `agent` and `protocol` never import TensorFlow; the worker-side names below load on first use.
"""
from tf_elastic.elastic.worker import __all__ as _WORKER_NAMES

__all__ = list(_WORKER_NAMES)


def __getattr__(name: str):
    if name in _WORKER_NAMES:
        from tf_elastic.elastic import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'tf_elastic.elastic' has no attribute {name!r}")
