"""DCP resume: :func:`load_latest` on ckptlib's one resume loop, :func:`latest_checkpoint`.

Both list candidates with :func:`candidates` (one scan: manifest valid, files present with
their sizes, DCP metadata present). :func:`load_latest` runs
:func:`ckptlib.engine.resume.resume_newest` over ckptlib's coordinator
(``default_coordinator()``: its own gloo group, deadlines from ``CKPTLIB_COORD_TIMEOUT``),
on the caller's thread, every rank in the same order; each attempt is a ``dcp.load``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlanner

from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import default_coordinator
from ckptlib.engine.resume import Candidate, resume_newest, step_candidates
from ckptlib.engine.scan import StepInfo
from ckptlib.errors import CheckpointError, CorruptCheckpointError
from ckptlib.integrations.dcp.metadata import EXTRA_KEY
from ckptlib.integrations.dcp.reader import CkptlibReader

LOAD_TIMEOUT = 600.0
"""Deadline of each agreement step of :func:`load_latest` (the coordinator's group timeout,
``CKPTLIB_COORD_TIMEOUT``, bounds each collective too)."""


@dataclass(slots=True)
class DcpCheckpoint:
    """A DCP checkpoint found by :func:`latest_checkpoint`."""

    step: int
    url: str
    """The folder URL, for ``CkptlibReader(url)`` or ``dcp.load(checkpoint_id=url, ...)``."""
    save_id: str
    world_size: int
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """Newer steps that were passed over, with the reason."""


def _judge(i: StepInfo) -> tuple[str, str, Any]:
    """``step_candidates``' judge: ``extra`` is ``[save_id, world_size]``; a committed step
    without DCP metadata becomes ``not_dcp``."""
    if i.manifest is None or EXTRA_KEY not in i.manifest.extra:
        return "not_dcp", "a ckptlib checkpoint without DCP metadata", None
    return i.status, i.reason, [i.save_id, i.world_size]


def candidates(root: str, storage_options: dict[str, Any] | None) -> Iterator[Candidate]:
    """Every step under ``root``, newest first, each judged as the caller gets to it
    (``step_candidates``); ``folder`` is the step's URL."""
    return (replace(c, folder=f"{root.rstrip('/')}/{c.folder}")
            for c in step_candidates(open_storage(root, storage_options), _judge))


def latest_checkpoint(
    root: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> DcpCheckpoint | None:
    """The newest committed DCP step under ``root`` (manifest valid, every file present with its
    recorded size), or None. A quick check: payload checksums are verified when loading, and
    :func:`load_latest` falls back to older steps when that finds damage."""
    skipped: list[tuple[int, str]] = []
    for c in candidates(os.fspath(root), storage_options):
        if c.status == "committed":
            return DcpCheckpoint(c.step, c.folder, c.extra[0], c.extra[1], skipped)
        skipped.append((c.step, f"{c.status}: {c.reason}"))
    return None


class DcpLoadError(CheckpointError):
    """``dcp.load`` failed (DCP's ``CheckpointException``, with every rank's failure, is the cause)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.dcp_failures: Any = getattr(error, "failures", None)


def _corruption(e: BaseException, reader: CkptlibReader | None) -> str | None:
    """``damaged=`` hook of the resume loop: why a failed ``dcp.load`` means the checkpoint is
    damaged, or None for other failures (decided from every rank's failure in DCP's exception)."""
    failures = e.dcp_failures if isinstance(e, DcpLoadError) else None
    if isinstance(failures, dict):
        bad = []
        last = reader.last_error if reader is not None else None
        for rank, f in sorted(failures.items()):
            exc = f[0] if isinstance(f, tuple) and f else f
            if isinstance(exc, CorruptCheckpointError):
                bad.append(f"rank {rank}: {exc}")
            elif isinstance(exc, AssertionError) and isinstance(last, CorruptCheckpointError):
                bad.append(f"rank {rank}: {last}")  # DCP wrapped read_metadata's error
        return "; ".join(bad) or None
    if isinstance(e, CorruptCheckpointError):
        return str(e)
    return None


def load_latest(
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    verify: bool = True,
    allow_pickled_objects: bool = False,
) -> int | None:
    """Resume: ``dcp.load`` the newest consistent step under ``root`` into ``state_dict``.

    Collective when torch.distributed is initialized (every rank calls it), on ckptlib's
    resume loop (module docstring): a step whose load finds damage on any rank is skipped by
    all ranks. ``process_group`` is passed to ``dcp.load``. Returns the step loaded, or None
    when there is no checkpoint. Raises ``CorruptCheckpointError`` when checkpoints exist but
    none is usable, and ``StateMismatchError`` / ``CheckpointError`` (DCP's exception as the
    cause) on every rank for other load failures.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    root = os.fspath(root)
    reader: list[CkptlibReader] = []

    def attempt(c: Candidate) -> None:
        reader[:] = [CkptlibReader(c.folder, storage_options=storage_options, verify=verify,  # judged: sizes checked
                                   allow_pickled_objects=allow_pickled_objects, judged=True)]
        try:
            dcp.load(state_dict, storage_reader=reader[0], planner=planner, process_group=process_group)
        except CheckpointException as e:  # a BaseException: the resume loop handles Exceptions
            raise DcpLoadError(e) from e

    got = resume_newest(
        default_coordinator(), lambda: candidates(root, storage_options), attempt,
        timeout=LOAD_TIMEOUT, where=root, damaged=lambda e: _corruption(e, reader[0] if reader else None),
    )
    return got.candidate.step if got else None
