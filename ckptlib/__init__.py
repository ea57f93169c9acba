"""ckptlib: fault-tolerant checkpoint and resume for large-model training in PyTorch.

Public names are listed in ``__all__`` (see API.md); everything else is internal.

Names that need torch (``save``, ``load``, ``CheckpointManager``, ...) are imported on first
use (PEP 562 ``__getattr__`` below), so ``import ckptlib`` -- and the ``ckptlib ls``/``verify``/
``prune`` commands, which read only JSON manifests and bytes -- never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptlib._version import __version__
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitError,
    CommitTimeoutError,
    CommitUnknownError,
    CorruptCheckpointError,
    FatalStorageError,
    ManifestVersionError,
    MissingDependencyError,
    NonFiniteError,
    NotInCheckpointError,
    ReplicaMismatchError,
    StateMismatchError,
    StepExistsError,
    StorageError,
    StorageTimeoutError,
    TargetNotEmptyError,
    UnsupportedValueError,
)

if TYPE_CHECKING:
    from ckptlib.api import load, load_metadata, save
    from ckptlib.engine.load import LoadResult
    from ckptlib.engine.scan import StepInfo
    from ckptlib.format.leaves import PerRank, Shard
    from ckptlib.manager import CheckpointManager, SaveHandle
    from ckptlib.read.view import CheckpointView, TensorInfo
    from ckptlib.read.view import open_view as open  # API.md: ckptlib.open(url)
    from ckptlib.rng import RNGState

_LAZY: dict[str, tuple[str, str]] = {
    "load": ("ckptlib.api", "load"),
    "load_metadata": ("ckptlib.api", "load_metadata"),
    "save": ("ckptlib.api", "save"),
    "LoadResult": ("ckptlib.engine.load", "LoadResult"),
    "StepInfo": ("ckptlib.engine.scan", "StepInfo"),
    "PerRank": ("ckptlib.format.leaves", "PerRank"),
    "Shard": ("ckptlib.format.leaves", "Shard"),
    "CheckpointManager": ("ckptlib.manager", "CheckpointManager"),
    "SaveHandle": ("ckptlib.manager", "SaveHandle"),
    "CheckpointView": ("ckptlib.read.view", "CheckpointView"),
    "TensorInfo": ("ckptlib.read.view", "TensorInfo"),
    "open": ("ckptlib.read.view", "open_view"),
    "RNGState": ("ckptlib.rng", "RNGState"),
}
"""Public name -> (module, attribute), imported on first access by :func:`__getattr__`."""


def __getattr__(name: str) -> Any:
    """PEP 562: import a torch-using public name on first use and cache it in the module."""
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'ckptlib' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CheckpointError", "CheckpointManager", "CheckpointNotFoundError", "CheckpointView",
    "CommitError", "CommitTimeoutError", "CommitUnknownError", "CorruptCheckpointError", "FatalStorageError",
    "LoadResult", "ManifestVersionError", "MissingDependencyError", "NonFiniteError", "NotInCheckpointError", "PerRank", "ReplicaMismatchError", "RNGState", "SaveHandle", "Shard", "StateMismatchError",
    "StepExistsError", "StepInfo", "StorageError", "StorageTimeoutError", "TargetNotEmptyError",
    "TensorInfo",
    "UnsupportedValueError", "__version__", "load", "load_metadata", "open", "save",
]
