"""Dynamic mini-batch SGD (Lin et al. 2019) in miniature: does a smooth LR transition beat a jump?

One process simulates an elastic job whose global batch changes as if GPUs came and went (the paper
switches between 1x and 16x its base batch every few epochs). A ResNet-20 is trained on a harder 10-class
32x32 task (`reproduction.colour_digits`: MNIST digits at random offsets, random colours on random
backgrounds, Gaussian noise) under, with the same seeds (same initial weights, same data order):

- static: the base batch all along (the reference accuracy);
- immediate: linear scaling applied at once at every resize;
- ramp: Dynamic SGD's linear ramp (`--ramp_per_factor` steps per factor of batch growth);
- equal-LR control: jumps at once, like immediate, to the constant scale that gives each phase the ramp's
  average learning rate: separates "the ramp is smooth" from "the ramp trains at a lower average rate";
- momentum: the parameter-free transition that follows the share of the momentum buffer still made of
  old-batch gradients (`BatchResizeSchedule(transition="momentum")`).

The phases must be long enough for every ramp to finish: the script checks and says so. Prints a table
(test accuracy, final train loss, loss spikes after the plan's resizes, each with a 95 % interval over
seeds) and paired comparisons per seed, and writes a plot.

    python -m launch.papers.reproduce_dynamic_sgd               # ~60 min on 2 CPU cores (5 configurations)
    python -m launch.papers.reproduce_dynamic_sgd --quick       # ~1 min, for the test suite
"""
import json
import os
import time
from pathlib import Path
from typing import Dict, List

from absl import app, flags, logging

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402  (after the log level)
from keras import ops  # noqa: E402

from . import reproduction  # noqa: E402
from tf_elastic.elastic.flag_checks import require_finite_floats  # noqa: E402

CONFIGS = ("static", "immediate", "ramp", "equal_lr", "momentum")

flags.DEFINE_string("data_dir", None, "Directory holding mnist.npz (default: ~/.keras/datasets, else a download).")
flags.DEFINE_string("out_dir", "runs/dynamic_sgd", "Where the table, raw results and plot are written.")
flags.DEFINE_enum("task", "colour_digits", ["colour_digits", "mnist"],
                  "colour_digits: the harder 32x32 RGB task built from MNIST; mnist: plain MNIST.")
flags.DEFINE_string("model", "resnet20", "A name from models.NAMES.")
flags.DEFINE_list("plan", ["1", "16", "1", "16"], "Global batch per phase, as multiples of --base_batch.")
flags.DEFINE_float("phase_epochs", 2.0, "Epochs per phase of the plan.", lower_bound=0.01)
flags.DEFINE_integer("base_batch", 16, "Reference (static) global batch.", lower_bound=1)
flags.DEFINE_float("learning_rate", 0.025, "SGD learning rate at the base batch (momentum 0.9, cosine decay over "
                   "the run); 0.025 at 16 is 0.2 at 128.", lower_bound=0.0)
flags.DEFINE_float("weight_decay", 5e-4, "SGD weight decay.", lower_bound=0.0)
flags.DEFINE_float("ramp_per_factor", 1.0, "Ramp length in steps per factor of batch growth.", lower_bound=0.0)
flags.DEFINE_list("configs", list(CONFIGS), f"Which of {', '.join(CONFIGS)} to run.")
flags.DEFINE_integer("seeds", 5, "Seeds per configuration.", lower_bound=1)
flags.DEFINE_integer("train_examples", 4000, "Training examples used (a prefix of the training set).",
                     lower_bound=100)
flags.DEFINE_integer("test_examples", 2000, "Test examples evaluated (a prefix of the test set).", lower_bound=100)
flags.DEFINE_integer("spike_window", 10, "Steps after (and before) a resize compared for the loss spike.",
                     lower_bound=1)
flags.DEFINE_integer("spike_smoothing", 5, "Steps in the running mean of the loss that spikes are read from.",
                     lower_bound=1)
flags.DEFINE_bool("quick", False, "A minute-long version (mnist_cnn on MNIST, 1000 examples, 2 seeds), for the "
                  "test suite.")
FLAGS = flags.FLAGS
require_finite_floats(__name__)


def design() -> reproduction.Design:
    """The experiment the flags describe."""
    return reproduction.Design(FLAGS.model, [int(m) for m in FLAGS.plan],
                               [int(FLAGS.phase_epochs * FLAGS.train_examples)] * len(FLAGS.plan), FLAGS.base_batch,
                               FLAGS.learning_rate, FLAGS.ramp_per_factor, FLAGS.weight_decay)


def schedule_for(config: str) -> keras.optimizers.schedules.LearningRateSchedule:
    """The learning-rate schedule of `config`, its resizes already recorded (the plan is known in advance)."""
    return _equal_lr() if config == "equal_lr" else reproduction.schedule_for(design(), config)


def _equal_lr() -> "StepTable":
    """Immediate jumps, each phase scaled so that its summed learning rate equals the ramp's in that phase."""
    import numpy as np

    plan = reproduction.phases(design())
    steps = sum(n for _, n in plan)
    ramp, immediate = (np.array([float(schedule_for(c)(step)) for step in range(steps)])
                       for c in ("ramp", "immediate"))
    start = 0
    for _, n in plan:
        part = slice(start, start + n)
        immediate[part] *= ramp[part].sum() / immediate[part].sum()
        start += n
    return StepTable(immediate)


def spikes(run: reproduction.Run) -> List[float]:
    """Per resize: the highest running-mean loss in the `--spike_window` steps after it, less the mean of the
    running mean over the window before it."""
    return reproduction.spikes(run, design(), FLAGS.spike_window, FLAGS.spike_smoothing)


class StepTable(keras.optimizers.schedules.LearningRateSchedule):
    """A learning rate read from a per-step table (the equal-LR control's precomputed rates)."""

    def __init__(self, table):
        self.table = [float(v) for v in table]

    def __call__(self, step):
        index = ops.minimum(ops.cast(step, "int32"), len(self.table) - 1)
        return ops.take(ops.convert_to_tensor(self.table, "float32"), index)

    def get_config(self):
        return {"table": self.table}


def summarise(results: Dict[str, List[reproduction.Run]]) -> str:
    import numpy as np

    lines = ["| configuration | test accuracy % (mean ± 95 % CI) | final train loss | mean loss spike after a resize "
             "| worst spike |", "|---|---:|---:|---:|---:|"]
    for name, runs in results.items():
        acc = reproduction.interval([r.test_accuracy * 100 for r in runs])
        tail = reproduction.interval([np.mean(r.losses[-max(1, len(r.losses) // 20):]) for r in runs])
        mean_spike = reproduction.interval([np.mean(spikes(r) or [np.nan]) for r in runs])
        worst = reproduction.interval([max(spikes(r) or [np.nan]) for r in runs])
        lines.append(f"| {name} | {acc} | {tail.mean:.4f} | {mean_spike.mean:.3f} ± {mean_spike.half_width:.3f} | "
                     f"{worst.mean:.3f} ± {worst.half_width:.3f} |")
    pairs = [("ramp", "immediate"), ("ramp", "equal_lr"), ("equal_lr", "immediate"), ("ramp", "static"),
             ("immediate", "static"), ("momentum", "immediate")]
    lines += ["", reproduction.PAIRED_HEADER]
    for a, b in pairs:
        if a in results and b in results:
            lines.append(reproduction.paired([r.test_accuracy * 100 for r in results[a]],
                                             [r.test_accuracy * 100 for r in results[b]])
                         .row(f"accuracy: {a} - {b} (points)"))
    for a, b in [("immediate", "ramp"), ("immediate", "equal_lr"), ("equal_lr", "ramp"), ("immediate", "momentum")]:
        if a in results and b in results:
            lines.append(reproduction.paired([np.mean(spikes(r)) for r in results[a]],
                                             [np.mean(spikes(r)) for r in results[b]])
                         .row(f"mean spike: {a} - {b}"))
    return "\n".join(lines)


def plot(results: Dict[str, List[reproduction.Run]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(4, 1, figsize=(10, 12))
    for n, (name, runs) in enumerate(results.items()):
        run = runs[0]
        smooth = np.convolve(run.losses, np.ones(20) / 20, mode="valid")
        axes[0].plot(run.samples, run.learning_rates, label=name)
        axes[1].plot(run.samples, run.batches, label=name)
        axes[2].plot(run.samples[19:], smooth, label=name, linewidth=0.8)
        accuracies = [r.test_accuracy * 100 for r in runs]
        axes[3].scatter([n] * len(accuracies), accuracies, color=f"C{n}")
    for ax in axes[:3]:
        ax.sharex(axes[0])
        for boundary in reproduction.resize_samples(design()):
            ax.axvline(boundary, color="grey", linestyle=":", linewidth=0.8)
    axes[0].set_ylabel("learning rate")
    axes[1].set_ylabel("global batch")
    axes[2].set_ylabel("train loss (20-step mean)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("samples seen")
    axes[3].set_xticks(range(len(results)), list(results))
    axes[3].set_ylabel("test accuracy % (each seed)")
    axes[0].legend(fontsize=7)
    axes[0].set_title("Dynamic SGD in miniature (first seed; dotted lines: resizes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: List[str]) -> None:
    del argv
    if FLAGS.quick:
        FLAGS.task, FLAGS.model, FLAGS.train_examples, FLAGS.test_examples = "mnist", "mnist_cnn", 1000, 500
        FLAGS.seeds, FLAGS.learning_rate = 2, 0.05
        FLAGS.base_batch, FLAGS.phase_epochs, FLAGS.ramp_per_factor = 4, 1.0, 0.5
    unknown = sorted(set(FLAGS.configs) - set(CONFIGS))
    if unknown:
        raise app.UsageError(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    train_data, test_data = reproduction.load_task(FLAGS.task, FLAGS.data_dir, FLAGS.train_examples,
                                                   FLAGS.test_examples)
    check = reproduction.ramp_check(design())
    print(check, flush=True)
    out = Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, List[reproduction.Run]] = {}
    started = time.time()
    for seed in range(FLAGS.seeds):  # seed by seed, so that a run cut short still has balanced, paired results
        for config in [c for c in CONFIGS if c in FLAGS.configs]:
            run = reproduction.train(design(), reproduction.phases(design(), config), schedule_for(config), seed,
                                     train_data, test_data)
            results.setdefault(config, []).append(run)
            logging.info("%s seed %d: test accuracy %.4f (%.0f s so far)", config, seed, run.test_accuracy,
                         time.time() - started)
        report = _write(results, out, check, time.time() - started)
    print(report)
    print(f"\nplot: {out / 'dynamic_sgd.png'}")


def _write(results: Dict[str, List[reproduction.Run]], out: Path, check: str, seconds: float) -> str:
    seeds = len(next(iter(results.values())))
    header = (f"{FLAGS.model} on {FLAGS.task} ({FLAGS.train_examples} training, {FLAGS.test_examples} test "
              f"examples); plan {'x,'.join(FLAGS.plan)}x of batch {FLAGS.base_batch}, {FLAGS.phase_epochs:g} epochs "
              f"a phase; SGD lr {FLAGS.learning_rate:g} at the base batch, momentum {reproduction.MOMENTUM}, "
              f"cosine decay; ramp {FLAGS.ramp_per_factor:g} steps per factor; {seeds} of {FLAGS.seeds} seeds; spikes: "
              f"{FLAGS.spike_smoothing}-step running mean, {FLAGS.spike_window}-step windows; {seconds:.0f} s\n{check}")
    report = header + "\n\n" + summarise(results) + "\n"
    (out / "table.md").write_text(report)
    (out / "results.json").write_text(json.dumps({k: [r._asdict() for r in v] for k, v in results.items()}))
    plot(results, out / "dynamic_sgd.png")
    return report


if __name__ == "__main__":
    app.run(main)
