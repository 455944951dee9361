"""`agent/job_record.py`: the job's records beside its rounds (the outcome and blacklist are tested with their
users, `test_rendezvous.py` and `test_blacklist.py`)."""
from tf_elastic.elastic.agent.job_record import JobRecord
from tf_elastic.elastic.store.file import FileStore


def test_the_groups_median_probe_is_published_for_hosts_on_probation_and_a_bad_record_reads_as_none(tmp_path):
    store = FileStore(str(tmp_path / "rdzv"))
    chief, evicted = JobRecord(store, "job", "a"), JobRecord(store, "job", "c")
    assert evicted.group_probe() is None
    chief.publish_probe(0.0125, 16)
    assert evicted.group_probe() == (0.0125, 16, 0.0)  # its seconds per step not known yet
    chief.publish_probe(0.0125, 16, 0.25)
    assert evicted.group_probe() == (0.0125, 16, 0.25)
    for bad in ("{", "[1, 2]", '{"median": 0, "batch": 16}', '{"median": 0.1, "batch": 1.5}',
                '{"median": NaN, "batch": 16}', '{"median": true, "batch": 16}'):
        store.set(chief.keys.probe, bad)
        assert evicted.group_probe() is None, bad
    for bad_step in ("-1", "NaN", '"x"', "true"):  # an unreadable step time is not known; the median stands
        store.set(chief.keys.probe, f'{{"median": 0.1, "batch": 16, "step_seconds": {bad_step}}}')
        assert evicted.group_probe() == (0.1, 16, 0.0), bad_step
