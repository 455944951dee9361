"""Bad flag values give an error that names the flag, before anything runs."""
import os
import subprocess
import sys

import pytest
from absl import flags

from conftest import REPO, agent_argv
from launch import train  # noqa: F401 - defines the training flags

TRAIN_BAD = [
    ("--epochs=0", "epochs"),
    ("--per_replica_batch_size=0", "per_replica_batch_size"),
    ("--global_batch_size=-8", "global_batch_size"),
    ("--reference_batch_size=0", "reference_batch_size"),
    ("--optimizer=adagrad", "optimizer"),
    ("--learning_rate=-1", "learning_rate"),
    ("--momentum=1.5", "momentum"),
    ("--trust_coefficient=-0.1", "trust_coefficient"),
    ("--weight_decay=-1", "weight_decay"),
    ("--base_schedule=step", "base_schedule"),
    ("--warmup_epochs=-1", "warmup_epochs"),
    ("--scaling=cubic", "scaling"),
    ("--transition=cosine", "transition"),
    ("--transition_steps=-5", "transition_steps"),
    ("--strategy=parameter_server", "strategy"),
    ("--collective=mpi", "collective"),
    ("--dtype_policy=int8", "dtype_policy"),
    ("--dataset=cifar", "dataset"),
    ("--dataset=tfds:", "dataset"),
    ("--model=vgg", "model"),
    ("--cpu_devices=0", "cpu_devices"),
    ("--commit_every_steps=-1", "commit_every_steps"),
    ("--commit_every_seconds=0", "commit_every_seconds"),
    ("--batch_policy=half", "batch_policy"),
    ("--batch_policy=global", "global_batch_size"),
    ("--strategy=tpu", "--tpu"),
    ("--learning_rate=nan", "--learning_rate must be a finite number"),
    ("--commit_every_seconds=inf", "--commit_every_seconds must be a finite number"),
]


@pytest.mark.parametrize("argument,name", TRAIN_BAD, ids=[a for a, _ in TRAIN_BAD])
def test_train_flag_errors_name_the_flag(argument, name):
    try:
        with pytest.raises(flags.Error) as error:
            flags.FLAGS(["train", argument])
        assert name in str(error.value)
    finally:
        flags.FLAGS.unparse_flags()


AGENT_BAD = [
    (["--nproc=0"], "--nproc"),
    (["--min_workers=3", "--max_workers=2"], "--min_workers=3 must be <= --max_workers=2"),
    (["--rdzv=zk://127.0.0.1:2181"], "unknown store scheme 'zk'"),
    (["--rdzv=file://otherhost/dir"], "expected file:///ABSOLUTE/DIR"),
    (["--heartbeat_timeout=0.1"], "--heartbeat_timeout"),
    (["--monitor_interval=10"], "--monitor_interval=10.0 must be < --heartbeat_timeout"),
    (["--max_restarts=-1"], "--max_restarts"),
    (["--job_id="], "--job_id is required"),
    (["--no_command"], "give the worker command after '--'"),
    (["--host_ttl=nan"], "--host_ttl must be a finite number"),
    (["--stop_grace=nan"], "--stop_grace must be a finite number"),
    (["--host_id=../x"], "--host_id='../x': use 1-128 letters"),
    (["--host_id=rack1/node3"], "--host_id='rack1/node3': use 1-128 letters"),
    (["--host_id=" + "h" * 300], "use 1-128 letters"),
    (["--preemption_signals=SIGFOO"], "--preemption_signals: unknown signal"),
    (["--preemption_signals=SIGTERM,SIGKILL"], "--preemption_signals: SIGKILL cannot be caught"),
    (["--advertise_addr=no-such-host.invalid"], "--advertise_addr='no-such-host.invalid' does not resolve"),
]


@pytest.mark.parametrize("arguments,fragment", AGENT_BAD, ids=[" ".join(a) for a, _ in AGENT_BAD])
def test_agent_flag_errors_name_the_flag(tmp_path, arguments, fragment):
    argv = agent_argv(tmp_path / "rdzv", tmp_path / "run", [a for a in arguments if a != "--no_command"])
    command = [] if "--no_command" in arguments else ["--", sys.executable, "-c", "pass"]
    proc = subprocess.run([sys.executable, "-m", "launch.elastic_run", *argv, *command], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert fragment in proc.stderr + proc.stdout, proc.stderr[-2000:]
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()] if (tmp_path / "run").exists() else []
    assert written == [], written  # refused before it started anything: no event, log or worker output


@pytest.mark.parametrize("script,argument", [
    ("bench.chaos", "--max_gap=nan"), ("bench.bench_elastic", "--progress_timeout=nan"),
    ("bench.partition", "--root=/nonexistent --partition_seconds=inf"),
    ("papers.reproduce_dynamic_sgd", "--phase_epochs=nan"), ("papers.reproduce_lars", "--weight_decay=nan"),
    ("papers.sweep_dynamic_sgd", "--tuned_lr=nan"), ("bench.bench_rendezvous", "--host_ttl=nan"),
    ("bench.bench_world", "--timeout=inf")])
def test_every_launch_script_refuses_non_finite_floats(script, argument):
    proc = subprocess.run([sys.executable, "-m", f"launch.{script}", *argument.split()], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    name = argument.split()[-1].split("=")[0]
    assert proc.returncode != 0 and f"{name} must be a finite number" in proc.stderr, proc.stderr[-2000:]


def test_agent_help_lists_the_agents_flags():
    """`--help` used to print only "Try --helpfull": absl lists the program file's key flags."""
    proc = subprocess.run([sys.executable, "-m", "launch.elastic_run", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    for flag in ("--nproc", "--max_workers", "--progress_timeout", "--preemption_notice_url"):
        assert flag in proc.stdout, proc.stdout[-2000:]
    help_text = " ".join(proc.stdout.split())  # (absl wraps lines)
    assert "visible to every user in ps" in help_text  # --job_token
    assert "password crosses the network in clear text" in help_text  # --rdzv_user without TLS


def test_the_trainers_help_exits_0_with_a_synopsis_and_never_imports_tensorflow():
    """`--help` used to wait about 6 s for TensorFlow's import (its flags' choices came from modules that need it)."""
    check = ("import sys\nsys.argv = ['tf-elastic-train', '--help']\nfrom launch import train\ntry:\n"
             "    train.run()\nexcept SystemExit as end:\n"
             "    print('exit', end.code, 'tensorflow' in sys.modules, 'keras' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.startswith("usage: tf-elastic-train"), proc.stdout[:500] + proc.stderr[-2000:]
    assert "<inception_v3|mnist_cnn|mobilenet_v2|resnet20|resnet50>" in proc.stdout  # --model lists its values
    assert proc.stdout.rstrip().endswith("exit 0 False False"), proc.stdout[-500:]


COMMAND_LINES = [
    # (module, a bad flag, the exit code, what the one line must name)
    ("launch.train", ["--epochs=0"], 78, "tf-elastic-train: error: flag --epochs=0"),  # 78: the agent does not retry
    ("launch.train", ["--no_such_flag=1"], 78, "tf-elastic-train: error: Unknown command line flag 'no_such_flag'"),
    ("launch.elastic_run", ["--rdzv=file:///tmp/x", "--job_id=j", "--run_dir=/tmp/r", "--max_workers=0", "--",
                            "true"], 2, "tf-elastic-run: error: flag --max_workers=0"),
    ("launch.status", ["--job_id=j"], 2, "tf-elastic-status: error: flag --rdzv=None"),
    ("launch.report", ["--run_dir=/tmp/r", "--dataset_size=0"], 2, "tf-elastic-report: error: flag --dataset_size=0"),
]


@pytest.mark.parametrize("module,arguments,code,line", COMMAND_LINES,
                         ids=[c[0] + " " + c[1][-1] for c in COMMAND_LINES])
def test_a_flag_error_is_one_line_naming_the_flag_and_help_exits_0(module, arguments, code, line):
    """absl printed two lines (or the agent's whole help) and exited 1, also for the trainer under an agent,
    which then restarted it; `--help` of the status and the report exited 1."""
    proc = subprocess.run([sys.executable, "-m", module, *arguments], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    lines = [text for text in proc.stderr.splitlines() if text.strip() and "absl::InitializeLog" not in text]
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert lines[0].startswith(line) and lines[0].endswith("(see --help)"), lines
    helped = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: "), helped.stdout[:300] + helped.stderr[-300:]
