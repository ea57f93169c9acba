"""Pause Python's cyclic garbage collector while a phase builds many small objects.

Flattening a state, building and parsing a manifest and planning reads create several
container objects per tensor. With tens of thousands of tensors those allocations trigger
repeated full collections that walk the whole heap (the model, the optimizer state, every
tensor): on a 20,000-tensor state about half of save and load time. Nothing these phases
build is cyclic garbage, so pausing collection for their duration frees nothing later.

Used as a context manager by the engine around those phases only (never around I/O waits):
:func:`ckptlib.engine.save.prepare` and the manifest build in ``persist``,
:func:`ckptlib.engine.scan.read_manifest`, and the planning half of
:func:`ckptlib.engine.load.load_checkpoint`. Any thread may enter; pauses nest and overlap
across threads (a counter under a lock), and collection is re-enabled only when the last
pause ends and only if it was enabled when the first began. Reference counting keeps
freeing memory meanwhile. The collector is process-wide, so a pause also defers collection
for the training loop's threads; pauses last as long as those loops (tens of milliseconds
for 20,000 tensors), and the one collection that follows a pause catches up.
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
