"""A key that names the same parse function in the next process: its module, name and a hash of its bytecode.

A shard's largest label depends on the parse function, so the index cache stores it under this key: an
edited function gets another key (its labels are found again), and one a name and code do not pin down
gets none (nothing cached). Python's own hash or a repr would differ between processes or miss edits.
"""
import hashlib
from typing import Callable, Optional


def _code_hash(code, digest) -> None:
    """Feeds a code object into `digest`: its bytecode, the names it uses and its constants, nested code
    objects (comprehensions, inner functions) by their own contents, never by a repr with an address."""
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for constant in code.co_consts:
        if hasattr(constant, "co_code"):
            _code_hash(constant, digest)
        else:
            digest.update(repr(constant).encode())


def parse_key(parse: Callable) -> Optional[str]:
    """The same parse function in the next process: its name and a hash of its code (an edited function
    gets another key); None for what a name and code do not pin down: a lambda, a local function, a
    closure or a bound method (their behaviour depends on captured values)."""
    name = f"{getattr(parse, '__module__', '')}.{getattr(parse, '__qualname__', '<none>')}"
    code = getattr(parse, "__code__", None)
    if "<" in name or code is None or getattr(parse, "__closure__", None) or hasattr(parse, "__self__"):
        return None
    digest = hashlib.sha256()
    _code_hash(code, digest)
    return f"{name}:{digest.hexdigest()[:16]}"
