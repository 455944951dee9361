"""`agent/probation.py`: an evicted host's agent times each local slot's pass alone, in real processes that stay
up between timings."""
import math
import os
import subprocess
import sys

from tf_elastic.elastic.agent import workers
from tf_elastic.elastic.agent.probation import OwnPass
from tf_elastic.elastic.agent.worker_output import WorkerOutput
from tf_elastic.elastic.protocol import Env, HostDir
from tf_elastic.elastic.worker.world import World

# A stand-in for the user's script under `elastic.fit` (tested in test_probe.py and the straggler job): it
# reads its world as a worker does and writes the seconds its slot is given times the timings made so far,
# again each time its last is taken (as `probe.time_alone` does), or never writes.
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
for timing in range(1, 100):  # "unknown": a model whose inputs are unknown has no pass; its input is read
    own_pass, read = (0.0, 0.5) if seconds == "unknown" else (float(seconds) * int(batch), float(seconds) * 10)
    open(path + ".tmp", "w").write(f"{own_pass * timing} {read * timing}")
    os.replace(path + ".tmp", path)
    while os.path.exists(path):
        time.sleep(0.01)
"""


def _own_pass(tmp_path, seconds, batch=2):
    started = []

    def launch(slot, world):
        env = dict(os.environ, SLOT=str(slot), PYTHONPATH=os.getcwd(), **world)
        process = workers.spawn([sys.executable, "-c", _SLOT, *seconds], env, WorkerOutput(tmp_path / "logs", "none"),
                                warm=False)
        started.append(process)
        return process

    host_dir = HostDir(tmp_path / "host")
    host_dir.path.mkdir(exist_ok=True)
    return OwnPass(launch, host_dir, slots=len(seconds), batch=batch, heartbeat_timeout=3.0), started


def test_the_slowest_slot_is_the_hosts_time_each_slot_in_a_world_of_its_own_and_timed_again_when_asked(tmp_path):
    """The slowest slot's pass, and the slowest slot's input read alone (each slot writes both); asked
    again, the same workers time again (the stand-in's second timing doubles its figures); closed, they end."""
    own, started = _own_pass(tmp_path, ["0.01", "0.03"])
    try:
        assert own.time(timeout=60) == (0.06, 0.3) and own.running and own.batch == 2
        assert own.time(timeout=60) == (0.12, 0.6) and own.running and len(started) == 2
    finally:
        own.close()
    assert [p.returncode for p in started] == [-9, -9] and not own.running
    assert World.from_env({"TF_CONFIG": "", Env.PROBATION: "x,1"}).size == 1


def test_a_slot_still_at_it_after_the_limit_is_killed_and_its_host_is_too_slow(tmp_path):
    """A host throttled to 0.15 of a core could not even import TensorFlow within the limit: it is slow, and
    its workers are ended (the next timing starts afresh)."""
    own, started = _own_pass(tmp_path, ["0.01", "hang"])
    assert own.time(timeout=5) == (math.inf,) * 2 and not own.running
    assert started[1].returncode == -9
    assert subprocess.run(["kill", "-0", str(started[1].pid)], capture_output=True).returncode != 0


def test_a_slot_that_ends_without_a_time_leaves_its_host_unjudged(tmp_path):
    """A script that cannot be probed (it never calls `elastic.fit`, it fails) says nothing of the host."""
    own, started = _own_pass(tmp_path, ["0.01", "fail"])
    assert own.time(timeout=60) is None and not own.running
    assert started[1].returncode == 1 and started[0].returncode == -9


def test_a_model_whose_pass_cannot_be_timed_is_judged_by_its_input_and_its_workers_stay_up(tmp_path):
    """Its workers write a pass of 0 (not known) and wait to be asked again: the host is judged by its input,
    not held as too slow to time (every result was written)."""
    own, started = _own_pass(tmp_path, ["unknown"])
    try:
        assert own.time(timeout=60) == (0.0, 0.5) and own.running
    finally:
        own.close()


def test_a_notice_ends_the_timing_at_once(tmp_path):
    """The timing stops at the first look that sees the notice (its limit is far off), killing its slot."""
    own, started = _own_pass(tmp_path, ["hang"])
    looks = []

    def cancelled():
        looks.append(True)
        return len(looks) >= 5

    assert own.time(timeout=600, cancelled=cancelled) is None
    assert len(looks) == 5 and started[0].returncode == -9
