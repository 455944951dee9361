"""Learning-rate schedules for elastic training."""
from tf_elastic.schedules.batch_resize import BatchResizeSchedule
from tf_elastic.schedules.warmup_polynomial import WarmupPolynomialDecay

__all__ = ["BatchResizeSchedule", "WarmupPolynomialDecay"]
