"""``ckptlib.RNGState``: a leaf that saves and restores every random generator of this rank.

Put one in the state and the manager does the rest (one line in a training loop)::

    state = {"model": model, "optim": opt, "rng": ckptlib.RNGState()}
    mgr.restore(state)          # the generators continue where the saved run left them
    ...
    mgr.save(step, state)       # captures Python ``random``, NumPy, torch CPU and CUDA states

Who calls what: it is a stateful leaf (``state_dict``/``load_state_dict``, like a module).
The save flattens it on the training thread at ``save()`` (engine/save.prepare), so the
states are those at the moment of the call; a restore calls :meth:`load_state_dict` on the
caller's thread after every tensor of the step was read and checked.

What is stored (no pickle anywhere): Python's state as ``version`` + 625 ints +
``gauss_next``; NumPy's legacy global generator (``np.random.get_state(legacy=False)``) as
its key (624 ints), position and cached Gaussian; torch's CPU generator as its uint8 state
tensor; each visible CUDA device's generator as a uint8 tensor (an empty list without CUDA).
All of it is wrapped in :class:`~ckptlib.PerRank`: every rank saves its own generators and
gets its own back. Restoring on a different world size raises unless the restore passes
``per_rank="rank0"`` (every rank takes rank 0's states) -- see ``CheckpointManager.restore``.
CUDA states are restored only where CUDA is available, for as many devices as both the saved
and the current process have. Generators a program creates itself (``torch.Generator()``,
``np.random.default_rng()``) are not global; save them with their own ``get_state()``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ckptlib.errors import CorruptCheckpointError
from ckptlib.format.leaves import PerRank

KEY = "this_rank"
"""The single key of :meth:`RNGState.state_dict` (its value is a :class:`PerRank`)."""


class RNGState:
    """Every global random generator of this process, captured at save, restored at restore.

    ``cuda=False`` leaves CUDA generators alone (never touching CUDA at all).
    """

    def __init__(self, *, cuda: bool = True) -> None:
        self.cuda = cuda

    def __repr__(self) -> str:
        return f"RNGState(cuda={self.cuda})"

    def state_dict(self) -> dict[str, Any]:
        """The current states of this rank's generators, JSON-typed values and uint8 tensors."""
        return {KEY: PerRank(capture(self.cuda))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set this rank's generators to ``state`` (from :meth:`state_dict`, after a load)."""
        value = state.get(KEY) if isinstance(state, dict) else None
        if isinstance(value, PerRank):
            value = value.value
        if not isinstance(value, dict):
            raise CorruptCheckpointError(f"RNG state must be a dict under {KEY!r}, got {type(value).__name__}")
        apply(value, self.cuda)


def _cuda_ready(cuda: bool) -> bool:
    return cuda and torch.cuda.is_available()


def capture(cuda: bool = True) -> dict[str, Any]:
    """This process's generator states as a tree ckptlib stores without pickle."""
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    assert isinstance(np_state, dict)
    return {
        "python": {"version": int(version), "internal": [int(x) for x in internal], "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": str(np_state["bit_generator"]),
            "key": [int(x) for x in np_state["state"]["key"]],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if _cuda_ready(cuda) else [],
    }


def apply(state: dict[str, Any], cuda: bool = True) -> None:
    """Set this process's generators from :func:`capture`'s tree (after a load). Values of the
    wrong type are a :class:`CorruptCheckpointError`; every part is checked before any is set."""
    try:
        py, nps, cpu, devices = state["python"], state["numpy"], state["torch"], state["cuda"]
        internal = tuple(py["internal"])
        gauss_next = py["gauss_next"]
        if not all(type(x) is int for x in internal) or not (gauss_next is None or type(gauss_next) is float):
            raise TypeError("python state must hold ints and a float or None")
        py_state = (int(py["version"]), internal, gauss_next)
        np_state = {
            "bit_generator": str(nps["bit_generator"]),
            "state": {"key": np.asarray(nps["key"], dtype=np.uint32), "pos": int(nps["pos"])},
            "has_gauss": int(nps["has_gauss"]),
            "gauss": float(nps["gauss"]),
        }
        if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
            raise TypeError("torch state must be a uint8 tensor")
        if not isinstance(devices, list | tuple) or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in devices
        ):
            raise TypeError("cuda states must be a list of uint8 tensors")
        probe = random.Random()
        probe.setstate(py_state)  # validates before the global generator is touched
        np.random.RandomState().set_state(np_state)  # likewise
    except (KeyError, IndexError, TypeError, ValueError, OverflowError) as e:
        raise CorruptCheckpointError(f"saved RNG state is not valid: {type(e).__name__}: {e}") from None
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(cpu.cpu())
    if devices and _cuda_ready(cuda):
        n = min(len(devices), torch.cuda.device_count())
        for i in range(n):
            torch.cuda.set_rng_state(devices[i].cpu(), i)
