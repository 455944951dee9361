"""Test mode (`--index_log`): the example indices each training step really trained, written by the step.

What was planned or logged is no evidence of what a step consumed: a strategy that re-split each batch
once trained 1/W of every epoch while every log said all of it. In this mode the pipeline carries each
example's index beside it (last in the element), and the model's `train_step` is wrapped so that each
replica writes the optimizer step it trains and the indices of its own batch, then trains on the batch
without them. `audit.index_records` reads these lines (`STEP [I I ...]`); the trainer's index log adds
the epoch of each step.
"""
from pathlib import Path

import keras
import tensorflow as tf


def record_steps(model: keras.Model, path: Path, element_spec) -> None:
    """Wraps `model.train_step` to append `STEP INDICES...` to `path` for every replica's batch; builds the
    compiled loss and metrics first from `element_spec` less its indices (Keras would take them for weights)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Keras builds the loss and metrics from the first batch when they are not built; from ours it would
    # take the indices for sample weights. Built here from the element without them, it skips that.
    model._symbolic_build(data_batch=tuple(element_spec[:-1]))
    train_step, iterations = model.train_step, model.optimizer.iterations

    def recording_step(data):
        *data, indices = data
        tf.print(iterations + 1, indices, output_stream=f"file://{path}", summarize=-1)
        return train_step(tuple(data))

    model.train_step = recording_step
