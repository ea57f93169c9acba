"""Typed errors raised by ckptlib. Imports nothing from ckptlib.

Every error derives from :class:`CheckpointError` (some also from a builtin, so generic
handlers keep working) and pickles cleanly: errors cross processes in distributed saves.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class CheckpointError(Exception):
    """Base class of every error ckptlib raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (or no root folder) exists where one was asked for."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed validation: bad manifest, size, checksum, or hostile content.
    ``path`` names the file that was wrong (or ``""``)."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.detail = message

    def __reduce__(self):  # keep pickling exact across processes
        return (type(self), (self.detail, self.path))


class ManifestVersionError(CorruptCheckpointError):
    """The manifest was written by a newer, unknown format version."""


class CommitError(CheckpointError):
    """A save could not be committed. Nothing was published; the previous checkpoint stands.
    ``failures`` maps rank -> a one-line description, when ranks failed."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})

    def __reduce__(self):
        return (type(self), (self.args[0], self.failures))


class CommitTimeoutError(CommitError, TimeoutError):
    """A save did not finish within its deadline (a stalled rank or storage)."""


class CommitUnknownError(CommitError):
    """The save's outcome could not be learned: its coordinator's process died after this rank's
    bytes were durable and before it told this rank, and the commit point is on storage this
    rank cannot read (a tier save's record, on the coordinator's node); or, on an object store,
    the manifest's put failed without a definite answer and could not be read back (every rank
    raises it). The step may be committed; the next restore decides. A rank that loses its
    coordinator where the commit point is shared storage settles the save itself instead
    (``ckptlib.engine.commit.fence``)."""


class NonFiniteError(CommitError):
    """A save with ``nonfinite="refuse"`` found NaN or Inf in floating-point tensors (named in
    the message, with the ranks that hold them); nothing of that step was committed."""


class ReplicaMismatchError(CommitError):
    """Copies of a replicated tensor held by several ranks differ (a silent fault in one
    data-parallel replica): the message names the tensor and the ranks that disagree; nothing of
    that step was committed."""


class StepExistsError(CommitError, FileExistsError):
    """A committed, valid checkpoint already exists at the step being saved."""


class TargetNotEmptyError(CommitError, FileExistsError):
    """A save's target folder holds files ckptlib did not write (or is a file); nothing in it
    was moved or changed."""


class StateMismatchError(CheckpointError, ValueError):
    """The target ``state`` of a load does not match the checkpoint (keys, shapes, dtypes)."""


class NotInCheckpointError(CheckpointError, KeyError):
    """A tensor name or a path that the checkpoint does not hold (``CheckpointView.info``,
    ``read``, ``load(select=...)``); also a ``KeyError``, so ``except KeyError`` keeps working.
    Its text is the message as written (a plain ``KeyError`` would print it quoted)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StorageError(CheckpointError, OSError):
    """The storage backend failed (I/O error, permission, unreachable server)."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage operation (or the save it belongs to) ran past its deadline."""


class FatalStorageError(StorageError):
    """A storage failure that retrying cannot fix (access denied, missing bucket, ...)."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A state leaf cannot be saved without pickle (e.g. an arbitrary Python object)."""


class MissingDependencyError(CheckpointError, ImportError):
    """A feature needs an optional package that is not installed. The message names the feature
    and the command that installs it (``pip install "ckptlib[EXTRA]"``, or ``pip install PACKAGE``
    where ckptlib has no extra for it, ``extra=""``); ``extra`` holds EXTRA. Raised by
    :func:`require` and by ``open_storage`` for an fsspec URL whose filesystem package is missing
    (also an ``ImportError``, so existing handlers keep working)."""

    def __init__(self, feature: str, extra: str, package: str = "") -> None:
        install = f'"ckptlib[{extra}]"' if extra else package
        super().__init__(f"{feature} needs the optional package {package or extra!r}, which is not "
                         f"installed: pip install {install}")
        self.feature, self.extra, self.package = feature, extra, package

    def __reduce__(self):  # keep pickling exact across processes
        return (type(self), (self.feature, self.extra, self.package))


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import the optional ``module`` (e.g. ``"s3fs"``) that ``feature`` needs, or raise
    :class:`MissingDependencyError` naming ``pip install "ckptlib[extra]"``. Called, on the
    caller's thread, by the code that first uses an optional package (the S3 backend, tensorstore
    arrays and zarr3 export, the framework integrations), never at ``import ckptlib`` time."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(feature, extra, module.split(".")[0]) from e
