"""`worker/data/ready_times.py`: how long the step waited for batches that tf.data reads inside the step (a
`Source`'s, a PyDataset's), through the feeds' `take_input_wait`, on a real strategy's distributed dataset;
and how fast each feed's input reads alone (`time_input`, `data/feed.py`'s `seconds_per_step`), what an input
straggler's eviction is weighed by."""
import math
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.data.experimental.ops import testing
from tensorflow.python.distribute import input_lib

from tf_elastic.elastic.worker import data
from tf_elastic.elastic.worker.data import feed
from tf_elastic.elastic.worker.data.dataset_feed import DatasetFeed
from tf_elastic.elastic.worker.data.planned_feed import PlannedFeed
from tf_elastic.elastic.worker.data.pydataset_feed import PyDatasetFeed
from tf_elastic.elastic.worker.world import World

EXAMPLES = 24


class _SlowReads(data.ArraySource):
    """Arrays read at one example every 30 ms, as from a slow disk (the read stage, before any parallel map)."""

    def examples(self, indices):
        return super().examples(indices).apply(testing.sleep(30000))


class _Batches(keras.utils.PyDataset):
    """Batches of 2 examples, each batch read in `seconds` (as from a slow service)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    @property
    def num_batches(self):
        return EXAMPLES // 2

    def __getitem__(self, index):
        time.sleep(self.seconds)
        return np.full((2, 1), index, np.float32), np.zeros(2, np.int64)


def _share_waited(feed, strategy, step_seconds: float) -> float:
    """Steps of `step_seconds` over one epoch of `feed`; the share of the time after its first step that the
    steps waited for their batches."""
    batches = iter(feed.distributed(strategy))
    next(batches)  # a pipeline's first call is not counted: it waits for the pipeline's start
    feed.trained(1, 1)
    feed.take_input_wait()
    began = time.time()
    for step in range(2, feed.steps() + 1):
        next(batches)
        time.sleep(step_seconds)
        feed.trained(1, step)
    return feed.take_input_wait() / (time.time() - began)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_step_waits_for_a_source_slower_than_it_and_never_for_a_quicker_one(replicas, two_cpu_strategy):
    """A source read at 30 ms an example under steps that take none: the steps wait most of the time (at
    two local replicas a step reads two elements and waits for the second: counting the first would halve
    it); the same arrays read at once under steps of 30 ms: read ahead, never waited for. (Shares of the
    time, not seconds: a loaded machine slows the steps too.)"""
    x, y = np.arange(EXAMPLES, dtype=np.float32).reshape(-1, 1), np.zeros(EXAMPLES, np.int64)
    strategy = two_cpu_strategy if replicas == 2 else tf.distribute.OneDeviceStrategy("/cpu:0")
    slow = PlannedFeed(_SlowReads(x, y), None, World(), worker_batch=2, seed=0)
    slow.begin(0, 0)
    assert _share_waited(slow, strategy, 0.0) > 0.5  # nearly 1 alone; 0.73 once under the suite's load
    quick = PlannedFeed(data.ArraySource(x, y), None, World(), worker_batch=2, seed=0)
    quick.begin(0, 0)
    assert _share_waited(quick, strategy, 0.03) < 0.1 and quick.take_input_wait() == 0.0


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_step_waits_for_a_pydataset_slower_than_it_and_never_for_a_quicker_one(replicas, two_cpu_strategy):
    """The same for a PyDataset whose batches take 60 ms to read, against one read at once under steps of
    30 ms (every replica's share of a step comes from one batch read)."""
    strategy = two_cpu_strategy if replicas == 2 else tf.distribute.OneDeviceStrategy("/cpu:0")
    assert _share_waited(PyDatasetFeed(_Batches(0.06)), strategy, 0.0) > 0.5  # as above
    quick = PyDatasetFeed(_Batches(0.0))
    assert _share_waited(quick, strategy, 0.03) < 0.1 and quick.take_input_wait() == 0.0


def test_a_feed_whose_waits_no_probe_reads_stamps_nothing(two_cpu_strategy):
    """Alone, or with the probe off (`World.probes_stragglers`), the feeds stamp nothing: a slow source's waits
    are not measured."""
    x, y = np.arange(EXAMPLES, dtype=np.float32).reshape(-1, 1), np.zeros(EXAMPLES, np.int64)
    off = PlannedFeed(_SlowReads(x, y), None, World(), worker_batch=2, seed=0, measure_waits=False)
    off.begin(0, 0)
    assert _share_waited(off, two_cpu_strategy, 0.0) == 0.0
    assert not World(size=1).probes_stragglers and not World(size=2, probe="0,0.05,1.5,3,1").probes_stragglers
    assert World(size=2).probes_stragglers


def test_an_epochs_first_step_waits_from_the_epochs_begin_except_in_a_rounds_first_epoch():
    """Each epoch's pipeline is new; its first element, ready 50 ms after the epoch began, was waited for
    (its iterator's start, a run's first read), except in the round's first epoch, whose first call traces
    the step too."""
    from tf_elastic.elastic.worker.data.ready_times import ReadyTimes

    ready, waited = ReadyTimes(), []
    for _ in range(2):
        elements = iter(ready.stamp(tf.data.Dataset.range(4)))
        ready.epoch_begins()
        time.sleep(0.05)
        next(elements)  # made now: the stamp is no prefetch's
        ready.called(0)
        next(elements)
        ready.called(1)  # ready before this call's step asked: no wait
        waited.append(ready.take())
    assert waited[0] < 0.01 and 0.04 < waited[1] < 5.0, waited  # the first: element 1's microseconds at most


def test_a_pipelines_new_epoch_waits_for_its_first_batch_from_the_epochs_begin(two_cpu_strategy):
    """A user's pipeline of 50 ms a batch: a new epoch's reader waits for its first batch from the epoch's
    begin; the round's first epoch does not count it (its first step traces too)."""
    feed = DatasetFeed(tf.data.Dataset.range(16).batch(2).apply(testing.sleep(50000)))
    feed.restore(0, 0, b"")
    waits = []
    try:
        for _ in range(2):
            feed.epoch_begins()
            steps = iter(feed.distributed(two_cpu_strategy))
            next(steps)
            feed.trained(1)
            waits.append(feed.take_input_wait())
            feed.next_epoch()
    finally:
        feed.close()
    assert waits[0] < 0.01 and waits[1] >= 0.05, waits  # timing-ok: a sleep's lower bound


def test_a_wait_far_behind_the_newest_element_is_looked_up_not_lost():
    """A probe interval of more than SLOTS // 2 elements: the oldest waits are looked up at once (before a newer
    element could take their ring slot), not dropped while their time still counts."""
    from tf_elastic.elastic.worker.data.ready_times import SLOTS, ReadyTimes

    ready = ReadyTimes()
    elements = iter(ready.stamp(tf.data.Dataset.range(4)))
    ready.called(0)  # a pipeline's first call: not counted; the next call's wait counts from its end
    time.sleep(0.05)
    list(elements)  # every element becomes ready 50 ms after that end
    ready.called(1)
    ready.called(SLOTS // 2 + 2)  # far ahead (its own element never stamped: no wait of it counts)
    assert 0.04 < ready.take() < 5.0


def _arrays():
    return np.arange(EXAMPLES, dtype=np.float32).reshape(-1, 1), np.zeros(EXAMPLES, np.int64)


def _planned(source_class, strategy):
    feed = PlannedFeed(source_class(*_arrays()), None, World(), worker_batch=2, seed=0)
    feed.begin(0, 0)
    feed.distributed(strategy)  # two local replicas: a step reads two elements of one example
    return feed


def _dataset(per_batch_us: int):
    """A pipeline of 5000 batches, `per_batch_us` each: a read alone of 0.2 s does not reach its end (a copy
    that ran out times nothing)."""
    return DatasetFeed(tf.data.Dataset.range(10000).batch(2).apply(testing.sleep(per_batch_us)))


@pytest.mark.parametrize("kind", ["source", "dataset"])
def test_a_feeds_input_read_alone_says_how_slow_it_is_and_moves_nothing_the_steps_read(kind, two_cpu_strategy):
    """A feed's input read alone by a side pipeline: a source read at 30 ms an example reads a step of two in
    60 ms or more, a tf.data pipeline of 60 ms a batch a step in 60 ms or more, and the same read at once in
    less; the batch the steps read next is the same after it (the feed's digest of it, or its position and
    first batch). A PyDataset is not read alone (its `__getitem__` may draw from shared state)."""
    make = {"source": lambda slow: _planned(_SlowReads if slow else data.ArraySource, two_cpu_strategy),
            "dataset": lambda slow: _dataset(60000 if slow else 100)}[kind]
    seconds = {}
    for slow in (True, False):
        feed = make(slow)
        if kind == "dataset":
            feed.restore(0, 0, b"")
        before = feed.position() if kind == "source" else feed.identity()
        seconds[slow] = feed.time_input(0.2)
        assert (feed.position() if kind == "source" else feed.identity()) == before
    # The sleeps bound the slow reads from below: what is tested is that the read alone sees them.
    assert seconds[True] >= 0.06 and 0 < seconds[False] < seconds[True], seconds  # timing-ok: sleeps bound it
    if kind == "source":
        first = next(iter(feed.distributed(two_cpu_strategy)))
        assert sorted(float(t.numpy()[0, 0]) for t in two_cpu_strategy.experimental_local_results(first[0])) == \
            sorted(float(i) for i in feed.batches[0])
    assert PyDatasetFeed(_Batches(0.0)).time_input(0.2) == 0.0


def test_a_read_alone_of_a_reshuffled_pipeline_leaves_the_next_epochs_order_as_a_worker_that_did_not_read():
    """A fresh iterator of a pipeline that reshuffles each epoch draws the next epoch's seeds: a rank that read
    its input alone must still train the order of one that did not (the straggler's ranks never read)."""
    def feed():
        made = DatasetFeed(tf.data.Dataset.range(4000).shuffle(4000, seed=7).batch(4).apply(testing.sleep(1000)))
        made.restore(0, 0, b"")  # reads the first batch: the shuffle's input ran out, a copy is read
        return made

    read, twin = feed(), feed()
    assert read.time_input(0.05) > 0
    for made in (read, twin):
        made.start(b"", 1)  # the next epoch, as `next_epoch` starts it
    assert read.identity() == twin.identity() and read.identity()[0] != 0


def test_a_pipelines_read_alone_reads_on_from_where_its_pump_stands_not_from_the_pass_start(two_cpu_strategy):
    """A pipeline slow for its first 10 batches (60 ms each), then quick: once the steps trained past them, the
    read alone reads the batches not read yet (a copy of the iterator, its buffers with it), quick; a fresh
    pass would read the slow start (and, on a real disk, pages the steps had just read). The next batch the
    steps train is the same after it."""
    slow = tf.data.Dataset.range(20).batch(2).apply(testing.sleep(60000))
    feed = DatasetFeed(slow.concatenate(tf.data.Dataset.range(20, 4000).batch(2)))
    feed.restore(0, 0, b"")
    assert feed.time_input(0.2) >= 0.06  # timing-ok: a sleep's lower bound (nothing trained: the slow start)
    steps = iter(feed.distributed(two_cpu_strategy))
    for _ in range(10):
        next(steps)
        feed.trained(1)
    before = feed.identity()
    try:
        assert feed.time_input(0.2) < 0.03  # timing-ok: the quick batches against a 60 ms sleep each
        assert feed.identity() == before and before[0] != 0
    finally:
        feed.close()


def test_a_probations_reads_alone_go_on_from_where_the_last_one_stopped_and_start_again_at_the_end():
    """A probation's worker (no pump) is asked to read alone again and again: a pipeline slow for its first 5
    batches (60 ms each), then quick, reads slow once and quick after (a fresh pass each time would read the
    slow start again, on a real disk from the pages the last read left in the cache); once the pass ran out
    the next read is a new pass, slow again."""
    slow = tf.data.Dataset.range(10).batch(2).apply(testing.sleep(60000))
    feed = DatasetFeed(slow.concatenate(tf.data.Dataset.range(10, 8000).batch(2)))
    assert feed.time_input(0.2) >= 0.05  # timing-ok: a sleep's lower bound (the slow start)
    assert feed.time_input(0.2) < 0.03  # timing-ok: the quick batches against a 60 ms sleep each
    reads = [0.0]
    while reads[-1] < 0.03 and len(reads) < 50:  # timing-ok: quick until the pass ran out...
        reads.append(feed.time_input(0.2))
    assert reads[-1] >= 0.05, reads  # timing-ok: ...then the slow start of a new pass


def test_a_probations_read_that_finds_its_pass_ended_reads_a_new_one_at_once():
    """Slow batches (60 ms each): the first read takes five (it stops 0.2 s after its first); the next finds
    one left and the pass's end, too few to time (0 would let the host rejoin unjudged), or, with a prefetch
    that filled between the reads, three made ahead (timed quick): either way it reads a new pass at once,
    slow."""
    for dataset in (tf.data.Dataset.range(12).batch(2).apply(testing.sleep(60000)),
                    tf.data.Dataset.range(16).batch(2).apply(testing.sleep(60000)).prefetch(8)):
        feed = DatasetFeed(dataset)
        assert feed.time_input(0.2) >= 0.05  # timing-ok: a sleep's lower bound
        time.sleep(0.5)  # the interval between timings: a prefetch fills
        assert feed.time_input(0.2) >= 0.05  # timing-ok: the new pass's, not 0 or the buffers'


def test_a_pipeline_with_a_cache_or_at_its_passs_end_is_not_read_alone(tmp_path):
    """A `cache` is shared by every iterator of the pipeline (a second one beside the pump's would take its
    file's lock, or reset its memory): not read. A copy that runs out before its time read the pass's last
    batches from its buffers: it times nothing. Neither moves the next batch the steps train."""
    for dataset in (tf.data.Dataset.range(400).cache().batch(2),
                    tf.data.Dataset.range(400).cache(str(tmp_path / "cache")).batch(2),
                    tf.data.Dataset.range(20).batch(2)):
        feed = DatasetFeed(dataset)
        feed.restore(0, 0, b"")
        before = feed.identity()
        assert feed.time_input(0.2) == 0.0 and feed.identity() == before


def test_a_read_alone_is_timed_in_its_steady_state_and_one_that_fails_or_hangs_times_nothing():
    """What the pipeline buffered while its first element was made comes out at once: a read timed over the
    second half of its time only sees the 0.2 s an element the source then takes (16 buffered ones counted
    would say 0.03 s). A read that fails times nothing; one that has not ended at the limit is too slow."""
    def buffered_then_slow():
        time.sleep(0.3)
        yield from range(17)
        while True:
            time.sleep(0.2)
            yield 0

    assert data.feed.seconds_per_step(buffered_then_slow(), 1, 0.5) >= 0.2  # timing-ok: a sleep's lower bound

    def failing():
        yield 0
        raise OSError("the disk went away")

    def hanging():
        yield 0
        time.sleep(2.0)
        yield 0

    assert data.feed.seconds_per_step(failing(), 1, 0.1) == 0.0
    assert data.feed.seconds_per_step(hanging(), 1, 0.1, limit=0.3) == math.inf  # too slow to time
    assert data.feed.seconds_per_step(iter([1]), 1, 0.1) == 0.0  # only the first element, which starts the read
    assert data.feed.seconds_per_step(iter(range(3)), 4, 0.0) == 0.0  # two of a step of four


def test_a_planned_epochs_fit_opens_one_iterator_and_reads_its_batches_once(monkeypatch):
    """`feed.to_replicas`: where Keras knows a dataset's length and it equals the steps, `model.fit` opens the
    next epoch's iterator as its epoch ends, for an epoch a call of one epoch never trains: with several
    workers (a MultiDeviceIterator, whose prefetch starts at once) it read ahead and instantiated the
    pipeline's functions again. Two iterators a call before."""
    reads, opened = [], []
    open_iterator = input_lib.DistributedDatasetsFromFunction.__iter__
    monkeypatch.setattr(input_lib.DistributedDatasetsFromFunction, "__iter__",
                        lambda dataset: opened.append(1) or open_iterator(dataset))

    def batched(batch):
        def note(i):
            reads.append(int(i))
            return i
        ids = tf.data.Dataset.range(EXAMPLES).map(lambda i: tf.ensure_shape(tf.py_function(note, [i], tf.int64), []))
        ids = ids.apply(tf.data.experimental.assert_cardinality(EXAMPLES))
        pairs = ids.map(lambda i: (tf.fill([1], tf.cast(i, tf.float32)), tf.cast(i, tf.float32)))
        return pairs.batch(batch).prefetch(2)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    # As with several workers (`keras_compat` builds from the element spec), no build opens an iterator.
    model._maybe_symbolic_build = lambda iterator=None, data_batch=None: None
    steps = EXAMPLES // 4
    for _ in range(2):
        model.fit(feed.to_replicas(strategy, 1, 4, batched), steps_per_epoch=steps, epochs=1, verbose=0)
    time.sleep(0.5)  # a dropped iterator's reads end
    assert len(opened) == 2, "an iterator for an epoch no call trains"
    assert len(reads) == 2 * EXAMPLES and int(model.optimizer.iterations.numpy()) == 2 * steps
