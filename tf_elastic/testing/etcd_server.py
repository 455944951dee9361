"""A throwaway single-member etcd on 127.0.0.1 (Debian's `etcd-server`), for tests, benchmarks and chaos.

Started with a short heartbeat and election timeout: etcd raises a lease TTL below 1.5 election
timeouts to that minimum, and tests give the agents host leases down to 0.4 s.
"""
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple

import requests

from tf_elastic.testing.net import free_port


class EtcdServer:
    """`tls`: (CA, server cert, server key) to serve https and require client certificates signed by the CA."""

    def __init__(self, data_dir: Optional[str] = None, tls: Optional[Tuple[str, str, str]] = None,
                 hosts: Tuple[str, ...] = ("127.0.0.1",), election_timeout_ms: int = 250):
        """`hosts`: the loopback addresses it serves clients on, all on one port (see `url_on`)."""
        self.tls, self.hosts, self.election_timeout_ms = tls, hosts, election_timeout_ms
        if shutil.which("etcd") is None:
            raise RuntimeError("etcd is not installed: apt-get install etcd-server")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="tf_elastic-etcd-", dir=_memory_dir()))
        self.client_port, self.peer_port = free_port(), free_port()
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return self.url_on(self.hosts[0])

    def url_on(self, host: str) -> str:
        return f"etcd://{host}:{self.client_port}"

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        """Starts etcd (again, after `stop`, on the same ports and data) and waits until it answers."""
        scheme = "https" if self.tls else "http"
        clients = ",".join(f"{scheme}://{host}:{self.client_port}" for host in self.hosts)
        client, peer = f"{scheme}://{self.hosts[0]}:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.tls:
            ca, cert, key = self.tls
            tls = [f"--cert-file={cert}", f"--key-file={key}", f"--trusted-ca-file={ca}", "--client-cert-auth"]
        log = open(self.data_dir.with_suffix(".log"), "ab")
        self.process = subprocess.Popen(
            ["etcd", "--name=tf_elastic", f"--data-dir={self.data_dir}", f"--listen-client-urls={clients}",
             f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}",
             f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=tf_elastic={peer}",
             f"--heartbeat-interval={self.election_timeout_ms // 10}", f"--election-timeout={self.election_timeout_ms}",
             *tls], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                # Any answer means it is up (with TLS we hold no client certificate here).
                requests.post(f"{client}/v3/kv/range", json={"key": "eA=="}, timeout=0.5, verify=False)
                return self
            except requests.exceptions.SSLError:
                return self
            except requests.RequestException:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not start within {timeout}s; see {self.data_dir.with_suffix('.log')}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir.with_suffix(".log").unlink(missing_ok=True)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


SHM, SHM_ROOM = "/dev/shm", 1 << 30  # etcd preallocates 64 MB WAL segments; Docker's default /dev/shm is 64 MB


def _memory_dir() -> Optional[str]:
    """/dev/shm when it has room: a test's etcd need not survive a reboot, and on a slow disk every write's
    fsync would time the tests (etcd 3.4 has no --unsafe-no-fsync). Else the temp dir."""
    try:
        return SHM if os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free > SHM_ROOM else None
    except OSError:
        return None
