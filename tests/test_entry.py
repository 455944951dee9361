"""`elastic.run(main)` with the README's own-script example: a plain Keras script, three lines changed, under
real agents, through the loss of the chief's host, replaced by a standby host with an empty disk."""
import ast
import re
import sys

import pytest

from tf_elastic.elastic.protocol import Event
from tf_elastic.testing.local_job import REPO, LocalJob, assert_replicas_identical, lose_the_chief_to_a_standby

STARTUP_TIMEOUT = 15.0
# About 1.3 s an epoch here (validation each epoch): the first round must outlast STARTUP_TIMEOUT + 5 s (about 16
# epochs) and c must start; the rest is trained by the joined round (60 epochs spent 81 s there, for nothing;
# 40 spent 13 s more than 30).
EPOCHS = 30
AGENT = ["--min_workers=1", "--max_workers=2", "--heartbeat_timeout=5", "--last_call=1",
         f"--startup_timeout={STARTUP_TIMEOUT}"]


def readme_script(epochs: int) -> str:
    """The README's own-script example as written, but for the number of epochs."""
    readme = (REPO / "README.md").read_text()
    script = re.search(r"<!-- own-script -->\n```python\n(.*?)```", readme, re.S).group(1)
    assert script.count("epochs=200") == 1, "the README's example changed: update this test"
    return script.replace("epochs=200", f"epochs={epochs}")


@pytest.mark.slow
@pytest.mark.alone
def test_the_readme_script_survives_losing_the_chief_host_to_a_standby_with_an_empty_disk(tmp_path):
    """The round of a and b outlives a shortened startup timeout (the heartbeat runs); every round of two
    starts, commits and ends with the same bits of every variable on both ranks (momentum slots and
    BatchNorm statistics included); validation and the returned History work under the agent."""
    script = tmp_path / "train_digits.py"
    script.write_text(readme_script(epochs=EPOCHS))
    (tmp_path / "job").mkdir()
    job = LocalJob(tmp_path / "job", [], AGENT, host_run_dirs=True, trainer="launch.train")
    try:
        seen = lose_the_chief_to_a_standby(job, command=[sys.executable, str(script)],
                                           round_seconds=STARTUP_TIMEOUT + 5)
        assert not [e for e in job.events(Event.FAILURE) if e["time"] < seen["killed_at"]], "taken for a hang"
        received = job.events(Event.STATE_TRANSFER, round=seen["joined"])
        assert [e["rank"] for e in received] == [1] and received[0]["bytes"] > 0, received
        assert job.wait_agents(timeout=400) == {seen["chief"]: -9, seen["survivor"]: 0, "c": 0}, job.describe()
    finally:
        job.cleanup()
    for round_ in (seen["first"], seen["joined"]):
        assert_replicas_identical(job, round_)
    assert job.events(Event.WORKER_EXIT, round=seen["joined"]), "the joined round trained to the end"
    # Validation ran under the agent and fit returned its History (the script prints it): the epochs of the
    # last round, the same on both ranks. Each rank's output is in its own log file, and echoed with a prefix.
    logs = "".join(job.worker_log(host, seen["joined"]) for host in (seen["survivor"], "c"))
    histories = [ast.literal_eval(line[len("history "):]) for line in logs.splitlines() if line.startswith("history {")]
    echoed = (job.tmp / "agent-c.log").read_text(errors="replace")
    assert f"[round {seen['joined']} rank 1] history {{" in echoed, echoed[-2000:]
    assert len(histories) == 2 and histories[0] == histories[1], histories
    restored_epoch = job.events(Event.RESTORE, round=seen["joined"], rank=0)[0]["epoch"]
    history = histories[0]
    assert len(history["val_accuracy"]) == len(history["loss"]) == EPOCHS - restored_epoch, (restored_epoch, history)
    assert history["val_accuracy"][-1] > 0.3, history  # chance: 0.1


@pytest.mark.slow
def test_the_readme_script_as_one_process_commits_in_its_relative_run_dir_and_a_second_run_resumes(tmp_path):
    """`python train_digits.py`, as the README says to run it: its commits go to the relative `runs/train`,
    where TensorFlow rewrote the list of kept paths in place (a tuple crashed the second commit); run again,
    it says that training is already complete (it printed an empty history without a word)."""
    import subprocess

    from tf_elastic.testing.local_job import repo_env

    (tmp_path / "train_digits.py").write_text(readme_script(epochs=3))
    run = lambda: subprocess.run([sys.executable, "train_digits.py"], cwd=tmp_path, env=repo_env(),  # noqa: E731
                                 capture_output=True, text=True, timeout=300)
    first = run()
    assert first.returncode == 0, first.stderr[-3000:]
    state = (tmp_path / "runs" / "train" / "checkpoints" / "checkpoint").read_text()
    assert state.count("all_model_checkpoint_paths") >= 2, state
    second = run()
    assert second.returncode == 0, second.stderr[-3000:]
    assert "training is already complete: the commit in " in second.stderr, second.stderr[-3000:]
    assert "is at epoch 3 of 3" in second.stderr and "Give more epochs to train on" in second.stderr
