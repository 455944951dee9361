"""The group's committed state: which commit a new round starts from, and its transfer between workers.

Hosts keep their own commits (no shared filesystem), so after a round forms the workers agree on the
newest commit any of them holds (by `CommitId`: generation, then step); those that lack it (a joiner with
an empty disk, a host that was behind, a host's second worker, which keeps no commits) receive it from
the lowest rank that holds it, over the strategy's collectives, and every worker then checks that it
holds the same bits as the source. Storage is only for durability (`durable.py`).

One SUM all-reduce of a small vector, one slot per rank, tells every worker each rank's commit id, a 48-bit
piece of the SHA-256 of its state and the chief's generation floor; the state travels only when ids or
digests differ. Generations come first in the order so that a stale history with higher steps (a host cut
off from the store that trained on alone, or the old job's hosts after a restart from an older durable
copy) loses to the group's (`CommittedState.begin_generation`). A host whose first worker received the
state writes it at once as its own commit, and each rank's `restore` event carries its `state_digest`, so
replicas can be compared bit for bit.
"""
import dataclasses
import hashlib
import time
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_elastic.elastic.worker.data.feed import local_replicas
from tf_elastic.elastic.worker.durable import CommitId
from tf_elastic.elastic.worker.errors import ConfigurationError, PeerFailure
from tf_elastic.elastic.worker.world import World

SumOverWorkers = Callable[[Sequence[float]], np.ndarray]


def sum_over_workers(strategy: tf.distribute.Strategy, world: World) -> SumOverWorkers:
    """A function summing a small float64 vector over the workers (each worker's values counted once)."""
    if world.size == 1:
        return lambda values: np.asarray(values, np.float64)

    @tf.function
    def total(local):
        per_replica = strategy.run(lambda: tf.identity(local))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    # Every local replica contributes: divide by their number (exact for the small integers we sum).
    here = local_replicas(strategy, world.size)
    return lambda values: total(tf.constant(values, tf.float64)).numpy() / here


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the group agreed on: the commit (`NO_COMMIT`: nothing committed anywhere), its source rank, the
    generation floor (the chief's, see `CommittedState.generation_floor`) and what this worker received
    (0 bytes when it held the commit already)."""
    id: CommitId
    floor: int
    source: int
    received_bytes: int
    seconds: float
    digest: str
    handed: bool = False  # the state was handed on (some worker lacked it): the same on every worker


def newest_holder(held: Sequence[CommitId]) -> int:
    """The rank whose commit the group starts from: the newest by `CommitId` (a higher step of an older
    generation loses), the lowest such rank."""
    return max(range(len(held)), key=lambda rank: (held[rank], -rank))


def to_int32(value: tf.Tensor) -> tf.Tensor:
    """The bits of `value` as a flat int32 vector: floats are bit-cast, never converted, so that the
    all-reduce's `x + 0` keeps every bit (-0.0 and NaN payloads included)."""
    width = value.dtype.size
    if value.dtype == tf.bool:
        return tf.reshape(tf.cast(value, tf.int32), [-1])
    if width == 1:
        return tf.reshape(tf.cast(tf.bitcast(value, tf.uint8), tf.int32), [-1])
    if width == 2:
        return tf.reshape(tf.cast(tf.bitcast(value, tf.uint16), tf.int32), [-1])
    return tf.reshape(tf.bitcast(value, tf.int32), [-1])  # 4 bytes: as is; 8 bytes: two int32 each


def from_int32(bits: tf.Tensor, like: tf.Variable) -> tf.Tensor:
    dtype, shape = like.dtype, like.shape
    width = dtype.size
    if dtype == tf.bool:
        return tf.reshape(tf.cast(bits, tf.bool), shape)
    if width in (1, 2):
        return tf.reshape(tf.bitcast(tf.cast(bits, tf.uint8 if width == 1 else tf.uint16), dtype), shape)
    if width == 8:
        return tf.reshape(tf.bitcast(tf.reshape(bits, [-1, 2]), dtype), shape)
    return tf.reshape(tf.bitcast(bits, dtype), shape)


def words(variable: tf.Variable) -> int:
    """int32 words `to_int32` makes of this variable."""
    return variable.shape.num_elements() * max(1, variable.dtype.size // 4)


class GroupState:
    """Agreement, broadcast and verification of the committed state's variables across the workers.

    MultiWorkerMirroredStrategy has no public broadcast, so it is built from the all-reduce (SUM) it has:
    the source's first replica contributes its values, every other replica zeros. All variables travel
    as one int32 vector (their bits, see `to_int32`), so a transfer is a single collective. Afterwards a
    SHA-256 of every variable's bits, summed into a vector with one slot per rank, shows every worker
    what each one holds; any difference from the source is a `PeerFailure` and the round starts again.
    """

    def __init__(self, strategy: tf.distribute.Strategy, world: World, variables: Sequence, names: Sequence[str],
                 sum_fn: SumOverWorkers):
        self.strategy, self.world, self._sum = strategy, world, sum_fn
        # Strings (a tf.data position) have no bits to sum: `hand_on` moves them, and their readers check them.
        kept = [(v, n) for v, n in zip(variables, names) if v.dtype != tf.string]
        self.variables, self.names = [v for v, _ in kept], [n for _, n in kept]
        if len({id(v) for v in self.variables}) != len(self.variables) or len(self.names) != len(self.variables):
            raise ValueError("GroupState needs each TensorFlow variable once, with one name each")
        self.bytes = 4 * sum(words(v) for v in self.variables)
        self._local_replicas = local_replicas(strategy, world.size)
        self._pack = tf.function(lambda: tf.concat([to_int32(tf.convert_to_tensor(v)) for v in self.variables], 0))
        self._broadcast = tf.function(self._broadcast_graph)  # one function: one trace at a round's start
        self._fingerprints = tf.function(self._fingerprint_graph)
        self._hand_on = tf.function(self._hand_on_graph, input_signature=[tf.TensorSpec([None], tf.int32),
                                                                         tf.TensorSpec([], tf.int32)])

    def digest(self) -> str:
        """SHA-256 (hex) of every variable's bits, as this worker holds them."""
        return hashlib.sha256(self._pack().numpy().tobytes()).hexdigest()

    def _fingerprint_graph(self) -> tf.Tensor:
        """[variables, local replicas, 2]: two 48-bit sums of each copy's bits (their sum, and their sum
        weighted by position), computed where the variable lives: a commit's check moves 16 bytes a copy
        to the host, not the model."""
        position_weights = {}
        rows = []
        for variable in self.variables:
            copies = []
            for copy in self.strategy.experimental_local_results(variable):
                bits = tf.cast(to_int32(tf.convert_to_tensor(copy)), tf.int64)
                size = bits.shape[0]
                if size not in position_weights:
                    position_weights[size] = tf.range(size, dtype=tf.int64) % 65521 + 1
                sums = tf.stack([tf.reduce_sum(bits), tf.reduce_sum(bits * position_weights[size])])
                copies.append(tf.bitwise.bitwise_and(sums, (1 << 48) - 1))  # int64 sums wrap alike everywhere
            # A variable outside the strategy (one copy, e.g. a plain step counter) cannot differ locally:
            # its row repeats that copy so that every row has one entry per local replica.
            if len(copies) not in (1, self._local_replicas):
                raise ValueError(f"variable {variable.name} has {len(copies)} local copies, not 1 or "
                                 f"{self._local_replicas}")
            rows.append(tf.stack(copies * (self._local_replicas // len(copies))))
        return tf.stack(rows)

    def check(self, when: str) -> None:
        """Raises `ConfigurationError` naming every variable of which some copy (on any worker, any local
        replica) holds other bits than the chief's first (two sums over the workers: the chief's
        fingerprints, then how many workers differ on each)."""
        prints = self._fingerprints().numpy().astype(np.float64)
        mine, local_apart = prints[:, 0, :].reshape(-1), (prints != prints[:, :1, :]).any(axis=(1, 2))
        chief = self._sum(mine if self.world.is_chief else np.zeros_like(mine))
        apart = (mine != chief).reshape(-1, 2).any(axis=1) | local_apart
        differ = self._sum(apart.astype(np.float64)) if self.world.size > 1 else apart
        names = [name for name, count in zip(self.names, differ) if count > 0]
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise ConfigurationError(f"the replicas hold different values of {len(names)} variable(s) {when}: "
                                     f"{shown}. A layer keeps per-replica state that is neither trained nor a "
                                     "floating statistic that fit averages; it was not committed.")

    def agree(self, held: CommitId, floor: int = 0) -> Agreement:
        """Finds the newest commit any worker holds (`held`: `NO_COMMIT` for none) and gives it to all; the
        chief's generation `floor` (other workers pass 0) reaches every worker with it."""
        size, rank = self.world.size, self.world.rank
        digest = self.digest()
        mine = np.zeros(3 * size + 1)  # generation + 1, step + 1 and digest of every rank, then the floor
        mine[rank], mine[size + rank], mine[2 * size + rank] = held.generation + 1, held.step + 1, _short(digest)
        mine[-1] = floor
        total = np.rint(self._sum(mine)).astype(np.int64)
        ids = [CommitId(int(g) - 1, int(s) - 1) for g, s in zip(total[:size], total[size:2 * size])]
        digests, floor = total[2 * size:3 * size], int(total[-1])
        source = newest_holder(ids)
        newest = ids[source]
        if all(i == newest for i in ids) and (digests == digests[source]).all():
            return Agreement(newest, floor, source, 0, 0.0, digest)
        started = time.perf_counter()
        self._broadcast(tf.constant(source * self._local_replicas, tf.int32))
        digest = self.digest()
        self.verify(digest, f"after the transfer of step {newest.step} (generation {newest.generation}) "
                            f"from rank {source}")
        received = ids[rank] != newest or digests[rank] != digests[source]
        return Agreement(newest, floor, source, self.bytes if received else 0, time.perf_counter() - started, digest,
                         handed=True)

    def hand_on(self, data: bytes, source: int) -> bytes:
        """Rank `source`'s `data`, on every worker (every worker calls it): its length in the small sum, then
        its bytes as int32 words in one all-reduce, zeros from every other replica."""
        lengths = np.zeros(self.world.size)
        lengths[self.world.rank] = len(data)
        length = int(np.rint(self._sum(lengths))[source])
        if not length:
            return b""
        words = np.zeros(4 * -(-length // 4), np.uint8)
        if self.world.rank == source:
            words[:length] = np.frombuffer(data, np.uint8)
        total = self._hand_on(tf.constant(words.view(np.int32)), tf.constant(source * self._local_replicas))
        return total.numpy().view(np.uint8)[:length].tobytes()

    def _hand_on_graph(self, words: tf.Tensor, source_replica: tf.Tensor) -> tf.Tensor:
        def contribute():
            context = tf.distribute.get_replica_context()
            is_source = tf.equal(context.replica_id_in_sync_group, source_replica)
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.where(is_source, words, tf.zeros_like(words)))

        return self.strategy.experimental_local_results(self.strategy.run(contribute))[0]

    def verify(self, digest: str, when: str) -> None:
        """Raises `PeerFailure` unless every worker's digest equals this one. (The vector has the length
        `agree` sums, so the summing function is not traced again.)"""
        size = self.world.size
        mine = np.zeros(3 * size + 1)
        mine[2 * size + self.world.rank] = _short(digest)
        digests = np.rint(self._sum(mine)).astype(np.int64)[2 * size:3 * size]
        if (digests != digests[0]).any():
            raise PeerFailure(-1, f"the workers hold different state {when}: digests {digests.tolist()}")

    def _broadcast_graph(self, source_replica: tf.Tensor) -> None:
        """The source's values, all-reduced with zeros from every other replica, assigned everywhere."""
        def contribute():
            context = tf.distribute.get_replica_context()
            bits = tf.concat([to_int32(v.read_value()) for v in self.variables], 0)
            is_source = tf.equal(context.replica_id_in_sync_group, source_replica)
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.where(is_source, bits, tf.zeros_like(bits)))

        bits = self.strategy.experimental_local_results(self.strategy.run(contribute))[0]
        offset = 0
        for variable in self.variables:
            size = words(variable)
            variable.assign(from_int32(bits[offset:offset + size], variable))
            offset += size


def _short(digest: str) -> float:
    """48 bits of a digest: exact in the float64 all-reduce."""
    return float(int(digest[:12], 16))
