"""Ports for the workers' TF servers, probed on this host each round."""
import socket
from typing import Collection, List, Optional, Tuple


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
