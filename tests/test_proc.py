"""tf_elastic/elastic/proc.py: the one /proc reader."""
import os
import subprocess
import sys
import time

import pytest

from tf_elastic.elastic import proc


def test_the_proc_reader_tells_running_zombie_and_gone_apart():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert proc.running(child.pid) and proc.group_has_live_member(child.pid)
        times = os.times()  # the kernel's own count of the same ticks
        assert proc.cpu_seconds(os.getpid()) == pytest.approx(times.user + times.system, abs=0.05)
        child.kill()
        deadline = time.time() + 10
        while proc.running(child.pid) and time.time() < deadline:  # a zombie until reaped
            time.sleep(0.01)
        assert proc.running(child.pid) is False and proc.group_has_live_member(child.pid) is False
    finally:
        child.kill()
        child.wait()
    assert proc.running(child.pid) is False
