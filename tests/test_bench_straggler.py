"""`launch/bench/bench_straggler.py`'s table (its runs are the ten-minute benchmark; the job it drives is
tested in test_stragglers.py)."""
from types import SimpleNamespace

from launch.bench.bench_straggler import PHASES, DataCopies, _train_args, table
from tf_elastic.testing.soak import TRAIN


def test_the_table_shows_each_runs_phases_the_evicted_hosts_probations_and_who_was_reported():
    """A rejoin is timed from the mild phase and from the unthrottling ("in mild" where it came before)."""
    run = {"mode": "evict", "rates": dict(zip(PHASES, (2.5, 1.1, 2.4, 2.5))), "report": 21.0, "without": 40.5,
           "rejoin": 72.0, "back_in_mild": False, "rejoin_unthrottled": 12.0,
           "evictions": {"before": 0, "slow": 1, "mild": 0, "after": 0},
           "probations": [False, False, True], "throttle": "cgroup", "late_in_slow": 1.9,
           "probe_cost": (0.0071, 0.0093, 0.0052), "reports": [(True, "input"), (True, "compute"), (False, "input")]}
    text = table([run, dict(run, mode="in mild", rejoin=30.0, back_in_mild=True)], {3: 2.0, 4: 2.5}, 4)
    row = ("| evict | 2.50 | 1.10 | 2.40 | 2.50 | 0.95x | 21.00 s | 40.50 s | 72.00 s | 12.00 s | 0/1/0/0 | 2/1 | "
           "0.71 % (0.93 %); 0.52 % | 1/1; 1 |")
    assert row in text, text
    assert "| 40.50 s | 30.00 s | in mild | 0/1/0/0 |" in text, text
    assert "3-worker alone: 2.00 steps/s; 4-worker alone: 2.50 steps/s" in text and "cgroup" in text


def test_a_run_of_slow_reads_trains_each_host_on_its_own_copy_the_slowed_ones_on_the_slow_disk(tmp_path):
    """Each host's `data` (relative to its agent's cwd) is the plain copy, the slowed host's the slow disk's:
    one copy for all would have the slow disk's cache eviction reach every host's reads."""
    copies = DataCopies(tmp_path / "plain", SimpleNamespace(path=tmp_path / "slow"))
    assert _train_args(None) == TRAIN
    args = _train_args(copies)
    assert args[:3] == ["--dataset=tfrecord:data", "--image_size=16", "--index_cache_dir="]
    assert args[3:] == [arg for arg in TRAIN if not arg.startswith("--dataset=")] and len(args) == len(TRAIN) + 2
    a, d = copies.host_dir(tmp_path / "job", "a", slowed=False), copies.host_dir(tmp_path / "job", "d", slowed=True)
    assert (a / "data").readlink() == tmp_path / "plain" and (d / "data").readlink() == tmp_path / "slow" / "tfrecord"
