"""The shared harness of the tests, benchmarks, soak and demo: real agents and workers on this machine
(`local_job`), a throwaway etcd (`etcd_server`), checks of a finished job from its own records
(`audit`), the fault-injection soak (`soak`) and loopback port helpers (`net`).

It runs `launch/` scripts from the checkout, so it is for a source checkout: `setup.py` leaves it out of the
wheel, with the launch tools that drive local jobs through it (the main job, the soak, the benchmarks)."""
