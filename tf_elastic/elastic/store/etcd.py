"""The etcd v3 backend: `etcd://HOST:PORT[,HOST:PORT...]`, spoken through etcd's JSON gateway.

Plain HTTP with `requests` rather than `etcd3gw` (2.7.0): that client talks to one endpoint and has no
authentication, and we need both. Hosts' leases are etcd leases (renewed, not rewritten, so a keepalive
is not a change), compare-and-set is a transaction, and `wait` wakes on a watch instead of polling.

Endpoints are tried in turn: one that does not answer within `request_timeout` hands the request to the
next. A user and password (the token is fetched again once when it expires) or TLS client certificates
authenticate; etcd 3.4's JSON gateway refuses a password login from a client that also presents a
certificate, so use one or the other there. etcd raises a lease TTL below 1.5 election timeouts to that
minimum, so a lost host is noticed only that late; a warning names the TTL granted (start etcd with a
shorter `--election-timeout` for less).
"""
import base64
import json
import math
import os
import random
import threading
import time
import traceback
import urllib.parse
import weakref
from typing import Dict, List, Optional, Sequence, Set, Tuple

import requests
from absl import logging

from tf_elastic.elastic.store.base import Store, StoreError, StoreOptions

ROOT = "/tf_elastic"  # every key of every job lives under this prefix
_IDLE_SECONDS = 60.0  # a watch no wait named for this long is stopped
_READ_FRESH_SECONDS = 10.0  # a watch starts after a read this recent (older: a long history to replay)
# The watches' own random stream. The process's `random` is the user's: `keras.utils.set_random_seed` seeds it
# and Keras's initializers draw their seeds from it, so a draw from a watch thread changed a seeded model's
# initial weights (found in the test suite: in-process agents' watches beside seeded training).
_JITTER = random.Random()
os.register_at_fork(after_in_child=_JITTER.seed)  # a forked agent draws its own jitter, as `random` does


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(b64: str) -> str:
    return base64.b64decode(b64).decode()


def _range_end(prefix: str) -> str:
    """The key just past every key that starts with `prefix`."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class EtcdStore(Store):
    notifies = True

    def __init__(self, endpoints: List[str], options: StoreOptions = StoreOptions()):
        self.endpoints, self.options = endpoints, options
        self._current = 0
        self._session = requests.Session()
        # Given with every request: a session's own `verify` loses to REQUESTS_CA_BUNDLE in the environment.
        self._tls = {"verify": options.ca_cert or True,
                     "cert": (options.cert, options.key) if options.cert and options.key else None}
        self._scheme = "https" if options.ca_cert or options.cert else "http"
        self._lock = threading.Lock()  # one request at a time: the session is shared with the watch threads
        self._leases: Dict[int, Tuple[str, int, float]] = {}  # requested ttl -> (lease id, granted ttl, renewed)
        self._written: Dict[str, Tuple[str, str]] = {}  # key -> (value, lease id) we put last
        self._watches: Dict[Tuple[str, bool], "_Watch"] = {}  # (key or prefix, deletions only) -> its watch
        self._revision = 0  # the newest store revision a reply showed
        self._read_at: Dict[str, Tuple[int, float]] = {}  # key or prefix -> (revision, monotonic time) last read
        self._changed = threading.Condition()  # every watch of this store notifies it
        self._token: Optional[str] = None

    # Store -----------------------------------------------------------------------------------------
    def get(self, key: str) -> Optional[str]:
        reply = self._call("/v3/kv/range", {"key": _b64(ROOT + key)})
        kvs = reply.get("kvs", [])
        if kvs:  # a key read absent is not noted: a watch of its deletion would never report the absence
            self._note_read(key, reply)
        return _text(kvs[0].get("value", "")) if kvs else None

    def set(self, key: str, value: str, ttl: Optional[float] = None) -> None:
        lease = self._lease(ttl) if ttl is not None else ""
        request = {"key": _b64(ROOT + key), "value": _b64(value)}
        if lease:
            request["lease"] = lease
        self._call("/v3/kv/put", request)
        self._written[key] = (value, lease)

    def compare_and_set(self, key: str, expected: Optional[str], value: str, ttl: Optional[float] = None) -> bool:
        name = _b64(ROOT + key)
        if expected is None:
            compare = {"key": name, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        else:
            compare = {"key": name, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        put = {"key": name, "value": _b64(value)}
        lease = self._lease(ttl) if ttl is not None else ""
        if lease:
            put["lease"] = lease
        if lease and expected == value and self._written.get(key) == (value, lease):
            # Our own value on the lease just renewed: check it is still there, without a write (a write
            # would wake every agent's watch at each keepalive).
            still = {"key": name, "target": "LEASE", "result": "EQUAL", "lease": lease}
            return bool(self._call("/v3/kv/txn", {"compare": [compare, still], "success": []}).get("succeeded"))
        reply = self._call("/v3/kv/txn", {"compare": [compare], "success": [{"request_put": put}]})
        if reply.get("succeeded"):
            self._written[key] = (value, lease)
            return True
        return False

    def list(self, prefix: str) -> Dict[str, str]:
        start = ROOT + prefix.rstrip("/") + "/"
        reply = self._call("/v3/kv/range", {"key": _b64(start), "range_end": _b64(_range_end(start))})
        self._note_read(start[len(ROOT):], reply)
        return {_text(kv["key"])[len(ROOT):]: _text(kv.get("value", "")) for kv in reply.get("kvs", [])}

    def delete(self, key: str) -> None:
        self._written.pop(key, None)
        self._call("/v3/kv/deleterange", {"key": _b64(ROOT + key)})

    def wait(self, keys: Sequence[str], timeout: float, gone: Sequence[str] = ()) -> Set[str]:
        """One watch per key or prefix (for `gone`, of deletions only), started at the first wait that
        names it: after the revision this client last read it at, if that read is recent (nothing is
        missed since), else after the newest revision seen, and then that first wait answers it as
        changed (what changed before the watch began is unknown). A watch outlives waits that do not name
        it for `_IDLE_SECONDS` (an agent waits on fewer keys while it joins a round than while it
        trains), so changes meanwhile still wake the next wait that names it."""
        now = time.monotonic()
        named = [(key, False) for key in keys] + [(key, True) for key in gone]
        for name in [n for n, watch in self._watches.items() if n not in named and now - watch.named > _IDLE_SECONDS]:
            self._watches.pop(name).stop()
        for key, deletions in named:
            if (key, deletions) not in self._watches:
                revision, read = self._read_at.get(key, (0, float("-inf")))
                fresh = now - read < _READ_FRESH_SECONDS
                if not fresh and not self._revision and not self._learn_revision():
                    time.sleep(timeout)  # unreachable: the caller's next read says so
                    return {key for key, _ in named}
                self._watches[(key, deletions)] = _Watch(self, ROOT + key, self._changed,
                                                         revision if fresh else self._revision, deletions,
                                                         unknown_before=not fresh)
            self._watches[(key, deletions)].named = now
        watches = {name: self._watches[name] for name in named}
        with self._changed:
            self._changed.wait_for(lambda: any(w.changes != w.seen for w in watches.values()), timeout)
            changed = {key for (key, _), w in watches.items() if w.changes != w.seen}
            for watch in watches.values():
                watch.seen = watch.changes
            return changed

    def _note_read(self, key: str, reply: Dict) -> None:
        """Remembers the revision `key` (or a prefix, ending in '/') was read at: a watch that starts
        right after it misses nothing, so its first wait need not answer it as changed."""
        revision = int(reply.get("header", {}).get("revision", 0))
        if revision:
            self._read_at[key] = (revision, time.monotonic())

    def _learn_revision(self) -> bool:
        """A watch starts after a revision this client saw, so that nothing is missed: reads one, if no
        reply showed one yet. False when etcd cannot be reached."""
        try:
            self._call("/v3/kv/range", {"key": _b64(ROOT)})
        except StoreError:
            return False
        return True

    def close(self) -> None:
        for watch in self._watches.values():
            watch.stop()
        for lease, _, _ in list(self._leases.values()):  # a revoke refused as expired clears `_leases`
            try:  # our leased keys go at once rather than after their TTL
                self._call("/v3/lease/revoke", {"ID": lease})
            except StoreError:
                pass
        self._session.close()

    # Leases ----------------------------------------------------------------------------------------
    def lease_seconds(self, ttl: float) -> float:
        self._lease(ttl)
        return float(self._leases[max(1, math.ceil(ttl))][1])

    def _lease(self, ttl: float) -> str:
        """A lease for `ttl` seconds, renewed when a third of it has passed; a new one once it expired."""
        wanted = max(1, math.ceil(ttl))
        lease, granted, renewed = self._leases.get(wanted, ("", 0, 0.0))
        now = time.monotonic()
        if lease and now - renewed < granted / 3:
            return lease
        if lease:
            result = self._call("/v3/lease/keepalive", {"ID": lease}).get("result", {})
            if int(result.get("TTL", 0)) > 0:
                self._leases[wanted] = (lease, granted, now)
                return lease
        reply = self._call("/v3/lease/grant", {"TTL": wanted})
        granted = int(reply["TTL"])
        if granted > wanted and not lease:
            logging.warning("etcd raised a %d s lease to %d s (its minimum is 1.5 election timeouts): a lost host "
                            "is noticed after %d s; start etcd with a shorter --election-timeout for less",
                            wanted, granted, granted)
        self._leases[wanted] = (reply["ID"], granted, now)
        return reply["ID"]

    # HTTP ------------------------------------------------------------------------------------------
    def stream(self, path: str, body: Dict, read_timeout: float) -> requests.Response:
        """A streaming POST to the current endpoint (a watch), outside the request lock: it can block
        for `read_timeout` seconds and must not hold up the agent's requests meanwhile."""
        headers = {"Authorization": self._token} if self._token else {}
        return requests.post(self._url(path), json=body, stream=True, headers=headers,
                             timeout=(self.options.request_timeout, read_timeout), **self._tls)

    def _url(self, path: str, endpoint: Optional[str] = None) -> str:
        return f"{self._scheme}://{endpoint or self.endpoints[self._current]}{path}"

    def _call(self, path: str, body: Dict) -> Dict:
        """POSTs to the current endpoint, moving on to the next one while an endpoint cannot be reached."""
        errors = []
        with self._lock:
            for _ in range(len(self.endpoints)):
                endpoint = self.endpoints[self._current]
                try:
                    return self._post(endpoint, path, body)
                except requests.RequestException as error:
                    errors.append(f"{endpoint}: {type(error).__name__}")
                    self._current = (self._current + 1) % len(self.endpoints)
        raise StoreError(f"cannot reach etcd ({'; '.join(errors)})")

    def _post(self, endpoint: str, path: str, body: Dict, retry_auth: bool = True) -> Dict:
        if self.options.user and self._token is None:
            self._token = self._authenticate(endpoint)
        headers = {"Authorization": self._token} if self._token else {}
        status, text = self._send(endpoint, path, body, headers)
        try:
            reply = json.loads(text)
        except ValueError:
            raise StoreError(f"etcd at {endpoint} answered {path} with HTTP {status} and no JSON") from None
        if status != 200 or "error" in reply:
            message = reply.get("message") or reply.get("error") or text[:200]
            if retry_auth and self.options.user and "token" in str(message):
                self._token = None  # expired: authenticate again, once
                return self._post(endpoint, path, body, retry_auth=False)
            if "lease not found" in str(message):
                self._leases.clear()  # expired while this client was stalled: the next write takes a new one
            raise StoreError(f"etcd at {endpoint} refused {path}: {message}")
        self._revision = max(self._revision, int(reply.get("header", {}).get("revision", 0)))
        return reply

    def _send(self, endpoint: str, path: str, body: Dict, headers: Dict[str, str]) -> Tuple[int, str]:
        """One POST to `endpoint` through the session (TLS as configured): its status and body. Raises
        `requests.RequestException` when the endpoint cannot be reached (`_call` then tries the next)."""
        response = self._session.post(self._url(path, endpoint), json=body, headers=headers,
                                      timeout=self.options.request_timeout, **self._tls)
        return response.status_code, response.text

    def _authenticate(self, endpoint: str) -> str:
        response = self._session.post(self._url("/v3/auth/authenticate", endpoint),
                                      timeout=(self.options.request_timeout, self.options.login_timeout),
                                      json={"name": self.options.user, "password": self.options.password or ""},
                                      **self._tls)
        try:
            reply = response.json()
        except ValueError:
            reply = {"message": response.text.strip()[:200]}
        if response.status_code != 200 or "token" not in reply:
            raise StoreError(f"etcd at {endpoint} refused user {self.options.user!r}: "
                             f"{reply.get('message') or reply.get('error') or response.status_code}")
        return reply["token"]


class _Watch:
    """A background watch on a key, or on a prefix (ending in '/'), of every change or of deletions only
    (a lease that expires is deleted): counts them and wakes the store's waiters.

    A stream ends after `_STREAM_SECONDS` without a line (drawn anew for each stream, so that agents that
    started together do not all start their next streams in the same second) and the next resumes after
    the last revision seen, so no change is missed. A store dropped without `close` ends its watches at
    their streams' ends (they hold it weakly)."""

    _STREAM_SECONDS = (20.0, 40.0)

    def __init__(self, store: EtcdStore, key: str, changed: threading.Condition, after: int,
                 deletions: bool = False, unknown_before: bool = True):
        """`after`: a revision the store's client saw before this watch began; it reports every change
        after it (a stream that began later would miss a change made in between). `unknown_before`: the
        client never read the key at `after`, so the first wait reports it as changed."""
        self._store, self.key, self._changed, self._deletions = weakref.ref(store), key, changed, deletions
        self._after = after
        self.changes, self.seen = int(unknown_before), 0
        self.named = time.monotonic()  # when a wait last named it
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch{key}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The thread ends at its stream's next line or read timeout (closing the stream from here
        would block on the read in progress)."""
        self._stopped = True

    def _notify(self) -> None:
        with self._changed:
            self.changes += 1
            self._changed.notify_all()

    def _request(self, revision: int) -> Dict:
        request = {"key": _b64(self.key), "start_revision": str(revision + 1)}
        if self.key.endswith("/"):
            request["range_end"] = _b64(_range_end(self.key))
        if self._deletions:
            request["filters"] = ["NOPUT"]
        return {"create_request": request}

    def _run(self) -> None:
        revision = self._after  # the last revision seen; the next stream starts after it
        while not self._stopped:
            store = self._store()
            if store is None:
                return
            revision, streamed = self._stream(store, revision)
            del store  # held only while a stream is open
            if not streamed:
                # The stream's read timeout, or etcd down (the readers see that themselves): a short pause;
                # the next stream resumes after `revision`, so nothing is missed meanwhile.
                time.sleep(0.1)

    def _stream(self, store: EtcdStore, revision: int) -> Tuple[int, bool]:
        """Follows one stream until it ends: (the last revision seen, whether it ended without an error)."""
        try:
            with store.stream("/v3/watch", self._request(revision), _JITTER.uniform(*self._STREAM_SECONDS)) \
                    as response:
                for line in response.iter_lines():
                    result = json.loads(line).get("result", {}) if line else {}
                    if result.get("compact_revision"):
                        # History we needed is gone: waiters read afresh, and the next stream starts
                        # at the oldest revision kept (not the newest: a change meanwhile would be lost).
                        self._notify()
                        return int(result["compact_revision"]) - 1, True
                    events = result.get("events", [])
                    if events:
                        revision = max(int(e["kv"]["mod_revision"]) for e in events)
                        self._notify()
                    if self._stopped:
                        break
        except (requests.RequestException, ValueError, KeyError) as error:
            _release_frames(error)
            return revision, False
        return revision, True


def _release_frames(error: BaseException) -> None:
    """Clears the finished frames of `error`'s traceback and of the errors it chains: urllib3 keeps a raised
    error in a local of a frame of its traceback, a cycle only the collector frees, and the frames above hold
    the store, which would outlive its last user by as long."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def from_url(url: urllib.parse.ParseResult, options: StoreOptions) -> Store:
    endpoints = [e for e in url.netloc.split(",") if e]
    if not endpoints or url.path not in ("", "/") or any(":" not in e for e in endpoints):
        raise ValueError(f"--rdzv={url.geturl()!r}: expected etcd://HOST:PORT[,HOST:PORT...].")
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--rdzv={url.geturl()!r}: endpoint {endpoint!r} needs HOST:PORT with a port in 1..65535.")
    return EtcdStore(endpoints, options)

