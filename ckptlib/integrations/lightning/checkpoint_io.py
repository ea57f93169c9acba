"""``CkptlibCheckpointIO``: Lightning's ``CheckpointIO`` plugin writing ckptlib checkpoints.

Lightning's ``Trainer`` builds the checkpoint dict (``trainer.save_checkpoint``, called by
``ModelCheckpoint``) on every rank and hands it to the plugin on global rank 0 only, on the
training thread (or, wrapped in ``AsyncCheckpointIO``, on that wrapper's one worker thread,
after it cloned the tensors on the training thread). So the plugin saves with a local
coordinator: rank 0 alone writes one ckptlib checkpoint *folder* at the path Lightning chose
(``.../epoch=3-step=120.ckpt/``), atomically: the folder appears only once every byte is
durable, and an existing one (``last.ckpt``) is replaced only by a committed new one.
``load_checkpoint`` runs on every rank that loads (no collective); ``remove_checkpoint`` on
rank 0, deleting the folder invisibly first. Values that are not JSON-typed follow
:mod:`ckptlib.integrations.values` (converted, refused, or opted in as opaque bytes).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback

from ckptlib import api
from ckptlib.backends import join, open_storage
from ckptlib.coord.coordinator import LocalCoordinator
from ckptlib.engine import retire
from ckptlib.errors import CheckpointError
from ckptlib.format import layout
from ckptlib.format.schema import MANIFEST_NAME
from ckptlib.integrations.values import from_stored, to_storable
from ckptlib.rng import apply, capture


class CkptlibCheckpointIO(CheckpointIO):
    """Save and load Lightning checkpoints as ckptlib checkpoint folders.

    ``Trainer(plugins=[CkptlibCheckpointIO()])``; async: ``Trainer(plugins=[AsyncCheckpointIO(
    CkptlibCheckpointIO())])``. ``compression``: None or ``"zstd"``. ``storage_options``: for
    fsspec URLs (``s3://...`` as ``default_root_dir``/``dirpath``). ``allow_pickle_for``: key
    paths whose unconvertible values may be stored as opaque pickled bytes; ``unpickle=True``
    turns them back into objects at load (only for checkpoints you trust; default: they load
    as :class:`~ckptlib.integrations.values.PickledValue`).
    """

    def __init__(
        self,
        *,
        compression: str | None = None,
        storage_options: dict[str, Any] | None = None,
        allow_pickle_for: tuple[str, ...] | list[str] = (),
        unpickle: bool = False,
        verify: bool = True,
    ) -> None:
        if isinstance(allow_pickle_for, str):
            raise TypeError("allow_pickle_for must be a tuple of key paths, e.g. ('hyper_parameters',)")
        self.compression = compression
        self.storage_options = storage_options
        self.allow_pickle_for = tuple(allow_pickle_for)
        self.unpickle = unpickle
        self.verify = verify

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Rank 0 (Lightning calls it there only): write ``checkpoint`` as a folder at ``path``."""
        if storage_options is not None:
            raise TypeError(
                "CkptlibCheckpointIO does not take per-call storage_options; pass storage_options= "
                "to CkptlibCheckpointIO(...) instead"
            )
        state = to_storable(checkpoint, self.allow_pickle_for)
        meta = {k: checkpoint[k] for k in ("global_step", "epoch") if type(checkpoint.get(k)) is int}
        api.save(state, os.fspath(path), storage_options=self.storage_options, compression=self.compression,
                 metadata=meta, overwrite=True, coordinator=LocalCoordinator())

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Any rank: the checkpoint dict at ``path`` (CPU tensors, or moved to ``map_location``
        when it is a device). Nothing is unpickled unless ``unpickle=True`` was given."""
        loaded = api.load(os.fspath(path), storage_options=self.storage_options, verify=self.verify)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{path} is a ckptlib checkpoint but not a Lightning one (not a dict)")
        if isinstance(map_location, str | torch.device) and torch.device(map_location).type != "cpu":
            device = torch.device(map_location)
            loaded = _to_device(loaded, device)
        out = from_stored(loaded, unpickle=self.unpickle)
        assert isinstance(out, dict)
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Rank 0: delete the checkpoint folder at ``path`` (invisible first); a missing one is
        fine; anything that is not a ckptlib checkpoint is refused and left alone."""
        parent, name = api.split_url(os.fspath(path))
        storage = open_storage(parent, self.storage_options)
        try:
            if not storage.exists(name):
                return
            if storage.size(join(name, MANIFEST_NAME)) is None and storage.size(join(name, layout.MARKER)) is None:
                raise CheckpointError(
                    f"not removing {path}: it is not a ckptlib checkpoint (no {MANIFEST_NAME}); delete it yourself"
                )
            retire.delete_step(storage, name)
        finally:
            storage.close()


class RNGCallback(Callback):
    """Saves the global RNG states (Python, NumPy, torch, CUDA) in Lightning checkpoints and
    restores them on resume, so a resumed run draws what the uninterrupted run would have
    (shuffling, dropout). Lightning writes rank 0's checkpoint only: every rank gets rank 0's
    states back (docs/integrations/lightning.md)."""

    def __init__(self, *, cuda: bool = True) -> None:
        self.cuda = cuda

    @property
    def state_key(self) -> str:
        return "ckptlib.RNGCallback"

    def state_dict(self) -> dict[str, Any]:
        return capture(self.cuda)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        apply(state_dict, self.cuda)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value
