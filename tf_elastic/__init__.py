"""tf_elastic: elastic, large-batch distributed training for TensorFlow / Keras 3.

Three rooms: `tf_elastic.optimizers` (LARS), `tf_elastic.schedules` (BatchResizeSchedule) and
`tf_elastic.elastic` (agent, rendezvous, worker runtime). The top-level names load lazily so that the
elastic agent, which must never import TensorFlow, can import this package.
"""
import importlib
import os

__version__ = "0.1.0"

# A wheel holds `launch/` and `models/` inside this package (setup.py's package_dir); a checkout keeps them
# beside it: there, the checkout's root joins the package's path, so that `tf_elastic.launch` and
# `tf_elastic.models` import the same way from both.
_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.dirname(_HERE)
if not os.path.isdir(os.path.join(_HERE, "launch")) and os.path.isfile(os.path.join(_CHECKOUT, "launch", "train.py")):
    __path__.append(_CHECKOUT)

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
