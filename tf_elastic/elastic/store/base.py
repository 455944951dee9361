"""The store interface every rendezvous backend implements.

The agents keep all shared state (rounds, host leases, job outcome) in a store. Keys are absolute
'/'-separated paths (`/JOB/hosts/HOST`), everywhere: `get`, `set` and what `list` returns. Values are
JSON text: nothing is pickled, on the wire or on disk.
"""
import abc
import dataclasses
import time
from typing import Dict, Optional, Sequence, Set


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
    # Seconds per request before an endpoint counts as unreachable: at most a sixth of the host TTL per
    # endpoint (`decisions.request_timeout_limit`; the agent's CLI checks it), here for the default 1 s.
    request_timeout: float = 1.0 / 6
    # Seconds for a password login's answer (its connection gets `request_timeout`, so a dead endpoint
    # still fails fast). etcd checks a password with bcrypt, tens of milliseconds of its CPU each, which a
    # busy server or hundreds of hosts starting at once push far past `request_timeout`; a client logs in
    # once per token (etcd's simple tokens live 5 minutes), and a renewal that needs a new token can then
    # outlast its lease.
    login_timeout: float = 5.0


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
    def compare_and_set(self, key: str, expected: Optional[str], value: str, ttl: Optional[float] = None) -> bool:
        """Writes `value` only if the current value is `expected` (None: absent); True if written. With
        `ttl`, as `set`'s."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Dict[str, str]:
        """All live keys under `prefix` (absolute, like the keys `get` takes), with their values."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Removes `key` if present."""

    def lease_seconds(self, ttl: float) -> float:
        """How long a key written with `ttl` lives unrenewed here (a backend may raise it to its minimum)."""
        return ttl

    def wait(self, keys: Sequence[str], timeout: float, gone: Sequence[str] = ()) -> Set[str]:
        """Blocks until one of `keys` (a key, or every key under a prefix that ends in '/') may have
        changed, or one of `gone` may have disappeared (deleted, or its lease expired), since this store's
        last `wait` that named it, or `timeout` passed. Returns the names (of `keys` and `gone`) that may
        have changed: empty when none did, so that a caller reads only those.

        Backends that cannot notify just sleep and answer every name: read again."""
        time.sleep(timeout)
        return set(keys) | set(gone)

    def close(self) -> None:
        """Releases connections; the default has none."""
