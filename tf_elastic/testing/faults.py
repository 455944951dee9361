"""Fault-injection points for the tests and benchmarks, kept out of the library: a worker started as

    python -m tf_elastic.testing.faults MODULE [ARGS...]      # `command(MODULE, *ARGS)`

runs MODULE (the trainer its caller names, e.g. `launch.train`) as `python -m MODULE ARGS...` would, with two
additions:

- SIGUSR2 blocks its main thread for ever: a stuck training step, while the heartbeat thread beats on;
- pause points in commits: while the directory in `PAUSE_DIR` (an environment variable) holds a file named
  after a point, or `POINT.rankN` for rank N only, a commit waits there, after writing its PID to
  `POINT.reached-rankN` for the test to see. Points: "local" (a commit's files are written, the state file
  does not name it yet) and "durable" (a durable copy's files are up, its marker is not). A test can then
  SIGKILL the worker that waits at a known point of a commit, or hold one host's commit while another's
  completes.
"""
import json
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path
from typing import List

PAUSE_DIR = "TF_ELASTIC_TEST_PAUSE_DIR"


def command(module: str, *args: str) -> List[str]:
    """The worker command running `module` with these faults installed."""
    return [sys.executable, "-m", "tf_elastic.testing.faults", module, *args]


def pause(point: str, rank: int) -> None:
    """Waits while `PAUSE_DIR` holds `point` or `point.rankN`, after writing this process's PID to
    `point.reached-rankN` (the process to kill: the rank's worker of another round than the test expects
    may be the one that got there)."""
    directory = os.environ.get(PAUSE_DIR)
    held = [Path(directory) / name for name in (point, f"{point}.rank{rank}")] if directory else []
    if not any(path.exists() for path in held):
        return
    reached = Path(directory) / f"{point}.reached-rank{rank}"
    written = reached.with_name(f"{reached.name}.{os.getpid()}.tmp")
    written.write_text(str(os.getpid()))
    os.replace(written, reached)  # whole: never read empty
    while any(path.exists() for path in held):
        time.sleep(0.05)


def _rank_from_tf_config() -> int:
    """This worker's rank (a warm worker learns its TF_CONFIG only once its round is handed to it)."""
    return int(json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("index", 0))


def install() -> None:
    """Installs the SIGUSR2 handler and wraps the two commit steps the pause points precede."""
    from tf_elastic.elastic.worker.commit import CommittedState
    from tf_elastic.elastic.worker.durable import DurableCopies

    signal.signal(signal.SIGUSR2, lambda *_: threading.Event().wait())
    name_in_state_file, write_marker = CommittedState._name_in_state_file, DurableCopies._write_marker

    def paused_name_in_state_file(self, *args, **kwargs):
        pause("local", self.world.rank)
        return name_in_state_file(self, *args, **kwargs)

    def paused_write_marker(self, *args, **kwargs):
        pause("durable", _rank_from_tf_config())
        return write_marker(self, *args, **kwargs)

    CommittedState._name_in_state_file = paused_name_in_state_file
    DurableCopies._write_marker = paused_write_marker


if __name__ == "__main__":
    install()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
