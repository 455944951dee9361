"""What users run: the trainer (`train`), the elastic agent's CLI (`elastic_run`), the job's status (`status`),
its report (`report`) and the main job (`main_job`). Two rooms beside them stay in the checkout: `bench/` (our
benchmarks and soaks) and `papers/` (the paper reproductions).

An installed wheel holds this package's own modules as `tf_elastic.launch` and the model registry as
`tf_elastic.models` (setup.py maps both; its rooms are left out by the layout); a checkout also runs it as the
top-level `launch`, and `tf_elastic.models` is its `models/` (see tf_elastic/__init__.py)."""
