"""The LARS paper's claim in miniature: does LARS keep accuracy at a 32x larger batch?

You et al. (2017) report LARS at batch 8K matching small-batch accuracy (AlexNet-BN 60.1 % vs 60.2 % at
512; ResNet-50 73.5 % vs 73.8 % at 256) where SGD with linear scaling and warm-up falls behind. Here:
the same CNN, the same epochs on MNIST, ≥ 3 seeds, under (1) SGD at the base batch, (2) SGD at 32x the
batch with linear LR scaling and warm-up, (3) LARS at 32x with warm-up and polynomial decay. Prints a
markdown table and writes a plot; the goal is LARS at 32x within 1 % of the baseline.

    python -m launch.reproduce_lars            # ~35 min on 2 CPU cores
    python -m launch.reproduce_lars --quick    # ~1 min, for the test suite
"""
import json
import os
import time
from pathlib import Path
from typing import Dict, List, NamedTuple

from absl import app, flags, logging

flags.DEFINE_string("data_dir", None, "Directory holding mnist.npz (default: ../shared/data).")
flags.DEFINE_string("out_dir", "runs/lars", "Where the table, raw results and plot are written.")
flags.DEFINE_integer("base_batch", 32, "The small-batch baseline's batch.", lower_bound=1)
flags.DEFINE_integer("batch_factor", 32, "How much larger the large batch is.", lower_bound=2)
flags.DEFINE_integer("epochs", 5, "Epochs, the same for every configuration.", lower_bound=1)
flags.DEFINE_float("warmup_epochs", 1.0, "Warm-up of the large-batch runs, in epochs.", lower_bound=0.0)
flags.DEFINE_float("sgd_learning_rate", 0.05, "SGD learning rate at the base batch (scaled linearly).", lower_bound=0.0)
flags.DEFINE_float("lars_learning_rate", 10.0, "LARS global learning rate at the large batch.", lower_bound=0.0)
flags.DEFINE_float("lars_trust_coefficient", 0.001, "LARS eta.", lower_bound=0.0)
flags.DEFINE_enum("lars_exclude", "none", ["none", "biases"],
                  "Variables LARS leaves unadapted (trust ratio 1): none, as in the paper's Algorithm 1, or biases "
                  "(rank <= 1, LARS's default as in later implementations): those then move by the global LR, "
                  "several units at 32x.")
flags.DEFINE_float("weight_decay", 5e-4, "Weight decay (LARS: inside the trust ratio).", lower_bound=0.0)
flags.DEFINE_integer("seeds", 3, "Seeds per configuration.", lower_bound=1)
flags.DEFINE_integer("train_examples", 60000, "Training examples used.", lower_bound=100)
flags.DEFINE_bool("quick", False, "A minute-long version: 4000 examples, 2 epochs, 1 seed.")
flags.DEFINE_list("lars_sweep", [], "Instead of the comparison: LR/ETA pairs (e.g. 2/0.001,5/0.001) for LARS at the "
                  "large batch, one seed each, against the baseline: how --lars_learning_rate and "
                  "--lars_trust_coefficient were chosen.")
FLAGS = flags.FLAGS


class Result(NamedTuple):
    losses: List[float]
    test_accuracy: float


def train(config: str, seed: int, data, lars_learning_rate: float, lars_trust_coefficient: float) -> Result:
    import keras

    import models
    from tf_elastic import LARS, WarmupPolynomialDecay

    keras.utils.set_random_seed(seed)
    x, y = data.x_train[: FLAGS.train_examples], data.y_train[: FLAGS.train_examples]
    large = config != "SGD, base batch"
    batch = FLAGS.base_batch * (FLAGS.batch_factor if large else 1)
    steps = FLAGS.epochs * (len(x) // batch)
    warmup = int(FLAGS.warmup_epochs * (len(x) // batch)) if large else 0
    if config.startswith("LARS"):
        optimizer = LARS(WarmupPolynomialDecay(lars_learning_rate, warmup, max(1, steps - warmup)),
                         momentum=0.9, weight_decay=FLAGS.weight_decay, trust_coefficient=lars_trust_coefficient,
                         exclude_from_layer_adaptation=[] if FLAGS.lars_exclude == "none" else None)
    else:
        peak = FLAGS.sgd_learning_rate * (FLAGS.batch_factor if large else 1)
        optimizer = keras.optimizers.SGD(WarmupPolynomialDecay(peak, warmup, max(1, steps - warmup)), momentum=0.9,
                                         weight_decay=FLAGS.weight_decay)
    model = models.get("mnist_cnn", x.shape[1:], data.num_classes)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    kept = len(x) // batch * batch  # whole batches only, so every step sees the configured batch
    history = model.fit(x[:kept], y[:kept], batch_size=batch, epochs=FLAGS.epochs, shuffle=True, verbose=0)
    _, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=1000, verbose=0)
    return Result(history.history["loss"], float(accuracy))


def main(argv: List[str]) -> None:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if FLAGS.quick:
        FLAGS.train_examples, FLAGS.epochs, FLAGS.seeds = min(FLAGS.train_examples, 4000), 2, 1
    import numpy as np

    from tf_elastic.elastic.worker import datasets

    data = datasets.load("mnist", FLAGS.data_dir or datasets.DEFAULT_DATA_DIR)
    large = FLAGS.base_batch * FLAGS.batch_factor
    configs = ["SGD, base batch", f"SGD, {FLAGS.batch_factor}x batch, linear scaling + warm-up",
               f"LARS, {FLAGS.batch_factor}x batch, warm-up + poly decay"]
    if FLAGS.lars_sweep:
        return _sweep(configs, data)
    results: Dict[str, List[Result]] = {}
    started = time.time()
    for config in configs:
        for seed in range(FLAGS.seeds):
            results.setdefault(config, []).append(
                train(config, seed, data, FLAGS.lars_learning_rate, FLAGS.lars_trust_coefficient))
            logging.info("%s seed %d: %.4f (%.0f s)", config, seed, results[config][-1].test_accuracy,
                         time.time() - started)
    baseline = np.mean([r.test_accuracy for r in results[configs[0]]]) * 100
    lines = ["| configuration | batch | test accuracy % (mean ± std) | gap to baseline (points) | final train loss |",
             "|---|---:|---:|---:|---:|"]
    for config in configs:
        acc = np.array([r.test_accuracy for r in results[config]]) * 100
        batch = FLAGS.base_batch if config == configs[0] else large
        lines.append(f"| {config} | {batch} | {acc.mean():.2f} ± {acc.std():.2f} | {acc.mean() - baseline:+.2f} | "
                     f"{np.mean([r.losses[-1] for r in results[config]]):.4f} |")
    lars_gap = np.mean([r.test_accuracy for r in results[configs[2]]]) * 100 - baseline
    header = (f"{FLAGS.epochs} epochs of {FLAGS.train_examples} MNIST examples, {FLAGS.seeds} seed(s), "
              f"LARS lr {FLAGS.lars_learning_rate} eta {FLAGS.lars_trust_coefficient} unadapted {FLAGS.lars_exclude}, "
              f"{time.time() - started:.0f} s")
    verdict = f"LARS at {FLAGS.batch_factor}x is {lars_gap:+.2f} points from the baseline (goal: within 1 point): " + (
        "met" if lars_gap >= -1.0 else "NOT met")
    out = Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = f"{header}\n\n" + "\n".join(lines) + f"\n\n{verdict}\n"
    (out / "table.md").write_text(report)
    (out / "results.json").write_text(json.dumps({k: [r._asdict() for r in v] for k, v in results.items()}))
    _plot(results, out / "lars.png")
    print(report + f"\nplot: {out / 'lars.png'}")


def _sweep(configs: List[str], data) -> None:
    pairs = []
    for pair in FLAGS.lars_sweep:
        try:
            lr, eta = (float(v) for v in pair.split("/"))
        except ValueError:
            raise app.UsageError(f"--lars_sweep: {pair!r} is not LR/ETA (for example 5/0.001)") from None
        pairs.append((lr, eta))
    started = time.time()
    baseline = train(configs[0], 0, data, 0.0, 0.0).test_accuracy * 100
    lines = [f"LARS sweep: {FLAGS.epochs} epochs of {FLAGS.train_examples} MNIST examples, batch "
             f"{FLAGS.base_batch * FLAGS.batch_factor}, seed 0; baseline (SGD, batch {FLAGS.base_batch}) "
             f"{baseline:.2f} %", "",
             "| LARS lr | eta | lr x eta | test accuracy % | gap (points) | final train loss |",
             "|---:|---:|---:|---:|---:|---:|"]
    for lr, eta in pairs:
        result = train(configs[2], 0, data, lr, eta)
        lines.append(f"| {lr:g} | {eta:g} | {lr * eta:.4g} | {result.test_accuracy * 100:.2f} | "
                     f"{result.test_accuracy * 100 - baseline:+.2f} | {result.losses[-1]:.4f} |")
        logging.info("%s (%.0f s)", lines[-1], time.time() - started)
    out = Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _plot(results: Dict[str, List[Result]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for config, runs in results.items():
        for i, run in enumerate(runs):
            ax.plot(range(1, len(run.losses) + 1), run.losses, color=f"C{list(results).index(config)}",
                    alpha=0.8, label=config if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss")
    ax.set_title("LARS in miniature: same epochs, 32x the batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
