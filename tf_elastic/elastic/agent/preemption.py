"""Preemption notices from a cloud's metadata server, polled: the agent commits and leaves before the
machine goes (it gets SIGTERM or a configured signal such as Slurm's `--signal=USR1@90` the same way).

A notice is an HTTP 200 whose body is neither empty nor `FALSE` nor `NONE`. That covers
  GCE  `.../computeMetadata/v1/instance/preempted` (TRUE once preempted),
       `.../instance/maintenance-event` (NONE until a maintenance is scheduled),
  AWS  `.../latest/meta-data/spot/instance-action` (404 until `{"action": "terminate", "time": ...}`).
"""
import datetime
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Dict, Optional, Tuple

from tf_elastic.elastic.events import EventLog
from tf_elastic.elastic.protocol import Event

_QUIET = ("", "FALSE", "NONE")


def notice_in(status: int, body: str) -> Optional[str]:
    """The notice a metadata answer holds, or None."""
    text = body.strip()
    if status != 200 or text.upper() in _QUIET:
        return None
    return text[:200]


def seconds_left(notice: str, now: datetime.datetime) -> Optional[float]:
    """Seconds until the termination time a notice names (AWS's `time`), if it names one."""
    try:
        when = datetime.datetime.fromisoformat(json.loads(notice)["time"].replace("Z", "+00:00"))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return (when - now).total_seconds()


class NoticeWatcher:
    """Polls `url` every `interval` seconds from a daemon thread; calls `on_notice(text)` once."""

    def __init__(self, url: str, interval: float, on_notice: Callable[[str], None], timeout: float = 2.0):
        self.url, self.interval, self.on_notice, self.timeout = url, interval, on_notice, timeout
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tf_elastic-preemption", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def poll(self) -> Optional[str]:
        request = urllib.request.Request(self.url, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return notice_in(response.status, response.read().decode("utf-8", "replace"))
        except urllib.error.HTTPError as error:  # 404: no notice (AWS)
            return notice_in(error.code, "")
        except (urllib.error.URLError, OSError):
            return None  # the metadata server is unreachable now: no notice, try again

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            notice = self.poll()
            if notice is not None:
                self.on_notice(notice)
                return


class Notices:
    """This host's notices that it is about to go: each of `signals` sent to the agent, and the notice URL
    (polled by a `NoticeWatcher`). The first one makes `received` true: the agent then has its workers commit
    and leaves. A signal handler only sets flags: one that wrote the event log could wait forever on the
    log's lock, held by the very main thread it interrupted. `report` writes the event, once, from the
    agent's main loop.

    Use as a context manager: it installs the handlers and starts the watcher, and restores and stops them."""

    def __init__(self, signals: Tuple[int, ...], url: Optional[str], poll_interval: float, events: EventLog,
                 host_id: str):
        self.signals, self.events, self.host_id = signals, events, host_id
        self._watcher = NoticeWatcher(url, poll_interval, self.on_notice) if url else None
        self._previous: Dict[int, object] = {}
        self._first: Optional[Tuple[float, datetime.datetime, str]] = None  # (monotonic, wall clock, what)
        self._reported = False

    def __enter__(self) -> "Notices":
        self._previous = {sig: signal.signal(sig, self.on_signal) for sig in self.signals}
        if self._watcher:
            self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._watcher:
            self._watcher.stop()

    @property
    def received(self) -> bool:
        return self._first is not None

    @property
    def what(self) -> Optional[str]:
        return self._first and self._first[2]

    def seconds_since(self) -> Optional[float]:
        return self._first and round(time.monotonic() - self._first[0], 2)

    def on_signal(self, signum, frame) -> None:
        del frame
        self.on_notice(f"signal {signal.Signals(signum).name}")

    def on_notice(self, what: str) -> None:
        if self._first is None:
            self._first = (time.monotonic(), datetime.datetime.now(datetime.timezone.utc), what)

    def report(self) -> None:
        if self._first is not None and not self._reported:
            self._reported = True
            _, when, what = self._first
            self.events.write(Event.PREEMPTION_NOTICE, host=self.host_id, notice=what,
                              seconds_left=seconds_left(what, when))
