"""Bad input, tried on purpose: each gives an error naming the culprit, a non-zero exit where it is a
process, and leaves committed work untouched. (Every flag's range has its own table in test_flags.py.)"""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, agent_argv

pytestmark = pytest.mark.slow

TRAIN = [sys.executable, "-m", "launch.train", "--dataset=digits", "--epochs=1", "--threads=1"]


def _digest(directory: Path) -> str:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """A run dir holding committed work of a small LARS job."""
    run_dir = tmp_path_factory.mktemp("committed") / "run"
    subprocess.run([*TRAIN, f"--run_dir={run_dir}"], cwd=REPO, check=True, capture_output=True, timeout=300)
    return run_dir


def _run(argv, env=None, timeout=120):
    import os

    full_env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.run(argv, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


API_CASES = [
    # (the call, what the ValueError must say): optimizer and schedule arguments
    ("LARS(learning_rate=-1.0)", "LARS `learning_rate` must be a finite number >= 0; received learning_rate=-1.0"),
    ("LARS(momentum=1.5)", "LARS `momentum` must be a finite number in [0, 1); received momentum=1.5"),
    ("LARS(trust_coefficient=0.0)", "LARS `trust_coefficient`"),
    ("LARS(weight_decay=-1e-4)", "LARS `weight_decay` must be a finite number >= 0"),
    ("LARS(epsilon=float('nan'))", "LARS `epsilon` must be a finite number >= 0; received epsilon=nan"),
    ("LARS(exclude_from_layer_adaptation=5)", "LARS `exclude_from_layer_adaptation` must be None, a regex string"),
    ("LARS(exclude_from_weight_decay=['('])", "LARS `exclude_from_weight_decay` has an invalid regex '('"),
    ("BatchResizeSchedule('x', 32)", "`base` must be a float or a LearningRateSchedule"),
    ("BatchResizeSchedule(0.1, 0)", "`reference_batch_size` must be an int > 0; received reference_batch_size=0"),
    ("BatchResizeSchedule(0.1, 32, batch_size=0)", "`batch_size` must be an int > 0"),
    ("BatchResizeSchedule(0.1, 32, scaling='cubic')", "`scaling` must be one of 'linear', 'sqrt', 'none'"),
    ("BatchResizeSchedule(0.1, 32, transition='bogus')", "`transition` must be one of 'linear', 'momentum', 'none'"),
    ("BatchResizeSchedule(0.1, 32, transition='momentum', momentum=1.0)", 'transition="momentum" needs `momentum`'),
    ("BatchResizeSchedule(0.1, 32, transition_steps=-1)", "`transition_steps` must be None or an int >= 0"),
    ("BatchResizeSchedule(0.1, 32).resize(-5, 64)", "`step` must be an int >= the last resize step 0"),
    ("WarmupPolynomialDecay(0.1, -1, 100)", "`warmup_steps` must be >= 0; received warmup_steps=-1"),
    ("WarmupPolynomialDecay(0.1, 10, 0)", "`decay_steps` must be > 0; received decay_steps=0"),
]


@pytest.mark.parametrize("call, message", API_CASES, ids=[c for c, _ in API_CASES])
def test_bad_optimizer_and_schedule_arguments_are_named(call, message):
    from tf_elastic import LARS, BatchResizeSchedule, WarmupPolynomialDecay

    with pytest.raises(ValueError) as error:
        eval(call, {"LARS": LARS, "BatchResizeSchedule": BatchResizeSchedule,
                    "WarmupPolynomialDecay": WarmupPolynomialDecay})
    assert message in str(error.value)


TRAIN_CASES = [
    # (extra train flags, environment, what the error must say)
    (["--model=resnet20"], {}, "does not fit this model or optimizer"),
    (["--optimizer=adam"], {}, "does not fit this model or optimizer"),
    (["--dataset=mnist", "--data_dir=/nonexistent"], {}, "--data_dir='/nonexistent' has no mnist.npz"),
    (["--dataset=tfds:not_a_dataset"], {}, "tfds:not_a_dataset"),
    ([], {"TF_CONFIG": "{not json"}, "TF_CONFIG is not a valid worker cluster spec"),
    ([], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 3}})},
     "TF_CONFIG is not a valid worker cluster spec"),
    ([], {"TF_CONFIG": json.dumps({"cluster": {"chief": ["127.0.0.1:1"]}, "task": {"type": "chief", "index": 0}})},
     "TF_CONFIG is not a valid worker cluster spec"),
    (["--strategy=mirrored"], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                                        "task": {"type": "worker", "index": 0}})},
     "--strategy=mirrored is single-worker"),
    (["--batch_policy=global", "--global_batch_size=30", "--cpu_devices=4", "--strategy=mirrored"], {},
     "--global_batch_size=30 is not divisible by the 4 replicas"),
    (["--cluster_resolver=slurm"], {}, "--cluster_resolver=slurm: SLURM_PROCID not found in environment"),
    (["--cluster_resolver=kubernetes"], {}, "--cluster_resolver=kubernetes needs --k8s_selector"),
]


@pytest.mark.parametrize("flags, env, message", TRAIN_CASES,
                         ids=[" ".join(f) or next(iter(e)) + "=" + e["TF_CONFIG"][:20]
                                                                  for f, e, _ in TRAIN_CASES])
def test_bad_training_input_is_named_and_committed_work_stays(committed, flags, env, message):
    before = _digest(committed / "checkpoints")
    proc = _run([*TRAIN, f"--run_dir={committed}", *flags], env)
    assert proc.returncode == 78, (proc.returncode, proc.stderr[-2000:])
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert _digest(committed / "checkpoints") == before


AGENT_CASES = [
    (["--rdzv=etcd://127.0.0.1:9", "--rendezvous_timeout=1", "--rdzv_request_timeout=0.3"],
     "no rendezvous within --rendezvous_timeout=1s: cannot reach etcd (127.0.0.1:9"),
    (["--rdzv=etcd://127.0.0.1"], "expected etcd://HOST:PORT"),
    (["--rdzv=etcd://127.0.0.1:99999"], "port in 1..65535"),
    (["--rdzv=file://relative"], "expected file:///ABSOLUTE/DIR"),
    (["--rdzv=redis://127.0.0.1:6379"], "unknown store scheme 'redis'"),
    (["--job_id=a/b"], "--job_id='a/b': use 1-128 letters"),
    (["--port_range=9000"], "--port_range='9000': expected LOW-HIGH"),
    (["--port_range=30000-20000"], "expected LOW-HIGH with 1024 <= LOW <= HIGH <= 65535"),
    (["--port_range=30000-30000", "--nproc=2"], "holds fewer ports than --nproc=2"),
    (["--rdzv_cert=/tmp/c.pem"], "--rdzv_cert and --rdzv_key go together"),
    (["--blacklist_after=0"], "--blacklist_after"),
    (["--host_ttl=0.3", "--monitor_interval=0.2"], "must be at most half of --host_ttl=0.3"),
    (["--startup_timeout=0"], "--startup_timeout"),
]


@pytest.mark.parametrize("flags, message", AGENT_CASES, ids=[" ".join(f) for f, _ in AGENT_CASES])
def test_bad_agent_input_is_named_and_committed_work_stays(committed, tmp_path, flags, message):
    before = _digest(committed / "checkpoints")
    proc = _run([sys.executable, "-m", "launch.elastic_run", *agent_argv(tmp_path / "rdzv", committed, flags), "--",
                 *TRAIN])
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert _digest(committed / "checkpoints") == before


def test_a_worker_configuration_error_fails_the_job_at_once_without_restarts(committed, tmp_path):
    """A worker that cannot start for a reason a restart cannot fix (exit 78) ends the job at once,
    not after --max_restarts futile restarts."""
    before = _digest(committed / "checkpoints")
    proc = _run([sys.executable, "-m", "launch.elastic_run", f"--rdzv=file://{tmp_path}/rdzv", "--job_id=j",
                 f"--run_dir={committed}", "--max_restarts=5", "--nowarm_start", "--host_id=bad", "--",
                 *TRAIN, "--model=resnet20"], timeout=180)
    assert proc.returncode == 1
    events = [json.loads(line) for line in (committed / "events.jsonl").read_text().splitlines()]
    mine = [e for e in events if e["source"] == "agent:bad"]
    reason = mine[-1]["reason"]  # the worker's own error, not "see the worker's log"
    assert "rank 0 on bad stopped on a configuration error (exit code 78)" in reason, mine[-1]
    assert "does not fit this model or optimizer" in reason and reason in proc.stderr.splitlines()[-1], reason
    assert len([e for e in mine if e["event"] == "worker_start"]) == 1
    assert _digest(committed / "checkpoints") == before
