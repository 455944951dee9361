"""Input pipeline benchmark: the elastic data sources against plain tf.data, memory, and restart cost.

    python -m launch.bench.bench_input                        # the table below, data generated in a temp dir
    python -m launch.bench.bench_input --sizes=20000,200000   # worker peak RSS at two folder sizes

1. examples/s of `data.pipeline` (plan indices -> read -> decode -> preprocess -> batch -> prefetch) against a
   plain pipeline over the same files with the same decode (list_files / interleave / map / batch / prefetch),
   from making the pipeline and from its first batch on (start-up is a fixed cost: tracing, the first run),
   stamped as `elastic.fit` reads it (`ReadyTimes`: each batch's ready time, for the step's wait for input),
   and the stamp's cost (against the same pipeline unstamped);
2. peak resident memory of a `launch.train` worker on generated image folders of two sizes (same steps);
3. time from a restart to the first batch at a mid-epoch position, for each source kind (TFRecords with
   and without the index cache of an earlier start);
4. a user's own tf.data pipeline (TFRecord + parse + shuffle + batch): steps/s (of the second epoch, from its
   first step's end on; its first step's seconds apart, where a new pass starts) under `elastic.fit` (every
   worker reads the whole pipeline; commits at the epochs' ends, and again with one every
   `--commit_every_steps`: an epoch here is under a second, so that cadence is a commit every ~0.3 s) against
   plain MultiWorkerMirroredStrategy `model.fit` sharded by DATA and by FILE, and the same records as a
   `TFRecordSource` under `elastic.fit` (each worker reads only its share, by index), at 1, 2 and 4 workers
   (`pipeline_worker.py`, TF_CONFIG on loopback); and the committed position (`DatasetFeed.state`) with
   shuffle buffers of 1k and 10k images: its bytes against the buffer's, the time to make it, a restart's time
   from the state to its first batch, and its transfer to a joiner (2 workers on loopback); and a restart
   three quarters of a pass in, of the pipeline alone and of two copies mixed by `sample_from_datasets`,
   restored from the state, and of a mix whose input ran out before the commit, read forward from the last
   commit before that (TensorFlow 2.21 restores such a mix wrongly).
"""
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from tf_elastic.testing.local_job import repo_env  # noqa: E402

flags.DEFINE_integer("examples", 20000, "Images in the throughput folder and TFRecords: a pass of ~1 s here, "
                     "so that start-up (paid once an epoch; in its own column) weighs as in a short epoch, "
                     "not as in a pass of a few hundred ms.", lower_bound=100)
flags.DEFINE_integer("image_size", 32, "Side of the generated JPEG images.", lower_bound=8)
flags.DEFINE_integer("batch_size", 64, "Batch size of both pipelines.", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "Passes per pipeline; the best counts.", lower_bound=1)
flags.DEFINE_list("sizes", ["20000", "200000"], "Folder sizes for the worker's peak memory (none: skip it).")
flags.DEFINE_list("pipeline_workers", ["1", "2", "4"], "World sizes of the tf.data comparison (none: skip).")
flags.DEFINE_integer("pipeline_examples", 6000, "Images of the tf.data comparison's TFRecords.", lower_bound=640)
flags.DEFINE_integer("pipeline_repeats", 3, "Runs of each (workers, method) of the comparison, taking turns; the "
                     "best and the median count.", lower_bound=1)
flags.DEFINE_integer("commit_every_steps", 50, "elastic.fit's commits besides the epochs' ends, every this many steps, "
                     "in the comparison's second elastic.fit column (the first commits at the epochs' ends only, "
                     "plain model.fit never): what commits cost at that cadence. 0: none.", lower_bound=0)
flags.DEFINE_list("shuffle_buffers", ["1000", "10000"], "Shuffle buffers whose committed state is measured.")
flags.DEFINE_string("work_dir", None, "Where to generate data (default: a temp dir, removed after).")
FLAGS = flags.FLAGS
# The restart section resumes half an epoch in at 2 workers: each must still have a whole batch to read.
flags.register_multi_flags_validator(
    ["examples", "batch_size"], lambda f: f["examples"] >= 4 * f["batch_size"],
    message="--examples must be at least 4 x --batch_size (half an epoch, split over 2 workers, is a batch each)")


def _images(count: int, size: int) -> List[bytes]:
    """`count` distinct-enough JPEGs: 64 noise images, reused (decode cost is what matters)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    encoded = [tf.io.encode_jpeg(rng.integers(0, 255, (size, size, 3), np.uint8)).numpy() for _ in range(64)]
    return [encoded[n % 64] for n in range(count)]


def write_folder(root: Path, count: int, size: int, classes: int = 10) -> None:
    images = _images(count, size)
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    for n, image in enumerate(images):
        (root / f"class_{n % classes:03d}" / f"{n:07d}.jpg").write_bytes(image)


def write_tfrecords(directory: Path, count: int, size: int, shards: int = 8) -> None:
    import tensorflow as tf

    from tf_elastic.testing.data_files import example

    directory.mkdir(parents=True, exist_ok=True)
    images = _images(count, size)
    per = -(-count // shards)
    for shard in range(shards):
        with tf.io.TFRecordWriter(str(directory / f"train-{shard:05d}-of-{shards:05d}")) as writer:
            for n in range(shard * per, min(count, (shard + 1) * per)):
                writer.write(example(images[n], n % 10 + 1))


def _rates(makers: List[Callable], count: int) -> List[Tuple[float, float, float]]:
    """Each pipeline's best examples/s over the passes: from making it (start-up included), and from its
    first batch on (the steady rate: a training epoch is far longer than this benchmark's few hundred ms);
    and its best start-up (making it to its first batch, seconds). The pipelines take turns, so a change
    in the machine's load hits each alike."""
    best = [[0.0, 0.0, float("inf")] for _ in makers]
    for _ in range(FLAGS.repeats):
        for make, rates in zip(makers, best):
            started = time.perf_counter()
            batches = iter(make())
            first = int(next(batches)[0].shape[0])
            running = time.perf_counter()
            rest = sum(int(x.shape[0]) for x, _ in batches)
            ended = time.perf_counter()
            del batches  # its threads stop here, not inside the next pipeline's timing
            assert first + rest >= count - FLAGS.batch_size, (first + rest, count)
            rates[:] = (max(rates[0], (first + rest) / (ended - started)), max(rates[1], rest / (ended - running)),
                        min(rates[2], running - started))
    return [tuple(rates) for rates in best]


def throughput(root: Path) -> List[tuple]:
    import tensorflow as tf

    from tf_elastic.elastic.worker import data
    from tf_elastic.elastic.worker.data import preprocess
    from tf_elastic.elastic.worker.data.ready_times import ReadyTimes
    from tf_elastic.elastic.worker.data_plan import DataPlan

    size, batch, auto = FLAGS.image_size, FLAGS.batch_size, tf.data.AUTOTUNE
    prep = preprocess.simple(size)
    decode = lambda contents: tf.io.decode_image(contents, channels=3, expand_animations=False)  # noqa: E731

    def plain_folder():
        files = tf.data.Dataset.list_files(str(root / "folder" / "*" / "*"), shuffle=False)

        def load(path):
            label = tf.strings.to_number(tf.strings.substr(tf.strings.split(path, os.sep)[-2], 6, 3), tf.int32)
            return prep(decode(tf.io.read_file(path)), label, None)

        return files.map(load, num_parallel_calls=auto).batch(batch).prefetch(auto)

    def plain_tfrecord():
        files = tf.data.Dataset.list_files(str(root / "tfrecord" / "train-*"), shuffle=False)
        records = files.interleave(tf.data.TFRecordDataset, cycle_length=8, num_parallel_calls=auto)

        def load(record):
            encoded, label = data.default_parse(record)
            return prep(decode(encoded), label, None)

        return records.map(load, num_parallel_calls=auto).batch(batch).prefetch(auto)

    rows = []
    for kind, source, plain in (
            ("image folder", data.ImageFolder(str(root / "folder")), plain_folder),
            ("TFRecord", data.TFRecordSource(str(root / "tfrecord" / "train-*")), plain_tfrecord)):
        order = DataPlan(source.num_examples, 0, lambda e: source.epoch_order(0, e)).permutation(0)  # as fit
        # As `elastic.fit` reads a source: each batch's ready time stamped (the step's wait for input).
        elastic = lambda: data.pipeline(source, order, batch, preprocess=prep, stamp=ReadyTimes().stamp)  # noqa: E731
        unstamped = lambda: data.pipeline(source, order, batch, preprocess=prep)  # noqa: E731
        rows.append((kind, *_rates([elastic, plain, unstamped], source.num_examples)))
    return rows


def peak_rss(root: Path, count: int) -> float:
    """Peak RSS (MiB) of one `launch.train` worker training 50 steps on a folder of `count` images."""
    folder = root / f"rss{count}"
    write_folder(folder / "train", count, 8)
    write_folder(folder / "validation", 100, 8)
    proc = subprocess.Popen([sys.executable, "-m", "launch.train", f"--dataset=folder:{folder}",
                             "--image_size=8", "--train_examples=1600", "--epochs=1", "--optimizer=sgd", "--threads=2",
                             f"--run_dir={folder / 'run'}"], env=repo_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise RuntimeError(f"the worker on {count} images failed: {proc.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1024


def restart_to_first_batch(root: Path, files: dict) -> List[tuple]:
    """Seconds from making the source (as a restarted worker does) to its first batch, half an epoch in.
    TFRecords: without the index cache, then with one that an earlier start filled."""
    import numpy as np

    from tf_elastic.elastic.worker import data
    from tf_elastic.elastic.worker.data import preprocess
    from tf_elastic.elastic.worker.data_plan import DataPlan
    from tf_elastic.testing import data_files

    (x, y), _ = data_files.digits()
    makers = {"arrays": lambda: data.ArraySource(x, y),
              "image folder": lambda: data.ImageFolder(str(root / "folder")),
              "TFRecord": lambda: data.TFRecordSource(str(root / "tfrecord" / "train-*")),
              "TFRecord, index cached": lambda: data.TFRecordSource(str(root / "tfrecord" / "train-*"),
                                                                   cache_dir=str(root / "index_cache")),
              "TFDS": lambda: data.TFDSSource("digits_files", "train", str(files["tfds"]))}
    makers["TFRecord, index cached"]().num_classes  # the earlier start: fills the cache
    rows = []
    for kind, make in makers.items():
        started = time.perf_counter()
        source = make()
        plan = DataPlan(source.num_examples, 0, lambda e: source.epoch_order(0, e))
        batches = plan.replica_batches(0, source.num_examples // 2, 2, 1, FLAGS.batch_size)
        dataset = data.pipeline(source, np.concatenate(batches), FLAGS.batch_size,
                                preprocess=preprocess.simple(FLAGS.image_size))
        next(iter(dataset))
        rows.append((kind, source.num_examples, time.perf_counter() - started))
    return rows


def user_pipeline(records: str, batch: int, shuffle: int, size: int, auto_shard: str = ""):
    """A user's own pipeline: TFRecord shards interleaved, parsed and decoded, shuffled, batched, prefetched."""
    import tensorflow as tf

    from tf_elastic.elastic.worker import data

    files = tf.data.Dataset.list_files(records, shuffle=False)
    examples = files.interleave(tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE,
                                deterministic=True)

    def parse(record):
        encoded, label = data.default_parse(record)
        image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
        image.set_shape([size, size, 3])
        return tf.cast(image, tf.float32) / 255.0, label - 1

    dataset = examples.map(parse, num_parallel_calls=tf.data.AUTOTUNE).shuffle(shuffle, seed=1)
    dataset = dataset.batch(batch).prefetch(tf.data.AUTOTUNE)
    if auto_shard:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = getattr(tf.data.experimental.AutoShardPolicy,
                                                                    auto_shard)
        dataset = dataset.with_options(options)
    return dataset


def _pipeline_workers(root: Path, world: int, mode: str, *flags: str) -> List[str]:
    """Each of `world` `pipeline_worker`s' output (one TF_CONFIG on loopback, a fresh run dir)."""
    import json
    import socket

    ports = []
    for _ in range(world):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    run_dir = tempfile.mkdtemp(dir=root, prefix=f"run-{mode}-{world}-")  # each run a fresh one: no resume
    procs = [subprocess.Popen([sys.executable, "-m", "launch.bench.pipeline_worker", f"--mode={mode}",
                               f"--run_dir={run_dir}", f"--batch_size={FLAGS.batch_size}",
                               f"--image_size={FLAGS.image_size}", *flags],
                              env={**repo_env(), "TF_CONFIG": json.dumps({"cluster": cluster, "task": {
                                  "type": "worker", "index": index}})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for index in range(world)]
    outputs = [proc.communicate(timeout=1200) for proc in procs]
    for proc, (_, err) in zip(procs, outputs):
        if proc.returncode:
            raise RuntimeError(f"{mode} at {world} workers failed: {err[-2000:]}")
    return [out for out, _ in outputs]


def pipeline_rates(root: Path, world: int, mode: str, commit_every_steps: int = 0) -> Tuple[float, float]:
    """The chief's steps/s in the second epoch of `pipeline_worker` at `world` workers, from its first step's
    end on, and that first step's seconds."""
    words = _pipeline_workers(root, world, mode, f"--records={root / 'pipeline' / 'train-*'}",
                              f"--commit_every_steps={commit_every_steps}")[0].split("steps_per_second ")[-1].split()
    return float(words[0]), float(words[2])


def transfer_seconds(root: Path, buffer: int) -> float:
    """Seconds to hand the pipeline's state (shuffle buffer `buffer`, full) from the chief to a second worker
    as a joiner receives it (`GroupState.hand_on`, loopback), the median of 3; checks it arrived whole."""
    outputs = _pipeline_workers(root, 2, "transfer", f"--records={root / 'state' / 'train-*'}", f"--shuffle={buffer}")
    received = {out.split("received ")[-1].split()[0] for out in outputs}
    if len(received) != 1:
        raise RuntimeError(f"the workers received different states: {received}")
    return float(outputs[0].split("transfer_seconds ")[-1].split()[0])


def _state_pipeline(root: Path, buffer: int):
    """The user's pipeline over the records of the state measurements, with a shuffle buffer of `buffer`."""
    return user_pipeline(str(root / "state" / "train-*"), FLAGS.batch_size, buffer, FLAGS.image_size)


def pipeline_state(root: Path, buffer: int) -> tuple:
    """(state MB, buffer MB, seconds to make the state, seconds from it to a restarted feed's first batch)."""
    import tensorflow as tf

    from tf_elastic.elastic.worker.data.dataset_feed import DatasetFeed

    make = functools.partial(_state_pipeline, root, buffer)
    feed = DatasetFeed(make())
    feed.start(b"", 0)
    for _ in range(3):
        feed.trained(len(list(feed.replica_dataset(1, 0, 1).take(1))))  # the buffer is full from the first batch
    started = time.perf_counter()
    state = feed.state()
    made = time.perf_counter() - started
    started = time.perf_counter()
    restarted = DatasetFeed(make())
    restarted.start(state, 0)
    restarted.first_rows()
    image = FLAGS.image_size * FLAGS.image_size * 3 * tf.float32.size
    return len(state) / 2**20, buffer * image / 2**20, made, time.perf_counter() - started


def replay_cost(root: Path, buffer: int) -> List[tuple]:
    """(pipeline, batches read before the last commit, batches read again, seconds from its state to a
    restarted feed's first batch), committed at a quarter and at three quarters of a pass: the pipeline
    alone, which tf.data's state restores; two copies of it mixed by `sample_from_datasets`, restored from
    the state as well while every input lasts; and a mix whose shorter input (a sixth of the batches) ran
    out between the commits, which `DatasetFeed` restores from the first commit and reads forward
    (TensorFlow 2.21 restores a mix wrongly once an input ran out)."""
    import tensorflow as tf

    from tf_elastic.elastic.worker.data.dataset_feed import DatasetFeed

    one = functools.partial(_state_pipeline, root, buffer)
    batches = sum(1 for _ in one())
    makers = {"alone": one, "mixed, every input lasting": lambda: tf.data.Dataset.sample_from_datasets(
        [one(), one()], weights=[0.5, 0.5], seed=1), "mixed, an input run out": lambda: (
        tf.data.Dataset.sample_from_datasets([one(), one().take(batches // 5)], weights=[0.5, 0.5], seed=1))}
    rows = []
    for name, make in makers.items():
        passed = sum(1 for _ in make())
        feed = DatasetFeed(make())
        feed.start(b"", 0)
        for _ in range(passed * 3 // 4):
            feed.trained(len(list(feed.replica_dataset(1, 0, 1).take(1))))
            if feed.batches == passed // 4:
                feed.state()
        state, started = feed.state(), time.perf_counter()
        restarted = DatasetFeed(make())
        restarted.start(state, 0)
        restarted.first_rows()
        rows.append((name, feed.batches, restarted.replayed, time.perf_counter() - started))
    return rows


def print_pipeline_comparison(root: Path) -> None:
    """Section 4's table: best of `--pipeline_repeats` runs of each method, taking turns, at each world size;
    each ratio of the best runs and, after the slash, of the median runs (plain DATA runs at two rates on
    shared cores, so the best of a few runs says which mode it caught)."""
    commits = FLAGS.commit_every_steps
    runs = {"elastic": ("elastic", 0), "data": ("data", 0), "file": ("file", 0), "source": ("source", 0)}
    header = ["workers", "elastic.fit, pipeline read whole", "plain DATA", "plain FILE", "elastic / DATA",
              "elastic / FILE", "elastic.fit, TFRecordSource (share only)", "source / FILE",
              "epoch's first step s, elastic / DATA / FILE / source (medians)"]
    if commits:
        runs["commits"] = ("elastic", commits)
        header += [f"elastic.fit, a commit every {commits} steps", "with / without those commits"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for world in [int(w) for w in FLAGS.pipeline_workers]:
        measured = {name: [] for name in runs}
        for _ in range(FLAGS.pipeline_repeats):
            for name, results in measured.items():
                results.append(pipeline_rates(root, world, *runs[name]))
        best = {name: max(rate for rate, _ in results) for name, results in measured.items()}
        median = {name: statistics.median(rate for rate, _ in results) for name, results in measured.items()}
        first = {name: statistics.median(step for _, step in results) for name, results in measured.items()}

        def ratio(a: str, b: str) -> str:
            return f"{best[a] / best[b]:.2f}x / {median[a] / median[b]:.2f}x"

        cells = [f"{world}", f"{best['elastic']:.2f}", f"{best['data']:.2f}", f"{best['file']:.2f}",
                 ratio("elastic", "data"), ratio("elastic", "file"), f"{best['source']:.2f}", ratio("source", "file"),
                 " / ".join(f"{first[name]:.3f}" for name in ("elastic", "data", "file", "source"))]
        if commits:
            cells += [f"{best['commits']:.2f}", ratio("commits", "elastic")]
        print("| " + " | ".join(cells) + " |", flush=True)


def print_pipeline_tables(root: Path) -> None:
    write_tfrecords(root / "pipeline", FLAGS.pipeline_examples, FLAGS.image_size)
    if FLAGS.pipeline_workers:
        print(f"\nA tf.data pipeline (TFRecord + parse + shuffle 1000 + batch {FLAGS.batch_size}, "
              f"{FLAGS.pipeline_examples} images), steps/s of the second epoch from its first step's end on "
              f"(its first step apart), side by side (the best of "
              f"{FLAGS.pipeline_repeats} runs; ratios: of the best runs / of the median runs)")
        print_pipeline_comparison(root)
    buffers = [int(b) for b in FLAGS.shuffle_buffers]
    write_tfrecords(root / "state", max(buffers, default=0) + 4 * FLAGS.batch_size, FLAGS.image_size)
    print("\nThe committed position of that pipeline, its shuffle buffer full (DatasetFeed.state, float32 images)")
    print("| shuffle buffer | state MB | buffer MB | state - buffer MB | make s | restart to first batch s | "
          "transfer to a joiner s (2 workers) |\n|---|---|---|---|---|---|---|")
    for buffer in buffers:
        state, held, made, restart = pipeline_state(root, buffer)
        print(f"| {buffer} | {state:.1f} | {held:.1f} | {state - held:.2f} | {made:.3f} | {restart:.3f} | "
              f"{transfer_seconds(root, buffer):.3f} |", flush=True)
    if buffers:
        print(f"\nA restart three quarters of a pass in, after commits there and at a quarter (shuffle buffer "
              f"{buffers[0]}): restored, or a mix read forward from its last commit before an input ran out")
        print("| pipeline | batches before the commit | batches read again | restart to first batch s |\n"
              "|---|---|---|---|")
        for name, batches, replayed, seconds in replay_cost(root, buffers[0]):
            print(f"| {name} | {batches} | {replayed} | {seconds:.3f} |", flush=True)


def main(argv):
    del argv
    from tf_elastic.testing import data_files

    with tempfile.TemporaryDirectory(dir=FLAGS.work_dir) as tmp:
        root = Path(tmp)
        write_folder(root / "folder", FLAGS.examples, FLAGS.image_size)
        write_tfrecords(root / "tfrecord", FLAGS.examples, FLAGS.image_size)
        files = data_files.write_all(root / "digits")
        if FLAGS.pipeline_workers or FLAGS.shuffle_buffers:
            print_pipeline_tables(root)
        print(f"\nThroughput ({FLAGS.examples} JPEGs {FLAGS.image_size}x{FLAGS.image_size}, batch {FLAGS.batch_size}, "
              f"best of {FLAGS.repeats})")
        print("| source | elastic examples/s | plain tf.data examples/s | ratio | ratio from the first batch on "
              "| start-up to first batch, elastic / plain | elastic / without its ready-time stamp, from the first "
              "batch on |\n|---|---|---|---|---|---|---|")
        for kind, (elastic, elastic_steady, elastic_start), (plain, plain_steady, plain_start), (_, unstamped, _) in \
                throughput(root):
            print(f"| {kind} | {elastic:.0f} | {plain:.0f} | {elastic / plain:.2f}x | "
                  f"{elastic_steady / plain_steady:.2f}x | {elastic_start * 1000:.0f} ms / "
                  f"{plain_start * 1000:.0f} ms | {elastic_steady / unstamped:.2f}x |", flush=True)
        print("\nRestart to first batch, half an epoch in (source made + plan + first batch)")
        print("| source | examples | seconds |\n|---|---|---|")
        for kind, count, seconds in restart_to_first_batch(root, files):
            print(f"| {kind} | {count} | {seconds:.3f} |", flush=True)
        if not FLAGS.sizes:
            return
        print("\nPeak RSS of a launch.train worker (image folder, 50 steps)")
        print("| images | peak RSS MiB |\n|---|---|")
        peaks = []
        for count in [int(s) for s in FLAGS.sizes]:
            peaks.append(peak_rss(root, count))
            print(f"| {count} | {peaks[-1]:.0f} |", flush=True)
        print(f"\nlargest / smallest: {max(peaks) / min(peaks):.2f}x")


if __name__ == "__main__":
    app.run(main)
