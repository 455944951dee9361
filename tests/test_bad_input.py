"""Bad input, tried on purpose: each gives an error naming the culprit, a non-zero exit where it is a
process, and leaves committed work untouched. (Every flag's range has its own table in test_flags.py.)"""
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, agent_argv

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("bad_input")]  # its module fixtures: built once, on one worker

TRAIN = [sys.executable, "-m", "launch.train", "--dataset=digits", "--epochs=1", "--threads=1"]


def _digest(directory: Path) -> str:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()


@pytest.fixture(scope="module")
def committed(tmp_path_factory, machine_slots):
    """A run dir holding committed work of a small LARS job."""
    run_dir = tmp_path_factory.mktemp("committed") / "run"
    with machine_slots.held():
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
    (["--rdzv=etcd://127.0.0.1:9", "--rendezvous_timeout=1", "--rdzv_request_timeout=0.1"],
     "no rendezvous within --rendezvous_timeout=1s: cannot reach etcd (127.0.0.1:9"),
    (["--rdzv=etcd://127.0.0.1:9,127.0.0.1:10", "--host_ttl=1", "--rdzv_request_timeout=0.1"],
     "--rdzv_request_timeout=0.1 must be at most --host_ttl / (6 x 2 endpoints) = 0.0833: a lease renewal"),
    (["--rdzv_request_timeout=2"], "raise --host_ttl or leave --rdzv_request_timeout out"),
    (["--rdzv=etcd://127.0.0.1:9,127.0.0.1:10,127.0.0.1:11,127.0.0.1:12", "--host_ttl=1"],
     "--host_ttl=1 is too short for a store of 4 endpoints: a request could take only 0.0417s; give --host_ttl "
     "of at least 1.2"),
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


def test_an_unusable_run_dir_and_a_mistyped_command_end_the_agent_in_one_line_creating_nothing(tmp_path):
    """A user's first mistakes: one line each, naming what is wrong and what to do, no traceback, and no
    store directory created for a job that cannot start."""
    (tmp_path / "a_file").write_text("")
    cases = [(["--run_dir=/proc/nope"], TRAIN, "--run_dir=/proc/nope: cannot be used"),
             ([f"--run_dir={tmp_path / 'a_file' / 'run'}"], TRAIN, "a_file/run: cannot be used (Not a directory)"),
             ([], ["tf-elastic-trian", "--dataset=digits"], "the worker command 'tf-elastic-trian' is not an "
                                                             "executable program"),
             ([f"--run_dir={tmp_path / 'sweep[lr=0.1]'}"], TRAIN, "TensorFlow reads a checkpoint's path as a pattern")]
    for flags, command, message in cases:
        proc = _run([sys.executable, "-m", "launch.elastic_run",
                     *agent_argv(tmp_path / "rdzv", tmp_path / "run", flags), "--", *command])
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and not (tmp_path / "rdzv").exists()


def test_a_batch_size_the_world_does_not_divide_is_refused_in_fits_own_words():
    """`elastic.fit(batch_size=65)` spoke of launch/train.py's flags, which a user's script never used."""
    from tf_elastic.elastic.worker.errors import ConfigurationError
    from tf_elastic.elastic.worker.training import global_batch_size

    with pytest.raises(ConfigurationError) as refused:
        global_batch_size(2, batch_size=65)
    assert str(refused.value).startswith("batch_size=65 does not split evenly over the 2 replicas of this world: "
                                         "give fit a batch_size that every world size divides")
    assert "--global_batch_size" not in str(refused.value) and "--batch_policy" not in str(refused.value)


def test_the_agent_with_a_relative_run_dir_trains_and_a_second_start_of_the_finished_job_says_so(tmp_path):
    """`--run_dir=run` from the user's own directory (every relative run dir used to fail each commit), then
    the same command again: it used to exit 0 at once with "training finished", which a user who changed
    --epochs takes for a run that trained."""
    argv = [sys.executable, "-m", "launch.elastic_run", f"--rdzv=file://{tmp_path}/rdzv", "--job_id=j",
            "--run_dir=run", "--nowarm_start", "--", *TRAIN]
    env = dict(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    import os

    first = subprocess.run(argv, cwd=tmp_path, env=dict(os.environ, **env), capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert list((tmp_path / "run" / "commits").glob("*/checkpoint")), "the commits went into ./run"
    second = subprocess.run(argv, cwd=tmp_path, env=dict(os.environ, **env), capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 0
    assert re.search(r"job 'j' had already ended at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(training finished\); this "
                     r"agent trained nothing\. To train on from its commits \(more --epochs\), start a new "
                     r"--job_id with the same --run_dir", second.stderr), second.stderr[-2000:]
