"""`file:///DIR`: a store in a directory, for one host or a filesystem all hosts share."""
import fcntl
import json
import os
import time
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional

from tf_elastic.elastic.store.base import Store, StoreError, StoreOptions


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
                    key = "/" + path.relative_to(self.root).with_suffix("").as_posix()
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


def from_url(url: urllib.parse.ParseResult, options: StoreOptions) -> Store:
    del options  # a directory needs no credentials
    if url.netloc not in ("", "localhost") or not url.path:
        raise ValueError(f"--rdzv=file://{url.netloc}{url.path}: expected file:///ABSOLUTE/DIR.")
    return FileStore(url.path)
