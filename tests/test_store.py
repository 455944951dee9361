"""Tests `tf_elastic/elastic/store/` (the file store, the etcd store's watches, and the store URLs `open_store`
reads)."""
import errno
import fcntl
import gc
import json
import os
import pathlib
import random
import threading
import time

import pytest

from tf_elastic.elastic.agent.round import Round
from tf_elastic.elastic.store import StoreError, open_store
from tf_elastic.elastic.store import etcd as etcd_store
from tf_elastic.elastic.store.file import FileStore


def test_file_store_is_private_and_refuses_a_root_others_can_write(tmp_path):
    store = FileStore(str(tmp_path / "rdzv"))
    store.set("/job/k", "v")
    assert (tmp_path / "rdzv").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "rdzv" / "job" / "k.json").stat().st_mode & 0o777 == 0o600
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(StoreError, match="writable by group or others"):
        FileStore(str(shared))
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)  # (the tests run as root, as CI does)
    with pytest.raises(StoreError, match="belongs to another user"):
        FileStore(str(foreign))


def test_file_store_lock_held_by_a_stuck_process_is_an_error_not_a_hang(tmp_path):
    store = FileStore(str(tmp_path / "rdzv"), lock_timeout=0.3)
    store.set("/job/k", "v")
    holder = os.open(tmp_path / "rdzv" / ".lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file description: as another process would hold it
    try:
        with pytest.raises(StoreError, match="lock .* is held by another process"):
            store.set("/job/k", "w")
    finally:
        os.close(holder)
    store.set("/job/k", "w")
    assert store.get("/job/k") == "w"


def test_a_lock_the_filesystem_refuses_is_a_store_error(tmp_path, monkeypatch):
    """NFS without a lock daemon answers ENOLCK: the agent must train on as through any store outage."""
    store = FileStore(str(tmp_path / "rdzv"))

    def refused(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    with pytest.raises(StoreError, match="cannot lock the file store.*No locks available"):
        store.set("/job/k", "v")


def test_a_store_root_of_ours_that_others_may_read_is_made_private(tmp_path):
    root = tmp_path / "rdzv"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    FileStore(str(root)).set("/job/k", "v")
    assert root.stat().st_mode & 0o777 == 0o700
    assert (root / ".lock").stat().st_mode & 0o777 == 0o600


def test_file_store_disk_errors_are_store_errors_and_files_are_synced_before_the_rename(tmp_path, monkeypatch):
    store = FileStore(str(tmp_path / "rdzv"))
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b)))
    store.set("/job/k", "v")
    assert calls == ["fsync", "replace"]

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(StoreError, match="No space left on device"):
        store.set("/job/k", "w")
    assert store.get("/job/k") == "v"  # the committed value stays
    assert not list((tmp_path / "rdzv" / "job").glob(".*.tmp")), "the staged file is removed"

    def refused(self, missing_ok=False):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(pathlib.Path, "unlink", refused)  # nor can the staged file be removed: still a StoreError
    with pytest.raises(StoreError, match="No space left on device"):
        store.compare_and_set("/job/k", "v", "w")


def test_a_lease_is_timed_on_the_readers_clock_not_the_writers(tmp_path, monkeypatch):
    """A writer whose wall clock runs an hour behind (or a file server's) must not make its live lease
    look expired; a lease nobody renews expires after its TTL on the reader's own clock. The reader's
    clock (the monotonic one the file store times leases on) is the test's: it moves only when told to."""
    writer, reader = FileStore(str(tmp_path / "rdzv")), FileStore(str(tmp_path / "rdzv"))
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - 3600)  # every write by the writer's late clock
    writer.set("/job/hosts/a", "{}", ttl=0.5)
    for _ in range(8):  # renewed every 0.1 s for longer than the TTL
        assert reader.get("/job/hosts/a") == "{}"
        writer.set("/job/hosts/a", "{}", ttl=0.5)
        clock[0] += 0.1
    assert reader.get("/job/hosts/a") == "{}"  # the last renewal, first seen now
    clock[0] += 0.4
    assert reader.get("/job/hosts/a") == "{}"  # unrenewed, but within its TTL
    assert FileStore(str(tmp_path / "rdzv")).get("/job/hosts/a") == "{}"  # a new reader times it from now
    clock[0] += 0.2
    assert reader.get("/job/hosts/a") is None  # 0.6 s unchanged on the reader's clock: expired


@pytest.mark.parametrize("record", [{"value": "v", "version": "1", "ttl": "soon"}, {"value": "v", "expires": 3}])
def test_file_store_malformed_records_are_named(tmp_path, record):
    store = FileStore(str(tmp_path))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "k.json").write_text(json.dumps(record))
    with pytest.raises(StoreError, match="malformed store file"):
        store.get("/job/k")


def test_file_store_rejects_malformed_content(tmp_path):
    store = FileStore(str(tmp_path))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "round.json").write_text("not json")
    with pytest.raises(StoreError, match="malformed store file"):
        store.get("/job/round")
    with pytest.raises(StoreError, match="malformed rendezvous round record"):
        Round.from_json(json.dumps({"version": 99}))


def test_unknown_store_scheme_is_named():
    with pytest.raises(ValueError, match=r"--rdzv='zk://x': unknown store scheme 'zk'"):
        open_store("zk://x")


def test_a_lease_first_seen_long_after_its_last_write_is_expired(tmp_path):
    """A reader that never saw a lease counted it live however old: a taker froze a round at its first
    listing with a host dead for seconds. Its age is read on the filesystem's clock instead."""
    FileStore(str(tmp_path / "rdzv")).set("/job/hosts/dead", "{}", ttl=1.0)
    FileStore(str(tmp_path / "rdzv")).set("/job/hosts/live", "{}", ttl=1.0)
    path = tmp_path / "rdzv" / "job" / "hosts" / "dead.json"
    os.utime(path, (path.stat().st_mtime - 3, path.stat().st_mtime - 3))  # its host died 3 s ago
    reader = FileStore(str(tmp_path / "rdzv"))
    assert reader.get("/job/hosts/dead") is None
    assert reader.list("/job/hosts") == {"/job/hosts/live": "{}"}
    FileStore(str(tmp_path / "rdzv")).set("/job/hosts/dead", "{}", ttl=1.0)  # renewed (or taken) again: live
    assert reader.get("/job/hosts/dead") == "{}"


def test_a_write_syncs_its_file_before_it_takes_the_lock(tmp_path, monkeypatch):
    """An fsync can wait seconds for a busy disk; holding the lock meanwhile kept every other agent from
    renewing its lease, and live hosts were counted lost."""
    store = FileStore(str(tmp_path / "rdzv"))
    store.set("/job/k", "v")
    free_while_syncing = []
    real_fsync = os.fsync

    def fsync(fd):
        other = os.open(tmp_path / "rdzv" / ".lock", os.O_RDWR)
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the writer held the lock
            free_while_syncing.append(True)
            fcntl.flock(other, fcntl.LOCK_UN)
        finally:
            os.close(other)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert store.compare_and_set("/job/k", "v", "w", ttl=3.0)
    assert not store.compare_and_set("/job/k", "v", "x")
    store.set("/job/k", "y")
    assert free_while_syncing == [True, True, True] and store.get("/job/k") == "y"
    assert not list((tmp_path / "rdzv" / "job").glob(".*.tmp")), "a staged file not published is removed"


def _watch_threads(key):
    return [t for t in threading.enumerate() if t.name == f"etcd-watch{etcd_store.ROOT}{key}"]


def test_etcd_watches_leave_the_processs_random_alone_and_end_with_a_dropped_store(etcd, monkeypatch):
    """A watch thread's jitter comes from its own stream: the process's `random` (which
    `keras.utils.set_random_seed` seeds, and Keras's initializers draw from) stays where the user's seed left
    it while watches open stream after stream. A store dropped without `close` takes its watches with it."""
    monkeypatch.setattr(etcd_store._Watch, "_STREAM_SECONDS", (0.05, 0.1))  # a new stream every ~0.2 s
    key = f"/t{time.time_ns()}/k"
    drawn = []  # this watch's draws (other tests' watches may live on in this process too)
    mine = f"etcd-watch{etcd_store.ROOT}{key}"
    monkeypatch.setattr(etcd_store._JITTER, "uniform", lambda *bounds: drawn.extend(
        [bounds] if threading.current_thread().name == mine else []) or bounds[0])
    random.seed(7)
    seeded = random.getstate()
    store = open_store(etcd.url)
    store.wait([key], 0.1)
    deadline = time.monotonic() + 10
    while len(drawn) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(drawn) >= 3, drawn  # the watch opened three streams
    assert random.getstate() == seeded
    [thread] = _watch_threads(key)
    del store
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_dropped_stores_watch_ends_while_etcd_is_down():
    """A failed stream's traceback (urllib3 keeps its error in a frame of it: a cycle) must not keep a
    dropped store, and its watch thread, alive while etcd cannot be reached."""
    from tf_elastic.testing.etcd_server import EtcdServer

    key = f"/t{time.time_ns()}/k"
    with EtcdServer() as server:
        store = open_store(server.url)
        store.wait([key], 0.1)
        [thread] = _watch_threads(key)
    time.sleep(1.0)  # etcd is gone: streams fail, one every 0.1 s
    del store  # no gc.collect(): nothing but a cycle could keep it
    thread.join(timeout=5)
    assert not thread.is_alive()
