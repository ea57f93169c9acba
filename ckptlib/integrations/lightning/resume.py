"""The newest consistent Lightning checkpoint in a folder, on ckptlib's one resume loop.

Called on the training thread before ``trainer.fit(ckpt_path=...)``, by every rank or by one
(it is not collective: each caller judges the folder itself with a local coordinator and all
get the same answer). The candidates are the ckptlib checkpoint folders written by
:class:`~ckptlib.integrations.lightning.CkptlibCheckpointIO` directly under ``dirpath``
(``epoch=3-step=120.ckpt``, ``last.ckpt``, ...), newest first by the ``global_step`` each
recorded (then by save time); crashed saves (``*.tmp-*`` folders) are never candidates. The
quick check (manifest, file sizes) runs for all; ``verify=True`` also checksums the chosen one
and falls back to an older one if it is damaged.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ckptlib.backends import Storage, join, open_storage
from ckptlib.coord.coordinator import LocalCoordinator
from ckptlib.engine.resume import Candidate, resume_newest
from ckptlib.engine.scan import StepInfo, check_step
from ckptlib.errors import CheckpointError, CorruptCheckpointError
from ckptlib.format import layout
from ckptlib.format import tree as tree_codec

log = logging.getLogger("ckptlib")


def _global_step(info: StepInfo, where: str) -> int:
    """The ``global_step`` the plugin recorded in the manifest's metadata (-1 if none)."""
    if info.manifest is None or info.manifest.metadata is None:
        return -1
    try:
        meta = tree_codec.decode(info.manifest.metadata, (), where)
    except CheckpointError:
        return -1
    step = meta.get("global_step") if isinstance(meta, dict) else None
    return step if type(step) is int and step >= 0 else -1


def checkpoint_candidates(storage: Storage) -> list[Candidate]:
    """Every checkpoint folder under ``storage``'s root, newest first (module docstring)."""
    try:
        entries = storage.listdir("")
    except FileNotFoundError:
        return []
    found: list[tuple[int, float, Candidate]] = []
    for e in entries:
        if not e.is_dir or layout.TMP_RE.match(e.name):
            continue
        info = check_step(storage, e.name)
        if info.status == "incomplete" and storage.size(join(e.name, layout.MARKER)) is None:
            continue  # a folder without a manifest that ckptlib did not start: not a checkpoint
        step = _global_step(info, f"{storage.url}/{e.name}")
        found.append((step, info.created or 0.0, Candidate(step, e.name, info.status, info.reason)))
    found.sort(key=lambda f: (f[0], f[1], f[2].folder), reverse=True)
    return [c for _, _, c in found]


def newest_checkpoint(
    dirpath: str | os.PathLike[str],
    *,
    verify: bool = False,
    storage_options: dict[str, Any] | None = None,
    timeout: float = 600.0,
) -> str | None:
    """The path (or URL) of the newest usable checkpoint under ``dirpath``, for
    ``trainer.fit(ckpt_path=...)``; None when there is none yet (a fresh start). Raises
    :class:`CorruptCheckpointError` when checkpoints exist but none is usable."""
    root = os.fspath(dirpath)
    storage = open_storage(root, storage_options)
    try:

        def attempt(c: Candidate) -> None:
            if verify:
                info = check_step(storage, c.folder, deep=True)
                if info.status != "committed":
                    raise CorruptCheckpointError(info.reason, f"{storage.url}/{c.folder}")

        got = resume_newest(LocalCoordinator(), lambda: checkpoint_candidates(storage), attempt,
                            timeout=timeout, where=storage.url, label="global step")
    finally:
        storage.close()
    if got is None:
        return None
    return f"{root.rstrip('/')}/{got.candidate.folder}"
