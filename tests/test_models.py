"""Every registered model builds and trains a step; unknown names list the known ones."""
import keras
import numpy as np
import pytest

import models

SHAPES = {"mnist_cnn": (28, 28, 1), "resnet20": (32, 32, 3), "resnet50": (64, 64, 3), "mobilenet_v2": (64, 64, 3),
          "inception_v3": (75, 75, 3)}


@pytest.mark.parametrize("name", models.NAMES)
def test_builds_and_trains_a_step(name):
    keras.utils.set_random_seed(0)
    model = models.get(name, SHAPES[name], 10)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    x = np.random.default_rng(0).random((2, *SHAPES[name]), dtype=np.float32)
    before = [w.numpy().copy() for w in model.trainable_weights[:1]]
    loss = model.train_on_batch(x, np.array([1, 2]))
    assert np.isfinite(loss) and model.output_shape == (None, 10)
    assert not np.array_equal(before[0], model.trainable_weights[0].numpy())


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'vgg'; known models: inception_v3, mnist_cnn, mobilenet_v2"):
        models.get("vgg", (28, 28, 1), 10)


def test_the_trainers_model_choices_are_the_registrys():
    """`tf_elastic.choices` spells the names for `--model` without importing Keras: it must list the registry."""
    from tf_elastic import choices

    assert tuple(sorted(choices.MODELS)) == models.NAMES
