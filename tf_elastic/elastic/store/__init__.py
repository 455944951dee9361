"""Rendezvous stores: one small key-value interface (`base`), backends chosen by URL scheme.

The registry holds factories by module path and imports a backend only when a URL names it: backends
never register themselves at import, and `etcd` (which needs `requests`) loads only for `etcd://`.
"""
import importlib
import urllib.parse
from typing import Callable, Dict, Union

from tf_elastic.elastic.store.base import Store, StoreError, StoreOptions

Factory = Callable[[urllib.parse.ParseResult, StoreOptions], Store]
# scheme -> a factory, or "module:function" naming one (imported on first use).
BACKENDS: Dict[str, Union[str, Factory]] = {
    "file": "tf_elastic.elastic.store.file:from_url",
    "etcd": "tf_elastic.elastic.store.etcd:from_url",
}
__all__ = ["BACKENDS", "Store", "StoreError", "StoreOptions", "open_store", "register_backend"]


def register_backend(scheme: str, factory: Union[str, Factory]) -> None:
    """Adds a backend for `scheme://` URLs: a factory, or "module:function" to import when first used."""
    BACKENDS[scheme] = factory


def open_store(url: str, options: StoreOptions = StoreOptions()) -> Store:
    """Opens the store that `url` names, e.g. `file:///tmp/rdzv` or `etcd://127.0.0.1:2379`."""
    parsed = urllib.parse.urlparse(url)
    factory = BACKENDS.get(parsed.scheme)
    if factory is None:
        raise ValueError(f"--rdzv={url!r}: unknown store scheme {parsed.scheme!r}; known: "
                         f"{', '.join(s + '://' for s in sorted(BACKENDS))}.")
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
    return factory(parsed, options)
