"""The Dynamic-SGD sweep's design, in its --quick form: paired seeds, equal samples per configuration, ramps that
finish inside their phase, every configuration present. Its results are not asserted."""
import json
import subprocess
import sys

import pytest

from conftest import REPO, run_python

pytestmark = pytest.mark.xdist_group("sweep")  # its module fixtures: built once, on one worker

CONFIGS = ("static", "immediate", "ramp", "momentum")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, mnist_dir, machine_slots):
    out = tmp_path_factory.mktemp("sweep")
    with machine_slots.held():
        proc = run_python(f"import sys; sys.argv = ['s', '--quick', '--out_dir={out}', '--data_dir={mnist_dir}'];"
                          "from launch.papers import sweep_dynamic_sgd as s; from absl import app; app.run(s.main)")
    return proc.stdout, out, json.loads((out / "results.json").read_text())["cells"]


@pytest.mark.slow
def test_every_cell_runs_every_configuration_on_paired_seeds(sweep):
    """For one seed every configuration of every cell starts from the same weights and reads the same examples in
    the same order; another seed changes both."""
    _, _, cells = sweep
    assert len(cells) == 2 and {cell["factor"] for cell in cells} == {2, 8}
    for cell in cells:
        assert set(cell["runs"]) == set(CONFIGS)
        assert {len(runs) for runs in cell["runs"].values()} == {2}
    for key in ("weights_digest", "data_digest"):
        per_seed = [{runs[seed][key] for cell in cells for runs in cell["runs"].values()} for seed in (0, 1)]
        assert all(len(digests) == 1 for digests in per_seed), (key, per_seed)
        assert per_seed[0] != per_seed[1], key


@pytest.mark.slow
def test_every_configuration_plans_the_same_samples(sweep):
    """The same number of samples in every configuration of every cell (static in base-batch steps), so one static
    run per seed serves every factor; a run that kept a finite loss saw all of them."""
    _, _, cells = sweep
    totals = {sum(batch * steps for batch, steps in plan) for cell in cells for plan in cell["phases"].values()}
    assert len(totals) == 1, totals
    assert len({json.dumps(cell["phases"]["static"]) for cell in cells}) == 1
    for cell in cells:
        assert {batch for batch, _ in cell["phases"]["static"]} == {2}
        assert [batch for batch, _ in cell["phases"]["ramp"]] == [2, 2 * cell["factor"]]
        for runs in cell["runs"].values():
            for run in runs:
                if run["losses"][-1] == run["losses"][-1]:  # not NaN
                    assert run["samples"][-1] == next(iter(totals))


@pytest.mark.slow
def test_every_ramp_finishes_inside_its_phase_and_the_transitions_start_low(sweep):
    import numpy as np

    stdout, _, cells = sweep
    assert "NOT every ramp" not in stdout and "ramp check: every ramp finishes inside its phase" in stdout
    checked = 0
    for cell in cells:
        assert cell["ramp"] and all(ramp <= steps for ramp, steps in cell["ramp"])
        small_steps = cell["phases"]["ramp"][0][1]
        for seed in (0, 1):
            lr = {c: np.array(cell["runs"][c][seed]["learning_rates"]) for c in ("immediate", "ramp", "momentum")}
            if min(map(len, lr.values())) < sum(steps for _, steps in cell["phases"]["ramp"]):
                continue  # stopped at a non-finite loss
            share = {c: lr[c] / lr["immediate"] for c in ("ramp", "momentum")}  # of the linear-scaling rate
            k = cell["factor"]  # both start from the small batch's scale 1 of the jump's k ...
            assert share["ramp"][small_steps] == pytest.approx(1 / k, rel=1e-4)
            assert share["momentum"][small_steps] == pytest.approx((1 + 0.1 * (k - 1)) / k, rel=1e-4)
            assert share["ramp"][-1] == pytest.approx(1, rel=1e-4)  # ... the ramp gets there inside its phase;
            assert 0.9 < share["momentum"][-1] <= 1 + 1e-6  # the momentum share 1 - 0.9^(n+1) only nears it
            checked += 1
    assert checked


@pytest.mark.slow
def test_the_sweep_writes_its_table_and_heat_maps(sweep):
    stdout, out, _ = sweep
    table = (out / "table.md").read_text()
    for config in CONFIGS:
        assert f"| {config} |" in table
    assert "wall " in table and " CPU " in table and "| static |" in stdout
    assert (out / "heat_maps.png").stat().st_size > 10_000


def test_a_factor_below_two_is_refused():
    proc = subprocess.run([sys.executable, "-m", "launch.papers.sweep_dynamic_sgd", "--factors=1,4"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--factors must be ints >= 2" in proc.stderr, proc.stderr[-2000:]
