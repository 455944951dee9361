"""The fault-injection soak in miniature: a fault of every kind and one more on etcd, then every invariant."""
import pytest

from tf_elastic.testing import soak


@pytest.mark.slow(minutes=6)
def test_a_fault_of_every_kind_loses_nothing(tmp_path):
    # The soak draws every kind once before it repeats one (in a seeded order), so a broken injection of
    # any kind fails here; failed_invariants also wants every fault recovered and every epoch checked.
    # (A kind that makes a host leave while one trains starts a second host first, within the same fault.)
    faults = len(soak.KINDS)
    result = soak.run_soak(tmp_path, faults=faults, seed=133, rdzv="etcd", max_gap=0.5, wait_for_spares=False,
                           trainer="launch.train")
    print(soak.table(result))
    assert len(result["faults"]) == faults, "the job ended before every fault was injected"
    assert {f["kind"] for f in result["faults"]} == set(soak.KINDS)
    assert soak.failed_invariants(result, tolerance=0.03) == []
    assert result["checks"]["samples_repeated"] == result["checks"]["samples_skipped"] == 0
    assert result["checks"]["steps_off_plan"] == 0


def test_a_soak_that_injected_fewer_faults_than_asked_fails():
    """`--faults=15` once injected 11 (training ended first) and reported "invariants: all hold"."""
    checks = {"finished": True, "accuracy": 0.9, "reference_accuracy": 0.9, "samples_repeated": 0,
              "samples_skipped": 0, "steps_off_plan": 0, "progress_backwards": [], "leaves_counted_as_lost": [],
              "orphans": [], "leaked_temp_dirs": [], "ports_still_bound": [], "epochs_checked": 5}
    fault = {"kind": "kill_worker", "time": 1.0, "recovered": 2.0, "note": ""}
    ended = {**fault, "recovered": None, "note": "the job had finished"}
    result = {"faults": [fault] * 11 + [ended], "faults_asked": 15, "epochs": 5, "checks": checks}
    assert soak.failed_invariants(result, tolerance=0.03) == [
        "11 of the 15 faults asked were injected before training ended: give more --epochs"]
    assert soak.failed_invariants({**result, "faults_asked": 11}, tolerance=0.03) == []


def test_the_soak_hurries_when_the_training_left_at_its_rate_is_short_for_the_faults_left():
    """A fault takes about HURRIED_FAULT_SECONDS whatever the epochs' speed: at 3 epochs/s, 10 faults need
    900 epochs of training left; at 0.1 epochs/s the floor of 8 epochs a fault rules."""
    assert soak.HURRIED_FAULT_SECONDS == 30.0
    assert soak.short_of_training(899, 10, 3.0) and not soak.short_of_training(900, 10, 3.0)
    assert soak.short_of_training(79, 10, 0.1) and not soak.short_of_training(80, 10, 0.1)
    assert not soak.short_of_training(0, 0, 3.0)
