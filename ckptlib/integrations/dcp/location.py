"""Where a DCP writer or reader points: a checkpoint folder URL, or a root + step.

Used by :mod:`~ckptlib.integrations.dcp.writer`, :mod:`~ckptlib.integrations.dcp.reader` and
:mod:`~ckptlib.integrations.dcp.resume` (``step_url``: the layout ``load_latest`` scans).
"""

from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from ckptlib.api import split_url
from ckptlib.backends import Storage, open_storage
from ckptlib.format import layout


def step_url(root: str | os.PathLike[str], step: int) -> str:
    """The folder URL of ``step`` under ``root`` (``<root>/step-000000000042``): the layout
    :func:`load_latest`, ``ckptlib ls`` and ``CheckpointManager`` scan."""
    return os.fspath(root).rstrip("/") + "/" + layout.step_dir(step)


def resolve(url: str | os.PathLike[str] | None, step: int | None) -> tuple[str, str, int | None]:
    """``(parent URL, folder name, step)`` for a checkpoint folder URL (or root + step)."""
    if url is None:
        raise ValueError("a checkpoint URL is required (pass it here or as dcp's checkpoint_id)")
    if step is not None:
        url = step_url(url, step)
    parent, name = split_url(url)
    if not name:
        raise ValueError(f"{url!r} names no checkpoint folder")
    return parent, name, layout.parse_step(name)


@dataclass(eq=False)
class Located:
    """Where a writer or reader points: ``url`` (+ ``step``) and its storage, opened once; and
    the options :class:`CkptlibWriter` and :class:`CkptlibReader` share. DCP calls them on the
    training thread (or an async-save thread), one save or load at a time per instance.
    """

    url: str | os.PathLike[str] | None = None
    _: KW_ONLY
    step: int | None = None
    storage_options: dict[str, Any] | None = None
    allow_pickled_objects: bool = False
    _storage: Storage | None = field(default=None, init=False, repr=False)
    _storage_url: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.url = None if self.url is None else os.fspath(self.url)

    def open_target(self) -> tuple[Storage, str, int | None]:
        """(storage of the parent folder, checkpoint folder name, step); reopened on a new URL."""
        parent, name, step = resolve(self.url, self.step)
        if self._storage is None or self._storage_url != parent:
            self._storage = open_storage(parent, self.storage_options)
            self._storage_url = parent
        return self._storage, name, step

    @property
    def checkpoint_id(self) -> str | None:
        if self.url is None:
            return None
        return step_url(self.url, self.step) if self.step is not None else os.fspath(self.url)
