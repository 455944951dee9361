"""Loopback ports for tests and benchmarks."""
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bindable(host: str, port: int) -> bool:
    """Could a server listen on `host:port` now? A closed connection's TIME_WAIT does not count as holding
    it (SO_REUSEADDR); a listener still does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False
