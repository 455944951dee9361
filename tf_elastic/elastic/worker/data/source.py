"""The data-source interface of `fit`, in-memory arrays, and the graph-mode pipeline over any source.

A source answers one question in the tf.data graph: "what is example number `index`?", as `model.fit`
takes an element: `(features, target)` or `(features, target, sample_weight)`, each a tensor or a nested
dict/tuple of tensors. `DataPlan` decides which indices each worker trains on; the pipeline turns this
worker's planned indices into batches (read -> decode -> preprocess -> batch -> prefetch) with parallel
calls and a deterministic order, so batch k is exactly the plan's batch k (the index log records it) and a
step redone after a restart sees the same data. Random augmentation gets a stateless seed made of
(seed, epoch, example index) for the same reason.
"""
import hashlib
import re
from typing import Callable, Dict, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tf_elastic.elastic.worker.errors import ConfigurationError

# preprocess(features, target, seed) -> (features, target); `seed` is an int64 [2] tensor for tf.random.stateless_*.
# An example's sample weight, if it has one, passes by it unchanged.
Preprocess = Callable[[tf.Tensor, tf.Tensor, tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]
AUTOTUNE = tf.data.AUTOTUNE


class Source:
    """Random access to a dataset by example index, inside the tf.data graph.

    A new source sets `num_examples` and implements `read`; or `examples` and `decode` instead, to read
    several indices at once (a Python data source per batch, a run of records at an offset), and
    `epoch_order` to visit examples in an order its storage reads fast. An example is `(features, target)`
    or `(features, target, sample_weight)`, in any structure a model takes (dict features, several
    outputs, float or integer targets, token ids). `num_classes` is set only where targets are class ids
    (the launch scripts size their model's last layer from it)."""

    num_examples: int
    num_classes: Optional[int] = None

    def read(self, index: tf.Tensor) -> tuple:
        """Example `index` (a scalar int64 tensor), `(features, target[, sample_weight])`; graph ops only."""
        raise NotImplementedError(f"{type(self).__name__} implements neither read nor examples")

    def examples(self, indices: np.ndarray) -> tf.data.Dataset:
        """(index, raw example) for each of `indices`, in their order; `decode` makes them examples."""
        return tf.data.Dataset.from_tensor_slices((indices, indices))

    def decode(self, index: tf.Tensor, raw) -> tuple:
        """The example from what `examples` read; by default `read(index)`."""
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
    """In-memory arrays as `model.fit` takes them: `x` and `y` each an array or a dict, list or tuple of
    arrays (several inputs, several outputs); `sample_weight` None, an array (for every output), or one
    per output in `y`'s structure. `num_classes`: default the largest label + 1 where `y` is one array of
    integer class ids, else None."""

    def __init__(self, x, y, num_classes: Optional[int] = None, sample_weight=None):
        y = as_arrays(y, "y")
        weight = () if sample_weight is None else (_weights_of(as_arrays(sample_weight, "sample_weight"), y),)
        self.element = (as_arrays(x, "x"), y, *weight)
        lengths = {len(a) if a.ndim else 0 for a in tf.nest.flatten(self.element)}
        if len(lengths) != 1 or not min(lengths):
            names = "x, y and sample_weight" if weight else "x and y"
            several = " (a list of arrays is several inputs, as in model.fit: np.stack it for one)" if any(
                isinstance(part, (list, tuple)) for part in self.element) else ""
            raise ConfigurationError(f"{names} need one, non-zero length (their first axis); got "
                                     f"{sorted(lengths)}{several}.")
        self.num_examples = lengths.pop()
        classes = not tf.nest.is_nested(y) and y.dtype.kind in "iu" and y.ndim <= 2 and y.size == len(y)
        self.num_classes = int(num_classes) if num_classes is not None else int(np.max(y)) + 1 if classes else None
        self._tensors = None

    def fingerprint(self) -> str:
        # (x, y) arrays: their shapes, dtypes and bytes, as before structures were taken (a commit's
        # fingerprint must not change under a run); a structure adds its leaves' paths (dict keys sorted).
        leaves = [np.ascontiguousarray(a) for a in tf.nest.flatten(self.element)]
        shapes = [part for a in leaves for part in (a.shape, a.dtype.str)]
        nested = tf.nest.is_nested(self.element[0]) or tf.nest.is_nested(self.element[1]) or len(self.element) > 2
        paths = (repr([path for path, _ in keras.tree.flatten_with_path(self.element)]),) if nested else ()
        return digest(*shapes, *leaves, *paths)

    def read(self, index: tf.Tensor) -> tuple:
        # The arrays become tensors on first use, not at construction: a tensor made before the strategy
        # initialises TF's runtime, after which MultiWorkerMirroredStrategy cannot configure collectives.
        if self._tensors is None:
            with tf.init_scope():  # eager tensors, also when first read inside a dataset's traced function
                self._tensors = tf.nest.map_structure(tf.constant, self.element)
        return tf.nest.map_structure(lambda t: tf.gather(t, index), self._tensors)


def _weights_of(weights, y):
    """`sample_weight` as `model.fit` takes it: one array for one output; for several, one weight per example
    (replicated over the outputs) or one array per output in `y`'s structure."""
    if not tf.nest.is_nested(y):
        if tf.nest.is_nested(weights):
            raise ConfigurationError("sample_weight must be one array for a model with one output; got a "
                                     f"{type(weights).__name__} of arrays.")
        return weights
    if not tf.nest.is_nested(weights):
        if not (weights.ndim == 1 or weights.ndim == 2 and weights.shape[1] == 1):
            raise ConfigurationError(f"sample_weight: one array for several outputs must hold one weight per "
                                     f"example, shape (n,) or (n, 1); got {weights.shape}.")
        return tf.nest.map_structure(lambda _: weights, y)  # as model.fit replicates it
    try:
        tf.nest.assert_same_structure(y, weights, check_types=False)
    except (ValueError, TypeError):
        raise ConfigurationError(f"sample_weight must be one array, or one per output in y's structure "
                                 f"({tf.nest.map_structure(lambda _: '.', y)}).") from None
    return weights


def as_arrays(value, name: str):
    """`value` as NumPy: an array, or a dict, list or tuple of arrays (several inputs or outputs, as Keras
    reads them) kept as that structure. A list of numbers is one array, as `np.asarray` makes it."""
    if isinstance(value, dict):
        return {key: as_arrays(v, f"{name}[{key!r}]") for key, v in value.items()}
    if isinstance(value, (list, tuple)) and value and all(_array_like(v) or isinstance(v, dict) for v in value):
        items = [as_arrays(v, f"{name}[{i}]") for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple too
    try:
        array = np.asarray(value)
        got = f"{type(value).__name__} of {array.dtype} {array.shape}"
    except ValueError:  # NumPy refuses ragged lists
        array, got = np.empty(0, object), f"a ragged {type(value).__name__}"
    if array.dtype == object or not array.ndim:
        raise ConfigurationError(f"{name} must be an array of numbers or strings with one row an example (or a "
                                 f"dict, list or tuple of them); got {got} (ragged lists need a tf.data pipeline "
                                 "or a Source).")
    return array


def _array_like(value) -> bool:
    """An array of any library (NumPy, a tensor, a pandas Series): it has a shape or converts to one."""
    return not isinstance(value, (str, bytes)) and (hasattr(value, "__array__") or hasattr(value, "shape"))


class Head(Source):
    """The first `n` examples of another source (`--train_examples`)."""

    def __init__(self, source: Source, n: int):
        self.source, self.num_examples, self.num_classes = source, min(n, source.num_examples), source.num_classes

    def examples(self, indices: np.ndarray) -> tf.data.Dataset:
        return self.source.examples(indices)

    def decode(self, index: tf.Tensor, raw) -> tuple:
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


def to_float(features, target, seed: tf.Tensor) -> tuple:
    """The default preprocessing of a source: uint8 images (any uint8 feature) to float32 in [0, 1]; every
    other feature (floats, token ids, strings) and the target unchanged. (Every integer feature was scaled
    before: an integer feature shaped like an image that is not uint8 is said once in the log.)"""
    del seed

    def scale(t: tf.Tensor) -> tf.Tensor:
        if t.dtype == tf.uint8:
            return tf.cast(t, tf.float32) / 255.0
        if t.dtype.is_integer and (t.shape.rank or 0) >= 3 and t.dtype.name not in _SAID_UNSCALED:
            _SAID_UNSCALED.add(t.dtype.name)
            logging.warning("a source's %s feature shaped %s reaches the model unscaled: the default "
                            "preprocessing scales uint8 images only; pass preprocess= to scale it", t.dtype.name,
                            t.shape)
        return t

    return tf.nest.map_structure(scale, features), target


_SAID_UNSCALED = set()  # integer dtypes of image-shaped features already said unscaled


def example_seed(seed: int, epoch: int, index: tf.Tensor) -> tf.Tensor:
    """The stateless seed of one example in one epoch: the same whichever worker or round reads it."""
    return tf.stack([tf.constant(seed * 1_000_003 + epoch, tf.int64), tf.cast(index, tf.int64)])


def pipeline(source: Source, indices: np.ndarray, batch_size: int, *, preprocess: Optional[Preprocess] = None,
             seed: int = 0, epoch: int = 0, drop_remainder: bool = True,
             shard: "tf.data.experimental.AutoShardPolicy" = tf.data.experimental.AutoShardPolicy.OFF,
             class_weight: Optional[Dict[int, float]] = None, with_indices: bool = False,
             stamp: Optional[Callable[[tf.data.Dataset], tf.data.Dataset]] = None) -> tf.data.Dataset:
    """Batches of the source's examples for `indices` in their order: read, decode and preprocess in parallel.

    `shard`: how a strategy's `experimental_distribute_dataset` shards it over workers (`OFF` for a
    worker's own planned share, which `feed.to_replicas` hands to its replicas as it is). `class_weight`
    adds each example's weight, as `model.fit(class_weight=...)` does (it cannot map a dataset already
    distributed); `with_indices` adds each example's index last (test mode: `consumed.record_steps`);
    `stamp` is applied to the batches as the prefetch takes them (`ReadyTimes.stamp`)."""
    preprocess = preprocess or to_float
    examples = source.examples(np.asarray(indices, np.int64))
    weigh = _class_weights(class_weight)

    refused = []  # found while tracing, raised after it (an error raised inside would come wrapped)

    def example(i, raw):  # decode and preprocess in one parallel map
        features, target, *weight = source.decode(i, raw)
        features, target = preprocess(features, target, example_seed(seed, epoch, i))
        if weigh:
            refused.extend(_class_weight_refusal(target, weight))
            weight = [] if refused else [weigh(target)]
        return (features, target, *weight, i) if with_indices else (features, target, *weight)

    dataset = examples.map(example, num_parallel_calls=AUTOTUNE, deterministic=True)
    if refused:
        raise ConfigurationError(refused[0])
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder, num_parallel_calls=AUTOTUNE,
                            deterministic=True)
    # A known length: with an unknown one Keras 3.15 counts one extra optimizer iteration per epoch, and
    # warns that the input "ran out of data" after every evaluation (training, always given its steps,
    # hides it again: `feed.to_replicas`).
    batches = len(indices) // batch_size if drop_remainder else -(-len(indices) // batch_size)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(batches))
    if stamp is not None:
        dataset = stamp(dataset)
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


def describe_error(error: tf.errors.OpError) -> str:
    """What a failed input assertion says (it names the file), without TensorFlow's node and stack context."""
    lines = [re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", line.strip()) for line in str(error.message).splitlines()]
    lines = [line for line in lines if line and not line.startswith("[[")]  # "[[{{node ...}}]] [Op:...]"
    for line in lines:
        if "assertion failed:" in line:
            return line.split("assertion failed:", 1)[1].strip()[:500]
    return (lines[-1] if lines else type(error).__name__)[:500]


def _class_weight_refusal(target, weight: list) -> list:
    """Why `class_weight` cannot weigh these examples, as `model.fit` refuses it (empty: it can)."""
    if weight:
        return ["class_weight is not taken with sample weights (as by model.fit): put the class's weight into each "
                "example's sample weight."]
    if tf.nest.is_nested(target):
        return ["class_weight is taken for a model with one output only (as by model.fit); weigh several outputs "
                "with sample weights."]
    return []
