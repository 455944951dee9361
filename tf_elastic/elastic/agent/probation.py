"""Probation: an evicted straggler's host times its own pass, and reads its input alone, before it rejoins.

An evicted host sits out a hold-off (`stragglers.hold_off`). Rejoining on the clock alone, a host that was
still slow rejoined slow and was evicted again a window later (`bench_straggler`: 2 evictions in 240 s, the
group at 0.38x meanwhile). So after the hold-off its agent starts one worker per local slot in a world of
its own (`Env.PROBATION`): the worker runs the user's script as far as `elastic.fit`, times the model's pass
at the group's batch as the group's probe does and reads its input alone for a step's rows
(`probe.time_alone`), writes both down and waits to be asked again. The agent rejoins only once the slowest
slot is back within the straggler factor of the group's median probe (`stragglers.back_within`; the median
of a window of probes' medians, as its own pass is the median of a window of probes), and the slowest input
within it of the group's seconds a step, both of which the chief's agent publishes (`JobRecord.publish_probe`);
else it asks again after `--probation_interval`. The workers stay up between timings: a worker started for
each (imports, the user's data and model, the pass's trace) took the shared cores from the group, and a host
that recovered waited out another hold-off, then a start, then refilled its warm spares (the bench's rejoin
67-83 s after the recovery). Only an eviction doubles the hold-off: on a host of its own a timing on
probation costs the group nothing, so a host that recovered is back within an interval and a timing.
"""
import math
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from tf_elastic.elastic.agent import workers
from tf_elastic.elastic.protocol import Env, HostDir

Launch = Callable[[int, Dict[str, str]], subprocess.Popen]  # (local slot, world) -> the worker's process


class OwnPass:
    """This host's workers on probation, one per local slot, each in a world of its own at `batch` rows a
    replica (the group's), started once and timed again at each `time`."""

    def __init__(self, launch: Launch, host_dir: HostDir, slots: int, batch: int, heartbeat_timeout: float):
        self.batch = batch
        scratch = host_dir.path / "probation"  # the workers' run dir: nothing of the job's is touched
        scratch.mkdir(exist_ok=True)
        self._results = [scratch / f"slot-{slot}.seconds" for slot in range(slots)]
        for result in self._results:
            result.unlink(missing_ok=True)
        self._processes: List[subprocess.Popen] = []
        try:
            for slot, result in enumerate(self._results):
                self._processes.append(launch(slot, {
                    "TF_CONFIG": "",  # a world of one: no peer to wait for
                    Env.RUN_DIR: str(scratch),
                    Env.HEARTBEAT_FILE: str(scratch / f"heartbeat-{slot}"),
                    Env.HEARTBEAT_TIMEOUT: str(heartbeat_timeout),
                    Env.PROBATION: f"{result},{batch}",
                }))
        except BaseException:
            self.close()  # those started: no spare pool or round knows of them
            raise

    def time(self, timeout: float, cancelled: Callable[[], bool] = lambda: False
             ) -> Optional[Tuple[float, float]]:
        """Seconds per pass of this host's slowest slot, each timed alone, all at once, and per step of the
        slowest slot's input read alone (`probe.time_alone`; 0 where not known: a model whose inputs are
        unknown has no pass to time, and its host is judged by its input): each slot times again once its
        last result is taken (removed). `math.inf` for both when a slot was still at it after `timeout`
        seconds (its host is too slow to start and time a pass within the limit a worker's start has:
        throttled to 0.15 of a core, TensorFlow's import alone took longer, and a host still throttled
        rejoined as "not measured"). None when a slot ended without a time (a script that never calls
        `elastic.fit`, a worker that failed) or `cancelled()` (a preemption notice) came first, or the
        workers were ended before; either way they are ended (not `running`: the next timing starts
        afresh)."""
        if not self._processes:
            return None
        for result in self._results:
            result.unlink(missing_ok=True)
        deadline, stop = time.monotonic() + timeout, False
        while not all(result.exists() for result in self._results) and time.monotonic() < deadline and \
                all(p.poll() is None for p in self._processes) and not (stop := cancelled()):
            time.sleep(0.1)
        stop = stop or cancelled()
        if not stop and all(result.exists() for result in self._results):
            seconds = [_read_seconds(result) for result in self._results]
            return max(own_pass for own_pass, _ in seconds), max(read for _, read in seconds)
        late = not stop and all(p.poll() is None for p in self._processes)
        self.close()
        return (math.inf, math.inf) if late else None

    @property
    def running(self) -> bool:
        """Every slot's worker is up (one that ended, or was ended, times no more)."""
        return bool(self._processes) and all(p.poll() is None for p in self._processes)

    def close(self) -> None:
        for process in self._processes:
            workers.kill(process)  # ends one that ran past the timeout (and what it started); reaps the rest
        self._processes = []


def _read_seconds(path: Path) -> Tuple[float, float]:
    """(seconds per pass, per step of input) a slot wrote; (0, 0) where it wrote nothing readable. A worker
    of a version before the input's read wrote the pass alone: its input is not known (0)."""
    try:
        numbers = [float(number) for number in path.read_text().split()]
    except (OSError, ValueError):
        return 0.0, 0.0
    return (numbers[0], numbers[1] if len(numbers) > 1 else 0.0) if numbers else (0.0, 0.0)
