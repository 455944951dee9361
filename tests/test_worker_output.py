"""Workers' output: a log file per round and rank, prefixed echo on the agent's streams (all, the chief, or
none but error lines), and a worker that raises names its exception in the job's last line."""
import subprocess
import sys
import time

import pytest

from conftest import REPO, agent_argv
from tf_elastic.elastic.agent import workers
from tf_elastic.elastic.agent.worker_output import WorkerOutput, logs_dir
from tf_elastic.elastic.events import read_events
from tf_elastic.elastic.protocol import Event
from tf_elastic.testing.local_job import repo_env

SCRIPT = ("import sys\n"
          "print('hello from stdout', flush=True)\n"
          "print('I1202 an info line', file=sys.stderr, flush=True)\n"
          "raise RuntimeError('boom')\n")


def _run(tmp_path, echo, rank):
    output = WorkerOutput(tmp_path / "logs", echo)
    output.assign(3, rank)
    process = workers.spawn([sys.executable, "-c", SCRIPT], {}, output, warm=False)
    assert process.wait(timeout=60) == 1
    workers.finish_output(process)
    return output


@pytest.mark.parametrize("echo,rank,echoed", [("all", 1, "all"), ("chief", 1, "errors"), ("chief", 0, "all"),
                                              ("none", 0, "errors")])
def test_each_line_goes_to_the_ranks_file_and_the_echo_chosen(tmp_path, capfdbinary, echo, rank, echoed):
    output = _run(tmp_path, echo, rank)
    text = (tmp_path / "logs" / "round-3" / f"rank-{rank}.log").read_text()
    assert "hello from stdout" in text and "I1202 an info line" in text and "RuntimeError: boom" in text
    out, err = (stream.decode() for stream in capfdbinary.readouterr())
    prefix = f"[round 3 rank {rank}] "
    assert (prefix + "hello from stdout" in out) is (echoed == "all")
    assert (prefix + "I1202 an info line" in err) is (echoed == "all")
    # The traceback, from its header to the exception's line, is echoed whatever the choice.
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert prefix + "Traceback (most recent call last):" in lines and prefix + "RuntimeError: boom" in lines
    assert output.tail[-1] == "RuntimeError: boom"


def test_a_spares_lines_before_its_round_have_a_file_of_their_own(tmp_path):
    output = WorkerOutput(tmp_path, "none")
    process = workers.spawn([sys.executable, "-c", "import sys; print('warming', flush=True); sys.stdin.readline(); "
                             "print('training')"], {}, output, warm=True)
    spare_log = tmp_path / f"spare-{process.pid}.log"
    deadline = time.time() + 60
    while "warming" not in (spare_log.read_text() if spare_log.exists() else "") and time.time() < deadline:
        assert process.poll() is None
        time.sleep(0.01)
    output.assign(0, 2)
    process.stdin.write(b"{}\n")
    process.stdin.close()
    assert process.wait(timeout=60) == 0
    workers.finish_output(process)
    assert (tmp_path / "round-0" / "rank-2.log").read_text() == "training\n"
    with pytest.raises(ValueError, match="echo='some': one of all, chief, none"):
        WorkerOutput(tmp_path, "some")


@pytest.mark.slow
def test_a_worker_that_raises_on_every_start_ends_the_job_naming_its_exception(tmp_path):
    """Through `elastic.run` (no decorator to remember): the worker's error file gives the agent the type and
    message; the job's last line and the failure event carry them; the per-rank log holds the traceback."""
    script = tmp_path / "boom.py"
    script.write_text("from tf_elastic import elastic\n\n\ndef main():\n    print('about to fail', flush=True)\n"
                      "    raise RuntimeError('boom')\n\n\nelastic.run(main)\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launch.elastic_run",
                           *agent_argv(tmp_path / "rdzv", run_dir, ["--host_id=h", "--warm_start=false"]),
                           "--", sys.executable, str(script)], cwd=REPO, env=repo_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "before its first step on 2 tries in a row: RuntimeError: boom" in last, last
    assert "[round 0 rank 0] about to fail" in proc.stdout, proc.stdout[-2000:]
    failures = [e for e in read_events(run_dir) if e["event"] == Event.FAILURE]
    assert len(failures) == 2 and all(f["error"] == "RuntimeError: boom" and f["code"] == 1 for f in failures)
    for failure in failures:  # the traceback's last lines, from the worker's error file
        assert failure["traceback"][-1] == "RuntimeError: boom" and "raise RuntimeError('boom')" in " ".join(
            failure["traceback"]), failure
    log = (logs_dir(str(run_dir), "h") / "round-0" / "rank-0.log").read_text()
    assert "about to fail" in log and "Traceback (most recent call last):" in log and "RuntimeError: boom" in log
