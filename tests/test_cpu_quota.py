"""The CPU quota a worker runs under, read from its cgroups: fake trees of both versions, and a real one."""
import subprocess
import sys
from pathlib import Path

import pytest

from tf_elastic.elastic.worker.cpu_quota import quota_period_seconds
from tf_elastic.testing.local_job import repo_env
from tf_elastic.testing.throttle import Throttle


def _proc(tmp_path: Path, mounts: str, groups: str, name: str = "proc") -> str:
    proc = tmp_path / name
    proc.mkdir()
    (proc / "mountinfo").write_text(mounts.replace("ROOT", str(tmp_path)))
    (proc / "cgroup").write_text(groups)
    return str(proc)


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("cpu_", "cpu.", 1)).write_text(text)


V1_MOUNTS = ("31 23 0:28 / ROOT/cg rw - tmpfs tmpfs rw\n"
             "32 31 0:29 / ROOT/cg/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
             "35 31 0:32 / ROOT/cg/memory rw,relatime - cgroup cgroup rw,memory\n")


def test_a_quota_on_the_workers_cgroup_or_one_above_it_gives_its_period_and_none_gives_zero(tmp_path):
    cpu = tmp_path / "cg" / "cpu,cpuacct"
    for level in (cpu, cpu / "kubepods", cpu / "kubepods" / "pod1", cpu / "kubepods" / "pod1" / "c1"):
        _write(level, cpu_cfs_quota_us="-1\n", cpu_cfs_period_us="100000\n")
    proc = _proc(tmp_path, V1_MOUNTS, "5:memory:/kubepods/pod1/c1\n4:cpu,cpuacct:/kubepods/pod1/c1\n0::/\n")
    assert quota_period_seconds(proc) == 0.0
    _write(cpu / "kubepods" / "pod1", cpu_cfs_quota_us="50000\n", cpu_cfs_period_us="250000\n")  # the pod's limit
    assert quota_period_seconds(proc) == 0.25
    _write(cpu / "kubepods" / "pod1" / "c1", cpu_cfs_quota_us="20000\n", cpu_cfs_period_us="100000\n")
    assert quota_period_seconds(proc) == 0.25  # the longest period of any quota above the worker
    # An unrelated cgroup's quota is not this worker's.
    _write(cpu / "other", cpu_cfs_quota_us="1000\n", cpu_cfs_period_us="900000\n")
    assert quota_period_seconds(proc) == 0.25


def test_cgroup_v2_reads_cpu_max_and_a_containers_own_cgroup_is_its_root(tmp_path):
    mounts = "40 23 0:40 /docker/abc ROOT/cg rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    root = tmp_path / "cg"
    _write(root, cpu_max="max 100000\n")
    _write(root / "worker", cpu_max="max 100000\n")
    proc = _proc(tmp_path, mounts, "0::/docker/abc/worker\n")
    assert quota_period_seconds(proc) == 0.0
    _write(root, cpu_max="150000 100000\n")  # the container's limit: 1.5 cores
    assert quota_period_seconds(proc) == 0.1
    # A path outside the mount's root (another namespace's view) is not read.
    assert quota_period_seconds(_proc(tmp_path, mounts, "0::/system.slice\n", "proc2")) == 0.0


def test_what_cannot_be_read_is_no_quota(tmp_path):
    assert quota_period_seconds(str(tmp_path / "no-proc")) == 0.0
    assert quota_period_seconds(_proc(tmp_path, "garbled\n", "no colons here\n", "torn")) == 0.0
    cpu = tmp_path / "cg" / "cpu,cpuacct"
    _write(cpu, cpu_cfs_quota_us="garbage\n", cpu_cfs_period_us="100000\n")
    assert quota_period_seconds(_proc(tmp_path, V1_MOUNTS, "4:cpu,cpuacct:/\n")) == 0.0


def test_a_worker_throttled_from_outside_probes_for_at_least_the_quotas_period(tmp_path):
    """A real cgroup (where this machine lets us make one): a process in it reads the period of the quota set
    from outside, and its probe times a period and a half of it, not the default 0.05 s."""
    with Throttle(f"tf-elastic-quota-{tmp_path.name}") as throttle:
        if throttle.kind != "cgroup":
            pytest.skip("no writable cgroup cpu controller here")
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.readline(); from tf_elastic.elastic.stragglers import "
             "ProbeSettings; from tf_elastic.elastic.worker import probe; print(probe.probe_seconds(ProbeSettings()))"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=repo_env())
        throttle.add(child.pid)
        throttle.set(1.5)  # a quota, not a slowdown
        out, _ = child.communicate("go\n", timeout=120)
    assert float(out.split()[-1]) >= 1.5 * 0.1  # (a quota above ours, of a longer period, would count too)
