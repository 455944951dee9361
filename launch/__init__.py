"""Everything that runs: training, the elastic agent's CLI, benchmarks and paper reproductions.

An installed wheel holds this package as `tf_elastic.launch` and the model registry as `tf_elastic.models`
(setup.py maps both); a checkout runs them as the top-level `launch` and `models`. `launch.models` is the
registry either way."""
try:
    from tf_elastic import models
except ImportError:  # a checkout: the registry is the top-level `models/` beside this package
    import models

__all__ = ["models"]
