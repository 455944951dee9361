"""The launch scripts run end to end in their short forms."""
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_python
from tf_elastic.testing.local_job import repo_env
from tf_elastic.testing.net import bindable, free_port


@pytest.mark.slow
def test_reproduce_dynamic_sgd_quick(tmp_path, mnist_dir):
    """Every configuration, the momentum transition included, runs on the same seeds; the ramp finishes inside its
    phase and reaches the immediate run's rate; the equal-LR control jumps at once yet trains each phase at the
    ramp's summed rate."""
    import numpy as np

    proc = run_python(f"import sys; sys.argv = ['r', '--quick', '--out_dir={tmp_path}', '--data_dir={mnist_dir}'];"
                      "from launch.papers import reproduce_dynamic_sgd as r; from absl import app; app.run(r.main)")
    table = (tmp_path / "table.md").read_text()
    assert "ramp check: every ramp finishes inside its phase" in table, table
    for name in ("static", "immediate", "ramp", "equal_lr", "momentum"):
        assert f"| {name} |" in table, table
    assert "| accuracy: ramp - immediate (points) |" in table and "| mean spike: immediate - ramp |" in table
    assert "| accuracy: momentum - immediate (points) |" in table and "| mean spike: immediate - momentum |" in table
    assert (tmp_path / "dynamic_sgd.png").stat().st_size > 10_000
    runs = {name: runs[0] for name, runs in json.loads((tmp_path / "results.json").read_text()).items()}
    assert len(runs["static"]["samples"]) > len(runs["ramp"]["samples"])  # the same samples in smaller batches
    assert runs["static"]["samples"][-1] == runs["ramp"]["samples"][-1]
    assert set(runs["static"]["batches"]) == {4} and set(runs["ramp"]["batches"]) == {4, 64}
    batches = np.array(runs["ramp"]["batches"])
    ends = [i for i in range(1, len(batches)) if batches[i] != batches[i - 1]] + [len(batches)]
    lr = {name: np.array(runs[name]["learning_rates"]) for name in ("ramp", "immediate", "equal_lr")}
    start = 0
    for end in ends:
        if batches[start] == 64:
            assert lr["ramp"][start] < lr["immediate"][start] / 2  # the ramp starts low ...
            assert lr["ramp"][end - 1] == pytest.approx(lr["immediate"][end - 1], rel=1e-4)  # ... and gets there
            assert lr["equal_lr"][start] > lr["ramp"][start] * 2  # the control jumps at once ...
        assert lr["equal_lr"][start:end].sum() == pytest.approx(lr["ramp"][start:end].sum(), rel=1e-3)  # ... same sum
        start = end
    assert "| static |" in proc.stdout


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
def test_reproduce_lars_quick(tmp_path, mnist_dir):
    """SGD and LARS get grids of the same size, scored on the validation split; the chosen points go to the test
    set; unequal grids are refused."""
    run_python(f"import sys; sys.argv = ['r', '--quick', '--out_dir={tmp_path}', '--data_dir={mnist_dir}'];"
               "from launch.papers import reproduce_lars as r; from absl import app; app.run(r.main)")
    table = (tmp_path / "table.md").read_text()
    assert "| 0.4 | 0 |" in table and "| 0.28 | 0 |" in table and "| 5 | 0 |" in table, table
    assert "| LARS - tuned SGD (points) |" in table and "from the baseline" in table
    assert table.count("is at the edge of its grid") == 2, table  # two-point grids: the best is always an edge
    results = json.loads((tmp_path / "results.json").read_text())
    grid = {(t["optimizer"], t["learning_rate"]): t["validation_accuracy"] for t in results["grid"]}
    best_sgd = max((lr for opt, lr in grid if opt == "sgd"), key=lambda lr: grid["sgd", lr])
    assert any(f"SGD, batch 256, lr {best_sgd:g}," in name for name in results["test"]), results["test"].keys()
    assert (tmp_path / "lars.png").stat().st_size > 10_000
    proc = subprocess.run([sys.executable, "-m", "launch.papers.reproduce_lars", "--sgd_grid=0.4/1",
                           "--lars_grid=5/1,10/1"], cwd=REPO, env=repo_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "equal tuning budget" in proc.stderr, proc.stderr


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
    for requeue in range(3):  # as `sbatch --requeue` would, a step that crashed in native code runs again
        codes = [proc.wait(timeout=300) for proc in srun()]
        logs = "".join(f"--- rank {rank} ---\n" + (tmp_path / f"rank{rank}.log").read_text()[-3000:]
                       for rank in range(2))
        if codes == [0, 0] or not any(code < 0 for code in codes):
            break
    assert codes == [0, 0], (requeue, codes, logs)
    restored = events("restore")[-1]
    # Not older than the last commit announced; newer when the one after it was in force but not yet announced.
    assert restored["world_size"] == 2 and restored["step"] >= committed > 0, (restored, committed)
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


@pytest.mark.parametrize("kind", ["folder", "tfrecord"])
def test_the_input_shape_of_image_files_is_read_from_the_images(tmp_path, kind):
    """Images decoded from files have no static size: the trainer reads it from the first images (it used to
    say they differed, and asked for --image_size, when they were all 12x16), and refuses only real
    differences."""
    import numpy as np

    from launch.train import input_shape_of
    from tf_elastic.elastic.worker import data
    from tf_elastic.testing import data_files

    def source(name, shapes):
        images = [np.full(shape, n, np.uint8) for n, shape in enumerate(shapes)]
        if kind == "folder":
            for n, image in enumerate(images):
                (tmp_path / name / "c").mkdir(parents=True, exist_ok=True)
                (tmp_path / name / "c" / f"{n}.png").write_bytes(data_files.png(image))
            return data.ImageFolder(str(tmp_path / name), channels=1)
        (tmp_path / name).mkdir()
        import tensorflow as tf

        with tf.io.TFRecordWriter(str(tmp_path / name / "train-00000-of-00001")) as writer:
            for n, image in enumerate(images):
                writer.write(data_files.example(data_files.png(image), 1))
        return data.TFRecordSource(str(tmp_path / name / "train-*"), num_classes=2, channels=1)

    assert input_shape_of(source("same", [(12, 16, 1)] * 5), None, kind) == (12, 16, 1)
    with pytest.raises(ValueError, match=rf"--dataset={kind}: the first 5 images are not all the same size: set "
                                         r"--image_size"):
        input_shape_of(source("mixed", [(12, 16, 1)] * 4 + [(8, 8, 1)]), None, kind)
