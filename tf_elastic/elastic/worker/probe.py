"""Each worker's own speed, which the collective hides: every step of a synchronous group takes as long as
its slowest rank's, so step times are the same everywhere. At a step the group agreed on, every rank times
the model's own forward and backward pass on a fixed batch for `ProbeSettings.seconds`, on its own replicas
and with no collective (so no rank waits for another). The passes run in one compiled loop, one call: a
loop of Python calls timed this process's Python threads as much as its compute (a chief's commit thread,
busy after a round's start, made its probe read 12-33x the others' on a host that was not slow). The next
agreement hands every rank every rank's time, and `stragglers.StragglerWatch` names the slow ones the same
way on every rank. Probes are due every `every_seconds` (on a beat: an agreement's lateness does not add
up; a suspect's window is confirmed at half the interval, within a budget: `stragglers.hurry`): at the
defaults (8 s, 0.05 s) the timed probes cost the group 0.76-1.09 % of the training time in
`bench_straggler` on 2 shared cores before its slowdown, 3.5-5.6 % in the 9-18 s before the report while
its slowed worker, under a quota, times a period and a half, 0.91-1.48 % after it; a round's first due
probe traces the pass (0.5 s at 4 workers there), a fixed cost (`take_spent`).
Where the worker's CPU has a quota (a container's limit) a probe times a period and a half of it
(`probe_seconds`), and a pass can take longer than `seconds` (a large model): where the slowest probe of the
ranks not suspected of straggling runs longer than `seconds`, the next is put off in proportion, up to ten
times (`stragglers.probe_interval`), so the probes keep to `seconds / every_seconds` of the group's time (and
a suspect's hurried probes: `stragglers.hurry`), and the reports (or, once a straggler is reported, its
recovery) come that much later.

A straggler's own workers put their slowness in the heartbeat, where their agent writes the `straggler`
event (host, rank, slowness, cause) and a log line and, with `--evict_stragglers`, leaves when the rules
say the group would train more without its host. The same rules judge, where the feed knows it (a user's
tf.data pipeline it hands the step; a source's or a PyDataset's batches, stamped as ready: `ReadyTimes`), how
much of the time each rank's step waited for its own input (`stragglers.input_slowness`): a
rank the group waits for is a straggler by its input, reported (cause `input`); then, once a window of
probes, the others read their own input alone (`time_input`, a side pipeline; `INPUT_TIMING_SECONDS`) and the
rules weigh its eviction by it (`stragglers.worth_evicting_for_input`). Every
rank's heartbeat also carries the group's median probe and its batch, which the chief's agent publishes:
an evicted host on probation times its own pass and reads its input alone (`time_alone`, in a worker that
trains nothing) and rejoins only once both are back within the factor of the group's (its median probe, its
seconds a step).
"""
import collections
import os
import statistics
import time
import zlib
from typing import Callable, List, Optional, Sequence, Set, Tuple

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tf_elastic.elastic.stragglers import (HURRIED_AT_MOST, HURRY_HISTORY, LONGEST_PROBE_STRETCH, ProbeSettings,
                                           StragglerWatch, hurry, input_slowness, probe_interval, worth_evicting,
                                           worth_evicting_for_input)
from tf_elastic.elastic.worker.cpu_quota import quota_period_seconds
from tf_elastic.elastic.worker.world import PULSE, World, seconds_in_round

# The group's throughput with and without a straggler's host is weighed over this many seconds ahead.
EVICTION_HORIZON_SECONDS = 120.0
# While a rank's input is a straggler, the others read their own input alone for at least this long, at
# most once a window of probes (`GroupProbe._read`): what eviction weighs it against.
INPUT_TIMING_SECONDS = 0.5
# What each rank's slots carry, a block of `size` each: its probe's seconds per pass, its host's key, its share of
# the time waiting for input, how long its probe ran, its seconds per step, its input's seconds per step read
# alone (0: not timed) and how long that read ran.
_BLOCKS = 7


def _host_key(host_id: Optional[str], rank: int) -> float:
    """A number naming this worker's host in the group's sum (exact in float64): which ranks leave together."""
    return float(zlib.crc32((host_id or f"rank {rank}").encode()) % (1 << 30) + 1)


class GroupProbe:
    """The probe of one worker in its group: `due` and `slots` go into the agreement's sum; after it,
    `after_agreement` probes (if the group agreed it was due) or reads the group's probes."""

    def __init__(self, model, strategy: tf.distribute.Strategy, world: World, settings: ProbeSettings):
        self.model, self.strategy, self.world, self.settings = model, strategy, world, settings
        self.watch = StragglerWatch(settings.rules)
        self.input_watch = StragglerWatch(settings.rules, baseline=min)  # on the waits for input
        self.pending = False  # probed since the last agreement: its time rides the next one
        self.seconds = 0.0
        self.duration = 0.0  # how long the last timed probe's passes ran
        self.interval = self._said = settings.every_seconds  # between probes, agreed alike (`probe_interval`)
        self.last = time.monotonic()
        self.round_seconds: Optional[float] = None  # a round's cost, as this worker measured its own start
        self.spent = self.traced = 0.0  # seconds of timed probes, and of tracing them, since `take_spent`
        self.batch = 0  # rows a replica of the probe's pass
        self.input_wait: Callable[[], float] = float  # seconds the step waited for input since the last call
        self.time_input: Callable[[float], float] = lambda seconds: 0.0  # the feed's input read alone, per step
        self.waiting = 0.0  # the share of the time it waited, between the last two probes
        self.step_seconds = 0.0  # wall seconds per step between the last two probes
        self.input_seconds = self.input_duration = 0.0  # the input read alone at the last probe (0: not read)
        self._waits_since, self._steps_at = time.monotonic(), 0
        self._readers: Set[int] = set()  # the ranks that read their input alone at the next probe (`_read`)
        self._probes_since_input = settings.rules.window  # probes read since the input was last read alone
        self._inputs: List[float] = []  # the newest read of the others' input alone (by rank), while one is slow
        self._inputs_for: Set[float] = set()  # the slow host (its key) the others read theirs alone beside
        self._worth: List[bool] = []  # the verdicts while the same host is slow, by probe
        self._pass = None
        self._warm = False  # the pass was traced (a round's first due probe does it, untimed)
        self._medians = collections.deque(maxlen=settings.rules.window)  # the group's, at the window's probes
        self._step_times = collections.deque(maxlen=settings.rules.window)  # the group's seconds per step, likewise
        self._hurried = collections.deque(maxlen=HURRY_HISTORY)  # whether each interval was halved (`hurry`)

    @property
    def enabled(self) -> bool:
        return self.world.probes_stragglers and self._pass is not None

    def first_step(self, per_replica_batch: int) -> None:
        """The round trains: its start's cost is known, and the model's inputs (the pass is built here; it is
        traced at the first probe, so that a round shorter than the cadence never pays for it)."""
        self.round_seconds = seconds_in_round()
        self.last = self._waits_since = time.monotonic()
        self._steps_at = PULSE.step
        self.input_wait()  # the round's start is not a wait for input
        if self.world.probes_stragglers:
            self.batch = max(1, per_replica_batch)
            self._pass = _forward_and_backward(self.model, self.strategy, self.batch)
            self._warm = False

    def due(self) -> float:
        return float(self.enabled and time.monotonic() - self.last >= self.interval)

    def slots(self) -> List[float]:
        """This worker's numbers of its last probe in its rank's slots, a block of `size` each (`_BLOCKS`);
        nothing unless a probe is pending (every rank knows that alike: they all probed at the same step)."""
        if not self.pending:
            return []
        size, rank = self.world.size, self.world.rank
        slots = [0.0] * (_BLOCKS * size)
        mine = (self.seconds, _host_key(self.world.host_id, rank), self.waiting, self.duration, self.step_seconds,
                self.input_seconds, self.input_duration)
        for block, value in enumerate(mine):
            slots[block * size + rank] = value
        return slots

    def after_agreement(self, due: bool, total: Sequence[float]) -> None:
        """`total`: what `slots` summed to over the group. Reads it, then probes if the group agreed to."""
        if self.pending:
            self.pending = False
            size = self.world.size
            self._read(*(list(total[k * size:(k + 1) * size]) for k in range(_BLOCKS)))
        if due and self.enabled:
            now, began = time.monotonic(), time.perf_counter()  # the look-up of the input waits is spent too
            self.waiting = self.input_wait() / max(now - self._waits_since, 1e-9)
            self.step_seconds = (now - self._waits_since) / max(1, PULSE.step - self._steps_at)
            if self._warm:
                self._probe()
                self.spent += time.perf_counter() - began
            else:  # the round's first probe traces the pass, on every rank at once: it times nothing
                self._pass(0.0)
                self._warm = True
                self.traced += time.perf_counter() - began
            # The next interval's steps and waits are counted from here: the probe's time is no step's.
            self._waits_since, self._steps_at = time.monotonic(), PULSE.step
            beat = self.last + self.interval  # when this probe was due: the next is due an interval after it,
            self.last = beat if now - beat < self.interval / 2 else now  # unless it came late by half of one

    def _probe(self) -> None:
        """Times the pass, and where the group agreed on it (`_weigh_input`) reads this worker's input alone;
        both ride the next agreement."""
        self.seconds, self.duration, _ = self._pass(probe_seconds(self.settings))
        self.input_seconds = self.input_duration = 0.0
        if self.world.rank in self._readers:
            read = time.perf_counter()
            self.input_seconds = self.time_input(INPUT_TIMING_SECONDS)
            self.input_duration = time.perf_counter() - read
        self._readers = set()
        self.pending = True

    def _space_out(self, durations: List[float]) -> None:
        suspects = self.watch.suspects
        interval = probe_interval(self.settings, durations, suspects)
        if self.world.is_chief and not self._said / 1.5 <= interval <= 1.5 * self._said:
            why = ("--probe_every_seconds" if interval == self.settings.every_seconds else
                   f"the slowest probe (of the ranks not suspected of straggling) runs longer than --probe_seconds, "
                   f"and probes are put off in proportion (up to {LONGEST_PROBE_STRETCH:g}x --probe_every_seconds)")
            logging.info("straggler probes every %.0f s from now (half that while a rank is over the factor, for at "
                         "most %d intervals of %d): %s", interval, HURRIED_AT_MOST, HURRY_HISTORY, why)
            self._said = interval  # said again only once it moves by half (a straggler's probes jitter)
        hurried = hurry(bool(suspects or self.input_watch.suspects), self._hurried)
        self._hurried.append(hurried)
        self.interval = interval / 2 if hurried else interval  # not logged: noise makes suspects

    def take_spent(self) -> Tuple[float, float]:
        """(seconds of timed probes, seconds of tracing the pass: once a round) on the training path since the
        last call: the cadence's cost, and a round's fixed one. A timed probe costs the group what its slowest
        rank's takes (the others wait for it at the next collective): this rank's own time, and its wait for
        the slowest rank's passes (counted at the agreement after the probe); the trace, this rank's own."""
        spent, self.spent, traced, self.traced = self.spent, 0.0, self.traced, 0.0
        return spent, traced

    def _read(self, seconds: List[float], hosts: List[float], waiting: List[float], durations: List[float],
              step_seconds: List[float], inputs: List[float], input_durations: List[float]) -> None:
        """Every rank judges the same numbers alike; each says in its heartbeat whether it is a straggler, by
        its compute or by its input (its agent writes the events and the log lines), and whether its host is
        worth evicting (by its compute, or by its input: `_weigh_input`); and all put off the next probe
        alike where probes take longer than `ProbeSettings.seconds`. The heartbeat's group median, a host on
        probation's yardstick, is the median of the window's probes' medians, once the round has had a window
        of probes: that host's own pass is the median of a window of probes too (`time_alone`), and one
        probe's median swung 0.6-1.1 ms in a run where a host 1.25x slower timed 1.2-1.3 ms and sat out two
        minutes more than it had to."""
        # The wait for the slowest rank's probe; bounded, as a clock stepped during a probe is not its time.
        self.spent += min(max(0.0, max(durations) - self.duration),
                          LONGEST_PROBE_STRETCH * max(self.duration, self.settings.seconds))
        self.spent += max(0.0, max(input_durations) - self.input_duration)  # and for the slowest input read
        began, ended = self.watch.observe(seconds)
        input_began, input_ended = self.input_watch.observe(input_slowness(waiting))
        self._space_out(durations)
        measured = [s for s in seconds if s > 0]
        median = float(np.median(measured)) if measured else 0.0
        if measured:
            self._medians.append(median)
        # A probation's yardstick: the group's step without the longest wait for input in it, at every probe (at
        # probes where no input was even suspect only, a job of short epochs, whose starts are waits, found none).
        paced = max(step_seconds) * (1.0 - min(1.0, max(waiting)))
        if paced > 0:
            self._step_times.append(paced)
        whole = len(self._medians) == self._medians.maxlen  # until then its agent keeps the last round's
        PULSE.median, PULSE.batch = statistics.median(self._medians) if whole else 0.0, self.batch
        if len(self._step_times) == self._step_times.maxlen:
            PULSE.step_seconds = float(statistics.median(self._step_times))
        if self.world.is_chief:
            for rank in began:
                logging.warning("rank %d is a straggler: its probe takes %.2fx the median's %.4fs (its step waited "
                                "for its input %.0f%% of the time)", rank, self.watch.stragglers[rank], median,
                                100 * waiting[rank])
            for rank in ended:
                logging.info("rank %d is no longer a straggler", rank)
            for rank in input_began:
                logging.warning("the group waits for the input of rank %d (%.0f%% of the time since the last probe): "
                                "the slowest host's input sets the group's pace; a quicker pipeline or storage there "
                                "would help", rank, 100 * waiting[rank])
            for rank in input_ended:
                logging.info("the group no longer waits for the input of rank %d", rank)
        PULSE.input_slow = self.input_watch.stragglers.get(self.world.rank, 0.0)
        mine = self.watch.stragglers.get(self.world.rank, 0.0)
        leaving = {rank for rank, key in enumerate(hosts) if key == hosts[self.world.rank]}
        PULSE.slow = mine
        by_input = self._weigh_input(hosts, step_seconds, waiting, inputs, leaving)  # on every rank, every probe
        PULSE.evict = by_input or bool(mine) and self.round_seconds is not None and worth_evicting(
            seconds, leaving, EVICTION_HORIZON_SECONDS, self.round_seconds, self.settings.min_workers)

    def _weigh_input(self, hosts: List[float], step_seconds: List[float], waiting: List[float],
                     inputs: List[float], leaving: Set[int]) -> bool:
        """Whether this host is worth evicting for its input, as the newest read of the others' input alone
        says against each probe's share of waiting (`stragglers.worth_evicting_for_input`), at two probes in a
        row: an interval that an epoch's start or a commit made long reads a smaller share, and its overhead
        rides the step with the straggler, not the others' read; and which ranks read their input alone at
        the next probe, from the agreed numbers alike on every rank: where evictions are on
        (`World.evicts_stragglers`) and the input stragglers are all on one host, with at least `min_workers`
        ranks left without it, once a window of probes (each read costs the group the slowest rank's
        `INPUT_TIMING_SECONDS` or more), the ranks of the other hosts (the straggler's input pace is known:
        the group waits for it). A read is kept while the same host is the only slow one."""
        self._probes_since_input += 1
        slow_hosts = {hosts[rank] for rank in self.input_watch.stragglers}
        others = {rank for rank, key in enumerate(hosts) if key not in slow_hosts}
        if self.world.evicts_stragglers and len(slow_hosts) == 1 and len(others) >= max(1, self.settings.min_workers) \
                and self._probes_since_input >= self.settings.rules.window:
            self._readers, self._probes_since_input = others, 0
        if slow_hosts != self._inputs_for:  # another host, or none, is slow: what was read and said is stale
            self._inputs, self._inputs_for, self._worth = [], slow_hosts, []
        if any(inputs):
            self._inputs = list(inputs)
        if self.world.rank not in self.input_watch.stragglers or not any(self._inputs) or self.round_seconds is None:
            return False
        self._worth.append(worth_evicting_for_input(max(step_seconds), waiting, self._inputs, leaving,
                                                    EVICTION_HORIZON_SECONDS, self.round_seconds,
                                                    self.settings.min_workers))
        if any(inputs) or self._worth[-2:-1] != self._worth[-1:]:  # a new read, or the verdict turned
            logging.info("the group waits for this worker's input (%.0f%% of a step of %.3fs); the other hosts read "
                         "theirs alone at %.3fs a step at most%s: its host is %sworth evicting (a round costs %.0fs)",
                         100 * waiting[self.world.rank], max(step_seconds), max(self._inputs),
                         "" if any(inputs) else " (at an earlier probe)", "" if self._worth[-1] else "not ",
                         self.round_seconds)
        return self._worth[-2:] == [True, True]


# A probation's read alone runs at most this long: a fresh pass's first batch fills the pipeline's buffers (a
# large shuffle's), longer than a group's read may take (`feed.LONGEST_READ_SECONDS`); within the agent's
# --startup_timeout (120 s by default), so that past it the host is kept out as too slow, its pass timed.
PROBATION_READ_SECONDS = 60.0


def _taken(path: str, poll: float = 0.1) -> bool:
    """Waits until `path` is gone (the agent took the timing in it and asks for the next)."""
    while os.path.exists(path):
        time.sleep(poll)
    return True


def time_alone(model, strategy: tf.distribute.Strategy, probation: str, settings: ProbeSettings,
               time_input: Callable[[float, int, float], float],
               asked_again: Callable[[str], bool] = _taken) -> Tuple[float, float]:
    """A host on probation (`Env.PROBATION`: "RESULT_FILE,BATCH"): times the model's pass on this worker's
    replicas at the group's batch, as the group's probe does (traced untimed, then the median of `window`
    probes of `seconds`), with no group to wait for, and its input read alone at a step's rows
    (`time_input(seconds, rows a step, limit)`, a feed's); writes "PASS INPUT" (seconds per pass, and per step of
    input; 0: the model's inputs are not known) to RESULT_FILE, and again each time the agent takes it
    (`asked_again(RESULT_FILE)`: by default waits until the agent removed it, for as long as the agent lives:
    the heartbeat's thread ends a worker whose agent is gone); returns the last timing once not asked again."""
    path, batch = probation.rsplit(",", 1)
    timed = _forward_and_backward(model, strategy, int(batch))
    if timed is not None:
        timed(0.0)
    while True:
        seconds = 0.0 if timed is None else statistics.median(
            timed(probe_seconds(settings))[0] for _ in range(settings.rules.window))
        read = time_input(INPUT_TIMING_SECONDS, int(batch) * strategy.num_replicas_in_sync, PROBATION_READ_SECONDS)
        with open(path + ".tmp", "w") as f:
            f.write(f"{seconds!r} {read!r}")
        os.replace(path + ".tmp", path)  # whole or absent: the agent reads it once every slot wrote one
        if not asked_again(path):
            return seconds, read


def probe_seconds(settings: ProbeSettings) -> float:
    """How long a probe runs: `settings.seconds`, or a period and a half of a CPU quota this worker runs under
    (`cpu_quota`: a probe that ends before the quota stops it times a throttled host as fast as any; the
    loop ends before its time, so a whole period is timed)."""
    return max(settings.seconds, 1.5 * quota_period_seconds())


def _forward_and_backward(model, strategy: tf.distribute.Strategy, batch: int):
    """`seconds -> (seconds per pass, results)`: a compiled loop of passes of the model on a batch of zeros of
    its input's shape (the gradients of the sum of its outputs) within `seconds` of wall time (at least one
    pass; no pass that would end after it, at the mean pass so far: running past it added half a pass to
    every probe's cost), on every local replica, nothing reduced across replicas or workers. Bounded by
    time, not by a number of passes: a host throttled on a duty cycle (a CFS quota) must be timed over its
    stalls too. None for a model whose inputs are unknown (a subclassed model taking several inputs that
    declares none)."""
    x = _zeros_like_inputs(model, max(1, batch))
    if x is None:
        logging.info("the straggler probe is off: the model's inputs are not known")
        return None

    def one_pass(carried):
        # The input depends on the previous pass (by a zero the optimizer cannot fold, NaN or not), so no pass
        # is hoisted out of the loop or run beside another.
        zero = tf.math.is_nan(carried) & tf.math.is_inf(carried)
        inputs = tf.nest.map_structure(
            lambda t: t + tf.cast(zero, t.dtype) if t.dtype.is_floating or t.dtype.is_integer else t, x)
        with tf.GradientTape() as tape:
            outputs = model(inputs, training=False)
            total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in tf.nest.flatten(outputs)])
        grads = [g.values if isinstance(g, tf.IndexedSlices) else g
                 for g in tape.gradient(total, model.trainable_variables) if g is not None]
        return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads]) if grads else total

    @tf.function(autograph=False)  # no Python control flow on tensors here: its conversion tripled the trace
    def probe(seconds):
        def local():  # timed in the graph: the call's own Python work is not the model's speed
            began = tf.timestamp()
            def another(i, _):  # one more pass if, at the mean pass so far, it ends within `seconds`
                elapsed = tf.timestamp() - began
                return (i == 0) | (elapsed * tf.cast(i + 1, tf.float64) <= seconds * tf.cast(i, tf.float64))

            with tf.control_dependencies([began]):
                passes, last = tf.while_loop(another, lambda i, carried: (i + 1, one_pass(carried)),
                                             (tf.constant(0), tf.constant(0.0)), parallel_iterations=1)
            with tf.control_dependencies([last]):
                elapsed = tf.timestamp() - began
                return elapsed / tf.cast(passes, tf.float64), elapsed, last
        return strategy.run(local)

    def timed(seconds: float) -> Tuple[float, float, List[float]]:
        """(seconds per pass, and of the loop, on the slowest local replica; each replica's last result)."""
        results = probe(tf.constant(seconds, tf.float64))
        per_pass, elapsed, last = (strategy.experimental_local_results(t) for t in results)
        return (float(max(t.numpy() for t in per_pass)), float(max(t.numpy() for t in elapsed)),
                [t.numpy() for t in last])

    return timed


def _zeros_like_inputs(model, batch: int):
    """Zeros shaped as the model's inputs: a functional model's `input`, else the input shape it was built with
    (a Sequential without an `Input`, built by its first batch)."""
    def zeros(shape, dtype):
        return tf.zeros((batch,) + tuple(d or 1 for d in shape[1:]), dtype)

    try:
        return tf.nest.map_structure(lambda t: zeros(t.shape, t.dtype), model.input)
    except (AttributeError, ValueError):
        pass
    shape = (model.get_build_config() or {}).get("input_shape")
    if not shape or not all(isinstance(d, int) or d is None for d in shape):
        return None
    return zeros(shape, keras.backend.floatx())
