"""Model registry: `models.get(name, input_shape, num_classes)` returns an uncompiled Keras model."""
from typing import Callable, Dict, Sequence

import keras


def mnist_cnn(input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """A small CNN: two conv blocks and a dense head ("same" padding, so 8x8 digits fit too)."""
    return keras.Sequential([
        keras.Input(tuple(input_shape)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(num_classes),
    ], name="mnist_cnn")


def resnet20(input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """The CIFAR-style ResNet-20 of He et al. 2016: 3 stages of 3 basic blocks, 16/32/64 filters."""
    inputs = keras.Input(tuple(input_shape))
    x = _conv_bn(inputs, 16, 1, activation=True)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            strides = 2 if stage and not block else 1
            shortcut = x if strides == 1 and x.shape[-1] == filters else _conv_bn(x, filters, strides, size=1)
            y = _conv_bn(x, filters, strides, activation=True)
            y = _conv_bn(y, filters, 1)
            x = keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name="resnet20")


def _conv_bn(x, filters: int, strides: int, size: int = 3, activation: bool = False):
    x = keras.layers.Conv2D(filters, size, strides=strides, padding="same", use_bias=False,
                            kernel_initializer="he_normal")(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.ReLU()(x) if activation else x


def _application(factory: Callable) -> Callable[[Sequence[int], int], keras.Model]:
    def build(input_shape: Sequence[int], num_classes: int) -> keras.Model:
        return factory(weights=None, input_shape=tuple(input_shape), classes=num_classes, classifier_activation=None)

    build.__doc__ = f"`keras.applications.{factory.__name__}` with random weights and logits out."
    return build


_REGISTRY: Dict[str, Callable[[Sequence[int], int], keras.Model]] = {
    "mnist_cnn": mnist_cnn,
    "resnet20": resnet20,
    "resnet50": _application(keras.applications.ResNet50),
    "mobilenet_v2": _application(keras.applications.MobileNetV2),
    "inception_v3": _application(keras.applications.InceptionV3),
}
NAMES = tuple(sorted(_REGISTRY))


def get(name: str, input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """Builds model `name`; an unknown name raises ValueError listing the known ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(NAMES)}.")
    return _REGISTRY[name](input_shape, num_classes)
