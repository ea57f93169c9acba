"""Overlap mode: parameters and optimizer state are copied after ``save()`` returns, and the
next optimizer step waits for that copy.

Used by ``CheckpointManager(overlap=True)``. Threads: :func:`deferred_mask` and every
:class:`SnapshotGate` method run on the training thread; the deferred copy runs on
``ckptlib-snapshot-<step>``; the optimizer step pre-hook runs inside ``optimizer.step()``
(the training thread).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ckptlib.engine.snapshot import Snapshot, SnapshotAborted
from ckptlib.errors import CommitTimeoutError
from ckptlib.plan.flatten import FlatState

log = logging.getLogger("ckptlib")


class SnapshotGate:
    """The snapshot copy still running after ``save()`` returned, and the step pre-hook that
    makes the next optimizer step wait for it (at most ``timeout`` seconds)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.wait_seconds = 0.0
        """Seconds the training thread spent waiting for deferred copies (all saves)."""
        self._snap: Snapshot | None = None
        self._thread: threading.Thread | None = None
        self._hooks: list[RemovableHandle] = []

    def start(self, snap: Snapshot, deadline: float, step: int) -> None:
        """Copy the rest of ``snap`` on a snapshot thread; arm the optimizer step pre-hook."""
        self._snap = snap
        self._thread = threading.Thread(
            target=_stage_rest, args=(snap, deadline), name=f"ckptlib-snapshot-{step}", daemon=True
        )
        self._thread.start()
        self._install_hook()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy is done. A copy that misses ``timeout`` (default: the snapshot
        deadline) abandons its save (which then fails); its error is never raised here."""
        snap = self._snap
        if snap is None:
            return
        limit = self.timeout if timeout is None else timeout
        t0 = time.perf_counter()
        try:
            snap.wait_staged(time.monotonic() + limit)
        except CommitTimeoutError as e:
            log.warning("ckptlib: snapshot still copying after %.1fs; abandoning that save", limit)
            snap.fail(e)
        self.wait_seconds += time.perf_counter() - t0
        self._snap = None

    def release(self, timeout: float | None = None) -> None:
        """:meth:`wait`, then remove the hook (``wait_for_snapshot``)."""
        self.wait(timeout)
        self._remove_hooks()

    def finish(self) -> None:
        """:meth:`wait`, join the snapshot thread, remove the hook (before the next save)."""
        self.wait()
        t = self._thread
        if t is not None:
            t.join(self.timeout)
            if not t.is_alive():
                self._thread = None
        self._remove_hooks()

    def _install_hook(self) -> None:
        """A global step pre-hook on every optimizer while a snapshot copies.

        The hook returns at once once the copy is done; it is removed on the training thread
        by :meth:`release`/:meth:`finish`, never from inside a hook (torch iterates the hook
        dict while calling them). It holds the gate weakly.
        """
        if self._hooks:
            return
        ref = weakref.ref(self)

        def pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            gate = ref()
            if gate is not None and gate._snap is not None:
                gate.wait()

        self._hooks.append(register_optimizer_step_pre_hook(pre_hook))

    def _remove_hooks(self) -> None:
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()


def _stage_rest(snap: Snapshot, deadline: float) -> None:
    """Snapshot thread: copy the deferred rounds; failures go to the save."""
    try:
        snap.stage(snap.nrounds, deadline)
    except SnapshotAborted:
        pass
    except Exception as e:
        snap.fail(e)


def deferred_mask(state: Any, flat: FlatState) -> list[bool]:
    """Which items only an optimizer step mutates (copied after ``save()``): those whose storage
    belongs to a module parameter or an optimizer's parameter or state found in ``state``."""
    owned: set[int] = set()
    stack: list[tuple[Any, int]] = [(state, 0)]
    while stack:
        x, depth = stack.pop()
        if depth > 100:
            continue
        if isinstance(x, torch.nn.Module):
            owned.update(p.untyped_storage().data_ptr() for p in x.parameters())
        elif isinstance(x, torch.optim.Optimizer):
            for g in x.param_groups:
                owned.update(p.untyped_storage().data_ptr() for p in g["params"])
            for st in x.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        owned.add(v.untyped_storage().data_ptr())
        elif isinstance(x, dict):
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list | tuple):
            stack.extend((v, depth + 1) for v in x)
    if not owned:
        log.info("ckptlib: overlap mode found no module or optimizer in the state; copying all")
    return [
        it.tensor.numel() > 0 and it.tensor.untyped_storage().data_ptr() in owned
        for it in flat.items
    ]
