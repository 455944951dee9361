"""Tests `tf_elastic/elastic/worker/data/dataset_feed.py` in one process: a user's tf.data pipeline read through
resizes (the rows each replica would train, batches pulled ahead of the step, restarts from the saved state
in a pipeline built anew) trains the global batches of a run without faults, in its order."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import run_python
from tf_elastic.elastic.worker.data.dataset_feed import DatasetFeed
from tf_elastic.elastic.worker.data.pydataset_feed import PyDatasetFeed
from tf_elastic.elastic.worker.errors import ConfigurationError

EXAMPLES, BATCH = 60, 8


def _pipeline(seed=None):
    """Shuffle (unseeded by default: the job's global seed makes it repeatable), filter, ragged map, batch."""
    tf.random.set_seed(7)
    ids = tf.data.Dataset.range(EXAMPLES).shuffle(16, seed=seed).filter(lambda i: i % 5 != 2)
    features = ids.map(lambda i: ({"id": i, "tokens": tf.range(i % 4)}, tf.cast(i, tf.float32)))
    return features.ragged_batch(BATCH).prefetch(2)


def _ids(pieces) -> list:
    """A global batch of `_pipeline`'s, read back from its replicas' pieces: its ids (each row's ragged tokens
    checked against its id)."""
    ids = np.concatenate([p[0]["id"].numpy() for p in pieces])
    assert [len(t) for p in pieces for t in p[0]["tokens"].to_list()] == [i % 4 for i in ids]
    return ids.tolist()


def _bytes(pieces) -> bytes:
    """Any global batch, read back from its replicas' pieces: the bytes of each component."""
    flat = [tf.nest.flatten(p) for p in pieces]
    return b"".join(tf.io.serialize_tensor(tf.concat([f[k] for f in flat], 0)).numpy() for k in range(len(flat[0])))


def _within(seconds: float, read):
    """`read()`'s result, or a failure if it has not returned within `seconds` (a reader waiting for ever:
    left behind in a daemon thread)."""
    import threading

    out = {}

    def run():
        try:
            out["value"] = read()
        except Exception as error:  # raised below, in the test's thread
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"the read did not return within {seconds} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _train(feed, steps: int, replicas: int, read, ahead: int = 2) -> list:
    """Trains up to `steps` global batches over `replicas` replicas (`read` each back from its pieces), then
    lets a strategy's prefetch pull `ahead` more: what it pulled must not be lost. A read that waits for
    ever fails the test (`_within`)."""
    def run():
        trained, share = [], iter(feed.replica_dataset(replicas, 0, replicas))
        for _ in range(steps):
            pieces = [next(share, None) for _ in range(replicas)]
            if pieces[0] is None:
                break
            trained.append(read(pieces))
            feed.trained(1)
        for _ in range(ahead * replicas):
            next(share, None)
        return trained

    return _within(120, run)


def _epochs(make_feed, epochs: int, plan, read=_ids) -> list:
    """Per epoch, the global batches trained; `plan`: (steps, replicas) of each round, each round a fresh feed
    (`make_feed()`: its pipeline built anew, as a restarted worker builds it) restored from the previous
    round's state."""
    state, epoch, out = b"", 0, [[] for _ in range(epochs)]
    for steps, replicas in plan:
        feed = make_feed()
        feed.restore(epoch, 0, state)
        while steps and epoch < epochs:
            got = _train(feed, steps, replicas, read)
            out[epoch] += got
            steps -= len(got)
            if feed.finished() or not got:
                feed.next_epoch()
                epoch += 1
        state = feed.state()
    return out


def _feed():
    return DatasetFeed(_pipeline())


def test_resizes_and_restarts_train_the_batches_of_a_run_without_faults_in_order():
    clean = _epochs(_feed, 3, [(100, 1)])
    assert [len(e) for e in clean] == [6, 6, 6] and clean[0] != clean[1]
    assert sorted(sum(clean[0], [])) == [i for i in range(EXAMPLES) if i % 5 != 2]
    assert _epochs(_feed, 3, [(2, 2), (3, 1), (1, 4), (5, 3), (100, 2)]) == clean
    for stop in range(1, 8):  # a commit at every position of the first epoch, its shuffle's end included
        assert _epochs(_feed, 3, [(stop, 1), (100, 3)]) == clean, stop


def test_a_dataset_of_known_length_says_its_steps():
    ids = tf.data.Dataset.range(20).map(lambda i: ({"id": i, "tokens": tf.range(i % 4)}, i))
    feed = DatasetFeed(ids.ragged_batch(4))
    feed.start(b"", 0)
    assert feed.steps() == 5 and feed.first_rows() == 4
    assert _train(feed, 2, 1, _ids, ahead=0) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert feed.steps() == 3 and feed.position() == 8


def test_workers_reading_one_stream_have_one_digest_and_a_seeded_other_order_another():
    one, two, other = DatasetFeed(_pipeline()), DatasetFeed(_pipeline()), DatasetFeed(_pipeline(seed=3))
    for feed in (one, two, other):
        feed.start(b"", 0)
    assert one.digest_ahead() == two.digest_ahead() != other.digest_ahead()


@pytest.mark.parametrize("pipeline", [
    lambda: tf.data.Dataset.from_generator(lambda: iter(range(8)), output_signature=tf.TensorSpec([], tf.int64)),
    lambda: tf.data.Dataset.range(8).map(lambda i: tf.py_function(lambda x: x, [i], tf.int64))])
def test_a_pipeline_tf_data_cannot_save_is_refused_in_one_line_naming_the_fix(pipeline):
    with pytest.raises(ConfigurationError, match=r"x: tf.data cannot save .*PyFunc.*from_generator") as error:
        DatasetFeed(pipeline().batch(4))
    assert "\n" not in str(error.value)


def test_a_nondeterministic_pipeline_and_a_position_of_another_pipeline_are_refused():
    options = tf.data.Options()
    options.deterministic = False
    ids = tf.data.Dataset.range(8)
    for unordered in (ids.batch(2).with_options(options),
                      ids.map(lambda i: i + 1, num_parallel_calls=2, deterministic=False).batch(2),
                      ids.interleave(lambda i: tf.data.Dataset.range(i), num_parallel_calls=2,
                                     deterministic=False).batch(2)):
        with pytest.raises(ConfigurationError, match=r"^x: .*no fixed order \(deterministic=False in [^)]+\)"):
            DatasetFeed(unordered)
    for repeated in (ids.batch(2).repeat(), ids.shuffle(8).repeat(2).batch(2)):
        with pytest.raises(ConfigurationError, match=r"^x: the tf.data pipeline repeats"):
            DatasetFeed(repeated)
    feed = DatasetFeed(_pipeline())
    feed.start(b"", 0)
    with pytest.raises(ConfigurationError, match="does not fit this tf.data pipeline"):
        DatasetFeed(tf.data.Dataset.range(8).batch(2)).start(feed.state(), 0)


class _Shuffled(keras.utils.PyDataset):
    """Ids in batches of 8 (the last of 4), reshuffled by a seeded generator at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.order, self.rng = np.arange(EXAMPLES), np.random.default_rng(5)

    @property
    def num_batches(self):
        return -(-EXAMPLES // BATCH)

    def __getitem__(self, index):
        ids = self.order[index * BATCH:(index + 1) * BATCH]
        return ids[:, None].astype(np.float32), ids

    def on_epoch_end(self):
        self.rng.shuffle(self.order)


def test_a_pydataset_resumes_at_its_batch_and_replays_its_seeded_reshuffles():
    make, ids = lambda: PyDatasetFeed(_Shuffled()), lambda pieces: np.concatenate([p[1] for p in pieces]).tolist()
    clean = _epochs(make, 3, [(100, 1)], ids)
    assert [len(e) for e in clean] == [8, 8, 8] and clean[0] != clean[1] and len(clean[0][-1]) == 4
    assert _epochs(make, 3, [(3, 2), (6, 1), (1, 4), (100, 3)], ids) == clean


class _InOrder(keras.utils.PyDataset):
    """Ids in batches of 8 (the last of 4), as a list `[x, y]` (Keras reads it as the tuple)."""

    @property
    def num_batches(self):
        return -(-EXAMPLES // BATCH)

    def __getitem__(self, index):
        ids = np.arange(index * BATCH, min(EXAMPLES, (index + 1) * BATCH))
        return [ids[:, None].astype(np.float32), ids]


def test_a_pydataset_reads_each_epochs_batches_in_a_seeded_order_of_its_own_as_model_fit_shuffles_them():
    """`model.fit(shuffle=True)`, its default, reads a PyDataset's batches in a new order each epoch: here one
    drawn from the seed and the epoch, the same through restarts and resizes; no seed, in order."""
    def firsts(epochs):
        return [[int(batch[0]) for batch in epoch] for epoch in epochs]

    ids = lambda pieces: np.concatenate([p[1] for p in pieces]).tolist()  # noqa: E731
    clean = _epochs(lambda: PyDatasetFeed(_InOrder(), shuffle_seed=3), 3, [(100, 1)], ids)
    orders = firsts(clean)
    assert all(sorted(order) == list(range(0, EXAMPLES, BATCH)) for order in orders)
    assert len({tuple(order) for order in orders}) == 3 and orders[0] != list(range(0, EXAMPLES, BATCH))
    assert sorted(sum(clean[1], [])) == list(range(EXAMPLES))  # every example once an epoch
    assert _epochs(lambda: PyDatasetFeed(_InOrder(), shuffle_seed=3), 3, [(3, 2), (6, 1), (1, 4), (100, 3)],
                   ids) == clean
    assert firsts(_epochs(lambda: PyDatasetFeed(_InOrder(), shuffle_seed=4), 1, [(100, 1)], ids)) != orders[:1]
    assert firsts(_epochs(lambda: PyDatasetFeed(_InOrder()), 2, [(100, 2)], ids)) == [
        list(range(0, EXAMPLES, BATCH))] * 2


def test_a_batch_of_fewer_rows_than_replicas_is_said_once_a_feed_naming_the_fix(caplog):
    """A short last batch at a large world leaves replicas with no row (BatchNormalization's statistics turn
    NaN there, as under plain MWMS): said once, in one line naming `drop_remainder`; batches of as many rows
    as replicas or more, nothing."""
    def said(make_feed, replicas):
        caplog.clear()
        with caplog.at_level("WARNING"):
            _epochs(make_feed, 2, [(100, replicas)], read=len)
        return [r.getMessage() for r in caplog.records if "replicas:" in r.getMessage()]

    tensors = lambda: DatasetFeed(tf.data.Dataset.range(EXAMPLES).batch(BATCH))  # noqa: E731 (a last batch of 4)
    assert said(tensors, 4) == [] and said(lambda: PyDatasetFeed(_InOrder()), 4) == []
    for make_feed in (tensors, lambda: PyDatasetFeed(_InOrder())):
        lines = said(make_feed, 5)
        assert len(lines) == 1 and "4 rows for 5 replicas: 1 of them" in lines[0] and "drop_remainder" in lines[0]


def _shapes(root):
    """Pipelines as users build them, each made anew for every round (a restarted worker builds its own)."""
    from tf_elastic.testing import data_files

    files = data_files.write_all(root)
    records = str(files["tfrecord"] / "train-*")

    def tfrecords():
        from tf_elastic.elastic.worker.data import default_parse

        parsed = tf.data.TFRecordDataset(tf.io.gfile.glob(records)).map(default_parse).shuffle(64)
        return parsed.filter(lambda image, label: label % 3 != 0).batch(BATCH)

    (x, y), test = data_files.digits()
    data_files.write_tfds(root / "tfds_records", "digits_records", (x[:400], y[:400]), test, file_format="tfrecord")

    def tfds_load():
        import tensorflow_datasets as tfds

        examples = tfds.load("digits_records", split="train", data_dir=str(root / "tfds_records"))
        return examples.map(lambda e: (e["image"], e["label"])).shuffle(100).batch(BATCH)

    def mixed():
        odd = tf.data.Dataset.range(1, 400, 2).shuffle(20)
        even = tf.data.Dataset.range(0, 200, 2).map(lambda i: i * 10)
        return tf.data.Dataset.sample_from_datasets([odd, even], weights=[0.7, 0.3]).batch(BATCH)

    return {"image_dataset_from_directory": lambda: keras.utils.image_dataset_from_directory(
                str(files["folder"] / "train"), image_size=(16, 16), batch_size=BATCH),  # shuffled, unseeded
            "TFRecordDataset, map, shuffle, filter, batch": tfrecords,
            "tfds.load": tfds_load,
            "sample_from_datasets": mixed}


@pytest.mark.parametrize("shape", ["image_dataset_from_directory", "TFRecordDataset, map, shuffle, filter, batch",
                                   "tfds.load", "sample_from_datasets"])
def test_pipelines_as_users_build_them_resume_exactly_through_resizes(tmp_path, shape):
    pipeline = _shapes(tmp_path)[shape]

    def make():
        keras.utils.set_random_seed(0)  # what elastic.run does before the script builds its pipeline
        return DatasetFeed(pipeline())

    clean = _epochs(make, 2, [(10_000, 1)], _bytes)
    assert len(clean[0]) > 4 and clean[0] != clean[1]  # a reshuffle
    assert _epochs(make, 2, [(3, 2), (2, 1), (5, 4), (10_000, 2)], _bytes) == clean


_MIX = """
import tensorflow as tf
from test_dataset_feed import _bytes, _epochs
from tf_elastic.elastic.worker.data.dataset_feed import DatasetFeed

def mixed():
    ranges = [tf.data.Dataset.range(first, first + 32) for first in (0, 100, 200)]
    return tf.data.Dataset.sample_from_datasets(ranges, weights=[0.4, 0.3, 0.3], seed=1).batch(16)

feed = lambda: DatasetFeed(mixed())
clean = _epochs(feed, 2, [(10_000, 1)], _bytes)
assert [len(e) for e in clean] == [6, 6], clean
for stop in range(1, 7):
    print(stop, flush=True)
    assert _epochs(feed, 2, [(stop, 1), (10_000, 2)], _bytes) == clean, stop
print("ok")
"""


def test_a_mix_of_datasets_resumes_from_every_position_of_a_pass():
    """TensorFlow restores `sample_from_datasets` wrongly: inputs that had run out count as active, and the
    read at the pass's end never returns (here from a commit after 4 of 6 batches). The feed replays the
    epoch instead. In a process of its own, with a time limit: a hung read never ends."""
    assert "ok" in run_python(_MIX, timeout=60).stdout


_ANCHOR = """
import tensorflow as tf
from test_dataset_feed import _bytes, _train
from tf_elastic.elastic.worker.data.dataset_feed import DatasetFeed

def mixed():  # `short` runs out at its 28th element, the 50th of 60; read ahead by the feed only
    short, long = tf.data.Dataset.range(0, 28), tf.data.Dataset.range(100, 132)
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    mix = tf.data.Dataset.sample_from_datasets([short, long], weights=[0.5, 0.5], seed=3)
    return mix.batch(4).with_options(options)

def run(commits):
    state, trained, replayed = b"", [], []
    for steps in commits:
        feed = DatasetFeed(mixed())
        feed.restore(0, 0, state)
        replayed.append(feed.replayed)
        trained += _train(feed, steps, 2, _bytes)
        state = feed.state()
    return trained, replayed

clean, _ = run([100])
assert len(clean) == 15
every, replayed = run([1] * 16)
assert every == clean and replayed[:9] == [0] * 9 and max(replayed) <= 4, replayed
late, replayed = run([3, 8, 100])  # the commit at 11 (14 read) holds `short` run out: from the one at 3 (6 read)
assert late == clean and replayed == [0, 0, 8], replayed
print("ok")
"""


def test_a_mix_restores_from_its_last_commit_before_an_input_ran_out_not_from_its_pass_start():
    """Before any input of a mix ran out TensorFlow restores it exactly: nothing is read again. After, a
    restore reads again only the batches since the last commit before it ran out (a replay from the
    pass's start read up to 16 here, a commit at every batch; 14 for the commit at 11)."""
    assert "ok" in run_python(_ANCHOR, timeout=90).stdout


def test_only_a_mix_that_reads_every_input_to_its_end_counts_as_draining_them():
    """Where every mix drains its inputs, an error one of them read ahead is refused in a commit
    (`iterator_state.held_error`); a mix that may end first, or one the Python objects do not show, not."""
    a, b = tf.data.Dataset.range(3), tf.data.Dataset.range(10, 20)

    def sample(**options):
        return tf.data.Dataset.sample_from_datasets([a, b], seed=1, **options)

    def drains(dataset) -> bool:
        return DatasetFeed(dataset)._mixes_drain

    assert drains(a.batch(2)) and drains(sample().batch(2).prefetch(1))
    assert drains(tf.data.Dataset.sample_from_datasets([sample(), b], seed=2))
    assert not drains(sample(stop_on_empty_dataset=True))
    choices = tf.data.Dataset.from_tensor_slices(tf.constant([0, 1, 1, 0], tf.int64))  # ends after four
    assert not drains(tf.data.Dataset.choose_from_datasets([a, b], choices, stop_on_empty_dataset=False))
    assert not drains(tf.data.Dataset.range(2).interleave(lambda i: sample(), deterministic=True))


def test_the_chief_of_four_or_more_workers_says_what_reading_the_whole_pipeline_costs(caplog):
    for size, rank, said in [(4, 0, True), (4, 1, False), (2, 0, False)]:
        caplog.clear()
        DatasetFeed(tf.data.Dataset.range(8).batch(4), size, rank)
        assert ("4 times the input work of a sharded read" in caplog.text) == said, (size, rank)


def test_a_restore_while_a_reader_pulls_keeps_no_batch_of_the_iterator_before_it():
    """The reader's thread is inside the pipeline (0.4 s a batch) when the feed is restored to a commit:
    the batch it was making belongs to the old iterator and must not be trained after the restore."""
    import time

    from tensorflow.python.data.experimental.ops import testing

    feed = DatasetFeed(tf.data.Dataset.range(6).apply(testing.sleep(400_000)).batch(1))
    feed.restore(0, 0, b"")
    committed = feed.state()
    reader = iter(feed.replica_dataset(1, 0, 1))
    assert int(_within(30, lambda: next(reader))[0]) == 0
    feed.trained(1)
    time.sleep(0.1)  # the reader's thread pulls the batches after it
    feed.restore(0, 0, committed)
    assert _train(feed, 100, 1, lambda pieces: int(pieces[0][0])) == list(range(6))


def _reader_threads() -> set:
    import threading

    return {t for t in threading.enumerate() if t.name.startswith("dataset-feed-reader-")}


def test_each_reader_has_a_thread_of_its_own_that_ends_when_a_newer_one_opens_or_the_feed_closes():
    """Two iterators of one dataset, as Keras makes them (one to build the model, then the epoch's): the
    second starts at the untrained batch; the first, superseded, fails when read instead of waiting. A
    reader of a dataset made before `close` gets no thread."""
    before = _reader_threads()
    feed = _feed()
    feed.start(b"", 0)
    dataset = feed.replica_dataset(1, 0, 1)
    dropped = iter(dataset)
    first = _within(30, lambda: _ids([next(dropped)]))  # read for a model build, never trained
    (opened,) = _reader_threads() - before
    reader = iter(dataset)
    assert _within(30, lambda: _ids([next(reader)])) == first  # the untrained batch again, first
    opened.join(30)
    assert not opened.is_alive()
    with pytest.raises(tf.errors.OpError):
        _within(30, lambda: [next(dropped) for _ in range(10)])
    feed.trained(1)
    (current,) = _reader_threads() - before
    feed.close()
    current.join(30)
    assert not _reader_threads() - before
    with pytest.raises(tf.errors.OpError):
        _within(30, lambda: next(iter(dataset)))
    assert not _reader_threads() - before


def test_a_call_of_several_steps_reads_them_all_before_its_end_and_an_error_reaches_the_reader():
    """`steps_per_call` global batches are handed before any is trained (one call of a multi-step training
    function reads them all first); an error of the user's pipeline is raised where the reader reads, is
    the feed's `failure`, and no state is saved after it (the iterator is past the rows of the failed
    read: a restart from it would skip them)."""
    feed = _feed()
    feed.start(b"", 0)
    reader = iter(feed.replica_dataset(1, 0, 1, steps_per_call=5))
    assert len(_within(20, lambda: [_ids([next(reader)]) for _ in range(5)])) == 5

    def checked(i):
        with tf.control_dependencies([tf.debugging.assert_less(i, tf.constant(10, tf.int64), message="bad id")]):
            return tf.identity(i)

    failing = DatasetFeed(tf.data.Dataset.range(20).map(checked).batch(4))
    failing.start(b"", 0)
    reader = iter(failing.replica_dataset(1, 0, 1))

    def read_all():
        for _ in reader:
            failing.trained(1)

    with pytest.raises(tf.errors.OpError, match="bad id"):
        _within(20, read_all)
    assert isinstance(failing.failure, tf.errors.InvalidArgumentError) and "bad id" in failing.failure.message
    with pytest.raises(tf.errors.InvalidArgumentError, match="bad id"):
        failing.state()


def test_the_step_waits_for_a_pipeline_slower_than_it_and_never_for_a_quicker_one():
    """What the straggler probe reports besides compute (`take_input_wait`): a pipeline that sleeps 30 ms a
    batch under a step that takes none makes the step wait most of the time; a quick pipeline under a step
    of 30 ms is read ahead, and the step never waits. (Shares of the time read, not seconds: a loaded
    machine slows the reading loop too.)"""
    import time

    from tensorflow.python.data.experimental.ops import testing

    def share_waited(feed, steps, step_seconds):
        def run():
            share = iter(feed.replica_dataset(1, 0, 1))
            next(share)  # a reader's first batch is not counted
            feed.trained(1)
            feed.take_input_wait()
            began = time.monotonic()
            for _ in range(steps):
                next(share)
                time.sleep(step_seconds)
                feed.trained(1)
            return feed.take_input_wait() / (time.monotonic() - began)
        return _within(60, run)

    slow = DatasetFeed(tf.data.Dataset.range(12).apply(testing.sleep(30000)).batch(1))
    slow.start(b"", 0)
    assert share_waited(slow, 10, 0.0) > 0.5
    quick = DatasetFeed(tf.data.Dataset.range(12).batch(1))
    quick.start(b"", 0)
    assert share_waited(quick, 10, 0.03) < 0.1 and quick.take_input_wait() == 0.0
