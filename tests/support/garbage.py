"""What a block of code leaves for the garbage collector: objects in reference cycles."""

from __future__ import annotations

import gc
import types
from collections.abc import Iterator
from contextlib import contextmanager


def of_ours(thing: object) -> bool:
    """Whether ``thing`` is an object of this package or a function defined in it."""
    owner = thing if isinstance(thing, types.FunctionType) else type(thing)
    return (getattr(owner, "__module__", None) or "").startswith("idempotency_mw")


@contextmanager
def garbage_of_ours() -> Iterator[list[object]]:
    """The collector is off inside the block; the list, once the block ended, holds what of
    ours the block left in reference cycles (each one costs the collector time, and makes it
    run more often)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found: list[object] = []
    try:
        yield found
        gc.collect()
        found.extend(thing for thing in gc.garbage if of_ours(thing))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
