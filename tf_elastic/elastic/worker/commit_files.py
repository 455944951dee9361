"""What a host's commit directory holds, read without trusting any single read.

`tf.train.get_checkpoint_state` returns None on any read or parse error of the `checkpoint` state file, which
looks like "no commit": one transient read error (an NFS EIO), a garbage or NUL-filled file after a crash
mid-write, and a caller sweeping "what the state file does not name" deletes every commit of the host.
`kept_commits` retries the read, and where the file is there but cannot be read or parsed, falls back to the
complete commits on disk (those whose `.index`, written last, exists), newest last.
"""
import posixpath
import time
from typing import List, Tuple

import tensorflow as tf
from absl import logging
from google.protobuf import text_format
from tensorflow.python.lib.io import file_io  # what get_checkpoint_state reads with
from tensorflow.python.training.checkpoint_state_pb2 import CheckpointState

from tf_elastic.elastic.protocol import PATTERN_CHARACTERS
from tf_elastic.elastic.worker.durable import commit_id
from tf_elastic.elastic.worker.errors import ConfigurationError

STATE_FILE = "checkpoint"


def check_plain(directory: str, argument: str) -> None:
    """Refuses a commit directory whose path TensorFlow would read as a pattern, naming `argument`."""
    found = sorted({c for c in directory if c in PATTERN_CHARACTERS})
    if found:
        raise ConfigurationError(f"{argument}={directory}: TensorFlow reads a checkpoint's path as a pattern, so "
                                 f"commits under a path with {' '.join(found)} could not be restored; use a path "
                                 f"without any of {' '.join(PATTERN_CHARACTERS)}")
READ_TRIES, READ_PAUSE = 3, 0.2  # a transient error of a network filesystem clears within a second


def kept_commits(directory: str) -> List[Tuple[str, float]]:
    """(path, time) of each commit the state file names, oldest first; if it exists but cannot be read or
    parsed, or names no commit, the complete commits found on disk, so that nothing is taken for absent."""
    path = posixpath.join(directory, STATE_FILE)
    error = None
    for attempt in range(READ_TRIES):
        try:
            if not tf.io.gfile.exists(path):
                return []
            state = text_format.Parse(file_io.read_file_to_string(path), CheckpointState())
            if not state.all_model_checkpoint_paths:  # we write it only after a commit: empty is damage
                raise ValueError("it names no commit (empty, as a crash before its sync can leave it)")
            return list(zip(state.all_model_checkpoint_paths, state.all_model_checkpoint_timestamps))
        except (tf.errors.OpError, OSError) as failed:
            error = failed
            time.sleep(READ_PAUSE * (attempt + 1))
        except (text_format.ParseError, UnicodeDecodeError, ValueError) as failed:
            error = failed
            break
    found = complete_on_disk(directory)
    logging.warning("the state file %s could not be read (%s); the %d complete commits on disk stand in for it",
                    path, str(error).splitlines()[0][:200] if str(error) else type(error).__name__, len(found))
    return [(prefix, 0.0) for prefix in found]


def complete_on_disk(directory: str) -> List[str]:
    """The prefixes of the commits in `directory` whose index exists, oldest first (by generation, step)."""
    names = [f[:-len(".index")] for f in tf.io.gfile.listdir(directory) if f.endswith(".index")]
    ids = [(commit_id(name), name) for name in names]
    return [posixpath.join(directory, name) for id_, name in sorted((i, n) for i, n in ids if i is not None)]
