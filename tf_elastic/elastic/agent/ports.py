"""Ports for the workers' TF servers, probed on this host each round.

Agents that share an address (several on one host) pick their ports without seeing each other's round
entries (each announces its own in its lease), so the ports one agent picked are held for it in a
host-local registry per address, `tf_elastic-ports-UID-ADDR.json` in the temporary directory, for
`HOLD_SECONDS`: long enough for its workers' servers to bind them. Another agent of that address skips
them meanwhile.
"""
import contextlib
import fcntl
import json
import os
import socket
import tempfile
import time
from typing import Collection, Dict, Iterator, List, Optional, Tuple

HOLD_SECONDS = 120.0
REGISTRY_PREFIX = "tf_elastic-ports-"  # the registries' file names start so; they outlive the agents on purpose


class NoFreePorts(RuntimeError):
    """`--port_range` has too few free ports on this host right now."""


def free_ports(count: int, port_range: Optional[Tuple[int, int]] = None, exclude: Collection[int] = ()) -> List[int]:
    """`count` ports free right now on every interface (within `port_range` if given), none of `exclude`;
    fresh every round, so a stale process cannot hold one.

    Probed on all interfaces, not on the advertised address: TF servers listen on all of them, and the
    advertised address may not be one of this host's (NAT, a public address)."""
    sockets = []
    try:
        candidates = iter(range(port_range[0], port_range[1] + 1)) if port_range else None
        while len(sockets) < count:
            s = socket.socket()
            try:
                s.bind(("", next(candidates) if candidates else 0))
            except StopIteration:
                s.close()
                raise NoFreePorts(f"--port_range={port_range[0]}-{port_range[1]} has fewer than {count} free "
                                  f"ports on this host") from None
            except OSError:
                s.close()
                continue
            if s.getsockname()[1] in exclude:
                s.close()
                continue
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def claim_ports(claimant: str, addr: str, count: int, port_range: Optional[Tuple[int, int]] = None) -> List[int]:
    """`free_ports`, none that another claimant of address `addr` on this host took in the last
    `HOLD_SECONDS`; recorded as `claimant`'s (its own earlier ports are free to it again)."""
    with _registry(addr) as held:
        now = time.time()
        others = {int(port) for port, (owner, when) in held.items() if owner != claimant and now - when < HOLD_SECONDS}
        ports = free_ports(count, port_range, exclude=others)
        for port, (owner, when) in list(held.items()):
            if owner == claimant or now - when >= HOLD_SECONDS:
                del held[port]
        held.update({str(port): (claimant, now) for port in ports})
        return ports


@contextlib.contextmanager
def _registry(addr: str) -> Iterator[Dict[str, Tuple[str, float]]]:
    """The registry of `addr` (port -> (claimant, wall-clock time)), locked; written back on success. An
    unreadable registry counts as empty: it only avoids collisions, it guards nothing."""
    name = "".join(c if c.isalnum() or c in ".-" else "_" for c in addr)
    path = os.path.join(tempfile.gettempdir(), f"{REGISTRY_PREFIX}{os.getuid()}-{name}.json")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+", encoding="utf-8") as registry:
        fcntl.flock(registry, fcntl.LOCK_EX)
        try:
            held = json.loads(registry.read() or "{}")
            held = {p: (str(v[0]), float(v[1])) for p, v in held.items()} if isinstance(held, dict) else {}
        except (ValueError, TypeError, IndexError, AttributeError):
            held = {}
        yield held
        registry.seek(0)
        registry.truncate()
        registry.write(json.dumps(held))
