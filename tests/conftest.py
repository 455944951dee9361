"""Shared fixtures. Two logical CPU devices are configured before TensorFlow initialises its runtime."""
import collections
import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Caches (the TFRecord index cache of launch.train's workers) go to a directory of this run, not the user's home.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="tf_elastic-test-cache-")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_elastic.testing.net import free_port  # noqa: E402,F401  (tests import it from here)

REPO = Path(__file__).resolve().parents[1]

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)


@pytest.fixture(scope="session")
def two_cpu_strategy() -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over the two logical CPU devices, one for the whole session: collective instance
    keys are process-wide, and a second strategy would reuse the first one's (a shape-mismatch abort)."""
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


class MachineSlots:
    """Under pytest-xdist (pytest.ini runs two workers), what runs holds one of the workers' slots: a slow test,
    and a module fixture while it is built (before any test's slot is taken); a test marked `alone` holds
    every slot, so that no other slow test runs beside it. Slots are files the workers lock (flock); a taker
    first holds the gate, so that one waiting for every slot is not overtaken. Reentrant within a worker."""

    def __init__(self, root: Path, count: int):
        self.root, self.count = root, count
        self.mine = {}  # slot number -> its locked file: the slots this worker holds

    @contextlib.contextmanager
    def held(self, alone: bool = False):
        before = set(self.mine)
        if self.count > 1:
            with open(self.root / "slots-gate", "a") as gate:
                fcntl.flock(gate, fcntl.LOCK_EX)
                for number in range(self.count) if alone else ():
                    if number not in self.mine:  # (a second lock of a slot this worker holds would wait forever)
                        self.mine[number] = self._lock(number, wait=True)
                while not self.mine:
                    for number in range(self.count):
                        slot = self._lock(number, wait=False)
                        if slot:
                            self.mine[number] = slot
                            break
                    else:
                        time.sleep(0.02)
        try:
            yield
        finally:
            for number in set(self.mine) - before:
                self.mine.pop(number).close()  # closing the file gives up its lock

    def _lock(self, number: int, wait: bool):
        """Slot `number`'s file, locked; None if another worker holds it and `wait` is False."""
        slot = open(self.root / f"slot-{number}", "a")
        try:
            fcntl.flock(slot, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            return slot
        except BlockingIOError:
            slot.close()
            return None


@pytest.fixture(scope="session")
def machine_slots(tmp_path_factory) -> MachineSlots:
    return MachineSlots(tmp_path_factory.getbasetemp().parent,  # the workers' basetemps share it
                        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def pytest_collection_modifyitems(items):
    """The slow tests first, longest first (`slow(minutes=N)`: a test's minutes, by default 1); then the tests
    marked `alone`, longest first too, each followed by a share of the quick tests and of the `light` ones in
    proportion to its minutes, and a share before the first. These take no slot: they run on the other
    worker beside an `alone` test, whose processes used 1.46 of the 2 cores on average (profiled), instead
    of idling it (the alone tests' work outlasts theirs: the rest of the time beside them is idle). A test
    waiting for every slot idles its worker until the slow test beside it ends, and a slow test queued behind
    another on a worker (pytest-xdist hands each worker two ahead) waited 168 s for an alone test to end: so
    the alone tests come after the slow ones, the longest slow tests come first (their queued tests are slow
    ones too, run while slow tests still run), a share of quick tests comes between (what a worker takes while
    the other ends its last slow test), and the suite does not end on a long alone test with nothing left to
    run beside it. The modules run on one worker (`xdist_group`) keep their place (pytest-xdist hands them
    out first)."""
    kinds = collections.defaultdict(list)
    for item in items:
        marker = item.get_closest_marker
        kinds["grouped" if marker("xdist_group") else "alone" if marker("alone") else "light" if marker("light")
              else "slow" if marker("slow") else "quick"].append(item)
    alone = _longest_first(kinds["alone"], "alone")
    weights = [BETWEEN_MINUTES] + [_minutes(item, "alone") for item in alone]
    shares = [_shares(kinds[kind], weights) for kind in ("light", "quick")]
    order = kinds["grouped"] + _longest_first(kinds["slow"], "slow")
    for n, test in enumerate([*alone, None]):
        order += [*shares[0][n], *shares[1][n], *([test] if test else [])]
    items[:] = order


# The share of the quick tests between the slow ones and the first alone test, in minutes of an alone test.
BETWEEN_MINUTES = 0.5


def _minutes(item, name: str) -> float:
    """`slow(minutes=N)`, `alone(minutes=N)`: the test's minutes (default 1), for the order and the shares."""
    marker = item.get_closest_marker(name)
    if marker.args or set(marker.kwargs) - {"minutes"}:
        raise pytest.UsageError(f"{item.nodeid}: {name} takes only minutes=N; got {marker.args} {marker.kwargs}")
    return float(marker.kwargs.get("minutes", 1))


def _longest_first(tests: list, name: str) -> list:
    return sorted(tests, key=lambda item: -_minutes(item, name))


def _shares(tests: list, weights: list) -> list:
    """`tests` in consecutive shares, one for each weight, of lengths in proportion to the weights."""
    total, ends, cumulative = sum(weights), [], 0.0
    for weight in weights:
        cumulative += weight
        ends.append(round(len(tests) * cumulative / total))
    return [tests[begin:end] for begin, end in zip([0] + ends[:-1], ends)]


@pytest.fixture(autouse=True)
def _machine_share(request, machine_slots):
    marker = request.node.get_closest_marker
    if not marker("alone") and (marker("light") or not marker("slow")):
        yield
        return
    with machine_slots.held(alone=bool(marker("alone"))):
        yield


@pytest.fixture(autouse=True)
def _clean_keras_state():
    import keras

    yield
    keras.mixed_precision.set_global_policy("float32")
    keras.backend.clear_session(free_memory=False)  # its gc.collect() cost 0.5 s a test (5 min of the suite)


def agent_argv(rdzv_dir: Path, run_dir: Path, arguments: list) -> list:
    """`launch.elastic_run` flags: a valid file store, job id and run dir, overridden by `arguments`."""
    base = {"--rdzv": f"file://{rdzv_dir}", "--job_id": "j", "--run_dir": str(run_dir)}
    for argument in arguments:
        base.pop(argument.split("=")[0], None)
    return [f"{k}={v}" for k, v in base.items()] + list(arguments)


def run_python(code: str, env: dict = None, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Runs `python -c code` in a fresh process with the repository and tests/ importable; raises on failure."""
    full_env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}", **(env or {}))
    proc = subprocess.run([sys.executable, "-c", code], env=full_env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_workers(*arguments: str, workers: int = 2, timeout: float = 240) -> list:
    """Runs `python ARGUMENTS WORKER_INDEX` as a MultiWorkerMirroredStrategy group of `workers` on loopback (one
    TF_CONFIG each, the repository importable); their outputs, once every one succeeded (any still running at
    the timeout is killed)."""
    import json

    cluster = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(workers)]}
    procs = [subprocess.Popen([sys.executable, *arguments, str(index)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=dict(
                                  os.environ, PYTHONPATH=str(REPO), TF_CONFIG=json.dumps(
                                      {"cluster": cluster, "task": {"type": "worker", "index": index}})))
             for index in range(workers)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outputs
    return outputs


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory) -> Path:
    """A directory holding an mnist.npz made at test time (`data_files.write_mnist_like`): the suite needs
    neither ../shared/data nor a download."""
    from tf_elastic.testing.data_files import write_mnist_like

    return write_mnist_like(tmp_path_factory.mktemp("mnist"))


@pytest.fixture(scope="session")
def mnist(mnist_dir):
    """That mnist.npz, scaled to [0, 1]."""
    import numpy as np

    with np.load(mnist_dir / "mnist.npz") as data:
        return {k: (data[k].astype("float32") / 255.0 if k.startswith("x") else data[k].astype("int32"))
                for k in data.files}


@pytest.fixture(scope="session")
def etcd():
    """One real etcd on 127.0.0.1 for the session; tests keep apart by job id."""
    from tf_elastic.testing.etcd_server import EtcdServer

    with EtcdServer() as server:
        yield server


@pytest.fixture(params=["file", "etcd"])
def rdzv_url(request, tmp_path) -> str:
    """Each rendezvous and elastic test runs against both store backends."""
    if request.param == "file":
        return f"file://{tmp_path / 'rdzv'}"
    return request.getfixturevalue("etcd").url


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 server on 127.0.0.1 with a bucket `bucket`; this process's boto3 talks to it. Yields the
    environment a child process needs to reach it."""
    pytest.importorskip("moto.server", reason='s3:// is tested against moto\'s server: pip install "moto[server]"')
    from tf_elastic.testing.s3 import local_s3

    with local_s3("bucket") as env:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        yield env


@pytest.fixture
def job(tmp_path):
    """A `LocalJob` (agents started as processes, one file store) of one or two workers, cleaned up after."""
    from tf_elastic.testing.local_job import LocalJob

    made = LocalJob(tmp_path, [], ["--nowarm_start", "--min_workers=1", "--max_workers=2", "--last_call=0.5"],
                    trainer="launch.train")
    yield made
    made.cleanup()
