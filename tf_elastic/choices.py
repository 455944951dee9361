"""The names a trainer's flags choose among, kept free of TensorFlow so that `launch.train --help` answers
at once: its flags are defined before anything heavy is imported. The modules that implement the choices
take their names from here (models, strategies, all-reduces, cluster resolvers, preprocessing, learning-rate
scalings and transitions), so a name is spelled once."""

MODELS = ("inception_v3", "mnist_cnn", "mobilenet_v2", "resnet20", "resnet50")
STRATEGIES = ("auto", "one_device", "mirrored", "mwms", "tpu")
COLLECTIVES = ("auto", "ring", "nccl")
RESOLVERS = ("tf_config", "slurm", "kubernetes")
PREPROCESSING = ("simple", "imagenet")
SCALINGS = ("linear", "sqrt", "none")
TRANSITIONS = ("linear", "momentum", "none")
