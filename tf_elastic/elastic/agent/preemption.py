"""Preemption notices from a cloud's metadata server, polled: the agent commits and leaves before the
machine goes (it gets SIGTERM or a configured signal such as Slurm's `--signal=USR1@90` the same way).

A notice is an HTTP 200 whose body is neither empty nor `FALSE` nor `NONE`. That covers
  GCE  `.../computeMetadata/v1/instance/preempted` (TRUE once preempted),
       `.../instance/maintenance-event` (NONE until a maintenance is scheduled),
  AWS  `.../latest/meta-data/spot/instance-action` (404 until `{"action": "terminate", "time": ...}`).
"""
import datetime
import json
import threading
import urllib.error
import urllib.request
from typing import Callable, Optional

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
