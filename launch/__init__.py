"""Everything that runs: training, the elastic agent's CLI, benchmarks and paper reproductions.

An installed wheel holds this package as `tf_elastic.launch` and the model registry as `tf_elastic.models`
(setup.py maps both); a checkout also runs it as the top-level `launch`, and `tf_elastic.models` is its
`models/` (see tf_elastic/__init__.py)."""
