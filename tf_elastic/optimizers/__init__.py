"""Optimizers for large-batch training."""
from tf_elastic.optimizers.lars import LARS

__all__ = ["LARS"]
