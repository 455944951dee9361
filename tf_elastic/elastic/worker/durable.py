"""Durable copies of commits on any `tf.io.gfile` filesystem (local, `gs://`, `s3://` through tensorflow-io,
`ram://`): what a restart of the whole job resumes from when no host kept a commit.

Hosts keep their recent commits themselves and hand them to each other (`group.py`); storage is only for
durability, so copies are made every few commits, off the training path. A copy is the commit's files in
a directory of its own name, then a `COMPLETE` marker: a reader takes only a directory with the marker,
so a copy cut short (a SIGKILL, a lost connection) is never mistaken for a complete one. Everything goes
through `tf.io.gfile`, whose object-store writes appear whole on close.
"""
import dataclasses
import os
import posixpath
import uuid
from typing import Callable, List, Optional

import tensorflow as tf

from tf_elastic.elastic.worker.errors import ConfigurationError

MARKER = "COMPLETE"


@dataclasses.dataclass(frozen=True)
class Copy:
    prefix: str  # the checkpoint prefix inside the copy, as `tf.train.Checkpoint.read` takes it
    step: int
    complete: bool


def commit_step(name: str) -> Optional[int]:
    """The step of a commit named `ckpt-STEP-EPOCH-SAMPLES`; None for any other name."""
    parts = name.split("-")
    return int(parts[1]) if len(parts) == 4 and parts[0] == "ckpt" and all(p.isdigit() for p in parts[1:]) else None


class DurableCopies:
    """The copies in `directory`; the newest `keep` complete ones are kept."""

    def __init__(self, directory: str, keep: int = 2):
        self.directory, self.keep = directory.rstrip("/"), keep

    def check_writable(self) -> None:
        """Raises `ConfigurationError` naming the directory if a file cannot be written there."""
        probe = posixpath.join(self.directory, f".probe-{uuid.uuid4().hex}")
        try:
            tf.io.gfile.makedirs(self.directory)
            with tf.io.gfile.GFile(probe, "w") as f:
                f.write("probe")
            tf.io.gfile.remove(probe)
        except (tf.errors.OpError, OSError) as error:
            raise ConfigurationError(f"--checkpoint_dir={self.directory} cannot be written "
                                     f"({type(error).__name__}: {_first_line(error)}): give a directory this "
                                     f"job may write, or --durable_every_commits=0 for no durable copies") from None

    def copies(self) -> List[Copy]:
        """Every copy (complete or not), oldest step first."""
        try:
            names = tf.io.gfile.listdir(self.directory)
        except tf.errors.NotFoundError:
            return []
        found = []
        for name in names:
            name = name.rstrip("/")
            step = commit_step(name)
            if step is not None:
                folder = posixpath.join(self.directory, name)
                found.append(Copy(posixpath.join(folder, name), step,
                                  tf.io.gfile.exists(posixpath.join(folder, MARKER))))
        return sorted(found, key=lambda c: c.step)

    def newest(self) -> Optional[Copy]:
        complete = [c for c in self.copies() if c.complete]
        return complete[-1] if complete else None

    def copy(self, prefix: str, before_marker: Callable[[], None] = lambda: None) -> int:
        """Copies the commit at `prefix` (a local checkpoint prefix); returns the bytes copied (0 if a
        complete copy was there already). Then removes copies beyond the newest `keep`."""
        name = os.path.basename(prefix)
        folder = posixpath.join(self.directory, name)
        if tf.io.gfile.exists(posixpath.join(folder, MARKER)):
            return 0
        tf.io.gfile.makedirs(folder)
        copied = 0
        for path in tf.io.gfile.glob(prefix + ".*"):
            tf.io.gfile.copy(path, posixpath.join(folder, os.path.basename(path)), overwrite=True)
            copied += tf.io.gfile.stat(path).length
        before_marker()
        with tf.io.gfile.GFile(posixpath.join(folder, MARKER), "w") as f:
            f.write(name)
        self.collect()
        return copied

    def collect(self) -> None:
        """Removes complete copies older than the newest `keep`, and partial ones older than the newest
        complete one (cut short: copies are made in order, by one writer, the chief)."""
        copies = self.copies()
        complete = [c for c in copies if c.complete]
        if not complete:
            return
        kept = {c.step for c in complete[-self.keep:]}
        for item in copies:
            if item.step not in kept and (item.complete or item.step < complete[-1].step):
                tf.io.gfile.rmtree(posixpath.dirname(item.prefix))


def _first_line(error: BaseException) -> str:
    text = getattr(error, "message", None) or str(error)
    return text.splitlines()[0][:200] if text else ""
