"""Dynamic SGD at the edge of stability: where, if anywhere, does a smooth transition beat jumping at once?

Lin et al. (2019) argue that momentum gathered under the small batch carries its noise into the first steps
after the learning rate jumps up, so an immediate linear-scaling jump hurts and a smooth one does not. That
should grow with the jump factor and with how close the scaled rate is to the edge of stability, which one
point far from the edge (`reproduce_dynamic_sgd`) cannot show. This sweep trains, on paired seeds (same
initial weights, same example stream):

    resize factor k in --factors  x  learning-rate multiplier m in --lr_multipliers

with a plan of two phases: `--small_samples` at the base batch b with SGD lr m * --tuned_lr, then
`--large_samples` at batch k*b, where linear scaling asks for k * m * tuned (cosine decay over the run, momentum
0.9). Per cell: static (batch b all along: the reference; one run per seed and m serves every k, since its plan
does not depend on k), immediate (jump at once), ramp (`--ramp_per_factor` steps per factor) and momentum (the
parameter-free momentum-share transition). Reported per cell and configuration: the divergence rate (a
non-finite loss, or test accuracy at chance at the end), the largest loss spike after the resize (the highest
running mean of the loss after it less the mean over the `--spike_window` steps before it; median over seeds),
test accuracy, and the paired difference against immediate with its 95 % interval. Writes a markdown table and
heat maps (factor x multiplier) of the accuracy and divergence-rate differences, ramp and momentum against
immediate, significant cells marked.

The model is the registry's `mnist_cnn` (two conv layers, no batch normalization) on `colour_digits`: the only
small model in `models/`, and without batch normalization the learning rate has a sharp stability limit, so
divergence is a real outcome rather than something normalization hides.

    python -m launch.papers.sweep_dynamic_sgd            # about 23 min on 2 CPU cores (3 seeds)
    python -m launch.papers.sweep_dynamic_sgd --quick    # well under a minute, for the test suite
"""
import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Dict, List, Tuple

from absl import app, flags, logging

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

from . import reproduction  # noqa: E402
from tf_elastic.elastic.flag_checks import require_finite_floats  # noqa: E402

CONFIGS = ("static", "immediate", "ramp", "momentum")
SMOOTH = ("ramp", "momentum")  # each compared against immediate

flags.DEFINE_string("data_dir", None, "Directory holding mnist.npz (default: ~/.keras/datasets, else a download).")
flags.DEFINE_string("out_dir", "runs/dynamic_sgd_sweep", "Where the table, raw results and heat maps are written.")
flags.DEFINE_enum("task", "colour_digits", ["colour_digits", "mnist"],
                  "colour_digits: the harder 32x32 RGB task built from MNIST; mnist: plain MNIST.")
flags.DEFINE_string("model", "mnist_cnn", "A name from models.NAMES.")
flags.DEFINE_list("factors", ["4", "16", "64"], "Resize factors k (ints >= 2): the large batch is k * --base_batch.")
flags.DEFINE_list("lr_multipliers", ["1", "2", "4", "8"], "Multipliers m of --tuned_lr at the base batch.")
flags.DEFINE_float("tuned_lr", 0.01, "SGD learning rate tuned for the static base batch (best validation accuracy "
                   "of 0.0025-0.04 at batch 8, 1 seed).", lower_bound=0.0)
flags.DEFINE_integer("base_batch", 8, "The small (and static) global batch.", lower_bound=1)
flags.DEFINE_integer("small_samples", 8192, "Training samples before the resize (rounded down to whole large "
                     "batches of the largest factor).", lower_bound=1)
flags.DEFINE_integer("large_samples", 49152, "Training samples after the resize (rounded likewise).", lower_bound=1)
flags.DEFINE_float("ramp_per_factor", 1.0, "Ramp length in steps per factor of batch growth.", lower_bound=0.0)
flags.DEFINE_float("weight_decay", 5e-4, "SGD weight decay.", lower_bound=0.0)
flags.DEFINE_integer("seeds", 3, "Paired seeds per cell (each adds about 8 min on 2 cores).", lower_bound=1)
flags.DEFINE_integer("train_examples", 16000, "Training examples used (a prefix of the training set).",
                     lower_bound=100)
flags.DEFINE_integer("test_examples", 2000, "Test examples evaluated (a prefix of the test set).", lower_bound=100)
flags.DEFINE_integer("spike_window", 10, "Steps before the resize that the spike is measured against.", lower_bound=1)
flags.DEFINE_integer("spike_smoothing", 5, "Steps in the running mean of the loss that spikes are read from.",
                     lower_bound=1)
flags.DEFINE_float("chance_accuracy", 0.15, "Test accuracy at or below which a run counts as diverged (chance is "
                   "0.10).", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_bool("quick", False, "A short version (MNIST, factors 2 and 8, multiplier 1, 2 seeds, a few "
                  "hundred samples), for the test suite.")
FLAGS = flags.FLAGS
require_finite_floats(__name__)

Cell = Tuple[int, float]  # (factor, multiplier)


def grid() -> Tuple[List[int], List[float]]:
    """The factors and multipliers the flags ask for; a clear error for a bad one."""
    try:
        factors, multipliers = [int(k) for k in FLAGS.factors], [float(m) for m in FLAGS.lr_multipliers]
    except ValueError as error:
        raise app.UsageError(f"--factors takes ints, --lr_multipliers numbers: {error}")
    if not factors or min(factors) < 2:
        raise app.UsageError(f"--factors must be ints >= 2; received {','.join(FLAGS.factors)}")
    if not multipliers or not all(math.isfinite(m) and m > 0 for m in multipliers):
        raise app.UsageError(f"--lr_multipliers must be finite numbers > 0; received {','.join(FLAGS.lr_multipliers)}")
    return factors, multipliers


def design(factor: int, multiplier: float) -> reproduction.Design:
    """One cell: the base batch for `--small_samples`, then factor x for `--large_samples`. Both are whole batches
    of the largest factor, so every cell (and its static run) trains on exactly the same samples."""
    unit = FLAGS.base_batch * max(grid()[0])
    small, large = (FLAGS.small_samples // unit * unit, FLAGS.large_samples // unit * unit)
    if not small or not large:
        raise app.UsageError(f"--small_samples and --large_samples must be >= --base_batch x the largest factor "
                             f"({unit}); received {FLAGS.small_samples} and {FLAGS.large_samples}")
    return reproduction.Design(FLAGS.model, [1, factor], [small, large], FLAGS.base_batch,
                               multiplier * FLAGS.tuned_lr, FLAGS.ramp_per_factor, FLAGS.weight_decay)


def sweep(train_data, test_data, out: Path, clock: Tuple[float, float]) -> str:
    """Trains every cell, seed by seed (a sweep cut short still has paired, balanced results), and rewrites the
    report after each seed."""
    factors, multipliers = grid()
    results: Dict[Cell, Dict[str, List[reproduction.Run]]] = {}
    static: Dict[tuple, reproduction.Run] = {}  # by (static plan, lr, seed): one run serves every factor
    for seed in range(FLAGS.seeds):
        for multiplier in multipliers:
            for factor in factors:
                cell = design(factor, multiplier)
                for config in CONFIGS:
                    plan = reproduction.phases(cell, config)
                    key = (tuple(plan), cell.learning_rate, seed)
                    run = static.get(key) if config == "static" else None
                    if run is None:
                        run = reproduction.train(cell, plan, reproduction.schedule_for(cell, config), seed,
                                                 train_data, test_data)
                    if config == "static":
                        static[key] = run
                    results.setdefault((factor, multiplier), {}).setdefault(config, []).append(run)
                    logging.info("k=%d m=%g %s seed %d: accuracy %.4f, %d steps (%.0f s)", factor, multiplier,
                                 config, seed, run.test_accuracy, len(run.losses), time.time() - clock[0])
        report = write(results, out, clock)
    return report


def diverged(run: reproduction.Run) -> bool:
    return not math.isfinite(run.losses[-1]) or run.test_accuracy <= FLAGS.chance_accuracy


def largest_spike(run: reproduction.Run, cell: reproduction.Design) -> float:
    """The largest rise of the smoothed loss after the resize over its mean before; nan if the run never got
    there, inf if its loss went non-finite after it."""
    found = reproduction.spikes(run, cell, FLAGS.spike_window, FLAGS.spike_smoothing, after=len(run.losses))
    return max(found) if found else float("nan")


def versus_immediate(runs: Dict[str, List[reproduction.Run]], config: str, measure) -> reproduction.Paired:
    """`measure(run)` of `config` less immediate's, seed by seed."""
    return reproduction.paired([measure(r) for r in runs[config]], [measure(r) for r in runs["immediate"]])


def accuracy(run: reproduction.Run) -> float:
    return run.test_accuracy * 100


def median(values: List[float]) -> float:
    """Over the runs that reached the resize (nan if none did); a diverged run's inf counts as the largest."""
    values = [v for v in values if not math.isnan(v)]
    return float(np.median(values)) if values else float("nan")


def table(results: Dict[Cell, Dict[str, List[reproduction.Run]]]) -> str:
    lines = ["| factor | lr multiplier | lr small → large | configuration | diverged | largest loss spike (median) "
             "| test accuracy % (mean ± 95 % CI) | accuracy − immediate (points, paired) | p |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for (factor, multiplier), runs in sorted(results.items()):
        rates = f"{multiplier * FLAGS.tuned_lr:g} → {factor * multiplier * FLAGS.tuned_lr:g}"
        for config in CONFIGS:
            spike = median([largest_spike(r, design(factor, multiplier)) for r in runs[config]])
            versus, p = "", ""
            if config != "immediate":
                paired = versus_immediate(runs, config, accuracy)
                versus = f"{paired.difference}{' *' if paired.significant else ''}"
                p = "n/a" if np.isnan(paired.p_value) else f"{paired.p_value:.3f}"
            lines.append(f"| {factor} | {multiplier:g} | {rates} | {config} | "
                         f"{sum(map(diverged, runs[config]))}/{len(runs[config])} | {spike:.3f} | "
                         f"{reproduction.interval([accuracy(r) for r in runs[config]])} | {versus} | {p} |")
    return "\n".join(lines)


def heat_maps(results: Dict[Cell, Dict[str, List[reproduction.Run]]], path: Path) -> None:
    """Rows: ramp and momentum against immediate; columns: accuracy difference (one colour scale for both rows;
    significant cells framed and starred) and divergence-rate difference (annotated with both counts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    factors, multipliers = sorted({k for k, _ in results}), sorted({m for _, m in results})
    shape = (len(SMOOTH), 2, len(factors), len(multipliers))
    values, texts, marked = np.full(shape, np.nan), np.full(shape, "", dtype=object), np.zeros(shape, bool)
    for row, config in enumerate(SMOOTH):
        for (i, factor), (j, multiplier) in _cells(factors, multipliers):
            runs = results[(factor, multiplier)]
            paired = versus_immediate(runs, config, accuracy)
            values[row, 0, i, j], marked[row, 0, i, j] = paired.difference.mean, paired.significant
            texts[row, 0, i, j] = f"{paired.difference.mean:+.1f}{' *' if paired.significant else ''}"
            count, base = (sum(map(diverged, runs[c])) for c in (config, "immediate"))
            values[row, 1, i, j] = (count - base) / len(runs[config])
            texts[row, 1, i, j] = f"{values[row, 1, i, j]:+.2f}\n{count} vs {base} of {len(runs[config])}"
    limits = (max(1e-9, np.nanmax(np.abs(values[:, 0]))), 1.0)
    titles = ("test accuracy − immediate (points; blue: higher)", "divergence rate − immediate (red: more)")
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), squeeze=False)
    for (row, config), column in itertools.product(enumerate(SMOOTH), (0, 1)):
        ax, limit = axes[row][column], limits[column]
        image = ax.imshow(values[row, column], cmap="RdBu" if column == 0 else "RdBu_r", vmin=-limit, vmax=limit)
        fig.colorbar(image, ax=ax, shrink=0.8)
        for (i, _), (j, _) in _cells(factors, multipliers):
            dark = abs(values[row, column, i, j]) > 0.6 * limit
            ax.text(j, i, texts[row, column, i, j], ha="center", va="center", fontsize=9,
                    color="white" if dark else "black")
            if marked[row, column, i, j]:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, linewidth=2.5))
        ax.set_xticks(range(len(multipliers)), [f"{m:g}×\n({m * FLAGS.tuned_lr:g})" for m in multipliers])
        ax.set_yticks(range(len(factors)), [f"{k}×" for k in factors])
        ax.set_xlabel("lr multiplier (lr at the base batch)")
        ax.set_ylabel("resize factor")
        ax.set_title(f"{config}: {titles[column]}", fontsize=10)
    fig.suptitle(f"{FLAGS.model} on {FLAGS.task}, batch {FLAGS.base_batch} → factor × {FLAGS.base_batch}; "
                 "* and frame: the paired 95 % interval over seeds excludes 0", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cells(factors: List[int], multipliers: List[float]):
    return [((i, k), (j, m)) for i, k in enumerate(factors) for j, m in enumerate(multipliers)]


def write(results: Dict[Cell, Dict[str, List[reproduction.Run]]], out: Path, clock: Tuple[float, float]) -> str:
    """Writes table.md, results.json and heat_maps.png under `out`; returns the report."""
    wall, cpu = time.time() - clock[0], time.process_time() - clock[1]
    report = header(results) + f"\nwall {wall:.0f} s, CPU {cpu:.0f} s (this process, all its threads)\n\n"
    report += table(results) + "\n"
    (out / "table.md").write_text(report)
    (out / "results.json").write_text(json.dumps({"wall_s": wall, "cpu_s": cpu, "cells": [
        {"factor": k, "multiplier": m, "ramp": reproduction.ramp_lengths(design(k, m)),
         "phases": {c: reproduction.phases(design(k, m), c) for c in CONFIGS},
         "runs": {c: [r._asdict() for r in runs[c]] for c in CONFIGS}} for (k, m), runs in sorted(results.items())]}))
    heat_maps(results, out / "heat_maps.png")
    return report


def header(results: Dict[Cell, Dict[str, List[reproduction.Run]]]) -> str:
    seeds = len(next(iter(next(iter(results.values())).values())))
    small, large = design(*next(iter(results))).phase_samples
    checks = sorted({reproduction.ramp_check(design(*cell)) for cell in results})
    return (f"{FLAGS.model} on {FLAGS.task} ({FLAGS.train_examples} training, {FLAGS.test_examples} test examples); "
            f"batch {FLAGS.base_batch} for {small} samples, then factor × {FLAGS.base_batch} for {large}; SGD "
            f"momentum {reproduction.MOMENTUM}, cosine decay, weight decay {FLAGS.weight_decay:g}; tuned lr "
            f"{FLAGS.tuned_lr:g}; ramp {FLAGS.ramp_per_factor:g} steps per factor; {seeds} of {FLAGS.seeds} paired "
            f"seeds; diverged: non-finite loss or test accuracy <= {FLAGS.chance_accuracy:g}; spike: "
            f"{FLAGS.spike_smoothing}-step running mean after the resize vs the {FLAGS.spike_window} steps before "
            "(static: read at the same sample count); *: the paired 95 % interval excludes 0\n" + "\n".join(checks))


def main(argv: List[str]) -> None:
    del argv
    if FLAGS.quick:
        FLAGS.task, FLAGS.train_examples, FLAGS.test_examples, FLAGS.seeds = "mnist", 1000, 500, 2
        FLAGS.factors, FLAGS.lr_multipliers, FLAGS.base_batch = ["2", "8"], ["1"], 2
        FLAGS.small_samples, FLAGS.large_samples = 128, 512
    grid()
    clock = (time.time(), time.process_time())
    train_data, test_data = reproduction.load_task(FLAGS.task, FLAGS.data_dir, FLAGS.train_examples,
                                                   FLAGS.test_examples)
    out = Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(sweep(train_data, test_data, out, clock))
    print(f"\nheat maps: {out / 'heat_maps.png'}")


if __name__ == "__main__":
    app.run(main)
