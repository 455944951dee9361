"""Replicas that must hold the same bits: per-replica statistics averaged, and a check of every variable.

Gradients are all-reduced, so weights and optimizer slots stay equal on every replica by construction.
State a layer updates from its own replica's batch does not: Keras 3's `BatchNormalization` (the default
`synchronized=False`) keeps its moving mean and variance per replica (aggregation "none"), and so would
any layer of a user's with running statistics. Before every commit and every validation pass `fit` calls
`average_statistics`, which sets each non-trainable floating model variable to the mean over all replicas,
computed as x0 + sum(x_i - x0) / n from the first replica's value x0: the same bits on every replica, and
exact for a variable that is equal everywhere already (a frozen layer's keeps its bits). Then
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
            bits = tf.concat([to_int32(x) for x in local], 0)
            first = tf.equal(context.replica_id_in_sync_group, 0)
            bits = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.where(first, bits, tf.zeros_like(bits)))
            base, offset = [], 0
            for variable in self.stats:
                base.append(from_int32(bits[offset:offset + words(variable)], variable))
                offset += words(variable)
            gaps = tf.concat([tf.reshape(tf.cast(x, tf.float64) - tf.cast(b, tf.float64), [-1])
                              for x, b in zip(local, base)], 0)
            total, offset = context.all_reduce(tf.distribute.ReduceOp.SUM, gaps), 0
            for variable, x0 in zip(self.stats, base):
                size = variable.shape.num_elements()
                mean = tf.cast(x0, tf.float64) + tf.reshape(total[offset:offset + size], variable.shape) / replicas
                variable.assign(tf.cast(mean, variable.dtype))
                offset += size

        self.strategy.run(replica)
