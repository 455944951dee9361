"""`file:///DIR`: a store in a directory, for one host or a filesystem all hosts share.

Private to the job's user: the directory is created 0700 and its files 0600, and a directory that
another user owns or that group or others may write is refused (whoever can write it controls the
job). Every filesystem error is a `StoreError`, so the agents train on through a full or flaky
shared disk as they do through an etcd outage.

Leases never compare clocks across hosts: each write carries a fresh version, and a reader counts a
key with a TTL as expired once it has seen the same version for longer than the TTL on its own
monotonic clock. A version it sees for the first time is as old as the filesystem says: its file's
mtime against the mtime of the lock file touched just now, both stamped by the filesystem's one clock
(the kernel's, or the NFS server's), less `CLOCK_MARGIN` (filesystems that stamp the writer's clock, as
some distributed ones do, need the hosts' clocks within it), so that a reader never counts a lease whose
host died long before it looked as live.

Each write goes to a temporary file, is fsynced and renamed into place; the rename (and a compare-and-set's
read before it) holds one `flock`, the fsync does not, and the lock is waited for at most `request_timeout`
(`--rdzv_request_timeout`), so that neither a busy disk nor a stopped holder blocks every agent's keepalive.
A shared filesystem must support `flock` (NFS: with its lock daemon).
"""
import fcntl
import json
import os
import stat
import time
import urllib.parse
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

from tf_elastic.elastic.store.base import Store, StoreError, StoreOptions


CLOCK_MARGIN = 1.0  # seconds a first-seen file's age is reduced by: clocks stamping mtimes may differ this much


class FileStore(Store):
    """A directory: one JSON file a key, atomic renames, one lock file for compare-and-set."""

    def __init__(self, root: str, lock_timeout: float = 1.0 / 6):
        self.root = Path(root)
        self.lock_timeout = lock_timeout
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = self.root.stat()
        except OSError as error:
            raise StoreError(f"cannot create the file store at {root!r}: {error}") from None
        if info.st_uid != os.getuid():
            raise StoreError(f"the file store {root!r} belongs to another user (uid {info.st_uid}); "
                             f"use a directory of your own")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StoreError(f"the file store {root!r} is writable by group or others (mode "
                             f"{stat.S_IMODE(info.st_mode):o}); chmod 700 it: whoever can write it controls the job")
        if info.st_mode & 0o077:
            try:  # ours, made by someone else's umask or an older version: others may not read it either
                self.root.chmod(0o700)
            except OSError as error:
                raise StoreError(f"cannot make the file store {root!r} private (chmod 700): {error}") from None
        self._lock_path = self.root / ".lock"
        try:
            self._lock_path.chmod(0o600)  # one left by an older version or another umask
        except OSError:
            pass  # not there yet (created 0600), or not ours: the lock still works
        # path -> (version, when this reader first saw it), on this process's monotonic clock
        self._seen: Dict[Path, Tuple[str, float]] = {}

    def get(self, key: str) -> Optional[str]:
        return self._read(self._path(key))

    def set(self, key: str, value: str, ttl: Optional[float] = None) -> None:
        path = self._path(key)
        with self._staged(path, value, ttl) as staged, self._locked():
            self._publish(staged, path)

    def compare_and_set(self, key: str, expected: Optional[str], value: str, ttl: Optional[float] = None) -> bool:
        path = self._path(key)
        with self._staged(path, value, ttl) as staged, self._locked():
            if self._read(path) != expected:
                return False
            self._publish(staged, path)
            return True

    def list(self, prefix: str) -> Dict[str, str]:
        base = self._dir(prefix)
        found = {}
        try:
            paths = list(base.rglob("*.json")) if base.is_dir() else []
        except OSError as error:
            raise StoreError(f"cannot list the file store under {base}: {error}") from None
        for path in paths:
            value = self._read(path)
            if value is not None:
                found["/" + path.relative_to(self.root).with_suffix("").as_posix()] = value
        return found

    def delete(self, key: str) -> None:
        with self._locked():
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as error:
                raise StoreError(f"cannot delete {key} from the file store: {error}") from None

    def _path(self, key: str) -> Path:
        return self._dir(key).with_name(self._dir(key).name + ".json")

    def _dir(self, prefix: str) -> Path:
        parts = [p for p in prefix.split("/") if p]
        if not parts or any(p in (".", "..") or "\0" in p for p in parts):
            raise ValueError(f"invalid store key {prefix!r}")
        return self.root.joinpath(*parts)

    def _read(self, path: Path) -> Optional[str]:
        try:
            with open(path, encoding="utf-8") as f:
                text, written = f.read(), os.fstat(f.fileno()).st_mtime  # the mtime of the version read
        except FileNotFoundError:
            self._seen.pop(path, None)
            return None
        except OSError as error:
            raise StoreError(f"cannot read the file store at {path}: {error}") from None
        try:
            record = json.loads(text)
        except ValueError as error:
            raise StoreError(f"malformed store file {path}: {error}") from None
        ttl = record.get("ttl") if isinstance(record, dict) else None
        if not (isinstance(record, dict) and isinstance(record.get("value"), str)
                and isinstance(record.get("version"), str)
                and (ttl is None or (isinstance(ttl, (int, float)) and ttl > 0))):
            raise StoreError(f"malformed store file {path}: expected {{'value': str, 'version': str, "
                             f"'ttl': positive number or null}}")
        if ttl is not None and self._unchanged_for(path, record["version"], ttl, written) > ttl:
            return None
        return record["value"]

    def _unchanged_for(self, path: Path, version: str, ttl: float, written: float) -> float:
        """Seconds `version` has been at `path`: since this reader first saw it, or (a path it never saw
        before) since the filesystem stamped it (`written`). A version that replaced one this reader saw is
        new."""
        now = time.monotonic()
        if path not in self._seen:
            self._seen[path] = (version, now - self._age(written, ttl))
        seen_version, since = self._seen[path]
        if seen_version != version:
            self._seen[path] = (version, now)
            return 0.0
        return now - since

    def _age(self, written: float, ttl: float) -> float:
        """How long ago a file stamped `written` was written, on the filesystem's clock, less `CLOCK_MARGIN`
        (0 when it cannot tell). Only an age beyond `ttl` matters, so a file young by this host's clock is
        not asked about (a clock behind the filesystem's can only make a file look younger: counted live,
        as any reader that just met it did before)."""
        if time.time() - written <= ttl + CLOCK_MARGIN:
            return 0.0
        return max(0.0, self._filesystem_now() - written - CLOCK_MARGIN)

    def _filesystem_now(self) -> float:
        """The filesystem's clock now: the lock file touched, then its mtime read back."""
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.utime(fd)
                return os.fstat(fd).st_mtime
            finally:
                os.close(fd)
        except OSError:
            return float("-inf")

    @staticmethod
    @contextmanager
    def _staged(path: Path, value: str, ttl: Optional[float]) -> Iterator[Path]:
        """A temporary file beside `path` holding the record, written and fsynced before the lock is taken:
        an fsync can wait for a busy disk, and every other agent's renewal waits on the lock (a held lock
        that outlasts a lease counts live hosts lost). Removed unless published."""
        temp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        record = json.dumps({"value": value, "version": uuid.uuid4().hex, "ttl": ttl})
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(record)
                f.flush()
                os.fsync(f.fileno())  # the rename must never publish a file whose content is not on disk
        except OSError as error:
            _discard(temp)
            raise StoreError(f"cannot write the file store at {path}: {error}") from None
        try:
            yield temp
        finally:
            _discard(temp)  # published: gone already

    @staticmethod
    def _publish(staged: Path, path: Path) -> None:
        try:
            os.replace(staged, path)
        except OSError as error:
            raise StoreError(f"cannot write the file store at {path}: {error}") from None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's lock, waited for at most `lock_timeout`: a holder that is stopped (SIGSTOP) or
        hung must not block every agent's keepalive forever."""
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise StoreError(f"cannot open the file store's lock {self._lock_path}: {error}") from None
        try:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreError(f"the file store's lock {self._lock_path} is held by another process "
                                         f"for over {self.lock_timeout:g}s") from None
                    time.sleep(0.005)
                except OSError as error:  # ENOLCK (NFS without a lock daemon), EIO
                    raise StoreError(f"cannot lock the file store's {self._lock_path}: {error}") from None
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)  # cannot fail on a lock this descriptor holds
        finally:
            os.close(fd)


def _discard(temp: Path) -> None:
    """Removes a staged file that was not published; a disk that refuses leaves a dot-file `list` skips."""
    try:
        temp.unlink(missing_ok=True)
    except OSError:
        pass


def from_url(url: urllib.parse.ParseResult, options: StoreOptions) -> Store:
    if url.netloc not in ("", "localhost") or not url.path:
        raise ValueError(f"--rdzv=file://{url.netloc}{url.path}: expected file:///ABSOLUTE/DIR.")
    return FileStore(url.path, lock_timeout=options.request_timeout)
