"""A host-local cache of each TFRecord shard's index, so that a restarted worker skips the pass over the shards.

Indexing reads every shard whole (and finding the class count parses every label): for a large dataset on
an object store, a long wait at every start. The cache holds what the pass found, keyed by what must be unchanged
for it to hold (`shard_identity`), and is only ever an optimisation: an entry in doubt is ignored.
"""
import hashlib
import json
import os
import tempfile
from typing import Dict, Optional, Tuple

from absl import logging

import numpy as np
import tensorflow as tf

from tf_elastic.elastic.worker.errors import ConfigurationError


SAMPLES, SAMPLE_BYTES = 8, 4096


def shard_identity(path: str) -> Optional[dict]:
    """What must be unchanged for a shard's cached index to hold (None: nothing reliable, no cache). A local
    file adds its inode and change time (set by every rewrite, unlike mtime, which tar or rsync restore);
    other filesystems give size and modification time (none on ram://), which `cp -p` and `rsync -a` keep
    over a same-size rewrite, and so a digest of `SAMPLES` windows of the file, its first and last bytes
    among them (a few small reads: a rewrite that changes no byte they cover goes unseen)."""
    if "://" not in path:
        local = os.stat(path)
        return {"path": os.path.abspath(path), "size": local.st_size, "inode": local.st_ino,
                "ctime": local.st_ctime_ns, "mtime": local.st_mtime_ns}
    stat = tf.io.gfile.stat(path)
    if not stat.mtime_nsec:
        return None
    return {"path": path, "size": stat.length, "mtime": stat.mtime_nsec, "sampled": _sampled(path, stat.length)}


def _sampled(path: str, size: int) -> str:
    hashed = hashlib.blake2b(digest_size=16)
    with tf.io.gfile.GFile(path, "rb") as f:
        for start in sorted({int(k * max(0, size - SAMPLE_BYTES) / (SAMPLES - 1)) for k in range(SAMPLES)}):
            f.seek(start)
            hashed.update(f.read(SAMPLE_BYTES))
    return hashed.hexdigest()


class IndexCache:
    """Each shard's index (record offsets, and its largest label under the current parse function) in a
    host-local directory, keyed by the shard's `shard_identity`: a restarted worker skips the pass over the
    shards. Files are written whole (temp file, then rename); an entry that does not load or does not
    match the shard is ignored (the shard is indexed again), never trusted, and one whose shard failed to
    read is removed."""

    def __init__(self, directory: str):
        if "://" in directory:
            raise ConfigurationError(f"the TFRecord index cache directory {directory} must be a local, host-local "
                                     f"directory (--index_cache_dir), not a remote filesystem.")
        self.directory, self._warned = directory, False

    def _file(self, identity: dict) -> str:
        return os.path.join(self.directory, hashlib.sha256(identity["path"].encode()).hexdigest()[:40] + ".npz")

    def load(self, identity: dict) -> Optional[Tuple[np.ndarray, Dict[str, int]]]:
        """(offsets, largest labels) of the shard `identity` describes, or None."""
        try:
            with np.load(self._file(identity), allow_pickle=False) as entry:
                meta, offsets = json.loads(str(entry["meta"])), entry["offsets"]
            if meta["identity"] != identity:
                return None
            in_order = offsets.ndim == 1 and offsets.dtype == np.int64 and (not len(offsets) or (
                offsets[0] == 0 and offsets[-1] + 16 <= identity["size"] and np.all(np.diff(offsets) >= 16)))
            return (offsets, {str(k): int(v) for k, v in meta["labels"].items()}) if in_order else None
        except Exception:  # noqa: BLE001 - missing, partly written by a killed process, another format: re-index
            return None

    def store(self, identity: dict, offsets: np.ndarray, labels: Dict[str, int]) -> None:
        meta = json.dumps({"identity": identity, "labels": labels})
        temp = None
        try:
            os.makedirs(self.directory, exist_ok=True)
            handle, temp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(handle, "wb") as f:
                np.savez(f, offsets=np.asarray(offsets, np.int64), meta=np.array(meta))
            os.replace(temp, self._file(identity))
        except OSError as error:  # a cache only saves time: a full or read-only disk must not stop training
            if temp is not None and os.path.exists(temp):
                os.remove(temp)
            if not self._warned:
                logging.warning("cannot write the TFRecord index cache in %s: %s", self.directory, error)
                self._warned = True

    def forget(self, identity: Optional[dict]) -> None:
        try:
            if identity is not None:
                os.remove(self._file(identity))
        except OSError:
            pass
