"""Warm spares: one worker per local slot started ahead of its round, so that a round change pays no
Python and TensorFlow imports and no data preparation (`elastic.run`'s `prepare`).

A spare blocks on stdin until `take` hands it its round's environment (`Spare.hand_world`); the worker
side is `world.wait_for_the_agents_world_on_stdin`. Spares are started before the first join (the group
trains on while a newcomer warms up) and again once a round trains (`tend`)."""
import time
from typing import Callable, Dict, Iterable

from tf_elastic.elastic.agent import workers
from tf_elastic.elastic.agent.worker_output import WorkerOutput
from tf_elastic.elastic.agent.workers import Spare
from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import Env, Event, HostDir


class WarmSpares:
    def __init__(self, command, host_dir: HostDir, events: EventLog, slot_env: Callable[[int], Dict[str, str]],
                 output: Callable[[], WorkerOutput]):
        self.command, self.host_dir, self.events = command, host_dir, events
        self._slot_env, self._output = slot_env, output
        self._spares: Dict[int, Spare] = {}  # local slot -> its warm worker
        self._spawned = 0

    def spawn(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self._spawned += 1
            ready = self.host_dir.warm_ready(self._spawned)
            env = dict(self._slot_env(slot), **{Env.WARM: "1", Env.WARM_READY: str(ready)})
            self._spares[slot] = Spare(workers.spawn(self.command, env, self._output(), warm=True), ready)

    def fill(self, slots: int) -> None:
        """Starts a spare for each of slots 0..`slots`-1 that has none."""
        self.spawn(slot for slot in range(slots) if slot not in self._spares)

    def wait_ready(self, timeout: float, interval: float, cancelled: Callable[[], bool]) -> None:
        """Waits (up to `timeout`) until every spare has done its imports."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not cancelled() and any(
                s.process.poll() is None and not s.is_ready() for s in self._spares.values()):
            time.sleep(interval)

    def take(self, slot: int, world: Dict[str, str]):
        """The slot's spare's process, handed this round's world on its stdin; None if it is gone."""
        spare = self._spares.pop(slot, None)
        return spare.process if spare is not None and spare.hand_world(world) else None

    def tend(self, round_number: int, slots: int, round_trains: bool) -> None:
        """Once this round trains, pays the next round's start-up (imports, data) ahead of time; says when a
        spare is ready (`spare_ready`)."""
        if round_trains:
            self.fill(slots)
        for spare in self._spares.values():
            if not spare.announced and spare.is_ready():
                spare.announced = True
                self.events.write(Event.SPARE_READY, round=round_number, worker_pid=spare.process.pid)

    def kill_all(self) -> None:
        for spare in self._spares.values():
            workers.kill(spare.process)
        self._spares.clear()
