"""The slow disk harness on the real kernel: a loop device's reads capped by a blkio cgroup for the processes
added to it only, a second pass as slow as the first (eviction), and nothing left behind."""
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tf_elastic.testing.slow_disk import BLKIO, SlowDisk, available, slow_disk

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

MB = 1 << 20
# Reads the file named by argv[1] once for every line on stdin, and prints the seconds it took.
READER = """
import sys, time
for _ in sys.stdin:
    start = time.monotonic()
    with open(sys.argv[1], "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    print(time.monotonic() - start, flush=True)
"""


class Reader:
    """A process that reads `path` when asked, started outside the disk's cgroup."""

    def __init__(self, path: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", READER, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def read(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SlowDisk]:
    with slow_disk(tmp_path, size_mb=32) as disk:
        (disk.path / "data.bin").write_bytes(os.urandom(4 * MB))
        yield disk


@pytest.fixture
def reader(disk: SlowDisk) -> Iterator[Reader]:
    reader = Reader(disk.path / "data.bin")
    yield reader
    reader.close()


def _cgroup_of(pid: int) -> str:
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return next(line.split(":", 2)[2] for line in lines if line.split(":")[1] == "blkio")


def test_an_added_process_reads_at_the_limit_and_a_second_pass_is_as_slow(disk, reader):
    disk.add(reader.proc.pid)
    assert _cgroup_of(reader.proc.pid) == "/" + disk.cgroup.name
    disk.limit(2 * MB)
    first = reader.read()
    second = reader.read()  # the page cache was emptied under it meanwhile
    assert 1.5 <= first < 6, first
    assert 1.5 <= second < 6, second


def test_without_a_limit_the_same_read_is_fast(disk, reader):
    disk.add(reader.proc.pid)
    disk.limit(MB)
    disk.limit(None)
    assert disk._evictor is None
    assert reader.read() < 0.5


def test_a_process_not_added_reads_fast_while_the_disk_is_limited(disk, reader):
    disk.limit(MB)
    time.sleep(2 * 0.05)  # an eviction pass or two
    assert reader.read() < 0.5
    assert reader.read() < 0.5


def test_leaving_removes_the_mount_the_loop_device_and_the_cgroup_even_after_an_error(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError, match="the body failed"):
            with slow_disk(tmp_path) as disk:
                disk.add(sleeper.pid)
                disk.limit(MB)
                (disk.path / "file").write_bytes(b"x" * 4096)
                mount, device, cgroup = disk.path, disk.device, disk.cgroup
                assert str(mount) in Path("/proc/mounts").read_text()
                raise RuntimeError("the body failed")
        assert str(mount) not in Path("/proc/mounts").read_text()
        assert not cgroup.exists()
        assert _cgroup_of(sleeper.pid) == "/"  # back in the root cgroup, still running
        assert sleeper.poll() is None
        name = os.path.basename(device)
        assert not Path(f"/sys/block/{name}/loop/backing_file").exists()
        assert not (tmp_path / "slow_disk.img").exists()
        assert not [c for c in BLKIO.iterdir() if c.name.startswith(f"tf_elastic-slow_disk-{os.getpid()}-")]
    finally:
        sleeper.kill()
        sleeper.wait()
