"""One-shot ``save`` and ``load`` of a single checkpoint folder (see API.md)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ckptlib import backends
from ckptlib.backends import Storage, open_storage
from ckptlib.coord.coordinator import Coordinator, default_coordinator
from ckptlib.engine import load as load_flow
from ckptlib.engine import safetensors_folder, target
from ckptlib.engine import save as save_flow
from ckptlib.engine.options import flag
from ckptlib.engine.scan import read_manifest
from ckptlib.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptlib.format import safetensors as safetensors_format
from ckptlib.format.schema import Manifest


def split_url(url: str | os.PathLike[str]) -> tuple[str, str]:
    """``(parent URL, name)`` of a checkpoint folder URL or local path (local paths made absolute).
    Public seam for adapters that address one checkpoint folder by URL."""
    return backends.split_url(url)


def save(
    state: Any,
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    compression: str | None = None,
    metadata: Any = None,
    overwrite: bool = False,
    coordinator: Coordinator | None = None,
) -> None:
    """Save ``state`` as one checkpoint folder at ``url``, atomically.

    The folder appears only once every byte is durable. ``url`` may not exist yet or be an
    empty folder. An existing checkpoint at ``url`` is kept (``StepExistsError``, raised before
    any payload is written) unless ``overwrite=True``; a file, or a folder holding files that
    are not a ckptlib checkpoint, is refused (``TargetNotEmptyError``) and left untouched.
    Collective when torch.distributed is initialized, unless ``coordinator`` says otherwise
    (``LocalCoordinator()``: this process alone writes, e.g. Lightning's rank-0-only
    checkpoint IO).
    """
    opts = save_flow.SaveOptions(compression=compression, overwrite=overwrite)  # bad arguments first
    parent, name = split_url(url)
    storage = open_storage(parent, storage_options)
    coordinator = coordinator or default_coordinator()
    flat = save_flow.prepare(state, coordinator.rank, collective=coordinator.world_size > 1)
    save_flow.persist(storage, name, flat, step=None, metadata=metadata, options=opts,
                      coordinator=coordinator)


def load(
    url: str | os.PathLike[str],
    *,
    into: Any = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    per_rank: str = "error",
    strict: bool = True,
    select: str | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> Any:
    """Load the checkpoint folder at ``url`` (the one holding ``manifest.json``; no collective:
    every rank reads what it needs), or a Hugging Face safetensors folder or file.

    ``into=None`` returns new CPU tensors; ``into=state`` loads in place (only the parts of
    sharded tensors this rank holds, whatever the saved sharding). ``strict=True`` (default):
    a key missing on either side raises ``StateMismatchError`` naming the keys, before anything
    is read, and the loaded ``state`` is returned. ``strict=False``: the keys both hold are
    loaded, and a :class:`~ckptlib.engine.load.LoadResult` is returned (``.state``, ``.missing``:
    target keys left as they were, ``.unexpected``: checkpoint keys not loaded). ``per_rank``:
    what ``PerRank`` values become on another world size (``"error"``, ``"rank0"``, ``"all"``).

    Safetensors (a folder of ``*.safetensors`` files, with or without
    ``model.safetensors.index.json``, or one file; docs/read.md): key ``a.b`` is loaded as
    ``/SELECT/a.b`` (``select="model"``: into ``state["model"]``; None: the root), the inverse of
    ``ckptlib export --to safetensors --select model``; ``rename(key)`` returns the name to load
    it as, or None to skip it. Such files carry no checksums (``verify`` has nothing to check);
    damaged headers raise ``CorruptCheckpointError`` before any tensor is read.
    """
    flag("strict", strict)
    flag("verify", verify)  # verify=None would silently skip every checksum
    parent, name = split_url(url)
    storage = open_storage(parent, storage_options)
    rank, world = _rank_world()
    keys: dict[str, list[str]] = {}
    try:
        m = _manifest(storage, name, pieces=False)
    except (CheckpointNotFoundError, CorruptCheckpointError):  # no manifest: safetensors?
        kind = safetensors_folder.find(storage, name)
        if kind is None:
            raise
        found = safetensors_folder.describe(storage, name, kind, select=select, rename=rename)
        state = load_flow.load_checkpoint(
            found.storage, found.folder, into, rank=rank, world_size=world, manifest=found.manifest,
            strict=strict, keys=keys, where=found.where,
            scope="".join(f"/{k}" for k in safetensors_format.key_path(select)),
        )
    else:
        if select is not None or rename is not None:
            raise ValueError("select= and rename= apply to safetensors folders; "
                             f"{url} is a ckptlib checkpoint (load it whole, or pass into= a part of your state)")
        state = load_flow.load_checkpoint(
            storage, name, into, verify=verify, rank=rank, world_size=world, per_rank=per_rank,
            manifest=m, strict=strict, keys=keys,
        )
    if strict or into is None:
        return state
    return load_flow.LoadResult(state, keys["missing"], keys["unexpected"])


def _manifest(storage: Storage, name: str, *, pieces: bool = True) -> Manifest:
    """The manifest of folder ``name``; a path that is no checkpoint folder at all (a file, a
    run root, an empty or unrelated folder) raises an error that says what to pass instead.
    ``pieces=False`` (:func:`load`): format v2 index files are left to the reader, which
    loads only those holding boxes this rank reads (``engine/index_io.resolve``)."""
    try:
        return read_manifest(storage, name, pieces=pieces)
    except (CheckpointNotFoundError, CorruptCheckpointError) as e:
        hint = target.not_a_checkpoint(storage, name)
        if hint is None:
            raise
        raise CheckpointNotFoundError(hint) from e


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def load_metadata(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Any:
    """The user metadata saved with the checkpoint at ``url`` (reads only the manifest)."""
    from ckptlib.format import tree as tree_codec

    parent, name = split_url(url)
    m = _manifest(open_storage(parent, storage_options), name)
    return tree_codec.decode(m.metadata, (), f"{url}/manifest.json")
