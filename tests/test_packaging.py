"""setup.py: the built wheel trains without the checkout, and a worker command with a typo ends the job at once."""
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from launch import report
from tf_elastic.elastic.events import read_events
from tf_elastic.testing.local_job import REPO

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packaging")]  # its module fixtures: built once, on one worker


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory, machine_slots):
    """A fresh venv holding only the built wheel; its dependencies (TensorFlow, Keras, ...) come from this
    interpreter's site-packages through a plain path entry, so that no .pth of the checkout's editable
    install is read: neither `launch`, nor `models`, nor the checkout's `tf_elastic` can be imported."""
    with machine_slots.held():
        return _wheel_env(tmp_path_factory.mktemp("wheel"))


def _wheel_env(root: Path):
    # Built from a copy without the checkout's own build/ (an earlier build's files would slip into the wheel).
    source = shutil.copytree(REPO, root / "source", ignore=shutil.ignore_patterns(
        "build", "*.egg-info", ".git", "__pycache__", ".benchmarks"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(root / "dist"), str(source)], check=True, cwd=root)
    wheel = next((root / "dist").glob("tf_elastic-*.whl"))
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, cwd=root)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PATH=f"{root / 'venv' / 'bin'}:{env.get('PATH', '')}")
    (root / "elsewhere").mkdir()
    return wheel, root, env


def test_the_wheel_holds_the_library_and_exactly_the_user_facing_commands(wheel_env):
    wheel, root, env = wheel_env
    names = zipfile.ZipFile(wheel).namelist()
    assert "tf_elastic/launch/train.py" in names and "tf_elastic/models/__init__.py" in names
    assert not [n for n in names if n.split("/")[0] in ("launch", "models", "tests")], names
    # launch/'s own modules are the commands, its rooms (bench/, papers/) stay in the checkout: by the layout.
    commands = {n for n in names if n.startswith("tf_elastic/launch/")}
    assert commands == {f"tf_elastic/launch/{p.name}" for p in (REPO / "launch").glob("*.py")}, commands
    assert {"main_job.py", "train.py", "status.py", "report.py"} <= {n.split("/")[-1] for n in commands}
    library = {n for n in names if n.endswith(".py") and n.split("/")[1] not in ("launch", "models")}
    assert library == {f"tf_elastic/{p.relative_to(REPO / 'tf_elastic')}"
                       for p in (REPO / "tf_elastic").rglob("*.py")}, library ^ set()
    where = subprocess.run(["python", "-c", "import tf_elastic, importlib.util as u; print(tf_elastic.__file__, "
                            "u.find_spec('launch'), u.find_spec('models'))"], cwd=root / "elsewhere", env=env,
                           check=True, capture_output=True, text=True).stdout
    assert str(root / "venv") in where and where.strip().endswith("None None"), where


@pytest.mark.alone  # beside another test, host-c's start came after training ended (main_job failed)
def test_the_readme_main_job_runs_from_the_wheel_and_its_report_and_status_read_it(wheel_env):
    """The README's first command from the wheel, shortened, with a relative run dir: a host lost, a host
    joined, each host with a run dir of its own; a summary and a plot that agree with the hosts' events;
    then tf-elastic-report and tf-elastic-status read the job."""
    _, root, env = wheel_env
    proc = subprocess.run(["python", "-m", "tf_elastic.launch.main_job", "--epochs=30", "--run_dir=main"],
                          cwd=root / "elsewhere", env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    main = root / "elsewhere" / "main"
    hosts = sorted((main / "hosts").iterdir())
    events = read_events(hosts)
    assert [p.name for p in hosts] == ["host-a", "host-b", "host-c"]
    assert not (main / "run").exists() and list((main / "durable").iterdir())
    sizes = [e["world_size"] for e in events if e["event"] == "rendezvous" and e["source"] == "agent:host-a"]
    # Two hosts, then one after the kill, then two again (a first round alone is possible under load).
    pair = sizes.index(2)
    assert 1 in sizes[pair:] and sizes[-1] == 2, sizes
    table = [line for line in proc.stdout.splitlines() if line.split("|")[1:2] and line.split("|")[1].strip().isdigit()]
    assert len(table) == len({e["round"] for e in events if e["event"] == "restore"})
    assert ("examples trained more than once in an epoch (committed work, as the steps consumed them): 0; missed "
            "beyond an epoch's remainder: 0; steps that trained other than planned: 0") in proc.stdout
    commits = [e for e in events if e["event"] == "commit"]
    assert f"final commit: epoch {commits[-1]['epoch']}, step {commits[-1]['step']}" in proc.stdout
    accuracy = [e for e in events if e["event"] == "evaluation"][-1]["test_accuracy"]
    assert f"test accuracy: {accuracy:.4f}" in proc.stdout
    assert (main / "run.png").stat().st_size > 10_000
    # Where each host's time went: the causes tile its wall time; host-b's ends where its loss was noticed.
    split = report.time_split(hosts)
    assert sorted(split) == ["host-a", "host-b", "host-c"], split
    for host, causes in split.items():
        assert abs(sum(causes[c] for c in report.CAUSES) - causes["wall"]) <= 0.02 * causes["wall"], (host, causes)
        assert causes["training"] > 0, (host, causes)
    lost = [e for e in events if e["event"] == "failure" and e["kind"] == "host_lost" and e["host"] == "host-b"]
    started = [e for e in events if e["event"] == "agent_start" and e["source"] == "agent:host-b"][0]
    assert lost and abs(split["host-b"]["wall"] - (lost[-1]["time"] - started["time"])) < 1e-6, (lost, split)
    assert "| host-a |" in proc.stdout and "goodput" in proc.stdout
    relative = ",".join(f"main/hosts/{p.name}" for p in hosts)
    for command in (["tf-elastic-report", f"--run_dir={relative}"],
                    ["tf-elastic-status", f"--rdzv=file://{main / 'rdzv'}", "--job_id=main", f"--run_dir={relative}"]):
        shown = subprocess.run(command, cwd=root / "elsewhere", env=env, capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and "finished" in shown.stdout, command + [shown.stdout, shown.stderr[-2000:]]


def _agent(root: Path, env, name: str, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tf-elastic-run", "--nproc=1", "--min_workers=1", "--max_workers=1",
                           f"--rdzv=file://{root / name / 'rdzv'}", f"--job_id={name}", f"--run_dir={root / name}",
                           "--", *command], cwd=root / "elsewhere", env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_readme_single_host_agent_example_trains_from_the_wheel(wheel_env):
    _, root, env = wheel_env
    done = _agent(root, env, "train", "tf-elastic-train", "--dataset=digits", "--epochs=2", "--threads=1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test accuracy" in done.stdout + done.stderr


def test_a_typo_in_the_worker_module_ends_the_job_on_its_second_try_naming_the_error(wheel_env):
    _, root, env = wheel_env
    failed = _agent(root, env, "typo", "python", "-m", "tf_elastic.lanch.train", "--dataset=digits")
    assert failed.returncode == 1, failed.stderr[-3000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert "before its first step on 2 tries in a row" in last, last
    assert "ModuleNotFoundError: No module named 'tf_elastic.lanch'" in last, last
    assert "blacklisted" not in failed.stderr, failed.stderr[-3000:]


def test_the_readme_own_script_on_tf_data_trains_from_the_wheel_under_the_agent(wheel_env):
    """The README's own-script example (a tf.data pipeline), with 2 epochs, from another directory."""
    from test_entry import readme_script

    _, root, env = wheel_env
    (root / "elsewhere" / "train_digits.py").write_text(readme_script(epochs=2))
    done = _agent(root, env, "own", "python", "train_digits.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "history {" in done.stdout + done.stderr and "val_accuracy" in done.stdout + done.stderr
