"""Pause Python's cyclic garbage collector while a phase builds many small objects.

With tens of thousands of tensors, flattening a state, building or parsing a manifest and
planning reads trigger full collections that walk the whole heap (about half of save and load
time at 20,000 tensors); nothing they build is cyclic garbage. Used around those phases only
(never I/O waits), from any thread: pauses nest (a counter under a lock) and collection is
re-enabled when the last ends, if it was enabled when the first began.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
