"""tf_elastic: elastic, large-batch distributed training for TensorFlow / Keras 3.

Three rooms: `tf_elastic.optimizers` (LARS), `tf_elastic.schedules` (BatchResizeSchedule) and
`tf_elastic.elastic` (agent, rendezvous, worker runtime). The top-level names load lazily so that the
elastic agent, which must never import TensorFlow, can import this package.
"""
import importlib

__version__ = "0.1.0"

_LAZY = {
    "LARS": "tf_elastic.optimizers",
    "BatchResizeSchedule": "tf_elastic.schedules",
    "WarmupPolynomialDecay": "tf_elastic.schedules",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tf_elastic' has no attribute {name!r}")
