"""Durable copies of commits (local or NFS paths, `gs://`, `s3://`, `ram://`: `storage.py`): what a restart of
the whole job resumes from when no host kept a commit.

Hosts keep their recent commits themselves and hand them to each other (`group.py`); storage is only for
durability, so copies are made every few commits, off the training path. A copy is the commit's files in
a directory of its own name, then a `COMPLETE` marker: a reader takes only a directory with the marker,
so a copy cut short (a SIGKILL, a lost connection) is never mistaken for a complete one. The protocol is
written once, against `Storage`, whose writes appear whole (object stores: on close or upload).

The chief copies every `durable_every_commits`-th commit and the last one of training. The newest two
complete copies are kept; older ones, and partial ones older than the newest complete one, are removed.
A restart of the whole job resumes from the newest complete copy, downloaded first where TensorFlow
cannot read the storage (`s3://`). Generation marks (`GENERATION-N`, created and never rewritten) keep the
highest generation a chief began here, so that a job restarted from an older copy commits above what the
old job's hosts hold. A directory the chief cannot write at the start is a `ConfigurationError` (exit 78)
naming it; a copy that fails later is a `durable_copy` event with its error, and training goes on.
"""
import dataclasses
import os
import posixpath
import re
import uuid
from typing import List, NamedTuple, Optional

import tensorflow as tf

from tf_elastic.elastic.protocol import error_line
from tf_elastic.elastic.worker.errors import ConfigurationError
from tf_elastic.elastic.worker.storage import Storage, StorageError, files_of, open_storage

MARKER = "COMPLETE"
GENERATION_MARK = "GENERATION"  # GENERATION-N: the highest generation N a chief using this directory began
_MARK = re.compile(GENERATION_MARK + r"-([0-9]{1,15})")  # 15 digits: exact in the agreement's float64 sum


class CommitId(NamedTuple):
    """Which commit is newer: the higher generation, then the higher step. Steps alone cannot tell: a host
    that went on alone in an abandoned round (cut off from the store), or the old job's hosts after a
    restart from an older durable copy, hold higher steps of a history the group no longer follows. The
    generation is the round's (`CommittedState.begin_generation`), so the group's newer rounds outrank them."""
    generation: int
    step: int


NO_COMMIT = CommitId(-1, -1)


@dataclasses.dataclass(frozen=True)
class Copy:
    prefix: str  # the checkpoint prefix inside the copy, as `tf.train.Checkpoint.read` takes it
    id: CommitId
    complete: bool

    @property
    def step(self) -> int:
        return self.id.step


def commit_id(name: str) -> Optional[CommitId]:
    """The id of a commit named `ckpt-GENERATION-STEP-EPOCH-SAMPLES`; None for a name that is no commit.
    A commit named the way tf_elastic did before generations (`ckpt-STEP-EPOCH-SAMPLES`) cannot be ordered
    against these: `ConfigurationError`, rather than a start from scratch beside it."""
    parts = name.split("-")
    if len(parts) == 5 and parts[0] == "ckpt" and all(p.isdigit() for p in parts[1:]):
        return CommitId(int(parts[1]), int(parts[2]))
    if len(parts) == 4 and parts[0] == "ckpt" and all(p.isdigit() for p in parts[1:]):
        raise ConfigurationError(f"the commit {name} was written by a tf_elastic before commit generations "
                                 f"(ckpt-STEP-EPOCH-SAMPLES); this version cannot resume it: finish that run with "
                                 f"the version that wrote it, or start a new --run_dir / --checkpoint_dir")
    return None


class DurableCopies:
    """The copies in `directory`; the newest `keep` complete ones are kept. `storage`: what serves the
    directory (default: the backend its scheme names)."""

    def __init__(self, directory: str, keep: int = 2, storage: Optional[Storage] = None):
        self.directory, self.keep = os.fspath(directory).rstrip("/"), keep
        self.storage = storage or open_storage(self.directory)

    def generation_mark(self) -> int:
        """The highest generation a chief using this directory began (-1: none): a job restarted from an
        older copy under a new rendezvous store commits above it, so that the old job's hosts, whose
        commits of later generations were never copied, cannot take the group back to their history."""
        return max(self._marks(), default=-1)

    def _marks(self) -> List[int]:
        return [int(m.group(1)) for m in map(_MARK.fullmatch, self.storage.listdir(self.directory)) if m]

    def mark_generation(self, generation: int) -> None:
        """Raises the mark to `generation`: one object per generation, created and never rewritten, so
        the mark only grows (a chief cut off from the store that marks a lower one later cannot lower it) and
        needs no rename (a copy on object stores). Lower marks are removed."""
        self.storage.makedirs(self.directory)
        marks = self._marks()
        if generation > max(marks, default=-1):
            self.storage.write_text(posixpath.join(self.directory, f"{GENERATION_MARK}-{generation}"), str(generation))
        for mark in marks:
            if mark < max(marks + [generation]):
                self.storage.remove(posixpath.join(self.directory, f"{GENERATION_MARK}-{mark}"))

    def check_writable(self) -> None:
        """Raises `ConfigurationError` naming the directory if a file cannot be written there."""
        probe = posixpath.join(self.directory, f".probe-{uuid.uuid4().hex}")
        try:
            self.storage.makedirs(self.directory)
            self.storage.write_text(probe, "probe")
            self.storage.remove(probe)
        except (tf.errors.OpError, OSError) as error:
            raise ConfigurationError(f"--checkpoint_dir={self.directory} cannot be written "
                                     f"({error_line(error)}): give a directory this "
                                     f"job may write, or --durable_every_commits=0 for no durable copies") from None

    def copies(self) -> List[Copy]:
        """Every copy (complete or not), oldest first (`CommitId` order)."""
        found = []
        for name in self.storage.listdir(self.directory):
            id_ = commit_id(name)
            if id_ is not None:
                folder = posixpath.join(self.directory, name)
                complete = self.storage.exists(posixpath.join(folder, MARKER))
                found.append(Copy(posixpath.join(folder, name), id_, complete))
        return sorted(found, key=lambda c: c.id)

    def newest(self) -> Optional[Copy]:
        complete = [c for c in self.copies() if c.complete]
        return complete[-1] if complete else None

    def copy(self, prefix: str) -> int:
        """Copies the commit at `prefix` (a local checkpoint prefix); returns the bytes copied (0 if a
        complete copy was there already). Then removes copies beyond the newest `keep`."""
        name = os.path.basename(prefix)
        folder = posixpath.join(self.directory, name)
        if self.storage.exists(posixpath.join(folder, MARKER)):
            return 0
        files = files_of(prefix)
        if not any(path.endswith(".index") for path in files):  # never a marker on a copy of nothing
            raise StorageError(f"the commit {prefix} has no index file to copy")
        self.storage.makedirs(folder)
        copied = 0
        for path in files:
            copied += self.storage.upload(path, posixpath.join(folder, os.path.basename(path)))
        self._write_marker(folder, name)
        self.collect()
        return copied

    def _write_marker(self, folder: str, name: str) -> None:
        """Written last: a copy without it (its writer died part-way) never counts and is collected."""
        self.storage.write_text(posixpath.join(folder, MARKER), name)

    def readable(self, item: Copy, scratch: str) -> str:
        """A prefix `tf.train.Checkpoint.read` can read for `item`: its own, or that of a download into the
        local directory `scratch` where TensorFlow cannot read the storage."""
        if self.storage.reads_directly:
            return item.prefix
        name = posixpath.basename(item.prefix)
        self.storage.download(posixpath.dirname(item.prefix), os.path.join(scratch, name))
        return os.path.join(scratch, name, name)

    def collect(self) -> None:
        """Removes complete copies older than the newest `keep`, and partial ones older than the newest
        complete one (cut short: copies are made in order, by one writer, the chief)."""
        copies = self.copies()
        complete = [c for c in copies if c.complete]
        if not complete:
            return
        kept = {c.id for c in complete[-self.keep:]}
        for item in copies:
            if item.id not in kept and (item.complete or item.id < complete[-1].id):
                self.storage.rmtree(posixpath.dirname(item.prefix))
