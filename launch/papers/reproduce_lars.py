"""The LARS paper's claim in miniature: at a 32x larger batch, does LARS keep the small-batch accuracy where
large-batch SGD, tuned as carefully, does not?

You et al. (2017) report LARS at batch 8K matching small-batch accuracy (AlexNet-BN 60.1 % vs 60.2 % at
512; ResNet-50 73.5 % vs 73.8 % at 256) where SGD with linear scaling and warm-up falls behind. Here the
same model trains for the same epochs under SGD at the base batch (the baseline), and, at the large batch,
SGD and LARS with the same tuning budget: each gets a grid of the same size (SGD: peak LR, including the
linear- and square-root-scaled ones, x warm-up length; LARS: global LR x warm-up length, eta fixed), one run
per point, scored on a validation split held out of the training set. The best point of each is then
trained with `--seeds` seeds and scored on the test set, with 95 % intervals and paired comparisons.

    python -m launch.papers.reproduce_lars            # ~35 min on 2 CPU cores
    python -m launch.papers.reproduce_lars --quick    # ~1 min, for the test suite
"""
import json
import os
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

from absl import app, flags, logging

from . import reproduction
from tf_elastic.elastic.flag_checks import require_finite_floats

flags.DEFINE_string("data_dir", None, "Directory holding mnist.npz (default: ~/.keras/datasets, else a download).")
flags.DEFINE_string("out_dir", "runs/lars", "Where the tables, raw results and plot are written.")
flags.DEFINE_enum("task", "mnist", ["mnist", "colour_digits"], "mnist, or the harder 32x32 RGB task built from it.")
flags.DEFINE_string("model", "mnist_cnn", "A name from models.NAMES.")
flags.DEFINE_integer("base_batch", 32, "The small-batch baseline's batch.", lower_bound=1)
flags.DEFINE_integer("batch_factor", 32, "How much larger the large batch is.", lower_bound=2)
flags.DEFINE_integer("epochs", 4, "Epochs, the same for every run.", lower_bound=1)
flags.DEFINE_float("sgd_learning_rate", 0.05, "The baseline's SGD learning rate at the base batch.", lower_bound=0.0)
flags.DEFINE_list("sgd_grid", [f"{lr}/{w}" for lr in ("0.2", "0.1", "0.05", "0.025", "0.0125") for w in (1, 2)],
                  "Large-batch SGD's tuning grid, PEAK_LR/WARMUP_EPOCHS. Linear scaling of 0.05 to 32x (1.6), 0.8, "
                  "0.4 and square-root scaling (0.28) diverged to chance in every run, so the grid spends its "
                  "points below them.")
flags.DEFINE_list("lars_grid", [f"{lr}/{w}" for lr in ("80", "40", "20", "10", "5") for w in (1, 2)],
                  "LARS's tuning grid, GLOBAL_LR/WARMUP_EPOCHS (the same size as --sgd_grid: an equal budget).")
flags.DEFINE_float("lars_trust_coefficient", 0.001, "LARS eta (fixed; the grid moves the global LR).", lower_bound=0.0)
flags.DEFINE_float("weight_decay", 5e-4, "Weight decay (LARS: inside the trust ratio).", lower_bound=0.0)
flags.DEFINE_integer("seeds", 3, "Seeds of each chosen configuration on the test set.", lower_bound=1)
flags.DEFINE_integer("train_examples", 30000, "Training examples used (after the validation split).",
                     lower_bound=100)
flags.DEFINE_integer("validation_examples", 10000, "Examples held out of the training set to choose by.",
                     lower_bound=1)
flags.DEFINE_bool("quick", False, "A minute-long version: 2000 examples, 1 epoch, 2-point grids, 1 seed.")
FLAGS = flags.FLAGS
require_finite_floats(__name__)


class Trial(NamedTuple):
    optimizer: str  # "sgd" or "lars"
    learning_rate: float
    warmup_epochs: float
    batch: int

    @property
    def name(self) -> str:
        if self.batch == FLAGS.base_batch:
            return f"SGD, batch {self.batch}, lr {self.learning_rate:g} (baseline)"
        return (f"{self.optimizer.upper()}, batch {self.batch}, lr {self.learning_rate:g}, "
                f"warm-up {self.warmup_epochs:g} ep")


class Result(NamedTuple):
    losses: List[float]
    accuracy: float


def grid(optimizer: str, entries: List[str]) -> List[Trial]:
    trials = []
    for entry in entries:
        try:
            lr, warmup = (float(v) for v in entry.split("/"))
        except ValueError:
            raise app.UsageError(f"--{optimizer}_grid: {entry!r} is not LR/WARMUP_EPOCHS (for example 0.8/1)") from None
        if not (lr > 0 and warmup >= 0):
            raise app.UsageError(f"--{optimizer}_grid: {entry!r} needs LR > 0 and WARMUP_EPOCHS >= 0")
        trials.append(Trial(optimizer, lr, warmup, FLAGS.base_batch * FLAGS.batch_factor))
    return trials


def train(trial: Trial, seed: int, train_data, eval_data) -> Result:
    import keras

    from tf_elastic import models
    from tf_elastic import LARS, WarmupPolynomialDecay

    keras.utils.set_random_seed(seed)
    x, y = train_data
    kept = len(x) // trial.batch * trial.batch  # whole batches only, so every step sees the configured batch
    steps = FLAGS.epochs * (kept // trial.batch)
    warmup = int(trial.warmup_epochs * (kept // trial.batch))
    schedule = WarmupPolynomialDecay(trial.learning_rate, warmup, max(1, steps - warmup))
    if trial.optimizer == "lars":  # every variable adapted, as in the paper's Algorithm 1
        optimizer = LARS(schedule, momentum=0.9, weight_decay=FLAGS.weight_decay,
                         trust_coefficient=FLAGS.lars_trust_coefficient, exclude_from_layer_adaptation=[])
    else:
        optimizer = keras.optimizers.SGD(schedule, momentum=0.9, weight_decay=FLAGS.weight_decay)
    model = models.get(FLAGS.model, x.shape[1:], 10)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(x[:kept], y[:kept], batch_size=trial.batch, epochs=FLAGS.epochs, shuffle=True, verbose=0)
    _, accuracy = model.evaluate(*eval_data, batch_size=1000, verbose=0)
    return Result(history.history["loss"], float(accuracy))


def load_task() -> Tuple[tuple, tuple, tuple]:
    """(train, validation, test): validation is held out of the training set; the test set is only scored."""
    from tf_elastic.elastic.worker import datasets

    data = datasets.load("mnist", FLAGS.data_dir or datasets.DEFAULT_DATA_DIR)
    x, xt = data.x_train, data.x_test
    if FLAGS.task == "colour_digits":
        x, xt = reproduction.colour_digits(x), reproduction.colour_digits(xt, reproduction.TASK_SEED + 1)
    (x, y), validation = reproduction.split_validation(x, data.y_train, FLAGS.validation_examples)
    return (x[: FLAGS.train_examples], y[: FLAGS.train_examples]), validation, (xt, data.y_test)


def main(argv: List[str]) -> None:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if FLAGS.quick:
        FLAGS.train_examples, FLAGS.validation_examples, FLAGS.epochs, FLAGS.seeds = 2000, 1000, 1, 1
        FLAGS.sgd_grid, FLAGS.lars_grid, FLAGS.batch_factor = ["0.4/0", "0.28/0"], ["5/0", "10/0"], 8
    sgd, lars = grid("sgd", FLAGS.sgd_grid), grid("lars", FLAGS.lars_grid)
    if len(sgd) != len(lars):
        raise app.UsageError(f"--sgd_grid has {len(sgd)} points and --lars_grid {len(lars)}: an equal tuning "
                             "budget needs grids of the same size")
    train_data, validation, test = load_task()
    started = time.time()
    scores: Dict[Trial, Result] = {}
    for trial in sgd + lars:
        scores[trial] = train(trial, 0, train_data, validation)
        logging.info("%s: validation %.4f (%.0f s)", trial.name, scores[trial].accuracy, time.time() - started)
    best = {name: max(trials, key=lambda t: scores[t].accuracy) for name, trials in (("sgd", sgd), ("lars", lars))}
    baseline = Trial("sgd", FLAGS.sgd_learning_rate, 0.0, FLAGS.base_batch)
    finals: Dict[str, List[Result]] = {}
    for trial in (baseline, best["sgd"], best["lars"]):
        for seed in range(FLAGS.seeds):
            finals.setdefault(trial.name, []).append(train(trial, seed, train_data, test))
            logging.info("%s seed %d: test %.4f (%.0f s)", trial.name, seed, finals[trial.name][-1].accuracy,
                         time.time() - started)
    report = _report(sgd, lars, scores, [baseline, best["sgd"], best["lars"]], finals, time.time() - started)
    report += _edges({"SGD": (sgd, best["sgd"]), "LARS": (lars, best["lars"])})
    out = Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(report)
    (out / "results.json").write_text(json.dumps(
        {"grid": [{**t._asdict(), "validation_accuracy": r.accuracy, "losses": r.losses} for t, r in scores.items()],
         "test": {k: [r._asdict() for r in v] for k, v in finals.items()}}))
    _plot(finals, out / "lars.png")
    print(report + f"\nplot: {out / 'lars.png'}")


def _edges(chosen: Dict[str, Tuple[List[Trial], Trial]]) -> str:
    """A best point on the edge of its grid means the grid did not bracket the optimum: say so."""
    lines = []
    for name, (trials, best) in chosen.items():
        rates = {t.learning_rate for t in trials}
        if len(rates) > 1 and best.learning_rate in (min(rates), max(rates)):
            lines.append(f"WARNING: {name}'s best learning rate, {best.learning_rate:g}, is at the edge of its grid\n")
    return "".join(lines) or "Each optimizer's best learning rate lies inside its grid.\n"


def _report(sgd, lars, scores, chosen, finals, seconds: float) -> str:
    acc = {name: [r.accuracy * 100 for r in runs] for name, runs in finals.items()}
    baseline, best_sgd, best_lars = (t.name for t in chosen)
    lines = [f"{FLAGS.model} on {FLAGS.task}: {FLAGS.epochs} epochs of {FLAGS.train_examples} training examples, "
             f"{FLAGS.validation_examples} held out for validation; large batch "
             f"{FLAGS.base_batch * FLAGS.batch_factor} ({FLAGS.batch_factor}x); LARS eta "
             f"{FLAGS.lars_trust_coefficient:g}; momentum 0.9, weight decay {FLAGS.weight_decay:g}, polynomial decay "
             f"after warm-up; {seconds:.0f} s", "",
             f"Tuning (seed 0, validation accuracy %; {len(sgd)} points each):", "",
             "| SGD peak LR | warm-up epochs | validation % | LARS LR | warm-up epochs | validation % |",
             "|---:|---:|---:|---:|---:|---:|"]
    for s, lt in zip(sgd, lars):
        lines.append(f"| {s.learning_rate:g} | {s.warmup_epochs:g} | {scores[s].accuracy * 100:.2f} | "
                     f"{lt.learning_rate:g} | {lt.warmup_epochs:g} | {scores[lt].accuracy * 100:.2f} |")
    lines += ["", f"Test set, {FLAGS.seeds} seed(s) of each chosen configuration:", "",
              "| configuration | test accuracy % (mean ± 95 % CI) | gap to baseline (points) | final train loss |",
              "|---|---:|---:|---:|"]
    base = reproduction.interval(acc[baseline]).mean
    for name in (baseline, best_sgd, best_lars):
        result = reproduction.interval(acc[name])
        loss = sum(r.losses[-1] for r in finals[name]) / len(finals[name])
        lines.append(f"| {name} | {result} | {result.mean - base:+.2f} | {loss:.4f} |")
    lines += ["", reproduction.PAIRED_HEADER,
              reproduction.paired(acc[best_lars], acc[best_sgd]).row("LARS - tuned SGD (points)"),
              reproduction.paired(acc[best_lars], acc[baseline]).row("LARS - baseline (points)"),
              reproduction.paired(acc[best_sgd], acc[baseline]).row("tuned SGD - baseline (points)"), ""]
    for name, label in ((best_lars, "LARS"), (best_sgd, "tuned large-batch SGD")):
        gap = reproduction.interval(acc[name]).mean - base
        lines.append(f"{label} is {gap:+.2f} points from the baseline: "
                     + ("within 1 point" if gap >= -1.0 else "more than 1 point below"))
    return "\n".join(lines) + "\n"


def _plot(finals: Dict[str, List[Result]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n, (name, runs) in enumerate(finals.items()):
        for i, run in enumerate(runs):
            ax.plot(range(1, len(run.losses) + 1), run.losses, color=f"C{n}", alpha=0.8,
                    label=name if i == 0 else None, marker="o")
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss")
    ax.set_title(f"LARS in miniature: same epochs, {FLAGS.batch_factor}x the batch, equal tuning budgets")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
