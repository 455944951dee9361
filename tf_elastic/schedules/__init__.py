"""Learning-rate schedules for elastic training."""
from tf_elastic.schedules.batch_resize import BatchResizeSchedule

__all__ = ["BatchResizeSchedule"]
