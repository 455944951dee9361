"""Durable copies on s3:// beside a local directory: seconds and bytes per copy, and what the training path pays.

One process trains `--model` on random data (`train_on_batch`) and commits through `CommittedState` as fit
does (asynchronous writes, the rest on the commit thread): every `--commit_every_steps` steps, with every
`--durable_every_commits`-th commit copied to no durable storage ("none"), a local directory ("local") or
`s3://` through boto3 against moto's S3 server on 127.0.0.1, started here ("s3"). The targets run side by
side, interleaved over `--repeats` rounds; medians are reported. The S3 server shares this machine's cores
with training, so its CPU is charged to the s3 row (on AWS it is not).

The training path's cost of a copy is the step time against "none"; the overhead at the runtime's default
cadence (a commit every 100 steps, a copy every 10th) spreads that cost over 1000 steps.

    python -m launch.bench.bench_durable --model=resnet20 --steps=200 --repeats=3
"""
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from absl import app, flags

flags.DEFINE_string("model", "resnet20", "Model of the registry (models.NAMES).")
flags.DEFINE_integer("image_size", 32, "Input images are IMAGE_SIZE x IMAGE_SIZE x 3.", lower_bound=8)
flags.DEFINE_integer("batch_size", 32, "Examples per step.", lower_bound=1)
flags.DEFINE_integer("steps", 200, "Timed training steps per run.", lower_bound=10)
flags.DEFINE_integer("commit_every_steps", 10, "Commit every N steps.", lower_bound=1)
flags.DEFINE_integer("durable_every_commits", 2, "Copy every N-th commit.", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "Rounds; each runs every target once.", lower_bound=1)
flags.DEFINE_list("targets", ["none", "local", "s3"], "Durable targets to compare: none, local, s3.")
FLAGS = flags.FLAGS

DEFAULT_COPY_EVERY_STEPS = 100 * 10  # train.py's --commit_every_steps and --durable_every_commits defaults


def run(target: str, root: Path, number: int) -> Dict[str, float]:
    """One training run; returns ms per step and the durable copies' median bytes and seconds."""
    import keras
    import numpy as np

    from tf_elastic import models
    from tf_elastic.elastic.events import EventLog, read_events
    from tf_elastic.elastic.protocol import Event
    from tf_elastic.elastic.worker.commit import CommittedState
    from tf_elastic.elastic.worker.durable import DurableCopies
    from tf_elastic.elastic.worker.world import World

    keras.utils.set_random_seed(0)
    model = models.get(FLAGS.model, (FLAGS.image_size, FLAGS.image_size, 3), 10)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.random((FLAGS.batch_size, FLAGS.image_size, FLAGS.image_size, 3), np.float32)
    y = rng.integers(0, 10, FLAGS.batch_size)
    model.train_on_batch(x, y)  # traces the step: not timed
    run_dir = root / f"{target}-{number}"
    directory = {"none": None, "local": str(run_dir / "durable"), "s3": f"s3://bench/{target}-{number}"}[target]
    state = CommittedState(World(), str(run_dir), model, durable=DurableCopies(directory) if directory else None,
                           durable_every_commits=FLAGS.durable_every_commits if directory else 0,
                           events=EventLog(run_dir, "bench"), background=True)
    started = time.perf_counter()
    for step in range(1, FLAGS.steps + 1):
        model.train_on_batch(x, y)
        if step % FLAGS.commit_every_steps == 0:
            state.commit(epoch=0, samples=step * FLAGS.batch_size, step=step, global_batch=FLAGS.batch_size)
    elapsed = time.perf_counter() - started
    state.close()
    copies = [e for e in read_events(run_dir) if e["event"] == Event.DURABLE_COPY]
    failed = [e["error"] for e in copies if "error" in e]
    if failed:
        raise RuntimeError(f"{target}: a durable copy failed: {failed[0]}")
    return {"ms_per_step": 1000 * elapsed / FLAGS.steps, "copies": len(copies),
            "bytes": statistics.median([e["bytes"] for e in copies]) if copies else 0.0,
            "copy_s": statistics.median([e["seconds"] for e in copies]) if copies else 0.0}


def table(results: Dict[str, List[Dict[str, float]]]) -> List[str]:
    base = statistics.median(r["ms_per_step"] for r in results.get("none", results[next(iter(results))]))
    lines = ["| target | copies per run | MB per copy | s per copy (median) | ms per step (median) | vs none | "
             "training-path overhead at the default cadence |", "|---|---|---|---|---|---|---|"]
    for target, runs in results.items():
        step_ms = statistics.median(r["ms_per_step"] for r in runs)
        copies = statistics.median(r["copies"] for r in runs)
        per_copy_ms = (step_ms - base) * FLAGS.steps / copies if copies else 0.0
        overhead = per_copy_ms / (DEFAULT_COPY_EVERY_STEPS * base)
        lines.append(f"| {target} | {copies:.0f} | {statistics.median(r['bytes'] for r in runs) / 1e6:.2f} | "
                     f"{statistics.median(r['copy_s'] for r in runs):.3f} | {step_ms:.1f} | {step_ms / base:.3f} | "
                     f"{overhead:+.2%} |" if copies else f"| {target} | 0 | - | - | {step_ms:.1f} | "
                     f"{step_ms / base:.3f} | - |")
    return lines


def main(argv: List[str]) -> Optional[int]:
    del argv
    unknown = set(FLAGS.targets) - {"none", "local", "s3"}
    if unknown:
        raise app.UsageError(f"--targets: unknown {sorted(unknown)}; accepted: none, local, s3")
    results: Dict[str, List[Dict[str, float]]] = {t: [] for t in FLAGS.targets}
    with tempfile.TemporaryDirectory(prefix="tf_elastic-bench-durable-") as root, contextlib.ExitStack() as stack:
        if "s3" in FLAGS.targets:
            from tf_elastic.testing.s3 import local_s3

            os.environ.update(stack.enter_context(local_s3("bench")))
        for number in range(FLAGS.repeats):
            for target in FLAGS.targets:
                results[target].append(run(target, Path(root), number))
                last = results[target][-1]
                print(f"round {number} {target}: {last['ms_per_step']:.1f} ms/step, {last['copies']} copies "
                      f"of {last['bytes'] / 1e6:.2f} MB, {last['copy_s']:.3f} s each", flush=True)
    print(f"\n{FLAGS.model} {FLAGS.image_size}x{FLAGS.image_size}, batch {FLAGS.batch_size}, {FLAGS.steps} steps, "
          f"a commit every {FLAGS.commit_every_steps} steps, a copy every {FLAGS.durable_every_commits} commits, "
          f"{FLAGS.repeats} rounds\n")
    print("\n".join(table(results)))
    return 0


def run_main() -> None:
    app.run(main)


if __name__ == "__main__":
    run_main()
