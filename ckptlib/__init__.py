"""ckptlib: fault-tolerant checkpoint and resume for large-model training in PyTorch.

Public names are listed in ``__all__`` (see API.md); everything else is internal.
"""

from __future__ import annotations

from ckptlib._version import __version__
from ckptlib.api import load, load_metadata, save
from ckptlib.engine.load import LoadResult
from ckptlib.engine.scan import StepInfo
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitError,
    CommitTimeoutError,
    CorruptCheckpointError,
    FatalStorageError,
    ManifestVersionError,
    StateMismatchError,
    StepExistsError,
    StorageError,
    StorageTimeoutError,
    TargetNotEmptyError,
    UnsupportedValueError,
)
from ckptlib.format.leaves import PerRank, Shard
from ckptlib.manager import CheckpointManager, SaveHandle
from ckptlib.read.view import CheckpointView, TensorInfo
from ckptlib.read.view import open_view as open  # API.md: ckptlib.open(url)

__all__ = [
    "CheckpointError", "CheckpointManager", "CheckpointNotFoundError", "CheckpointView",
    "CommitError", "CommitTimeoutError", "CorruptCheckpointError", "FatalStorageError", "LoadResult",
    "ManifestVersionError", "PerRank", "SaveHandle", "Shard", "StateMismatchError",
    "StepExistsError", "StepInfo", "StorageError", "StorageTimeoutError", "TargetNotEmptyError", "TensorInfo",
    "UnsupportedValueError", "__version__", "load", "load_metadata", "open", "save",
]
