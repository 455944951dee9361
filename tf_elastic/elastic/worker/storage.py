"""Where durable copies go: one small file interface, backends chosen by URL scheme (like the stores').

`durable.py` writes its protocol (files, then a marker; listing; collection; generation marks) once,
against `Storage`. `tf.io.gfile` serves local paths, `gs://`, `ram://` and any filesystem TensorFlow
has loaded; `s3://` goes through boto3 (`storage_s3.py`, imported only for such a URL), because
TensorFlow 2.21 has no S3 filesystem and tensorflow-io cannot load its plugins there.
"""
import importlib
import os
import posixpath
from typing import Callable, Dict, List, Union

import tensorflow as tf

from tf_elastic.elastic.worker.errors import ConfigurationError


def files_of(prefix: str) -> List[str]:
    """The local (or `tf.io.gfile`) files of the checkpoint at `prefix` (`PREFIX.index`, `PREFIX.data-*`), by
    listing its directory: `glob` would read the `[`, `*` or `?` a run dir may hold as a pattern."""
    directory, name = posixpath.split(prefix)
    if not tf.io.gfile.isdir(directory):
        return []
    return sorted(posixpath.join(directory, f) for f in tf.io.gfile.listdir(directory) if f.startswith(name + "."))


def sync_local(paths: List[str]) -> None:
    """Flushes local files, and the directories that hold them (their names), to the disk: what a commit
    promises must survive a crash of its host, not only of its process. Paths on other filesystems
    (`scheme://`) are left to them (an object store's write is durable when it returns)."""
    local = [p for p in paths if "://" not in p]
    for path in local + sorted({os.path.dirname(os.path.abspath(p)) for p in local}):
        handle = os.open(path, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


class StorageError(OSError):
    """A storage request that failed: the path and the reason (never a credential); `status` is the HTTP
    status where there was one (0: none)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class Storage:
    """Files under `/`-separated paths. `reads_directly`: TensorFlow reads a checkpoint there as it is;
    otherwise a copy is downloaded before it is read."""
    reads_directly = True

    def listdir(self, directory: str) -> List[str]:
        """The names directly under `directory`; [] when there is none."""
        try:
            return [name.rstrip("/") for name in tf.io.gfile.listdir(directory)]
        except tf.errors.NotFoundError:
            return []

    def exists(self, path: str) -> bool:
        return tf.io.gfile.exists(path)

    def makedirs(self, directory: str) -> None:
        tf.io.gfile.makedirs(directory)

    def write_text(self, path: str, text: str) -> None:
        with tf.io.gfile.GFile(path, "w") as f:
            f.write(text)
        sync_local([path])

    def upload(self, local_path: str, path: str) -> int:
        """Copies a local file to `path` (appearing whole, on the disk); returns its bytes."""
        tf.io.gfile.copy(local_path, path, overwrite=True)
        sync_local([path])
        return os.path.getsize(local_path)

    def download(self, directory: str, local_directory: str) -> None:
        """Copies every file directly under `directory` into `local_directory`."""
        os.makedirs(local_directory, exist_ok=True)
        for name in self.listdir(directory):
            tf.io.gfile.copy(posixpath.join(directory, name), os.path.join(local_directory, name), overwrite=True)

    def remove(self, path: str) -> None:
        tf.io.gfile.remove(path)

    def rmtree(self, directory: str) -> None:
        tf.io.gfile.rmtree(directory)


Factory = Callable[[str], Storage]
# scheme -> a factory, or "module:function" naming one (imported on first use). Any other scheme (and a
# plain path) goes to tf.io.gfile, which knows the filesystems TensorFlow has loaded. Process-wide on
# purpose: a registry, which `register_backend` extends for every commit of the process.
BACKENDS: Dict[str, Union[str, Factory]] = {"s3": "tf_elastic.elastic.worker.storage_s3:from_url"}


def register_backend(scheme: str, factory: Union[str, Factory]) -> None:
    """Adds a backend for `scheme://` paths: a factory, or "module:function" to import when first used."""
    BACKENDS[scheme] = factory


def open_storage(url: str) -> Storage:
    """The storage that serves `url` (a path, or `scheme://...`)."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    factory = BACKENDS.get(scheme)
    if factory is None:
        return Storage()
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as error:
            raise ConfigurationError(f"--checkpoint_dir={url}: {scheme}:// needs the Python module {error.name} "
                                     f"(pip install tf_elastic[{scheme}])") from None
    return factory(url)
