"""Replicas that must hold the same bits: per-replica statistics averaged, and a check of every variable.

Gradients are all-reduced, so weights and optimizer slots stay equal on every replica by construction.
State a layer updates from its own replica's batch does not: Keras 3's `BatchNormalization` (the default
`synchronized=False`) keeps its moving mean and variance per replica (aggregation "none"), and so would
any layer of a user's with running statistics. Before every commit and every validation pass `fit` calls
`average_statistics`, which sets each non-trainable floating model variable to the mean over all replicas,
computed as x0 + sum(x_i - x0) / n from the first replica's value x0 where any replica's bits differ from
x0, and x0 itself where none do: the same bits on every replica, and a value that is equal everywhere
(a frozen layer's, an infinity, -0.0, a NaN's payload) keeps its bits. Then
`GroupState.check` compares every variable of the committed state across the workers.
"""
from typing import List, Sequence

import keras
import tensorflow as tf

from tf_elastic.elastic.worker.group import from_int32, to_int32, words


def statistics(model_variables: Sequence) -> List:
    """The model variables that replicas may update apart: non-trainable and floating (BatchNorm's
    moving statistics; a frozen layer's weights, which averaging leaves as they are)."""
    return [v.value if isinstance(v, keras.Variable) else v for v in model_variables
            if not v.trainable and tf.as_dtype(v.dtype).is_floating]


class StatisticsAverage:
    """Averages `stats` (TensorFlow variables, see `statistics`) over all replicas of `strategy`."""

    def __init__(self, strategy: tf.distribute.Strategy, stats: Sequence):
        self.strategy, self.stats = strategy, list(stats)
        self._average = tf.function(self._average_graph)

    def __call__(self) -> None:
        """Every replica calls this at the same step: one broadcast and one sum over all replicas."""
        if self.stats and self.strategy.num_replicas_in_sync > 1:
            self._average()

    def _average_graph(self) -> None:
        replicas = self.strategy.num_replicas_in_sync

        def replica() -> None:
            context = tf.distribute.get_replica_context()
            local = [v.read_value() for v in self.stats]
            mine = [to_int32(x) for x in local]
            first = tf.equal(context.replica_id_in_sync_group, 0)
            bits = tf.concat(mine, 0)
            bits = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.where(first, bits, tf.zeros_like(bits)))
            base, differs, gaps, offset = [], [], [], 0
            for variable, x, own in zip(self.stats, local, mine):
                theirs = bits[offset:offset + words(variable)]
                offset += words(variable)
                base.append(from_int32(theirs, variable))
                elements = variable.shape.num_elements()
                other = tf.reduce_any(tf.reshape(tf.not_equal(own, theirs), [elements, -1]), axis=1)
                differs.append(tf.cast(other, tf.float64))
                # Only where the bits differ: inf - inf would make an equal infinity NaN.
                gaps.append(tf.where(other, tf.reshape(tf.cast(x, tf.float64) - tf.cast(base[-1], tf.float64),
                                                       [-1]), 0.0))
            sums = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat(gaps + differs, 0))
            total, count = tf.split(sums, 2)
            offset = 0
            for variable, x0 in zip(self.stats, base):
                size, shape = variable.shape.num_elements(), variable.shape
                mean = tf.cast(tf.cast(x0, tf.float64) + tf.reshape(total[offset:offset + size], shape) / replicas,
                               variable.dtype)
                variable.assign(tf.where(tf.reshape(count[offset:offset + size], shape) > 0, mean, x0))
                offset += size

        self.strategy.run(replica)
