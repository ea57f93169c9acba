"""The newest consistent Lightning checkpoint in a folder, on ckptlib's one resume loop.

Called on the training thread before ``trainer.fit(ckpt_path=...)``, by every rank or by one
(it is not collective: each caller judges the folder itself with a local coordinator and all
get the same answer). The candidates are the ckptlib checkpoint folders written by
:class:`~ckptlib.integrations.lightning.CkptlibCheckpointIO` directly under ``dirpath``
(``epoch=3-step=120.ckpt``, ``last.ckpt``, ...), newest first by the ``global_step`` each
recorded (then by save time); crashed saves (``*.tmp-*`` folders) are never candidates. Every
manifest is read, once, to order them; the rest of the quick check (file sizes) runs newest
first only as far as the resume goes, on the manifest already read; ``verify=True`` also
checksums the chosen one and falls back to an older one if it is damaged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from ckptlib.backends import Storage, join, open_storage
from ckptlib.coord.coordinator import LocalCoordinator
from ckptlib.engine.resume import Candidate, resume_newest
from ckptlib.engine.scan import StepInfo, check_step, read_manifest
from ckptlib.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ckptlib.format import layout
from ckptlib.format import tree as tree_codec
from ckptlib.format.manifest import Manifest

log = logging.getLogger("ckptlib")


def _global_step(manifest: Manifest | None, where: str) -> int:
    """The ``global_step`` the plugin recorded in the manifest's metadata (-1 if none)."""
    if manifest is None or manifest.metadata is None:
        return -1
    try:
        meta = tree_codec.decode(manifest.metadata, (), where)
    except CheckpointError:
        return -1
    step = meta.get("global_step") if isinstance(meta, dict) else None
    return step if type(step) is int and step >= 0 else -1


def checkpoint_candidates(storage: Storage) -> list[Candidate]:
    """Every checkpoint folder under ``storage``'s root, newest first (module docstring), each judged."""
    return list(iter_candidates(storage))


def iter_candidates(storage: Storage) -> Iterator[Candidate]:
    """:func:`checkpoint_candidates`, lazily: every folder's manifest is read now (its
    ``global_step`` orders them); the rest of the quick check (every payload file's size) runs
    only when the caller iterates that far, so a resume whose newest checkpoint is good checks
    the files of that one alone, from the manifest read here (not read again). A folder without
    a readable manifest is judged now, at global step -1."""
    try:
        entries = storage.listdir("")
    except FileNotFoundError:
        return iter(())
    found: list[tuple[int, float, str, StepInfo | Manifest]] = []
    for e in entries:
        if not e.is_dir or layout.TMP_RE.match(e.name):
            continue
        try:
            m = read_manifest(storage, e.name, pieces=False)
        except (CheckpointNotFoundError, CorruptCheckpointError):
            info = check_step(storage, e.name)  # its verdict and reason, as for any step
            if info.status == "incomplete" and storage.size(join(e.name, layout.MARKER)) is None:
                continue  # a folder without a manifest that ckptlib did not start: not a checkpoint
            found.append((-1, info.created or 0.0, e.name, info))
            continue
        found.append((_global_step(m, f"{storage.url}/{e.name}"), m.created, e.name, m))
    found.sort(key=lambda f: (f[0], f[1], f[2]), reverse=True)
    return (_candidate(storage, step, name, info) for step, _, name, info in found)


def _candidate(storage: Storage, step: int, name: str, judged: StepInfo | Manifest) -> Candidate:
    """:func:`iter_candidates`' candidate for folder ``name``: its verdict, or judged now from
    its manifest."""
    info = judged if isinstance(judged, StepInfo) else check_step(storage, name, manifest=judged)
    return Candidate(step, name, info.status, info.reason)


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

        got = resume_newest(LocalCoordinator(), lambda: iter_candidates(storage), attempt,
                            timeout=timeout, where=storage.url, label="global step")
    finally:
        storage.close()
    if got is None:
        return None
    return f"{root.rstrip('/')}/{got.candidate.folder}"
