"""Tests `tf_elastic/elastic/worker/strategy.py`: the strategy for a world."""
import pytest
import tensorflow as tf

from tf_elastic.elastic.worker.errors import ConfigurationError
from tf_elastic.elastic.worker.strategy import make_strategy
from tf_elastic.elastic.worker.world import World


def test_under_the_agent_a_tensorflow_that_already_ran_an_op_is_refused_in_one_line(tmp_path):
    """MWMS must configure TensorFlow's collectives before the process's first op; a script that builds a
    tensor or a dataset before `elastic.run` would fail every try of a round of several workers with
    TensorFlow's "must be configured at program startup". Refused in every round under the agent (a world
    of one grows); a process of its own, with no agent, has nothing to configure."""
    tf.constant(1)  # as a script's top level would (every test process has run ops already)
    with pytest.raises(ConfigurationError, match=r"^TensorFlow ran an op before elastic.run made the") as error:
        make_strategy(World(rank=0, size=1, heartbeat_file=str(tmp_path / "heartbeat")))
    assert "\n" not in str(error.value)
    assert make_strategy(World()) is tf.distribute.get_strategy()
