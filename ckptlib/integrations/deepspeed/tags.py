"""Which ckptlib step holds a DeepSpeed tag, and that step opened for loading.

Called on the training thread: by the checkpoint engine (:mod:`.engine`, ``open_tag`` once per
``load_checkpoint``, cached) and by :mod:`.resume` (``tag_of`` on the coordinator while listing
candidates). A tag is found by its step's manifest metadata, never by a directory name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptlib.backends import Storage
from ckptlib.engine.scan import check_files, iter_steps, read_manifest
from ckptlib.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptlib.format import layout
from ckptlib.format import tree as tree_codec
from ckptlib.format.manifest import Manifest

FORMAT = "ckptlib.deepspeed/1"
"""Written into every step's metadata (``{"deepspeed": {"format": FORMAT, "tag": ...}}``)."""

TAG_STEP = re.compile(r"^global_step(\d+)$")


@dataclass(slots=True)
class TagView:
    """One committed step opened for loading: manifest, decoded tree and file index."""

    storage: Storage
    folder: str
    step: int
    manifest: Manifest
    files: dict[str, Any]
    """DeepSpeed file name -> its decoded (still ckptlib-encoded) subtree."""
    zero: Any = None
    """The ZeRO partition layout saved with the tag (JSON, see :mod:`.partitions`), or None."""


def tag_of(m: Manifest, where: str) -> str | None:
    """The DeepSpeed tag in a step's metadata, or None (not a DeepSpeed step)."""
    meta = tree_codec.decode(m.metadata, (), where) if m.metadata is not None else None
    if isinstance(meta, dict) and isinstance(meta.get("deepspeed"), dict):
        tag = meta["deepspeed"].get("tag")
        return tag if isinstance(tag, str) else None
    return None


def open_tag(storage: Storage, tag: str,
             check: Callable[[Storage, str, Manifest], None] = check_files) -> TagView:
    """The committed step holding ``tag``, its payload files' sizes checked by ``check(storage,
    folder, manifest)`` (this rank alone by default; the engine's collective check inside
    ``load_checkpoint``). Raises ``CheckpointNotFoundError`` or ``CorruptCheckpointError``."""
    where = storage.url.rstrip("/")
    m_step = TAG_STEP.match(tag)
    found: tuple[str, int, Manifest] | None = None
    if m_step:  # fast path: the default tag names its step
        folder = layout.step_dir(int(m_step.group(1)))
        try:
            m = read_manifest(storage, folder, pieces=False)  # v2: run_plan loads the index files a load needs
            if m.step == int(m_step.group(1)) and tag_of(m, f"{where}/{folder}") == tag:
                found = (folder, int(m_step.group(1)), m)
        except CheckpointNotFoundError:
            pass
    if found is None:  # newest first, one manifest at a time up to the step holding the tag (its sizes: below)
        try:
            infos = iter_steps(storage, sizes=False)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"no ckptlib checkpoints under {where} (looking for tag {tag!r})"
            ) from None
        bad = []
        for info in infos:
            if info.status == "committed" and info.manifest is not None:
                if tag_of(info.manifest, f"{where}/{info.path}") == tag:
                    found = (info.path, info.step, info.manifest)
                    break
            elif info.status == "corrupt":
                bad.append(f"step {info.step}: {info.reason}")
        if found is None:
            detail = f" (unreadable steps: {'; '.join(bad)})" if bad else ""
            raise CheckpointNotFoundError(
                f"DeepSpeed tag {tag!r} is not a committed ckptlib step under {where}{detail}"
            )
    folder, step, m = found
    check(storage, folder, m)
    manifest_where = f"{where}/{folder}/manifest.json"
    tree = tree_codec.decode(m.tree, m.tensors, manifest_where)
    files: dict[str, Any] = {}
    ranks = tree.get("files") if isinstance(tree, dict) else None
    if not isinstance(ranks, tree_codec.PerRankSaved):
        raise CorruptCheckpointError(
            "not a DeepSpeed checkpoint (no per-rank 'files')", manifest_where
        )
    for per_rank in ranks.values:
        if not isinstance(per_rank, dict):
            raise CorruptCheckpointError("per-rank 'files' entry is not a dict", manifest_where)
        for name, node in per_rank.items():
            if name in files:
                raise CorruptCheckpointError(
                    f"file {name!r} saved by more than one rank", manifest_where
                )
            files[name] = node
    return TagView(storage, folder, step, m, files, tree.get("zero"))

