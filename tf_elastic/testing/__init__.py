"""The shared harness of the tests, benchmarks, soak and demo: real agents and workers on this machine
(`local_job`), faults injected into those workers (`faults`), a throwaway etcd (`etcd_server`), the
fault-injection soak and its checks of a finished job from its own records (`soak`, through
`tf_elastic.elastic.audit`), many agents' rendezvous simulated in one process (`rendezvous_sim`), small
datasets written at test time (`data_files`), local GCS and S3 servers (`gcs`, `s3`) and loopback port
helpers (`net`).

It starts each agent as the library's own module (`python -m tf_elastic.elastic.agent.cli`) and the workers
as the trainer module its caller names (`trainer=`, e.g. "launch.train"): it runs no `launch.*` module of
its own accord, so the launch tools that import it make no cycle. It runs them with the package's root on
`PYTHONPATH` (the checkout, or site-packages for an installed wheel): the wheel ships it, as the main job
(`tf_elastic.launch.main_job`) runs on it; `gcs` and `s3` need the `test` extras' servers."""
