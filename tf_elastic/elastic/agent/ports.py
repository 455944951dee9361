"""Ports for the workers' TF servers, probed on the advertised address each round."""
import socket
from typing import List, Optional, Tuple


class NoFreePorts(RuntimeError):
    """`--port_range` has too few free ports on this host right now."""


def free_ports(addr: str, count: int, port_range: Optional[Tuple[int, int]] = None) -> List[int]:
    """Ports free right now on `addr` (within `port_range` if given); fresh every round, so a stale
    process cannot hold one."""
    sockets = []
    try:
        candidates = iter(range(port_range[0], port_range[1] + 1)) if port_range else None
        while len(sockets) < count:
            s = socket.socket()
            try:
                s.bind((addr, next(candidates) if candidates else 0))
            except StopIteration:
                s.close()
                raise NoFreePorts(f"--port_range={port_range[0]}-{port_range[1]} has fewer than {count} free "
                                  f"ports on {addr}") from None
            except OSError:
                s.close()
                continue
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
