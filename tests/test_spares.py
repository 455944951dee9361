"""`agent/spares.py`: warm spares, in real processes: ready once their imports are done, and known as such."""
import json
import os
import sys
import time

from tf_elastic.elastic.agent.spares import WarmSpares
from tf_elastic.elastic.agent.worker_output import WorkerOutput
from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import HostDir

# A stand-in for a warm worker: "imports" for a while, says it is ready, and waits for its world on stdin.
_SPARE = """
import os, sys, time
time.sleep(float(sys.argv[1]))
open(os.environ["TF_ELASTIC_WARM_READY"], "w").close()
sys.stdin.read()
"""


def test_a_spare_is_ready_once_its_file_is_seen_and_a_second_wait_does_not_wait_for_the_file_again(tmp_path):
    """A probation waits for its spares before each timing, and again before it rejoins: a readiness seen
    (its file then removed) stays seen, and the spare is announced once."""
    host_dir = HostDir(tmp_path / "host")
    host_dir.path.mkdir()
    events = EventLog(tmp_path / "run", "agent:a")
    spares = WarmSpares([sys.executable, "-c", _SPARE, "0.5"], host_dir, events,
                        lambda slot: dict(os.environ), lambda: WorkerOutput(tmp_path / "logs", "none"))
    try:
        spares.fill(2)
        began = time.monotonic()
        spares.wait_ready(timeout=60, interval=0.05, cancelled=lambda: False)
        assert time.monotonic() - began >= 0.5  # timing-ok: the stand-ins' sleep, a lower bound
        assert not list(host_dir.path.glob("warm-*.ready"))  # seen, then removed
        began = time.monotonic()
        spares.wait_ready(timeout=60, interval=0.05, cancelled=lambda: False)
        assert time.monotonic() - began < 30  # timing-ok: at once, against the 60 s a wait on the file took
        spares.tend(0, 2, round_trains=False)
        spares.tend(0, 2, round_trains=False)
        announced = [json.loads(line) for line in events.path.read_text().splitlines()]
        assert [e["event"] for e in announced] == ["spare_ready"] * 2, announced
    finally:
        spares.kill_all()
