"""The launch scripts run end to end in their short forms."""
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_python
from tf_elastic.elastic.events import read_events
from tf_elastic.testing.local_job import repo_env
from tf_elastic.testing.net import bindable, free_port


@pytest.mark.slow
def test_reproduce_dynamic_sgd_quick(tmp_path, mnist_dir):
    proc = run_python(f"import sys; sys.argv = ['r', '--quick', '--out_dir={tmp_path}', '--data_dir={mnist_dir}'];"
                      "from launch import reproduce_dynamic_sgd as r; from absl import app; app.run(r.main)")
    table = (tmp_path / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "configuration" not in line]
    assert len(rows) == 7, table  # static, immediate, ramp 8k, ramp 32k (quick sweep), momentum, 2x LARS
    assert (tmp_path / "dynamic_sgd.png").stat().st_size > 10_000
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["static batch"][0]["resize_steps"] == []
    assert len(results["Dynamic SGD, ramp 8k (default)"][0]["resize_steps"]) == 3
    assert "| static batch |" in proc.stdout


@pytest.mark.slow
def test_train_single_process_without_agent(tmp_path):
    """Started without an agent, launch.train is a plain single-process run that commits and finishes."""
    proc = run_python(f"import sys; sys.argv = ['t', '--dataset=digits', '--epochs=2', '--run_dir={tmp_path}'];"
                      "from launch import train; from absl import app; app.run(lambda a: sys.exit(train.main(a)))")
    assert "test accuracy" in proc.stdout
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in events if e["event"] == "commit"][-1] == 2
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard scalars"


@pytest.mark.slow
def test_train_mirrored_on_two_logical_cpus(tmp_path):
    proc = run_python(f"import sys; sys.argv = ['t', '--dataset=digits', '--epochs=1', '--strategy=mirrored', "
                      f"'--cpu_devices=2', '--per_replica_batch_size=16', '--run_dir={tmp_path}'];"
                      "from launch import train; from absl import app; app.run(lambda a: sys.exit(train.main(a)))")
    assert "test accuracy" in proc.stdout
    commits = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
               if '"commit"' in line]
    assert commits[-1]["global_batch"] == 32 and commits[-1]["epoch"] == 1  # 2 replicas x 16


@pytest.mark.slow
def test_main_job_runs_end_to_end(tmp_path):
    """The README's first command, shortened: a host lost, a host joined, each host with a run dir of
    its own; a summary and a plot that agree with the hosts' events."""
    proc = run_python(f"import sys; sys.argv = ['m', '--run_dir={tmp_path}', '--epochs=30'];"
                      "from launch import main_job; from absl import app; "
                      "app.run(lambda a: sys.exit(main_job.main(a)))",
                      timeout=600)
    events = read_events(sorted((tmp_path / "hosts").iterdir()))
    assert [p.name for p in sorted((tmp_path / "hosts").iterdir())] == ["host-a", "host-b", "host-c"]
    assert not (tmp_path / "run").exists() and list((tmp_path / "durable").iterdir())
    rendezvous = [e for e in events if e["event"] == "rendezvous" and e["source"] == "agent:host-a"]
    sizes = [e["world_size"] for e in rendezvous]
    # Two hosts, then one after the kill, then two again (a first round alone is possible under load).
    pair = sizes.index(2)
    assert 1 in sizes[pair:] and sizes[-1] == 2, sizes
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| round")]
    trained_rounds = {e["round"] for e in events if e["event"] == "restore"}
    assert len(table) == len(trained_rounds)
    assert "examples used more than once in an epoch (committed work): 0" in proc.stdout
    commits = [e for e in events if e["event"] == "commit"]
    assert f"final commit: epoch {commits[-1]['epoch']}, step {commits[-1]['step']}" in proc.stdout
    accuracy = [e for e in events if e["event"] == "evaluation"][-1]["test_accuracy"]
    assert f"test accuracy: {accuracy:.4f}" in proc.stdout
    assert (tmp_path / "run.png").stat().st_size > 10_000


@pytest.mark.slow
def test_reproduce_lars_quick(tmp_path, mnist_dir):
    run_python(f"import sys; sys.argv = ['r', '--quick', '--out_dir={tmp_path}', '--data_dir={mnist_dir}'];"
               "from launch import reproduce_lars as r; from absl import app; app.run(r.main)")
    table = (tmp_path / "table.md").read_text()
    assert table.count("| SGD,") == 2 and table.count("| LARS,") == 1 and "goal: within 1 point" in table
    assert (tmp_path / "lars.png").stat().st_size > 10_000
    run_python(f"import sys; sys.argv = ['r', '--quick', '--lars_sweep=10/0.001,5/0.002', '--out_dir={tmp_path}', "
               f"'--data_dir={mnist_dir}'];"
               "from launch import reproduce_lars as r; from absl import app; app.run(r.main)")
    sweep = (tmp_path / "sweep.md").read_text()
    assert "| 10 | 0.001 | 0.01 |" in sweep and "| 5 | 0.002 | 0.01 |" in sweep, sweep


@pytest.mark.slow
def test_without_the_agent_slurm_workers_train_at_a_fixed_size_and_resume_after_a_failure(tmp_path):
    """Two workers of one Slurm step (the environment srun gives them) find each other through TF's
    SlurmClusterResolver. One is killed: the other stops with the peer-failure code, and the step run
    again (as a requeue would) resumes from the last commit and finishes."""
    port = free_port()
    while not bindable("127.0.0.1", port + 1):
        port = free_port()
    argv = [sys.executable, "-m", "launch.train", "--cluster_resolver=slurm", f"--port_base={port}", "--dataset=digits",
            "--epochs=3", "--per_replica_batch_size=16", "--commit_every_steps=10", "--optimizer=sgd",
            "--learning_rate=0.02", "--threads=1", f"--run_dir={tmp_path}"]

    def srun():
        slurm = lambda rank: repo_env(SLURM_PROCID=str(rank), SLURM_STEP_NUM_TASKS="2",  # noqa: E731
                                      SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="2")
        return [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, env=slurm(rank),
                                 stderr=open(tmp_path / f"rank{rank}.log", "ab"))
                for rank in range(2)]

    def events(name):
        path = tmp_path / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == name]

    first = srun()
    try:
        deadline = time.time() + 180
        while not [e for e in events("commit") if e["step"] >= 10] and time.time() < deadline:
            time.sleep(0.1)
        assert events("commit"), (tmp_path / "rank0.log").read_text()[-3000:]
        first[1].send_signal(signal.SIGKILL)
        assert first[0].wait(timeout=120) == 75  # EXIT_PEER_FAILURE: the scheduler restarts the step
    finally:
        for proc in first:
            proc.kill()
            proc.wait()
    committed = max(e["step"] for e in events("commit"))
    again = srun()
    assert [proc.wait(timeout=300) for proc in again] == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    restored = events("restore")[-1]
    assert restored["world_size"] == 2 and restored["step"] == committed > 0
    assert events("commit")[-1]["epoch"] == 3 and events("evaluation")


@pytest.mark.slow
def test_train_on_a_prepared_tfds_dataset(tmp_path):
    """`--dataset=tfds:NAME` reads a dataset prepared in TFDS's format in --data_dir through its random-access
    data source; nothing is downloaded."""
    import numpy as np
    import tensorflow as tf
    import tensorflow_datasets as tfds

    from tf_elastic.elastic.worker import datasets

    digits = datasets.load("digits")
    features = tfds.features.FeaturesDict({"image": tfds.features.Image(shape=digits.x_train.shape[1:], dtype=np.uint8),
                                           "label": tfds.features.ClassLabel(num_classes=10)})
    splits = {split: tf.data.Dataset.from_tensor_slices({"image": np.round(x * 255).astype(np.uint8), "label": y})
              for split, x, y in (("train", digits.x_train, digits.y_train), ("test", digits.x_test, digits.y_test))}
    tfds.dataset_builders.store_as_tfds_dataset(name="digits_local", version="1.0.0", features=features,
                                                split_datasets=splits, data_dir=tmp_path / "tfds",
                                                file_format="array_record")  # what tfds.data_source reads
    proc = run_python(f"import sys; sys.argv = ['t', '--dataset=tfds:digits_local', '--data_dir={tmp_path / 'tfds'}', "
                      f"'--epochs=3', '--optimizer=sgd', '--run_dir={tmp_path / 'run'}'];"
                      "from launch import train; from absl import app; app.run(lambda a: sys.exit(train.main(a)))")
    accuracy = float(proc.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.8, proc.stdout[-2000:]
