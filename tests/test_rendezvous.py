"""Stores and rendezvous rounds in one process, against both backends (a file store and a real etcd)."""
import dataclasses
import json
import threading
import time
import uuid

import pytest

from tf_elastic.testing.etcd_server import EtcdServer
from tf_elastic.elastic.agent.job_record import JobOutcome, TokenRefused
from tf_elastic.elastic.agent.rendezvous import Rendezvous, RendezvousTimeout
from tf_elastic.elastic.agent.round import Round, Timeouts
from tf_elastic.elastic.protocol import JobStatus
from tf_elastic.elastic.store import StoreError, StoreOptions, open_store
from tf_elastic.testing.rendezvous_sim import Simulation

FAST = Timeouts(rendezvous=10, last_call=0.3, survivor_wait=5, host_ttl=1.0, poll=0.05)


@pytest.fixture
def store(rdzv_url):
    store = open_store(rdzv_url)
    yield store
    store.close()


@pytest.fixture
def job():
    return f"t{uuid.uuid4().hex[:8]}"


def _rendezvous(store, job, host, **kwargs):
    args = dict(nproc=1, addr="127.0.0.1", min_workers=1, max_workers=2, max_restarts=3, timeouts=FAST)
    return Rendezvous(store, job, host, **dict(args, **kwargs))


def test_compare_and_set_list_and_leases(store, job):
    assert store.compare_and_set(f"/{job}/round", None, "1")
    assert not store.compare_and_set(f"/{job}/round", None, "2")
    assert not store.compare_and_set(f"/{job}/round", "0", "2")
    assert store.compare_and_set(f"/{job}/round", "1", "2") and store.get(f"/{job}/round") == "2"
    store.set(f"/{job}/hosts/a", "{}", ttl=1.0)
    store.set(f"/{job}/hosts/b", "{}")
    assert store.compare_and_set(f"/{job}/hosts/c", None, "{}", ttl=1.0)  # a lease taken by compare-and-set
    assert not store.compare_and_set(f"/{job}/hosts/c", None, "{}", ttl=1.0)
    assert set(store.list(f"/{job}/hosts")) == {f"/{job}/hosts/{h}" for h in "abc"}  # as `get` takes them
    for _ in range(12):  # renewed every 0.1 s: stays for longer than its TTL
        store.set(f"/{job}/hosts/a", "{}", ttl=1.0)
        store.set(f"/{job}/hosts/c", "{}", ttl=1.0)
        time.sleep(0.1)
    assert store.get(f"/{job}/hosts/a") == "{}" and store.get(f"/{job}/hosts/c") == "{}"
    time.sleep(2.2)
    assert store.get(f"/{job}/hosts/a") is None and store.get(f"/{job}/hosts/c") is None
    assert set(store.list(f"/{job}/hosts")) == {f"/{job}/hosts/b"}
    store.delete(f"/{job}/hosts/b")
    assert store.list(f"/{job}/hosts") == {}


def test_wait_wakes_on_a_change(store, job):
    """Only a notifying store (etcd) can say 'nothing changed'. The file store cannot (a lease expires
    without any write), so it says `notifies = False` and the agent reads it every interval instead. A
    key watched for its deletion (a lease that expires) wakes no one when it is rewritten."""
    if not store.notifies:
        assert store.wait([f"/{job}/"], 0.01), "a store that cannot notify must always answer: read again"
        return
    lease = f"/{job}/hosts/b"
    store.set(lease, "1", ttl=1.0)
    watched, gone = [f"/{job}/group/"], [lease]
    store.wait(watched, 0.1, gone)  # the first wait may answer True: changes before it began
    assert not store.wait(watched, 0.5, gone), "woke up with nothing changed"
    store.set(f"/{job}/hosts/a", "1")  # neither the prefix nor the key watched
    store.set(lease, "2", ttl=1.0)  # rewritten, not gone
    assert not store.wait(watched, 0.5, gone), "woke up on a key not watched, or on a rewrite"
    threading.Timer(0.3, lambda: store.set(f"/{job}/group/round", "1")).start()
    assert store.wait(watched, 3.0, gone)
    assert store.wait(watched, 10.0, gone), "the lease expired unnoticed"  # etcd's minimum TTL may be longer
    assert store.get(lease) is None
    other = f"/{job}/hosts/c"
    store.set(other, "1")
    store.wait(watched, 0.1, [other])
    store.delete(other)
    assert not store.wait(watched, 0.5), "woke up on a watch it did not name"
    assert store.wait(watched, 0.1, [other]), "what changed meanwhile wakes the next wait that names it"


def test_survivors_keep_their_order_and_a_newcomer_that_joined_first_is_ranked_last(store, job):
    """The newcomer joins first, then the survivors in the opposite order of their previous ranks; one at a
    time (a fixed order: nothing depends on how threads are scheduled). Ranks follow previous ranks, the
    newcomer gets the last."""
    results = {}

    def join(host, previous):
        results[host] = _rendezvous(store, job, host, max_workers=3, min_workers=3).join(previous_ranks=previous)

    threads = []
    for host, previous in (("new", None), ("b", [1]), ("a", [0])):
        threads.append(threading.Thread(target=join, args=(host, previous)))
        threads[-1].start()
        deadline = time.time() + 10  # the next joins only once this one is in the round
        while time.time() < deadline and '"round": 0' not in (store.get(f"/{job}/hosts/{host}") or ""):
            time.sleep(0.02)
    [t.join(timeout=20) for t in threads]
    rounds = {host: r for host, r in results.items()}
    assert len({r.number for r in rounds.values()}) == 1 and rounds["a"].world_size == 3
    assert rounds["a"].assignment == {"a": [0], "b": [1], "new": [2]}


def test_a_failure_seen_by_every_agent_is_counted_once(store, job):
    first = _rendezvous(store, job, "a", max_workers=1).join()
    agents = [_rendezvous(store, job, h) for h in "ab"]
    opened = [r.open_next(first, reason="worker_exit", failure=True) for r in agents]
    assert opened.count(True) == 1 and agents[0].current().restarts == 1


def test_max_restarts_exceeded_records_the_failed_outcome(store, job):
    rendezvous = _rendezvous(store, job, "a", max_restarts=0, max_workers=1)
    rendezvous.open_next(rendezvous.join(), reason="worker_exit", failure=True)
    assert rendezvous.job.outcome() == JobOutcome(JobStatus.FAILED, "max_restarts=0 exceeded (worker_exit)")


class _InterleavedStore:
    """A store that runs `before` once, just before the first read of `key`: another agent acting between
    two reads of this one."""

    def __init__(self, store, key, before):
        self._store, self._key, self._before = store, key, before

    def get(self, key):
        if key == self._key and self._before:
            self._before, before = None, self._before
            before()
        return self._store.get(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_host_that_finished_and_let_its_lease_go_between_two_reads_is_not_lost(store, job):
    """b's workers finish: its agent records the outcome, then its lease goes (etcd revokes it at once),
    just after a read the group and just before a reads b's lease. a must see the job done, not b lost:
    a lost host restarts the round and kills a's workers while they end (the chief's last evaluation)."""
    rounds = {}

    def join(host):
        rounds[host] = _rendezvous(store, job, host, min_workers=2).join()

    threads = [threading.Thread(target=join, args=(h,)) for h in "ab"]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    b = _rendezvous(store, job, "b")
    b.incarnation = json.loads(store.get(b.keys.host("b")))["incarnation"]  # b's agent, as it joined
    b._claimed = True

    def b_finishes():
        b.job.finish(JobStatus.DONE, "training finished")
        b.leave()

    a = _rendezvous(_InterleavedStore(store, b.keys.host("b"), b_finishes), job, "a")
    look = a.look(rounds["a"], changed=True)
    assert store.get(b.keys.host("b")) is None, "b's lease was not let go: the test did not interleave"
    assert look.change.name == "JOB_DONE" and look.lost == [], look


def test_an_agent_with_another_token_is_refused(store, job):
    _rendezvous(store, job, "a", token="secret").job.check_token()
    _rendezvous(store, job, "b", token="secret").job.check_token()
    for token in ("other", None):
        with pytest.raises(TokenRefused, match=f"refused to join job '{job}'"):
            _rendezvous(store, job, "c", token=token).job.check_token()
    assert "secret" not in json.dumps(store.list(f"/{job}"))


@pytest.mark.parametrize("key, value, message", [
    ("group/round", "garbage", "malformed rendezvous round record at /.*/group/round"),
    ("group/round", json.dumps({"version": 2, "number": 0}), "schema version 2, expected 1"),
    ("group/round", json.dumps({"version": 1, "number": 0}), "missing"),
    ("group/outcome", "[1, 2]", "malformed job outcome record"),
    ("blacklist/a", json.dumps({"strikes": "many"}), "malformed blacklist record"),
])
def test_malformed_store_content_is_rejected_with_a_clear_error(store, job, key, value, message):
    store.set(f"/{job}/{key}", value)
    rendezvous = _rendezvous(store, job, "a")
    read = {"group/round": rendezvous.current, "group/outcome": rendezvous.job.outcome,
            "blacklist/a": rendezvous.job.blacklisted_for}
    with pytest.raises(StoreError, match=message):
        read[key]()


def test_a_rendezvous_on_malformed_content_fails_after_the_timeout_and_names_it(store, job):
    store.set(f"/{job}/group/round", "garbage")
    timeouts = Timeouts(rendezvous=1.0, poll=0.05)
    with pytest.raises(RendezvousTimeout, match="no rendezvous within --rendezvous_timeout=1s: malformed"):
        _rendezvous(store, job, "a", timeouts=timeouts).join()
    assert store.get(f"/{job}/group/round") == "garbage"  # rejected, never overwritten


def test_blacklist_cooldown_doubles_with_each_strike(store, job):
    record = _rendezvous(store, job, "a").job
    assert record.blacklisted_for() == 0
    assert record.blacklist(10.0) == 10.0 and 9.0 < record.blacklisted_for() <= 10.0
    assert record.blacklist(10.0) == 20.0


def test_ports_come_from_the_port_range(store, job):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        low = s.getsockname()[1]
    round_ = _rendezvous(store, job, "a", nproc=2, max_workers=2, min_workers=2,
                         port_range=(low, low + 50)).join()
    ports = [int(a.rsplit(":", 1)[1]) for a in round_.cluster]
    assert len(ports) == 2 and all(low <= p <= low + 50 for p in ports)
    with socket.socket() as held:
        held.bind(("127.0.0.1", low))
        with pytest.raises(RendezvousTimeout, match=f"--port_range={low}-{low} has fewer than 1 free ports"):
            _rendezvous(store, f"{job}x", "b", port_range=(low, low),
                        timeouts=Timeouts(rendezvous=0.5, poll=0.05)).join()


def test_etcd_fails_over_to_the_next_endpoint(etcd, job):
    live = etcd.url.split("://")[1]
    store = open_store(f"etcd://127.0.0.1:9,{live}", StoreOptions(request_timeout=0.5))
    assert store.compare_and_set(f"/{job}/k", None, "v") and store.get(f"/{job}/k") == "v"
    store.close()


def test_a_lease_etcd_raises_above_the_host_ttl_is_reported(job, caplog):
    """etcd's default election timeout (1 s) makes its shortest lease 2 s: hosts are then lost after 2 s."""
    with EtcdServer(election_timeout_ms=1000) as slow:
        store = open_store(slow.url)
        store.set(f"/{job}/hosts/a", "{}", ttl=1.0)
        store.close()
    assert "etcd raised a 1 s lease to 2 s" in caplog.text


def test_unreachable_etcd_is_named(job):
    store = open_store("etcd://127.0.0.1:9,127.0.0.1:10", StoreOptions(request_timeout=0.5))
    with pytest.raises(StoreError, match=r"cannot reach etcd \(127.0.0.1:9: ConnectionError; 127.0.0.1:10"):
        store.get(f"/{job}/round")


@pytest.mark.parametrize("url, message", [
    ("etcd://", "expected etcd://HOST:PORT"),
    ("etcd://127.0.0.1", "expected etcd://HOST:PORT"),
    ("etcd://127.0.0.1:0", "port in 1..65535"),
    ("etcd://127.0.0.1:2379/prefix", "expected etcd://HOST:PORT"),
    ("file://relative/dir", "expected file:///ABSOLUTE/DIR"),
    ("zk://x", "unknown store scheme 'zk'; known: etcd://, file://"),
])
def test_bad_store_urls_are_named(url, message):
    with pytest.raises(ValueError, match=message):
        open_store(url)


def _certificates(directory):
    """A CA, and a server and a client certificate it signed, for 127.0.0.1 (openssl)."""
    import subprocess

    def run(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=tf_elastic test CA")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", "san.cnf")
    return {n: str(directory / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def test_etcd_over_tls_with_client_certificates(tmp_path, job):
    files = _certificates(tmp_path)
    with EtcdServer(tls=(files["ca.pem"], files["server.pem"], files["server.key"])) as etcd:
        options = StoreOptions(ca_cert=files["ca.pem"], cert=files["client.pem"], key=files["client.key"])
        store = open_store(etcd.url, options)
        assert store.compare_and_set(f"/{job}/k", None, "v") and store.get(f"/{job}/k") == "v"
        store.wait([f"/{job}/"], 0.5)
        threading.Timer(0.3, lambda: store.set(f"/{job}/k2", "w")).start()
        assert store.wait([f"/{job}/"], 3.0)  # the watch speaks TLS too
        store.close()
        for bad in (StoreOptions(), StoreOptions(ca_cert=files["ca.pem"])):  # no CA; no client certificate
            with pytest.raises(StoreError, match="cannot reach etcd"):
                open_store(etcd.url, dataclasses.replace(bad, request_timeout=1.0)).get(f"/{job}/k")


def test_etcd_with_a_user_and_password(job):
    """(etcd 3.4's JSON gateway refuses password logins from clients that present a certificate, so
    authentication is shown here without TLS.)"""
    import requests

    with EtcdServer() as private:
        base = f"http://127.0.0.1:{private.client_port}/v3/auth"
        for path, body in (("/user/add", {"name": "root", "password": "pw"}), ("/role/add", {"name": "root"}),
                           ("/user/grant", {"user": "root", "role": "root"}), ("/enable", {})):
            assert requests.post(base + path, json=body, timeout=5).status_code == 200
        options = StoreOptions(user="root", password="pw")
        store = open_store(private.url, options)
        assert store.compare_and_set(f"/{job}/k", None, "v") and store.get(f"/{job}/k") == "v"
        store.wait([f"/{job}/"], 0.5)
        threading.Timer(0.3, lambda: store.set(f"/{job}/k2", "w")).start()
        assert store.wait([f"/{job}/"], 3.0)  # the watch authenticates too
        store.close()
        for bad, message in ((dataclasses.replace(options, password="bad"),
                              "refused user 'root'.*authentication failed"),
                             (StoreOptions(), "user name is empty")):
            with pytest.raises(StoreError, match=message):
                open_store(private.url, bad).get(f"/{job}/k")


def test_a_round_whose_opener_is_gone_is_frozen_by_another(rdzv_url, job):
    """The opener freezes its round; when its lease goes before it does, a waiting agent takes over."""
    opener = _rendezvous(open_store(rdzv_url), job, "a")
    opener.claim_host_id()
    opener.store.compare_and_set(opener.keys.round, None, Round(0, "joining", "start", 0, time.time(), [],
                                                                "a").to_json())
    opener.leave()  # as if it died before freezing (its lease expired)
    rounds = {}

    def join(host):
        rounds[host] = _rendezvous(open_store(rdzv_url), job, host, min_workers=2).join()

    threads = [threading.Thread(target=join, args=(h,)) for h in "bc"]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert rounds["b"] == rounds["c"] and rounds["b"].number == 0, rounds
    assert rounds["b"].opener in ("b", "c") and sorted(rounds["b"].assignment) == ["b", "c"]


@pytest.mark.parametrize("skew", [3600.0, -3600.0], ids=["opener clock ahead", "opener clock behind"])
def test_last_call_is_timed_on_the_freezers_own_clock_whatever_the_openers_wall_clock(store, job, skew):
    """The round's `opened` is the opener's wall clock. Ahead by an hour, a freezer comparing it with its own
    clock never saw last_call pass (the round timed out); behind, it froze at once, leaving out a host that
    joined within last_call. Now a second host joining 0.05 s after the first is in the round either way."""
    round_key = _rendezvous(store, job, "a").keys.round
    assert store.compare_and_set(round_key, None, Round(0, "joining", "start", 0, time.time() + skew, [],
                                                        "a").to_json())
    rounds = {}

    def join(host):
        rounds[host] = _rendezvous(store, job, host, max_workers=3).join()

    threads = [threading.Thread(target=join, args=(host,)) for host in "ab"]
    threads[0].start()
    deadline = time.time() + 10
    while time.time() < deadline and '"round": 0' not in (store.get(f"/{job}/hosts/a") or ""):
        time.sleep(0.01)
    time.sleep(0.05)
    threads[1].start()
    [t.join(timeout=30) for t in threads]
    assert set(rounds) == {"a", "b"} and rounds["a"] == rounds["b"], rounds
    assert rounds["a"].number == 0 and sorted(rounds["a"].assignment) == ["a", "b"]


@pytest.mark.slow
def test_sixteen_simulated_hosts_through_a_loss_a_leave_and_a_join(rdzv_url):
    """The agents' own rendezvous and monitoring code (`rendezvous_sim`): every change is one new round,
    survivors keep their order and the lowest ranks, a joiner gets the last, and on etcd a round costs the
    store at most 4 requests per host and the opener's polls (counted at the clients; the file store is
    polled instead)."""
    n = 16
    sim = Simulation(rdzv_url, f"sim{uuid.uuid4().hex[:8]}", min_workers=n - 2, max_workers=n,
                     timeouts=Timeouts(rendezvous=60, last_call=1.0, survivor_wait=30, host_ttl=10.0, poll=0.1))
    try:
        hosts = sim.start_hosts(n)
        number = sim.wait_ranked(hosts, -1, 60)
        for change in ("lose", "leave", "join"):
            order = sorted(hosts, key=lambda h: h.rounds[number][1])
            if change == "join":
                hosts = order + sim.start_hosts(1)
            else:
                getattr(order[5], change)()  # a host in the middle of the ranks
                hosts = order[:5] + order[6:]
            requests = sim.requests.total
            after, number = number, sim.wait_ranked(hosts, number, 60)
            assert number == after + 1, (change, "took more than one round")
            assert [h.rounds[number][1] for h in hosts] == [[rank] for rank in range(len(hosts))], change
            if change != "lose" and sim.hosts[hosts[0].host_id].store.notifies:  # a loss waits out a lease
                # (the opener's polls of the leases, every 0.1 s until it freezes, are a constant per round)
                assert sim.requests.total - requests <= 4 * len(hosts) + 40, (change, sim.requests.total - requests)
    finally:
        sim.stop()
