"""``save_state``/``load_state``: an ``Accelerator``'s whole training state as one ckptlib step.

What is saved (what ``Accelerator.save_state`` covers), as one state tree that the manager saves
and restores in place (:func:`accelerator_state`):

- ``models``: each prepared model, unwrapped (DDP's ``module.`` prefix is not stored), by its
  state dict; ``optimizers`` and ``schedulers``: the prepared ones, by their state dicts;
- ``dataloaders``: per prepared data loader, the ``SeedableRandomSampler``'s seed and epoch
  (``use_seedable_sampler=True``), a stateful data loader's ``state_dict()``
  (``use_stateful_dataloader=True``) and the loader's epoch counter (``iteration``);
- ``scaler``: the ``GradScaler`` when mixed precision uses one; ``custom``: the objects given to
  ``accelerator.register_for_checkpointing``, in order; ``accelerator_step``: the internal step
  of gradient accumulation;
- ``rng``: :class:`ckptlib.RNGState` -- every process's own Python, NumPy, torch and CUDA states
  (per rank, like Accelerate's ``random_states_<i>.pkl``).

Data loader and custom-object state dicts go through :mod:`ckptlib.integrations.values`
(converted, refused naming the key, or opted in with ``allow_pickle_for``). Threads: both
functions run on the training thread of every process, collectively (every process calls,
in the same order), like the manager's ``save``/``restore``. Accelerate's ``save_state``
pre-hooks are not called (they write files of their own); models saved by DeepSpeed, FSDP or
Megatron plugins of Accelerate are out of scope (use ckptlib's DCP/DeepSpeed integrations).
"""

from __future__ import annotations

import os
from typing import Any

from ckptlib.integrations.values import from_stored, to_storable
from ckptlib.manager import CheckpointManager, SaveHandle
from ckptlib.rng import RNGState


class _Converted:
    """A stateful object whose state dict passes through the value policy both ways."""

    def __init__(self, obj: Any, allow_pickle_for: tuple[str, ...], unpickle: bool) -> None:
        self.obj, self.allow, self.unpickle = obj, allow_pickle_for, unpickle

    def state_dict(self) -> Any:
        return to_storable(self.obj.state_dict(), self.allow)

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(from_stored(state, unpickle=self.unpickle))


class _LoaderState:
    """The resumable part of one prepared data loader (module docstring)."""

    def __init__(self, loader: Any, allow_pickle_for: tuple[str, ...], unpickle: bool) -> None:
        self.loader, self.allow, self.unpickle = loader, allow_pickle_for, unpickle

    def _sampler(self) -> Any:
        from accelerate.data_loader import SeedableRandomSampler  # type: ignore[import-untyped]

        get = getattr(self.loader, "get_sampler", None)
        sampler = get() if callable(get) else None
        return sampler if isinstance(sampler, SeedableRandomSampler) else None

    def state_dict(self) -> dict[str, Any]:
        sampler = self._sampler()
        stateful = getattr(self.loader, "use_stateful_dataloader", False)
        return {
            "iteration": int(getattr(self.loader, "iteration", 0)),
            "sampler": None if sampler is None else {"epoch": int(sampler.epoch), "seed": int(sampler.initial_seed)},
            "dataloader": to_storable(self.loader.state_dict(), self.allow) if stateful else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.loader, "iteration"):
            self.loader.iteration = int(state["iteration"])
        sampler = self._sampler()
        if sampler is not None and state.get("sampler") is not None:
            sampler.initial_seed = int(state["sampler"]["seed"])
            sampler.set_epoch(int(state["sampler"]["epoch"]))
        if state.get("dataloader") is not None and getattr(self.loader, "use_stateful_dataloader", False):
            self.loader.load_state_dict(from_stored(state["dataloader"], unpickle=self.unpickle))


class _AcceleratorStep:
    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


def accelerator_state(
    accelerator: Any, *, allow_pickle_for: tuple[str, ...] = (), unpickle: bool = False
) -> dict[str, Any]:
    """The state tree of ``accelerator`` (module docstring): save it, or restore into it in place."""
    return {
        "models": [accelerator.unwrap_model(m, keep_torch_compile=False) for m in accelerator._models],
        "optimizers": list(accelerator._optimizers),
        "schedulers": list(accelerator._schedulers),
        "dataloaders": [_LoaderState(d, allow_pickle_for, unpickle) for d in accelerator._dataloaders],
        "scaler": accelerator.scaler,
        "custom": [_Converted(o, allow_pickle_for, unpickle) for o in accelerator._custom_objects],
        "accelerator_step": _AcceleratorStep(accelerator),
        "rng": RNGState(),
    }


def _manager(target: CheckpointManager | str | os.PathLike[str]) -> tuple[CheckpointManager, bool]:
    if isinstance(target, CheckpointManager):
        return target, False
    return CheckpointManager(target, async_save=False), True


def save_state(
    accelerator: Any,
    target: CheckpointManager | str | os.PathLike[str],
    step: int,
    *,
    metrics: dict[str, float] | None = None,
    allow_pickle_for: tuple[str, ...] = (),
) -> SaveHandle:
    """Save ``accelerator``'s state as ``step`` (every process). ``target``: a manager (its
    retention and async mode apply; the handle reports the commit) or a root URL (a synchronous
    save through a manager made for this call)."""
    mgr, own = _manager(target)
    try:
        return mgr.save(step, accelerator_state(accelerator, allow_pickle_for=allow_pickle_for), metrics=metrics)
    finally:
        if own:
            mgr.close()


def load_state(
    accelerator: Any,
    target: CheckpointManager | str | os.PathLike[str],
    *,
    step: int | None = None,
    unpickle: bool = False,
) -> int | None:
    """Restore ``accelerator`` in place from the newest consistent step (or ``step``) of
    ``target`` (every process); returns the step, or None when nothing was ever committed."""
    mgr, own = _manager(target)
    try:
        return mgr.restore(accelerator_state(accelerator, unpickle=unpickle), step=step)
    finally:
        if own:
            mgr.close()
