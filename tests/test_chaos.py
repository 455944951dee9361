"""The fault-injection soak in miniature: 10 random faults of every kind on etcd, then every invariant."""
import pytest

from tf_elastic.testing import soak

pytestmark = pytest.mark.slow


def test_ten_random_faults_lose_nothing(tmp_path):
    # Seed 133 draws all eight fault kinds (the soak's own RNG alone decides kinds and targets), so a broken
    # injection fails here. 40 epochs: the tenth fault comes before epoch 25 (measured).
    result = soak.run_soak(tmp_path, faults=10, seed=133, rdzv="etcd", epochs=40, max_gap=0.5, wait_for_spares=False)
    print(soak.table(result))
    assert len(result["faults"]) == 10, "the job ended before every fault was injected"
    assert soak.failed_invariants(result, tolerance=0.03) == []
    assert result["checks"]["samples_repeated"] == result["checks"]["samples_skipped"] == 0
