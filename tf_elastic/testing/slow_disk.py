"""A slow disk under one host's input pipeline, made from outside, for tests where a host is slow because its
reads are: an ext4 image on a loop device, mounted where the test writes its data files, and a blkio (cgroup v1)
cgroup whose `blkio.throttle.read_bps_device` caps reads from that device. Nothing in the slowed process knows.

The cap only meets reads that miss the page cache, so while it holds a thread evicts the mounted files from the
cache (`POSIX_FADV_DONTNEED`) every `EVICT_EVERY_S`: a second pass over the data is as slow as the first. Only
the processes `add`ed (and what they start) are capped; others read the same files at full speed.
"""
import contextlib
import functools
import itertools
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional

from tf_elastic.testing.throttle import descendants, move_to_cgroup

BLKIO = Path("/sys/fs/cgroup/blkio")
EVICT_EVERY_S = 0.05
TOOLS = ("losetup", "mkfs.ext4", "mount", "umount")
_names = itertools.count()


def _run(*argv: str) -> str:
    """`argv`'s stdout; its stderr in the error where it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout.strip()


def _attach(image: Path) -> str:
    """A free loop device attached to `image` (retried: another process may take the one `-f` found)."""
    for _ in range(4):
        with contextlib.suppress(RuntimeError):
            return _run("losetup", "-f", "--show", str(image))
        time.sleep(0.2)
    return _run("losetup", "-f", "--show", str(image))


@functools.lru_cache(maxsize=None)
def available() -> Optional[str]:
    """None where this machine can make a slow disk, else why not (a `pytest.skip` reason)."""
    if os.geteuid() != 0:
        return "slow_disk needs root (loop devices, mount, cgroups)"
    if not (BLKIO / "blkio.throttle.read_bps_device").exists() or not os.access(BLKIO, os.W_OK):
        return f"no writable cgroup v1 blkio controller with read_bps_device at {BLKIO}"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"slow_disk needs {', '.join(missing)}"
    with tempfile.NamedTemporaryFile(prefix="slow_disk-probe-") as probe:
        os.truncate(probe.name, 1 << 20)
        try:
            device = _attach(Path(probe.name))
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            return f"cannot attach a loop device: {error}"
        subprocess.run(["losetup", "-d", device], capture_output=True, timeout=60)
    return None


class SlowDisk:
    """The mounted disk at `path` (on loop `device`) and the blkio cgroup `cgroup` whose members' reads from it
    are capped by `limit`. Made by `slow_disk`, which removes it all."""

    def __init__(self, path: Path, device: str, cgroup: Path):
        self.path = path
        self.device = device
        self.cgroup = cgroup
        rdev = os.stat(device).st_rdev
        self._device_id = f"{os.major(rdev)}:{os.minor(rdev)}"
        self._stop = threading.Event()
        self._evictor: Optional[threading.Thread] = None

    def add(self, pid: int) -> None:
        """`pid` and the processes below it into the cgroup, each before its children are read (see
        `Throttle.add`); processes they start later are members from birth."""
        descendants(pid, lambda member: move_to_cgroup(self.cgroup, member))

    def limit(self, bytes_per_second: Optional[int]) -> None:
        """Cap the members' reads from the disk at `bytes_per_second` (None: no cap, and no eviction). The
        files are out of the page cache when this returns, so the cap meets the very next read."""
        rate = 0 if bytes_per_second is None else max(1, int(bytes_per_second))  # 0 removes the rule
        (self.cgroup / "blkio.throttle.read_bps_device").write_text(f"{self._device_id} {rate}")
        if bytes_per_second is None:
            self._stop_evicting()
            return
        self._evict(flush=True)  # pages written but not yet on the disk cannot be dropped until flushed
        if self._evictor is None:
            self._stop.clear()
            self._evictor = threading.Thread(target=self._evict_loop, name="slow_disk-evict", daemon=True)
            self._evictor.start()

    def _evict_loop(self) -> None:
        while not self._stop.wait(EVICT_EVERY_S):
            self._evict(flush=False)

    def _evict(self, flush: bool) -> None:
        """Drop every regular file under `path` from the page cache; files that vanish meanwhile are skipped."""
        for directory, _, names in os.walk(self.path):
            for name in names:
                try:
                    fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                except OSError:
                    continue
                try:
                    if flush:
                        os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass  # not a regular file, or gone
                finally:
                    os.close(fd)

    def _stop_evicting(self) -> None:
        self._stop.set()
        if self._evictor is not None:
            self._evictor.join(timeout=5)
            self._evictor = None

    def close(self) -> None:
        """Lift the cap and move the members still in the cgroup back to the root one."""
        self.limit(None)
        for tid in _members(self.cgroup):
            try:
                (BLKIO / "tasks").write_text(tid)
            except OSError:
                pass  # it ended meanwhile


def _members(cgroup: Path) -> List[str]:
    try:
        return (cgroup / "tasks").read_text().split()
    except OSError:
        return []


def _remove_cgroup(cgroup: Path) -> None:
    """rmdir, retried while members that were moving out or ending still hold it."""
    for _ in range(50):
        for tid in _members(cgroup):
            with contextlib.suppress(OSError):
                (BLKIO / "tasks").write_text(tid)
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    cgroup.rmdir()


def _unmount(mount: Path) -> None:
    """umount, retried briefly while the mount is busy, then lazily (it goes when its last user closes)."""
    for _ in range(20):
        if subprocess.run(["umount", str(mount)], capture_output=True, timeout=60).returncode == 0:
            return
        time.sleep(0.1)
    _run("umount", "-l", str(mount))


@contextlib.contextmanager
def slow_disk(image_dir: Path, size_mb: int = 64) -> Iterator[SlowDisk]:
    """A `size_mb` ext4 disk mounted at `image_dir / "mnt"`, uncapped until `SlowDisk.limit`. On exit, even
    from an error: no cap, members back in the root cgroup, the cgroup, mount, loop device and image gone."""
    image_dir = Path(image_dir)
    image, mount = image_dir / "slow_disk.img", image_dir / "mnt"
    cgroup = BLKIO / f"tf_elastic-slow_disk-{os.getpid()}-{next(_names)}"
    with contextlib.ExitStack() as cleanup:
        image_dir.mkdir(parents=True, exist_ok=True)
        image.write_bytes(b"")
        cleanup.callback(image.unlink, missing_ok=True)
        os.truncate(image, size_mb << 20)  # sparse: the image takes only what is written
        _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(image))
        device = _attach(image)
        cleanup.callback(_run, "losetup", "-d", device)
        mount.mkdir(exist_ok=True)
        _run("mount", "-t", "ext4", device, str(mount))
        cleanup.callback(_unmount, mount)
        cgroup.mkdir()
        cleanup.callback(_remove_cgroup, cgroup)
        disk = SlowDisk(mount, device, cgroup)
        cleanup.callback(disk.close)
        yield disk
