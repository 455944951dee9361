"""The data-source interface of `fit`, in-memory arrays, and the graph-mode pipeline over any source.

A source answers one question in the tf.data graph: "example number `index` is (features, label)".
`DataPlan` decides which indices each worker trains on; the pipeline turns this worker's planned
indices into batches (read -> decode -> preprocess -> batch -> prefetch) with parallel calls and a
deterministic order, so batch k is exactly the plan's batch k (the index log records it) and a step
redone after a restart sees the same data. Random augmentation gets a stateless seed made of
(seed, epoch, example index) for the same reason.
"""
import hashlib
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_elastic.elastic.worker.errors import ConfigurationError

# preprocess(features, label, seed) -> (features, label); `seed` is an int64 [2] tensor for tf.random.stateless_*.
Preprocess = Callable[[tf.Tensor, tf.Tensor, tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]
AUTOTUNE = tf.data.AUTOTUNE


class Source:
    """Random access to a labelled dataset by example index, inside the tf.data graph.

    A new source sets `num_examples` and `num_classes` and implements `read`; or `examples` and
    `decode` instead, to read several indices at once (a Python data source per batch, a run of
    records at an offset), and `epoch_order` to visit examples in an order its storage reads fast."""

    num_examples: int
    num_classes: int

    def read(self, index: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """(features, label) of example `index` (a scalar int64 tensor); graph ops only."""
        raise NotImplementedError(f"{type(self).__name__} implements neither read nor examples")

    def examples(self, indices: np.ndarray) -> tf.data.Dataset:
        """(index, raw example) for each of `indices`, in their order; `decode` makes them (features, label)."""
        return tf.data.Dataset.from_tensor_slices((indices, indices))

    def decode(self, index: tf.Tensor, raw) -> Tuple[tf.Tensor, tf.Tensor]:
        """(features, label) from what `examples` read; by default `read(index)`."""
        return self.read(index)

    def epoch_order(self, seed: int, epoch: int) -> Optional[np.ndarray]:
        """The order of an epoch's examples, a permutation of range(num_examples) that depends only on
        (seed, epoch); None: a uniformly random one (`DataPlan`'s)."""
        return None

    def fingerprint(self) -> str:
        """What identifies these examples, cheaply (a file list and sizes, not their bytes): `fit` commits
        it and refuses a worker or a restart that sees other data, whose positions would mean other
        examples. Default: the class and the number of examples; a source of your own should add more."""
        return f"{type(self).__name__}/{self.num_examples}"


class ArraySource(Source):
    """In-memory arrays (features `x`, integer labels `y`): today's case, and small datasets."""

    def __init__(self, x: np.ndarray, y: np.ndarray, num_classes: Optional[int] = None):
        if len(x) != len(y) or not len(x):
            raise ConfigurationError(f"x and y need the same, non-zero length; got {len(x)} and {len(y)}.")
        self.x, self.y = x, y
        self.num_examples = len(x)
        self.num_classes = int(num_classes if num_classes is not None else np.max(y) + 1)
        self._tensors: Optional[Tuple[tf.Tensor, tf.Tensor]] = None

    def fingerprint(self) -> str:
        return digest(self.x.shape, self.x.dtype.str, self.y.shape, self.y.dtype.str, np.ascontiguousarray(self.x),
                      np.ascontiguousarray(self.y))

    def read(self, index: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        # The arrays become tensors on first use, not at construction: a tensor made before the strategy
        # initialises TF's runtime, after which MultiWorkerMirroredStrategy cannot configure collectives.
        if self._tensors is None:
            with tf.init_scope():  # eager tensors, also when first read inside a dataset's traced function
                self._tensors = tf.constant(self.x), tf.constant(self.y)
        x, y = self._tensors
        return tf.gather(x, index), tf.gather(y, index)


class Head(Source):
    """The first `n` examples of another source (`--train_examples`)."""

    def __init__(self, source: Source, n: int):
        self.source, self.num_examples, self.num_classes = source, min(n, source.num_examples), source.num_classes

    def examples(self, indices: np.ndarray) -> tf.data.Dataset:
        return self.source.examples(indices)

    def decode(self, index: tf.Tensor, raw) -> Tuple[tf.Tensor, tf.Tensor]:
        return self.source.decode(index, raw)

    def fingerprint(self) -> str:
        return f"{self.source.fingerprint()}/first-{self.num_examples}"


def digest(*parts) -> str:
    """A short hex digest of `parts` (arrays by their bytes, anything else by its text)."""
    hashed = hashlib.blake2b(digest_size=8)
    for part in parts:
        hashed.update(memoryview(part).cast("B") if isinstance(part, np.ndarray) else repr(part).encode())
        hashed.update(b"\0")
    return hashed.hexdigest()


def fingerprint_number(source: Source) -> int:
    """`source.fingerprint()` as a 48-bit number: exact in the float64 sums the workers agree with."""
    return int(digest(source.fingerprint())[:12], 16)


def to_float(features: tf.Tensor, label: tf.Tensor, seed: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """The default preprocessing: integer images to float32 in [0, 1], float features unchanged."""
    del seed
    if features.dtype.is_integer:
        return tf.cast(features, tf.float32) / 255.0, label
    return features, label


def example_seed(seed: int, epoch: int, index: tf.Tensor) -> tf.Tensor:
    """The stateless seed of one example in one epoch: the same whichever worker or round reads it."""
    return tf.stack([tf.constant(seed * 1_000_003 + epoch, tf.int64), tf.cast(index, tf.int64)])


def pipeline(source: Source, indices: np.ndarray, batch_size: int, *, preprocess: Optional[Preprocess] = None,
             seed: int = 0, epoch: int = 0, drop_remainder: bool = True,
             shard: "tf.data.experimental.AutoShardPolicy" = tf.data.experimental.AutoShardPolicy.OFF,
             class_weight: Optional[Dict[int, float]] = None, with_indices: bool = False) -> tf.data.Dataset:
    """Batches of (features, label) for `indices` in their order: read, decode and preprocess in parallel.

    `shard`: how a strategy's `experimental_distribute_dataset` shards it over workers (`OFF` for a
    worker's own planned share, which `feed.to_replicas` hands to its replicas as it is). `class_weight`
    adds each example's weight, as `model.fit(class_weight=...)` does (it cannot map a dataset already
    distributed); `with_indices` adds each example's index last (test mode: `consumed.record_steps`)."""
    preprocess = preprocess or to_float
    examples = source.examples(np.asarray(indices, np.int64))
    weigh = _class_weights(class_weight)

    def example(i, raw):  # decode and preprocess in one parallel map
        features, label = preprocess(*source.decode(i, raw), example_seed(seed, epoch, i))
        extra = (weigh(label),) if weigh else ()
        return (features, label, *extra, i) if with_indices else (features, label, *extra)

    dataset = examples.map(example, num_parallel_calls=AUTOTUNE, deterministic=True)
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder, num_parallel_calls=AUTOTUNE,
                            deterministic=True)
    # A known length: with an unknown one Keras 3.15 counts one extra optimizer iteration per epoch, and
    # warns that the input "ran out of data" after every evaluation.
    batches = len(indices) // batch_size if drop_remainder else -(-len(indices) // batch_size)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(batches))
    options = tf.data.Options()
    options.deterministic = True
    # Every stage is parallel and prefetched already; the default rewrites cost ~35 ms a pipeline (grappler
    # over its functions and the captured index arrays) and measured no faster (launch/bench/bench_input.py).
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_distribute.auto_shard_policy = shard
    return dataset.prefetch(AUTOTUNE).with_options(options)


def _class_weights(class_weight: Optional[Dict[int, float]]) -> Optional[Callable[[tf.Tensor], tf.Tensor]]:
    """label -> its class's weight (1 for a class not named), for integer or one-hot labels, as Keras's."""
    if not class_weight:
        return None
    classes = [int(c) for c in class_weight]
    if min(classes) < 0:
        raise ConfigurationError(f"class_weight: classes must be integers >= 0; got {sorted(classes)}.")
    table = np.ones(max(classes) + 2, np.float32)  # the last: every class above those named
    for c, weight in class_weight.items():
        table[int(c)] = weight

    def weigh(label: tf.Tensor) -> tf.Tensor:
        label = tf.argmax(label, -1) if label.shape.rank and label.shape[-1] > 1 else tf.reshape(label, [])
        return tf.gather(tf.constant(table), tf.minimum(tf.cast(label, tf.int64), len(table) - 1))

    return weigh


def evaluation(source: Source, batch_size: int, preprocess: Optional[Preprocess] = None) -> tf.data.Dataset:
    """Every example of `source` once, in order, streamed, in batches of `batch_size`: the global batch, as
    `model.evaluate` takes a dataset under a strategy. Under MultiWorkerMirroredStrategy the workers share
    it by batch (`AutoShardPolicy.DATA`): each example is evaluated once in the group, and the metrics are
    summed over the workers, so every worker reports the whole set's (a worker whose share ran out feeds
    empty batches, which count for nothing, while the others finish)."""
    return pipeline(source, np.arange(source.num_examples), batch_size, preprocess=preprocess,
                    drop_remainder=False, shard=tf.data.experimental.AutoShardPolicy.DATA)


def describe_error(error: tf.errors.InvalidArgumentError) -> str:
    """What a failed input assertion says (it names the file), without TensorFlow's node and stack context."""
    lines = [line.strip() for line in str(error.message).splitlines() if line.strip()]
    for line in lines:
        if "assertion failed:" in line:
            return line.split("assertion failed:", 1)[1].strip()[:500]
    return (lines[-1] if lines else type(error).__name__)[:500]
