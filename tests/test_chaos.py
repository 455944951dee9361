"""The fault-injection soak in miniature: 10 random faults of every kind on etcd, then every invariant."""
import pytest

from tf_elastic.testing import soak

pytestmark = pytest.mark.slow


def test_ten_random_faults_lose_nothing(tmp_path):
    # The soak draws every kind once before it repeats one (in a seeded order), so a broken injection of
    # any kind fails here; failed_invariants also wants every fault recovered and every epoch checked.
    result = soak.run_soak(tmp_path, faults=11, seed=133, rdzv="etcd", epochs=64, max_gap=0.5, wait_for_spares=False)
    print(soak.table(result))
    assert len(result["faults"]) == 11, "the job ended before every fault was injected"
    assert {f["kind"] for f in result["faults"]} == set(soak.KINDS)
    assert soak.failed_invariants(result, tolerance=0.03) == []
    assert result["checks"]["samples_repeated"] == result["checks"]["samples_skipped"] == 0
