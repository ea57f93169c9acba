"""Accelerate integration: everything ``Accelerator.save_state`` covers, stored through ckptlib.

Usage (every process, after ``accelerator.prepare``; see docs/integrations/accelerate.md)::

    from ckptlib.integrations.accelerate import load_state, save_state
    mgr = ckptlib.CheckpointManager(url, keep_last=3)
    start = load_state(accelerator, mgr) or 0          # newest consistent step, or None
    ...
    save_state(accelerator, mgr, step)                  # async: returns a SaveHandle

Accelerate itself is imported only by :mod:`.state` when a save or load needs its classes.
"""

from __future__ import annotations

from ckptlib.integrations.accelerate.state import accelerator_state, load_state, save_state

__all__ = ["accelerator_state", "load_state", "save_state"]
