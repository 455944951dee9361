"""Many agents' rendezvous and monitoring in a few processes, against a real store, with no workers.

Each simulated host is a thread (in one of `Simulation`'s child processes) running the agent's own
store-facing code (`Rendezvous.join`, then, while its round "trains", `renew_if_due`, `look` and
`wait_for_change`, as `ElasticAgent._monitor` does) with its own store client, which counts the requests
it sends. Hosts are lost (the thread stops without a word: its lease expires, as after a SIGKILL), leave
gracefully, or join. Used by the rendezvous benchmark and tests.
"""
import base64
import collections
import http.client
import itertools
import json
import multiprocessing
import sys
import threading
import time
import urllib.parse
from typing import Callable, Collection, Dict, List, Optional

import requests

from tf_elastic.elastic import proc
from tf_elastic.elastic.agent.decisions import GroupChange
from tf_elastic.elastic.agent.job_record import JobEnded
from tf_elastic.elastic.agent.rendezvous import Rendezvous
from tf_elastic.elastic.agent.round import Round, Timeouts
from tf_elastic.elastic.store import Store, StoreError
from tf_elastic.elastic.store.etcd import ROOT, EtcdStore
from tf_elastic.elastic.store.file import FileStore


class RequestCounter:
    """Requests sent by every store client of a simulation, by kind (`get`, `list`, `cas`,
    `lease check`, `watch`, ...: where a round's requests go)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.kinds: collections.Counter = collections.Counter()

    def add(self, kind: str) -> None:
        with self._lock:
            self.kinds[kind] += 1

    def snapshot(self) -> collections.Counter:
        with self._lock:
            return collections.Counter(self.kinds)


class _CountedEtcd(EtcdStore):
    """Counts every HTTP request, a watch stream included. Its requests go over one keep-alive
    `http.client` connection rather than `requests`: the simulator's own cost, not the agent's (a thousand
    hosts here share one process and two cores with etcd, and `requests` costs about ten times the CPU per
    request; an agent on a host of its own pays it alone). What is sent, and how often, is the agent's."""

    def __init__(self, endpoints: List[str], counter: RequestCounter):
        super().__init__(endpoints)
        self._counter = counter
        self._connections: Dict[str, http.client.HTTPConnection] = {}

    def _send(self, endpoint, path, body, headers):
        connection = self._connections.get(endpoint)
        if connection is None:
            connection = self._connections[endpoint] = self._connect(endpoint)
        try:
            response = _post(connection, path, body, headers)
            return response.status, response.read().decode("utf-8", "replace")
        except requests.ConnectionError:
            del self._connections[endpoint]
            raise

    def close(self):
        super().close()
        for connection in self._connections.values():
            connection.close()

    def _call(self, path, body):
        self._counter.add(_etcd_kind(path, body))
        return super()._call(path, body)

    def stream(self, path, body, read_timeout):
        """A watch stream on a connection of its own, through `http.client` too."""
        self._counter.add("watch")
        connection = self._connect(self.endpoints[self._current])
        response = _post(connection, path, body, {})
        connection.sock.settimeout(read_timeout)
        return _Stream(connection, response)

    def _connect(self, endpoint: str) -> http.client.HTTPConnection:
        host, _, port = endpoint.rpartition(":")
        return http.client.HTTPConnection(host, int(port), timeout=self.options.request_timeout)


def _post(connection: http.client.HTTPConnection, path: str, body: Dict,
          headers: Dict[str, str]) -> http.client.HTTPResponse:
    """A JSON POST's response; an endpoint that cannot be reached raises what `requests` would (the
    connection closed), so that `EtcdStore` handles it as its own transport's."""
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
        return connection.getresponse()
    except (OSError, http.client.HTTPException) as error:
        connection.close()
        raise _unreachable(error) from None


def _unreachable(error: Exception) -> requests.ConnectionError:
    return requests.ConnectionError(f"{type(error).__name__}: {error}")


class _Stream:
    """What `_Watch` reads of a streaming response: its lines, then the connection closed."""

    def __init__(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse):
        self._connection, self._response = connection, response

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc) -> None:
        self._connection.close()

    def iter_lines(self):
        try:
            while True:
                line = self._response.readline()
                if not line:
                    return
                yield line.rstrip(b"\r\n")
        except (OSError, http.client.HTTPException) as error:  # the read timeout ends a stream, as requests'
            raise _unreachable(error) from None


def _etcd_kind(path: str, body: Dict) -> str:
    """What an etcd request does, in the store's vocabulary, and where: `get hosts`, `list group`, `cas
    token`, `lease check` (a renewal's check that the lease still holds our value), ..."""
    verb = {"/v3/kv/range": "list" if "range_end" in body else "get", "/v3/kv/put": "set",
            "/v3/kv/deleterange": "delete", "/v3/kv/txn": "cas" if body.get("success") else "lease check"}.get(path)
    if verb is None:
        return path.rsplit("/", 2)[-2] + " " + path.rsplit("/", 1)[-1]  # lease keepalive, lease grant, ...
    key = body.get("key") or (body.get("compare") or [{}])[0].get("key", "")
    return verb if verb == "lease check" else _kind(verb, base64.b64decode(key).decode(errors="replace")[len(ROOT):])


def _kind(verb: str, key: str) -> str:
    """`verb` and the part of the job's keys it touches: `/JOB/hosts/h1` -> `VERB hosts`."""
    parts = key.split("/")
    return f"{verb} {parts[2] if len(parts) > 2 else '/'}"


class _CountedFile(FileStore):
    """Counts every operation (a `wait` is a sleep, not a request). A lease renewal here is a `cas hosts`
    like a join: the file store has no leases of its own."""

    def __init__(self, root: str, counter: RequestCounter):
        super().__init__(root)
        self._counter = counter

    def get(self, key):
        self._counter.add(_kind("get", key))
        return super().get(key)

    def set(self, key, value, ttl=None):
        self._counter.add(_kind("set", key))
        return super().set(key, value, ttl)

    def compare_and_set(self, key, expected, value, ttl=None):
        self._counter.add(_kind("cas", key))
        return super().compare_and_set(key, expected, value, ttl)

    def list(self, prefix):
        self._counter.add(_kind("list", prefix))
        return super().list(prefix)

    def delete(self, key):
        self._counter.add(_kind("delete", key))
        return super().delete(key)


def counting_store(url: str, counter: RequestCounter) -> Store:
    """A client of the store at `url` (`etcd://HOST:PORT` or `file:///DIR`) that counts its requests."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "etcd":
        return _CountedEtcd(parsed.netloc.split(","), counter)
    return _CountedFile(parsed.path, counter)


class SimulatedHost:
    """One host's agent without workers. `rounds`: round number -> (monotonic time the host got its
    ranks, its ranks, why the round began)."""

    def __init__(self, make_store: Callable[[], Store], job_id: str, host_id: str, addr: str, min_workers: int,
                 max_workers: int, timeouts: Timeouts, monitor_interval: float):
        self.host_id, self.monitor_interval = host_id, monitor_interval
        self.store = make_store()
        self.rendezvous = Rendezvous(self.store, job_id, host_id, nproc=1, addr=addr, min_workers=min_workers,
                                     max_workers=max_workers, max_restarts=1_000_000, timeouts=timeouts)
        self.rounds: Dict[int, tuple] = {}
        self.error: Optional[BaseException] = None
        self._lost, self._leaving = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"host-{host_id}", daemon=True)

    def start(self) -> "SimulatedHost":
        self.thread.start()
        return self

    def lose(self) -> None:
        """Stops the host without a word: its lease expires after the host TTL."""
        self._lost.set()

    def leave(self) -> None:
        """A graceful leave: the next round opens without this host, and its lease goes at once."""
        self._leaving.set()

    def _run(self) -> None:
        ranks, after = None, -1
        try:
            while True:
                round_ = self.rendezvous.join(previous_ranks=ranks, after=after,
                                              cancelled=lambda: self._lost.is_set() or self._leaving.is_set())
                if round_ is None:
                    break
                ranks, after = round_.assignment[self.host_id], round_.number
                self.rounds[round_.number] = (time.monotonic(), ranks, round_.why)
                if not self._train(round_):
                    break
            if self._leaving.is_set():
                self.rendezvous.leave()
        except JobEnded:
            pass
        except BaseException as error:  # reported by the simulation, never lost in a thread
            self.error = error
        finally:
            if not self._lost.is_set():
                self.store.close()

    def _train(self, round_: Round) -> bool:
        """The agent's monitoring of a round, until the store says it changed (True: join the next one)."""
        changed: Collection[str] = ()
        while not self._lost.is_set():
            if self._leaving.is_set():
                current = self.rendezvous.current()
                if current is not None and current.number == round_.number:
                    self.rendezvous.open_next(current, reason=f"leave {self.host_id}", failure=False, leaving=True)
                return False
            try:
                self.rendezvous.renew_if_due()
                look = self.rendezvous.look(round_, changed)
            except StoreError:  # as the agent: the round trains on, the store is tried again
                self.rendezvous.wait_for_change(self.monitor_interval, training=round_)
                changed = self.rendezvous.watched_keys(round_)
                continue
            if look.change is not GroupChange.NONE:
                return look.change in (GroupChange.RESIZED, GroupChange.RESTARTED)
            if look.lost and look.current is not None:
                self.rendezvous.open_next(look.current, reason=f"host_lost host={look.lost[0]}", failure=True)
                return True
            changed = self.rendezvous.wait_for_change(self.monitor_interval, training=round_)
        return False


def _address(index: int) -> str:
    return f"127.1.{index // 250}.{index % 250 + 1}"


def _serve(url: str, job_id: str, settings: Dict, conn) -> None:
    """A child process's hosts: started, lost, left and reported as the parent's `Simulation` says."""
    counter, hosts = RequestCounter(), {}
    # Hundreds of threads here wait for one interpreter lock, each waking every switch interval to ask for it
    # (5 ms by default: a storm of wake-ups, the simulator's cost, not an agent's, which has a few threads).
    # Our threads mostly block on sockets, so a longer interval costs them nothing.
    sys.setswitchinterval(0.05)
    while True:
        command, arg = conn.recv()
        if command == "start":
            for index in arg:
                host = SimulatedHost(lambda: counting_store(url, counter), job_id, f"h{index:05d}", _address(index),
                                     **settings)
                hosts[host.host_id] = host.start()
        elif command in ("lose", "leave"):
            getattr(hosts[arg], command)()
        elif command == "poll":
            conn.send(({h: dict(host.rounds) for h, host in hosts.items()},
                       {h: repr(host.error) for h, host in hosts.items() if host.error is not None},
                       counter.snapshot()))
        elif command == "stop":
            for host in hosts.values():
                host.lose()
            for host in hosts.values():
                host.thread.join(timeout=5)
                host.store.close()
            conn.send(None)
            return


class HostHandle:
    """A simulated host, as the parent sees it: `rounds` as of the simulation's last poll."""

    def __init__(self, sim: "Simulation", host_id: str, conn):
        self.host_id, self._sim, self._conn = host_id, sim, conn

    @property
    def rounds(self) -> Dict[int, tuple]:
        return self._sim.rounds.get(self.host_id, {})

    def lose(self) -> None:
        """Stops the host without a word: its lease expires after the host TTL."""
        self._conn.send(("lose", self.host_id))

    def leave(self) -> None:
        """A graceful leave: the next round opens without this host, and its lease goes at once."""
        self._conn.send(("leave", self.host_id))


class _Requests:
    """Every child's requests, read when asked (a poll of the children)."""

    def __init__(self, sim: "Simulation"):
        self._sim = sim

    def snapshot(self) -> collections.Counter:
        self._sim.poll()
        return collections.Counter(self._sim.kinds)

    @property
    def total(self) -> int:
        return sum(self.snapshot().values())


class Simulation:
    """Hosts of one job on one store (`url`: `etcd://...` or `file:///DIR`), spread over `processes` child
    processes, round-robin: each has an interpreter lock of its own, so the hosts' Python runs on every
    core (one process of a thousand host threads is bound to one core's worth). Each process counts its
    requests; `requests` adds them up, and `cpu_seconds` the processes' CPU."""

    def __init__(self, url: str, job_id: str, min_workers: int, max_workers: int, timeouts: Timeouts,
                 monitor_interval: float = 0.2, processes: int = 1):
        settings = dict(min_workers=min_workers, max_workers=max_workers, timeouts=timeouts,
                        monitor_interval=monitor_interval)
        context = multiprocessing.get_context("spawn")  # no threads or locks of this process inherited
        self._children = []
        for _ in range(processes):
            mine, theirs = context.Pipe()
            child = context.Process(target=_serve, args=(url, job_id, settings, theirs), daemon=True)
            child.start()
            self._children.append((child, mine))
        self.notifies = url.startswith("etcd")
        self.requests = _Requests(self)
        self.hosts: Dict[str, HostHandle] = {}
        self.rounds: Dict[str, Dict[int, tuple]] = {}
        self.kinds: collections.Counter = collections.Counter()
        self._names = itertools.count()

    def start_hosts(self, count: int) -> List[HostHandle]:
        indices = [next(self._names) for _ in range(count)]
        for offset, (_, conn) in enumerate(self._children):
            mine = [i for i in indices if i % len(self._children) == offset]
            if mine:
                conn.send(("start", mine))
        started = [HostHandle(self, f"h{i:05d}", self._children[i % len(self._children)][1]) for i in indices]
        self.hosts.update((h.host_id, h) for h in started)
        return started

    def poll(self) -> None:
        """Reads every child's hosts' rounds and requests; raises if a simulated host failed."""
        kinds: collections.Counter = collections.Counter()
        for _, conn in self._children:
            conn.send(("poll", None))
        for _, conn in self._children:
            rounds, errors, counted = conn.recv()
            if errors:
                raise RuntimeError(f"a simulated host failed: {next(iter(errors.items()))}")
            self.rounds.update(rounds)
            kinds.update(counted)
        self.kinds = kinds

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by this process and the children."""
        return time.process_time() + sum(proc.cpu_seconds(child.pid) for child, _ in self._children)

    def ranked_together(self, hosts: List[HostHandle], after: int = -1) -> Optional[int]:
        """The newest round above `after` in which every one of `hosts` got ranks, if there is one (as of
        the last poll)."""
        common = set.intersection(*(set(h.rounds) for h in hosts)) if hosts else set()
        common = [n for n in common if n > after and all(h.rounds[n][1] for h in hosts)]
        return max(common) if common else None

    def wait_ranked(self, hosts: List[HostHandle], after: int, timeout: float) -> int:
        """Waits until `hosts` train together in a round above `after`; returns its number."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            number = self.ranked_together(hosts, after)
            if number is not None:
                return number
            time.sleep(0.05)
        raise TimeoutError(f"{len(hosts)} hosts did not train together in a round above {after} within {timeout}s")

    def ranked_at(self, hosts: List[HostHandle], number: int) -> float:
        """When the last of `hosts` got its ranks in round `number` (monotonic, one clock for every process)."""
        return max(h.rounds[number][0] for h in hosts)

    def stop(self) -> None:
        for child, conn in self._children:
            try:
                conn.send(("stop", None))
                conn.recv()
            except (OSError, EOFError):
                pass
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
