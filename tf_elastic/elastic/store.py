"""Rendezvous stores: one small key-value interface, backends chosen by URL scheme.

The agent keeps all shared state (rounds, host leases, job outcome) in a store. `file:///DIR` works on
one host or a shared filesystem; other backends (etcd) register themselves in `BACKENDS`.
Values are JSON text: nothing is pickled, on the wire or on disk.
"""
import abc
import dataclasses
import fcntl
import json
import os
import time
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional


class StoreError(RuntimeError):
    """The store is unreachable or holds content we cannot accept."""


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Connection settings a networked backend needs; the file store needs none."""
    user: Optional[str] = None
    password: Optional[str] = None
    ca_cert: Optional[str] = None  # TLS: verify the server against this CA
    cert: Optional[str] = None  # TLS client certificate and its key
    key: Optional[str] = None
    request_timeout: float = 2.0  # seconds per request before an endpoint counts as unreachable


class Store(abc.ABC):
    """Keys are '/'-separated paths; values are strings; every key lives under the job's prefix."""

    notifies = False  # True when `wait` wakes on changes rather than sleeping

    @abc.abstractmethod
    def get(self, key: str) -> Optional[str]:
        """The value, or None when absent or its lease expired."""

    @abc.abstractmethod
    def set(self, key: str, value: str, ttl: Optional[float] = None) -> None:
        """Writes `value`; with `ttl` the key disappears `ttl` seconds after its last write."""

    @abc.abstractmethod
    def compare_and_set(self, key: str, expected: Optional[str], value: str) -> bool:
        """Writes `value` only if the current value is `expected` (None: absent); True if written."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Dict[str, str]:
        """All live keys under `prefix`, with their values."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Removes `key` if present."""

    def wait(self, prefix: str, timeout: float) -> bool:
        """Blocks until a key under `prefix` may have changed (True) or `timeout` passed (False).

        Backends that cannot notify just sleep and answer True: read again."""
        time.sleep(timeout)
        return True

    def close(self) -> None:
        """Releases connections; the default has none."""


Factory = Callable[[urllib.parse.ParseResult, StoreOptions], Store]
BACKENDS: Dict[str, Factory] = {}


def register_backend(scheme: str, factory: Factory) -> None:
    BACKENDS[scheme] = factory


def open_store(url: str, options: StoreOptions = StoreOptions()) -> Store:
    """Opens the store that `url` names, e.g. `file:///tmp/rdzv` or `etcd://127.0.0.1:2379`."""
    from tf_elastic.elastic import etcd_store  # noqa: F401  registers etcd://

    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in BACKENDS:
        raise ValueError(f"--rdzv={url!r}: unknown store scheme {parsed.scheme!r}; known: "
                         f"{', '.join(s + '://' for s in sorted(BACKENDS))}.")
    return BACKENDS[parsed.scheme](parsed, options)


class FileStore(Store):
    """A directory: one JSON file a key, atomic renames, one lock file for compare-and-set."""

    def __init__(self, root: str):
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreError(f"cannot create the file store at {root!r}: {error}") from None
        self._lock_path = self.root / ".lock"

    def get(self, key: str) -> Optional[str]:
        return self._read(self._path(key))

    def set(self, key: str, value: str, ttl: Optional[float] = None) -> None:
        with self._locked():
            self._write(self._path(key), value, ttl)

    def compare_and_set(self, key: str, expected: Optional[str], value: str) -> bool:
        with self._locked():
            path = self._path(key)
            if self._read(path) != expected:
                return False
            self._write(path, value, None)
            return True

    def list(self, prefix: str) -> Dict[str, str]:
        base = self._dir(prefix)
        found = {}
        if base.is_dir():
            for path in base.rglob("*.json"):
                value = self._read(path)
                if value is not None:
                    key = str(path.relative_to(self.root).with_suffix(""))
                    found[key] = value
        return found

    def delete(self, key: str) -> None:
        with self._locked():
            self._path(key).unlink(missing_ok=True)

    def _path(self, key: str) -> Path:
        return self._dir(key).with_name(self._dir(key).name + ".json")

    def _dir(self, prefix: str) -> Path:
        parts = [p for p in prefix.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise ValueError(f"invalid store key {prefix!r}")
        return self.root.joinpath(*parts)

    @staticmethod
    def _read(path: Path) -> Optional[str]:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            raise StoreError(f"malformed store file {path}: {error}") from None
        if not isinstance(record, dict) or not isinstance(record.get("value"), str):
            raise StoreError(f"malformed store file {path}: expected {{'value': str, 'expires': float|null}}")
        expires = record.get("expires")
        if expires is not None and time.time() > expires:
            return None
        return record["value"]

    @staticmethod
    def _write(path: Path, value: str, ttl: Optional[float]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temp.write_text(json.dumps({"value": value, "expires": None if ttl is None else time.time() + ttl}))
        os.replace(temp, path)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _file_store(url: urllib.parse.ParseResult, options: StoreOptions) -> Store:
    del options  # a directory needs no credentials
    if url.netloc not in ("", "localhost") or not url.path:
        raise ValueError(f"--rdzv=file://{url.netloc}{url.path}: expected file:///ABSOLUTE/DIR.")
    return FileStore(url.path)


register_backend("file", _file_store)
