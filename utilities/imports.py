"""A command's imports without Python's cyclic garbage collector.

Importing torch, transformers and a model's code allocates about a million long-lived objects,
and the collector, started every few hundred allocations, walks all of them again at each full
collection, and once more at the interpreter's exit: a third of ``fsdp-course plan``'s CPU
time. ``paused_collection()`` turns the collector off for a command; the fake step calls
``collect_from_here()`` where its tracked work begins: what is alive then is frozen
(``gc.freeze``: left out of later collections, the exit's included) and the collector runs
again, so the step's own garbage is collected as in any other process.
"""

from __future__ import annotations

import contextlib
import gc

_paused = False  # inside paused_collection(), until collect_from_here()


@contextlib.contextmanager
def paused_collection():
    """No cyclic garbage collection inside, until ``collect_from_here()``; after, as before,
    except that what ``collect_from_here()`` froze stays frozen (unfrozen, the collection at the
    interpreter's exit would walk it all: a second of CPU after a plan)."""
    global _paused
    was_enabled = gc.isenabled()
    gc.disable()
    _paused = was_enabled
    try:
        yield
    finally:
        _paused = False
        if was_enabled:
            gc.enable()


def collect_from_here() -> None:
    """Inside ``paused_collection()``: freeze what is alive and collect again from here on."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
