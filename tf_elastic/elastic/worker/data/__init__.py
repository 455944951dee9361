"""Data sources for `fit`: where examples come from, by index, inside the tf.data graph.

    source = ImageFolder("/data/imagenet/train")            # or TFRecordSource("/data/tfr/train-*"),
    fit(model, source, world=..., preprocess=my_fn, ...)     # TFDSSource(name, split), ArraySource(x, y)

A source of your own subclasses `Source` (see source.py): `num_examples` and `read(index)` in graph ops,
returning `(features, target)` or `(features, target, sample_weight)` in any structure a model takes
(`num_classes` too where targets are class ids).
"""
from tf_elastic.elastic.worker.data.image_files import ImageFiles, ImageFolder
from tf_elastic.elastic.worker.data.parse import default_parse
from tf_elastic.elastic.worker.data.source import (ArraySource, Head, Preprocess, Source, describe_error, evaluation,
                                                   pipeline, to_float)
from tf_elastic.elastic.worker.data.tfds_source import TFDSSource
from tf_elastic.elastic.worker.data.tfrecord_source import TFRecordSource

__all__ = ["ArraySource", "Head", "ImageFiles", "ImageFolder", "Preprocess", "Source", "TFDSSource", "TFRecordSource",
           "default_parse", "describe_error", "evaluation", "pipeline", "to_float"]
