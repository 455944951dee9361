"""Rendezvous stores: one small key-value interface, backends chosen by URL scheme.

The agent keeps all shared state (rounds, host leases, job outcome) in a store. `file:///DIR` works on
one host or a shared filesystem; other backends (etcd) register themselves in `BACKENDS`.
Values are JSON text: nothing is pickled, on the wire or on disk.
"""
import abc
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


class Store(abc.ABC):
    """Keys are '/'-separated paths; values are strings; every key lives under the job's prefix."""

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

    def close(self) -> None:
        """Releases connections; the default has none."""


BACKENDS: Dict[str, Callable[[urllib.parse.ParseResult], Store]] = {}


def register_backend(scheme: str, factory: Callable[[urllib.parse.ParseResult], Store]) -> None:
    BACKENDS[scheme] = factory


def open_store(url: str) -> Store:
    """Opens the store that `url` names, e.g. `file:///tmp/rdzv`."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in BACKENDS:
        raise ValueError(f"--rdzv={url!r}: unknown store scheme {parsed.scheme!r}; known: "
                         f"{', '.join(s + '://' for s in sorted(BACKENDS))}.")
    return BACKENDS[parsed.scheme](parsed)


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


def _file_store(url: urllib.parse.ParseResult) -> Store:
    if url.netloc not in ("", "localhost") or not url.path:
        raise ValueError(f"--rdzv=file://{url.netloc}{url.path}: expected file:///ABSOLUTE/DIR.")
    return FileStore(url.path)


register_backend("file", _file_store)
