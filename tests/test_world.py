"""Tests `tf_elastic/elastic/worker/world.py` and `cluster.py`: the world a worker reads, and its heartbeat."""
import json
import socket
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from tf_elastic.elastic.protocol import Heartbeat
from tf_elastic.elastic.worker.cluster import resolve_world_and_export_tf_config
from tf_elastic.elastic.worker.world import World
from tf_elastic.testing.local_job import REPO, repo_env


def test_world_reads_tf_config():
    world = World.from_env({"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                                     "task": {"type": "worker", "index": 1}})})
    assert (world.rank, world.size, world.is_chief) == (1, 2, False)
    tfjob_with_chief = {"cluster": {"chief": ["c:1"], "worker": ["w:1"]}, "task": {"type": "chief", "index": 0}}
    with pytest.raises(ValueError, match="a chief task .*TFJob with a Chief replica.* is not supported"):
        World.from_env({"TF_CONFIG": json.dumps(tfjob_with_chief)})
    with pytest.raises(ValueError, match="TF_CONFIG is not a valid worker cluster spec"):
        World.from_env({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"index": 5}})})


def test_warm_worker_waits_for_its_world_on_stdin():
    import subprocess
    import sys

    from conftest import REPO

    code = ("from tf_elastic.elastic.worker.cluster import resolve_world_and_export_tf_config as resolve\n"
            "w = resolve('tf_config', 8888, None)\n"  # the path elastic.run takes
            "print(w.rank, w.size, w.round, flush=True)")
    env = {"PYTHONPATH": str(REPO), "TF_ELASTIC_WARM": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    world = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]},
                                      "task": {"type": "worker", "index": 2}}), "TF_ELASTIC_ROUND": "7"}
    out, _ = proc.communicate(json.dumps(world) + "\n", timeout=120)
    assert out.split() == ["2", "3", "7"]
    unused = subprocess.run([sys.executable, "-c", code], env=env, input="", capture_output=True, text=True,
                            timeout=120)
    assert unused.returncode == 0 and unused.stdout == ""  # the agent closed it unused: a quiet exit


def test_a_kubernetes_pod_finds_its_index_by_address_not_by_name(monkeypatch):
    """TF's KubernetesClusterResolver against a stand-in for the Kubernetes API (its `override_client`; no
    cluster here): it lists pods sorted by name, so worker w-10 comes before w-2. Each pod must find
    its own index from its node address."""
    monkeypatch.setenv("TF_CONFIG", "")  # restored (unset) afterwards: resolve_world_and_export_tf_config writes it
    mine = "10.0.0.2"  # pinned: computing it the way the code does would hide a wrong lookup
    monkeypatch.setattr(socket, "gethostname", lambda: "w-2")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: {"w-2": mine}[name])
    addresses = {"w-0": "10.0.0.1", "w-2": mine, "w-10": "10.0.0.3"}

    monkeypatch.setenv("POD_NAMESPACE", "team-a")

    class PodsApi:
        """Answers for namespace team-a only: listing every namespace (TF's default) would need a
        ClusterRole and could match another namespace's pods with the same labels."""

        def __init__(self, phase="Running"):
            self.phase = phase

        def list_namespaced_pod(self, namespace, label_selector):
            assert (namespace, label_selector) == ("team-a", "job-name=w")
            return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name=name),
                                                          status=SimpleNamespace(phase=self.phase, host_ip=ip))
                                          for name, ip in addresses.items()])

    world = resolve_world_and_export_tf_config("kubernetes", 2222, "job-name=w", k8s_client=PodsApi())
    assert world.cluster == {"worker": ["10.0.0.1:2222", "10.0.0.3:2222", f"{mine}:2222"]}
    assert (world.rank, world.size) == (2, 3)
    with pytest.raises(ValueError, match='--cluster_resolver=kubernetes: Pod "w-0" is not running; phase: "Pending"'):
        resolve_world_and_export_tf_config("kubernetes", 2222, "job-name=w", k8s_client=PodsApi("Pending"))
    addresses["w-2"] = "10.0.0.9"
    with pytest.raises(ValueError, match="should hold this pod's node address"):
        resolve_world_and_export_tf_config("kubernetes", 2222, "job-name=w", k8s_client=PodsApi())


def test_the_heartbeat_outlives_disk_errors_and_workers_ignore_notice_signals_until_fit(tmp_path):
    """A heartbeat write that failed (a full or vanished disk) used to end the heartbeat thread, and with
    it the watch on the agent; a worker signalled by Slurm before training used to die of SIGUSR1."""
    heartbeat = tmp_path / "later" / "heartbeat"
    code = ("import os, signal, time\n"
            "from tf_elastic.elastic.worker.world import World, report_progress, start_heartbeat\n"
            "world = World.from_env()\n"
            "thread = start_heartbeat(world, interval=0.05)\n"
            "report_progress(1)\n"  # the first step's write, on the main thread: fails, must not raise
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "time.sleep(0.3)\n"
            f"os.mkdir({str(heartbeat.parent)!r})\n"
            "deadline = time.time() + 20\n"
            f"while not os.path.exists({str(heartbeat)!r}) and time.time() < deadline:\n"
            "    time.sleep(0.05)\n"
            "print('alive', thread.is_alive())\n")
    env = dict(repo_env(), TF_ELASTIC_HEARTBEAT_FILE=str(heartbeat), TF_ELASTIC_STOP_SIGNALS="SIGTERM,SIGUSR1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "alive True" in proc.stdout
    assert "cannot write the heartbeat file" in proc.stderr
    assert Heartbeat.from_text(heartbeat.read_text()).step == 1


def test_the_heartbeat_carries_a_stragglers_slowness_and_the_groups_median_and_reads_older_fields():
    # The group's numbers come from a sum over workers, NumPy's: their repr ("np.float64(0.25)") once made every
    # heartbeat unreadable, and the agent took the worker for hung.
    beat = Heartbeat(7, 9, 11, slow=2.3456, evict=True, median=np.float64(0.012345678), batch=16, input_slow=2.5,
                     step_seconds=np.float64(0.25))
    assert Heartbeat.from_text(beat.to_text()) == Heartbeat(7, 9, 11, slow=2.346, evict=True, median=0.012345678,
                                                            batch=16, input_slow=2.5, step_seconds=0.25)
    assert Heartbeat.from_text("7 9 11") == Heartbeat(7, 9, 11)  # workers of the versions before
    assert Heartbeat.from_text("7 9 11 2.5 1 0.01 16") == Heartbeat(7, 9, 11, 2.5, True, 0.01, 16)
    assert Heartbeat.from_text("7 9 11 2.5 1 0.01 16 2.0") == Heartbeat(7, 9, 11, 2.5, True, 0.01, 16, 2.0)
    assert Heartbeat.from_text(beat.to_text() + " 0.5 x") == Heartbeat.from_text(beat.to_text())  # a newer one
    assert Heartbeat.from_text("7 9 11 2.5 1") == Heartbeat(7, 9, 11, slow=2.5, evict=True)
    for torn in ("7 9", "7 9 11 2.3", "7 9 11 x 1", "7 9 11 2.3 y", "7 9 11 2.3 1 0.1", "7 9 11 2.3 1 x 16",
                 "7 9 11 2.3 1 0.1 1.5", "7 9 11 2.3 1 0.1 16 x", ""):
        assert Heartbeat.from_text(torn) is None, torn
