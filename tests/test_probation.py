"""`agent/probation.py`: an evicted host's agent times each local slot's pass alone, in real processes."""
import math
import os
import subprocess
import sys

from tf_elastic.elastic.agent import workers
from tf_elastic.elastic.agent.probation import time_own_pass
from tf_elastic.elastic.agent.worker_output import WorkerOutput
from tf_elastic.elastic.protocol import Env, HostDir
from tf_elastic.elastic.worker.world import World

# A stand-in for the user's script under `elastic.fit` (tested in test_probe.py and the straggler job): it
# reads its world as a worker does and writes the seconds its slot is given, or never ends.
_SLOT = """
import os, sys, time
from tf_elastic.elastic.worker.world import World
world = World.from_env()
assert world.size == 1 and world.probation and world.elastic, world
path, batch = world.probation.rsplit(",", 1)
seconds = sys.argv[1:][int(os.environ["SLOT"])]
if seconds == "hang":
    time.sleep(600)
if seconds == "fail":
    sys.exit(1)
open(path, "w").write(f"{float(seconds) * int(batch)} {float(seconds) * 10}")
"""


def _launcher(tmp_path, seconds):
    started = []

    def launch(slot, world):
        env = dict(os.environ, SLOT=str(slot), PYTHONPATH=os.getcwd(), **world)
        process = workers.spawn([sys.executable, "-c", _SLOT, *seconds], env, WorkerOutput(tmp_path / "logs", "none"),
                                warm=False)
        started.append(process)
        return process
    return launch, started


def test_the_slowest_slot_is_the_hosts_time_and_each_slot_runs_in_a_world_of_its_own(tmp_path):
    """The slowest slot's pass, and the slowest slot's input read alone (each slot writes both)."""
    launch, started = _launcher(tmp_path, ["0.01", "0.03"])
    host_dir = HostDir(tmp_path / "host")
    host_dir.path.mkdir()
    assert time_own_pass(launch, host_dir, slots=2, batch=2, timeout=60, heartbeat_timeout=3.0) == (0.06, 0.3)
    assert [p.returncode for p in started] == [0, 0]
    assert World.from_env({"TF_CONFIG": "", Env.PROBATION: "x,1"}).size == 1


def test_a_slot_still_at_it_after_the_limit_is_killed_and_its_host_is_too_slow(tmp_path):
    """A host throttled to 0.15 of a core could not even import TensorFlow within the limit: it is slow."""
    launch, started = _launcher(tmp_path, ["0.01", "hang"])
    host_dir = HostDir(tmp_path / "host")
    host_dir.path.mkdir()
    assert time_own_pass(launch, host_dir, slots=2, batch=2, timeout=5, heartbeat_timeout=3.0) == (math.inf,) * 2
    assert started[1].returncode == -9
    assert subprocess.run(["kill", "-0", str(started[1].pid)], capture_output=True).returncode != 0


def test_a_slot_that_ends_without_a_time_leaves_its_host_unjudged(tmp_path):
    """A script that cannot be probed (it never calls `elastic.fit`, it fails) says nothing of the host."""
    launch, started = _launcher(tmp_path, ["0.01", "fail"])
    host_dir = HostDir(tmp_path / "host")
    host_dir.path.mkdir()
    assert time_own_pass(launch, host_dir, slots=2, batch=2, timeout=60, heartbeat_timeout=3.0) is None
    assert [p.returncode for p in started] == [0, 1]


def test_a_notice_ends_the_probe_at_once(tmp_path):
    """The probe stops at the first look that sees the notice (its limit is far off), killing its slot."""
    launch, started = _launcher(tmp_path, ["hang"])
    host_dir = HostDir(tmp_path / "host")
    host_dir.path.mkdir()
    looks = []

    def cancelled():
        looks.append(True)
        return len(looks) >= 5

    assert time_own_pass(launch, host_dir, slots=1, batch=2, timeout=600, heartbeat_timeout=3.0,
                         cancelled=cancelled) is None
    assert len(looks) == 5 and started[0].returncode == -9
