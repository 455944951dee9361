"""`launch.bench.bench_goodput` and its traces: traces generated and read as documented, the ideal integrated over
the capacity, and `--quick` replaying a trace written here against both methods with the same samples."""
import json
import subprocess
import sys

import pytest

from launch.bench import preemption_trace
from launch.bench.preemption_trace import NOTICE, PREEMPT, RETURN, Trace, TraceEvent
from tf_elastic.testing.local_job import REPO, repo_env

ELASTIC, RESTART, IDEAL = "elastic", "checkpoint-restart", "ideal"  # the bench's method names (it defines
# flags that clash with launch.train's: it is run, never imported, here)
GENERATED = dict(hosts=4, preemptions_per_host_hour=2.0, notice_fraction=0.5, notice_seconds=120.0,
                 return_seconds=600.0, compression=30.0, horizon=600.0)


def test_a_generated_trace_is_fixed_by_its_seed_and_alternates_each_host_between_up_and_down():
    trace = preemption_trace.generate(seed=3, **GENERATED)
    assert trace == preemption_trace.generate(seed=3, **GENERATED) != preemption_trace.generate(seed=4, **GENERATED)
    assert any(e.notice for e in trace.events) and any(e.kind == PREEMPT and not e.notice for e in trace.events)
    for host in range(4):
        kinds = [e.kind for e in trace.events if e.host == host]
        assert kinds == [PREEMPT, RETURN] * (len(kinds) // 2), kinds
    assert all(e.time < 600.0 for e in trace.events if e.kind == PREEMPT)
    assert all(0 < e.notice <= 120.0 / 30.0 for e in trace.events if e.notice)
    assert min(up for _, up in trace.capacity()) >= 0 and trace.capacity()[-1][1] == 4  # every host came back


def test_a_trace_survives_its_csv_and_bad_rows_are_refused_naming_the_line(tmp_path):
    trace = preemption_trace.generate(seed=1, **GENERATED)
    path = tmp_path / "trace.csv"
    preemption_trace.write_csv(trace, path, compression=30.0)
    again = preemption_trace.read_csv(path, hosts=4, compression=30.0)
    assert [(e.host, e.kind) for e in again.events] == [(e.host, e.kind) for e in trace.events]
    assert all(abs(a.time - b.time) < 1e-9 and abs(a.notice - b.notice) < 1e-9
               for a, b in zip(again.events, trace.events))
    for rows, message in ((["5,0,return,"], "while up"), (["5,0,preempt,10"], "before the host was up"),
                          (["5,4,preempt,"], "host must be in 0..3"), (["5,0,leave,"], "event must be"),
                          (["x,0,preempt,"], "must be numbers"), (["5,0,preempt,", "9,0,return,3"], "has no notice")):
        path.write_text("time_s,host,event,notice_s\n" + "\n".join(rows) + "\n")
        with pytest.raises(ValueError, match=message):
            preemption_trace.read_csv(path, hosts=4, compression=1.0)
    with pytest.raises(ValueError, match="notice_fraction must be a finite number >= 0 and <= 1"):
        preemption_trace.generate(seed=0, **dict(GENERATED, notice_fraction=1.5))


def test_notices_come_first_and_the_ideal_integrates_the_measured_throughput_over_the_capacity():
    trace = Trace(2, (TraceEvent(10.0, 1, PREEMPT, 4.0), TraceEvent(20.0, 1, RETURN)))
    assert trace.actions() == [(6.0, 1, NOTICE), (10.0, 1, PREEMPT), (20.0, 1, RETURN)]
    assert trace.capacity() == [(0.0, 2), (10.0, 1), (20.0, 2)]
    rates = {1: 10.0, 2: 15.0}
    # 150 samples by 10 s at 2 hosts, 100 more by 20 s at one, then 15/s: 300 samples at 20 + 50 / 15 s.
    assert trace.ideal_time(rates, 300.0) == pytest.approx(20.0 + 50.0 / 15.0)
    assert trace.ideal_time(rates, 120.0) == pytest.approx(8.0)
    assert trace.host_seconds(5.0, 25.0) == pytest.approx(2 * 5 + 10 + 2 * 5)
    assert trace.integral(rates, 0.0, 20.0) == pytest.approx(250.0)


@pytest.mark.parametrize("argument,fragment", [
    ("--device_seconds=nan", "--device_seconds must be a finite number"),
    ("--seeds=1,x", "--seeds must be whole numbers"),
    ("--trace_csv=/nonexistent/trace.csv", "--trace_csv=/nonexistent/trace.csv: cannot read it")])
def test_bad_flags_end_the_bench_before_it_starts_anything(tmp_path, argument, fragment):
    proc = subprocess.run([sys.executable, "-m", "launch.bench.bench_goodput", argument, f"--root={tmp_path / 'runs'}"],
                          cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and fragment in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow(minutes=2.5)
def test_quick_replays_the_trace_as_given_and_every_method_trains_the_same_samples(tmp_path):
    """Host 1 leaves on a notice and comes back; then host 0 goes without one (the elastic group may be left
    with no host and resume from the durable copies) and comes back. No result is asserted, only the design."""
    csv = tmp_path / "trace.csv"
    csv.write_text("time_s,host,event,notice_s\n6,1,preempt,3\n10,1,return,\n16,0,preempt,0\n22,0,return,\n")
    proc = subprocess.run([sys.executable, "-m", "launch.bench.bench_goodput", "--quick", f"--trace_csv={csv}",
                           "--compression=1", f"--root={tmp_path / 'runs'}"], cwd=REPO, env=repo_env(),
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads((tmp_path / "runs" / "results.json").read_text())
    run = results["runs"][0]
    expected = [[at, host, kind] for at, host, kind in
                preemption_trace.read_csv(csv, hosts=2, compression=1.0).actions()]
    for name in (ELASTIC, RESTART):
        replayed = [[a["time"], a["host"], a["action"]] for a in run[name]["replayed"]]
        assert replayed == expected[:len(replayed)], (name, replayed)
        assert run[name]["finished"] and run[name]["progress"][-1][1] == run["target"] == 2 * 1536, run[name]
        assert run[name]["split"]["wall"] > 0 and run[name]["split"]["training"] > 0
    # The fixed-size job cannot finish before every host is back: it met the whole trace.
    assert len(run[RESTART]["replayed"]) == len(expected)
    assert run[RESTART]["samples"] == run[IDEAL]["samples"] == run["target"]
    assert sorted(results["rates"]) == ["1", "2"] and all(rate > 0 for rate in results["rates"].values())
    assert "| elastic |" in proc.stdout and "| ideal |" in proc.stdout
    assert (tmp_path / "runs" / "goodput.png").stat().st_size > 10_000


def test_the_ideal_runs_the_fastest_world_the_hosts_up_allow():
    """On 2 cores 3 workers beat 4 (measured): an ideal scheduler with 4 hosts up runs 3, so the ideal
    must be at least that fast, or a method that did so would score above it."""
    rates = {1: 10.0, 2: 15.0, 3: 20.0, 4: 18.0}
    assert preemption_trace.fastest(rates) == {1: 10.0, 2: 15.0, 3: 20.0, 4: 20.0}
    assert preemption_trace.fastest({2: 15.0, 4: 30.0}) == {1: 0.0, 2: 15.0, 3: 15.0, 4: 30.0}
    trace = Trace(4, (TraceEvent(10.0, 3, PREEMPT), TraceEvent(30.0, 3, RETURN)))
    assert trace.ideal_time(rates, 400.0) == pytest.approx(20.0)  # 20/s throughout: 4 up or 3 up
    assert trace.ideal_samples(rates, 15.0) == pytest.approx(300.0)
    # No schedule of the measured worlds beats it: e.g. 4 workers while 4 are up, 3 while 3.
    assert trace.integral(rates, 0.0, 20.0) <= trace.ideal_samples(rates, 20.0)


def test_steady_rate_leaves_the_warm_up_out_and_a_curve_above_the_ideal_is_flagged():
    # A slow first commit (tracing, compiling), then 100 samples/s.
    points = [[3.0, 100.0], [4.0, 200.0], [5.0, 300.0], [6.0, 400.0], [7.0, 500.0], [8.0, 600.0], [9.0, 700.0]]
    assert preemption_trace.steady_rate(points) == pytest.approx(100.0)
    assert preemption_trace.steady_rate(points[-2:]) is None  # too few commits to leave warm-up out
    trace, rates = Trace(2, ()), {1: 60.0, 2: 100.0}
    assert preemption_trace.above_ideal(points, trace, rates, slack=0.0) is None  # at most 100/s
    faster = [[t, 110.0 * t] for t in range(1, 10)]  # 10 % above the ideal's 100/s at every commit
    assert preemption_trace.above_ideal(faster, trace, rates, slack=0.0) == [9, 990.0]
    assert preemption_trace.above_ideal(faster, trace, rates, slack=100.0) is None  # within a commit's worth


def test_progress_counts_a_restore_of_commits_that_were_never_announced():
    """Workers killed after their last commits and before the agreement that announces them (as they end):
    the next launch restores those commits and ends at once. CI's run saw its progress end at 2880 of 3072."""
    def record(event, time, epoch, samples):
        return {"event": event, "time": time, "epoch": epoch, "samples": samples}

    records = [record("restore", 9.5, 0, 0),  # a run's start: nothing committed yet, no point
               record("commit", 10.0, 0, 1536), record("commit", 11.0, 1, 1344),
               record("restore", 12.0, 1, 1200),  # redone work: no point
               record("restore", 20.0, 2, 0)]
    assert preemption_trace.committed(records, 9.0, 1536) == [[1.0, 1536], [2.0, 2880], [11.0, 3072]]
