"""Dynamic mini-batch SGD (Lin et al. 2019) in miniature: does a smooth LR transition beat a jump?

One process simulates an elastic job whose global batch changes as if GPUs came and went (the paper
switches between 1x and 16x its base batch every 5 epochs). The same CNN is trained on MNIST with the
same seeds under: a static batch; linear scaling applied at once; Dynamic SGD's linear ramp (and a sweep
of ramp lengths); the momentum-share transition; and LARS with the ramp. Prints a markdown table (final
test accuracy mean ± std, final train loss, worst loss spike after a resize) and writes a plot.

    python -m launch.reproduce_dynamic_sgd               # ~30 min on 2 CPU cores
    python -m launch.reproduce_dynamic_sgd --quick       # ~1 min, for the test suite
"""
import json
import os
import time
from pathlib import Path
from typing import Dict, List, NamedTuple

from absl import app, flags, logging

flags.DEFINE_string("data_dir", None, "Directory holding mnist.npz (default: ../shared/data).")
flags.DEFINE_string("out_dir", "runs/dynamic_sgd", "Where the table, raw results and plot are written.")
flags.DEFINE_list("plan", ["1", "16", "1", "16"], "Global batch per phase, as multiples of --base_batch.")
flags.DEFINE_float("phase_epochs", 0.5, "Epochs per phase of the plan.", lower_bound=0.01)
flags.DEFINE_integer("base_batch", 32, "Reference (static) global batch.", lower_bound=1)
flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate at the base batch (momentum 0.9).", lower_bound=0.0)
flags.DEFINE_float("lars_learning_rate", 0.1, "LARS global learning rate at the base batch.", lower_bound=0.0)
flags.DEFINE_float("lars_trust_coefficient", 0.05, "LARS trust coefficient (eta).", lower_bound=0.0)
flags.DEFINE_list("ramp_sweep", ["2", "32"], "Extra ramp lengths (steps per factor of batch growth) besides 8.")
flags.DEFINE_integer("seeds", 3, "Seeds per configuration.", lower_bound=1)
flags.DEFINE_integer("train_examples", 60000, "Training examples used (a prefix of the shuffled set).", lower_bound=100)
flags.DEFINE_integer("spike_window", 20, "Steps before/after a resize compared for the loss spike.", lower_bound=1)
flags.DEFINE_list("only", [], "Run only the configurations whose name contains one of these words.")
flags.DEFINE_bool("quick", False, "A minute-long version: 3000 examples, 1 seed, short sweep.")
FLAGS = flags.FLAGS

MOMENTUM = 0.9


class Config(NamedTuple):
    name: str
    optimizer: str  # "sgd" or "lars"
    transition: str  # BatchResizeSchedule transition; "static" keeps the base batch all along
    ramp_per_factor: float = 8.0


class Run(NamedTuple):
    samples: List[int]
    losses: List[float]
    learning_rates: List[float]
    batches: List[int]
    resize_steps: List[int]
    test_accuracy: float


def configurations() -> List[Config]:
    sweep = [Config(f"Dynamic SGD, ramp {r}k", "sgd", "linear", float(r)) for r in FLAGS.ramp_sweep]
    return [
        Config("static batch", "sgd", "static"),
        Config("linear scaling, immediate", "sgd", "none"),
        Config("Dynamic SGD, ramp 8k (default)", "sgd", "linear"),
        *sweep,
        Config("momentum transition", "sgd", "momentum"),
        Config("LARS, immediate", "lars", "none"),
        Config("LARS, ramp 8k", "lars", "linear"),
    ]


def train(config: Config, seed: int, data) -> Run:
    import numpy as np
    import tensorflow as tf
    import keras

    import models
    from tf_elastic import LARS, BatchResizeSchedule

    keras.utils.set_random_seed(seed)
    x, y = data.x_train[: FLAGS.train_examples], data.y_train[: FLAGS.train_examples]
    base = FLAGS.base_batch
    plan = [base] * len(FLAGS.plan) if config.transition == "static" else [base * int(m) for m in FLAGS.plan]
    model = models.get("mnist_cnn", x.shape[1:], data.num_classes)
    schedule = BatchResizeSchedule(
        FLAGS.lars_learning_rate if config.optimizer == "lars" else FLAGS.learning_rate, base,
        batch_size=plan[0], transition="none" if config.transition == "static" else config.transition,
        momentum=MOMENTUM, ramp_steps_per_factor=config.ramp_per_factor)
    optimizer = (LARS(schedule, momentum=MOMENTUM, weight_decay=5e-4, trust_coefficient=FLAGS.lars_trust_coefficient)
                 if config.optimizer == "lars"
                 else keras.optimizers.SGD(schedule, momentum=MOMENTUM))
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(input_signature=[tf.TensorSpec([None, *x.shape[1:]]), tf.TensorSpec([None], tf.int32)])
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss, optimizer.learning_rate

    rng = np.random.default_rng(seed)
    samples, losses, lrs, batches, resizes = [], [], [], [], []
    seen, iteration = 0, 0
    phase_samples = int(FLAGS.phase_epochs * len(x))
    order = rng.permutation(len(x))
    cursor = 0
    for phase, batch in enumerate(plan):
        if phase and batch != plan[phase - 1]:
            schedule.resize(iteration, batch)
            resizes.append(iteration)
        end = seen + phase_samples
        while seen + batch <= end:
            if cursor + batch > len(x):
                order, cursor = rng.permutation(len(x)), 0
            index = order[cursor: cursor + batch]
            cursor += batch
            loss, lr = step(x[index], y[index])
            seen += batch
            iteration += 1
            samples.append(seen)
            losses.append(float(loss))
            lrs.append(float(lr))
            batches.append(batch)
    logits = model.predict(data.x_test, batch_size=1000, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == data.y_test))
    return Run(samples, losses, lrs, batches, resizes, accuracy)


def worst_spike(run: Run, window: int) -> float:
    """Largest (max loss in `window` steps after a resize) - (mean loss in `window` steps before)."""
    before = [run.losses[max(0, s - window): s] for s in run.resize_steps if s > 0]
    after = [run.losses[s: s + window] for s in run.resize_steps if s > 0]
    spikes = [max(a) - sum(b) / len(b) for a, b in zip(after, before)]
    return max(spikes) if spikes else 0.0


def summarise(results: Dict[str, List[Run]]) -> str:
    import numpy as np

    lines = ["| configuration | test accuracy % (mean ± std) | final train loss | worst spike after a resize |",
             "|---|---:|---:|---:|"]
    for name, runs in results.items():
        acc = np.array([r.test_accuracy for r in runs]) * 100
        tail = [np.mean(r.losses[-max(1, len(r.losses) // 20):]) for r in runs]
        spikes = [worst_spike(r, FLAGS.spike_window) for r in runs]
        lines.append(f"| {name} | {acc.mean():.2f} ± {acc.std():.2f} | {np.mean(tail):.4f} | "
                     + (f"{np.mean(spikes):.3f} ± {np.std(spikes):.3f}" if runs[0].resize_steps
                        else "n/a (no resize)")
                     + " |")
    return "\n".join(lines)


def plot(results: Dict[str, List[Run]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for name, runs in results.items():
        run = runs[0]
        smooth = np.convolve(run.losses, np.ones(10) / 10, mode="same")
        axes[0].plot(run.samples, run.learning_rates, label=name)
        axes[1].plot(run.samples, run.batches, label=name)
        axes[2].plot(run.samples, smooth, label=name, linewidth=0.8)
    resized = next((runs[0] for runs in results.values() if runs[0].resize_steps), None)
    for ax in axes:
        for step in resized.resize_steps if resized else []:
            ax.axvline(resized.samples[step - 1], color="grey", linestyle=":", linewidth=0.8)
    axes[0].set_ylabel("learning rate")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("global batch")
    axes[2].set_ylabel("train loss (10-step mean)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("samples seen")
    axes[0].legend(fontsize=7)
    axes[0].set_title("Dynamic SGD in miniature (first seed; dotted lines: resizes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: List[str]) -> None:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if FLAGS.quick:
        FLAGS.train_examples, FLAGS.seeds, FLAGS.ramp_sweep = min(FLAGS.train_examples, 3000), 1, ["32"]
    from tf_elastic.elastic.worker import datasets

    data = datasets.load("mnist", FLAGS.data_dir or datasets.DEFAULT_DATA_DIR)
    out = Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, List[Run]] = {}
    started = time.time()
    for config in configurations():
        if FLAGS.only and not any(word.lower() in config.name.lower() for word in FLAGS.only):
            continue
        for seed in range(FLAGS.seeds):
            run = train(config, seed, data)
            results.setdefault(config.name, []).append(run)
            logging.info("%s seed %d: test accuracy %.4f (%.0f s so far)", config.name, seed, run.test_accuracy,
                         time.time() - started)
    table = summarise(results)
    header = (f"Plan {'x,'.join(FLAGS.plan)}x of batch {FLAGS.base_batch}, {FLAGS.phase_epochs} epoch(s) per phase, "
              f"{FLAGS.train_examples} MNIST examples, {FLAGS.seeds} seed(s), SGD lr {FLAGS.learning_rate}, "
              f"LARS lr {FLAGS.lars_learning_rate} eta {FLAGS.lars_trust_coefficient}, {time.time() - started:.0f} s")
    (out / "table.md").write_text(header + "\n\n" + table + "\n")
    (out / "results.json").write_text(json.dumps({k: [r._asdict() for r in v] for k, v in results.items()}))
    plot(results, out / "dynamic_sgd.png")
    print(header + "\n\n" + table)
    print(f"\nplot: {out / 'dynamic_sgd.png'}")


if __name__ == "__main__":
    app.run(main)
