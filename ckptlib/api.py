"""One-shot ``save`` and ``load`` of a single checkpoint folder (see API.md)."""

from __future__ import annotations

import os
from typing import Any

from ckptlib.backends import check_url, open_storage
from ckptlib.coord.coordinator import Coordinator, default_coordinator
from ckptlib.engine import load as load_flow
from ckptlib.engine import save as save_flow


def split_url(url: str | os.PathLike[str]) -> tuple[str, str]:
    """``(parent URL, name)`` of a checkpoint folder URL or local path (local paths made absolute).
    Public seam for adapters that address one checkpoint folder by URL."""
    url = os.fspath(url).rstrip("/")
    check_url(url)  # "s3:/bucket" is a usage error, never a local folder named "s3:"
    if "://" in url:
        scheme, rest = url.split("://", 1)
        parent, _, name = rest.rpartition("/")
        return f"{scheme}://{parent}", name
    url = os.path.abspath(url)
    return os.path.dirname(url), os.path.basename(url)


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

    The folder appears only once every byte is durable. An existing checkpoint at ``url`` is
    kept (``StepExistsError``) unless ``overwrite=True``. Collective when torch.distributed
    is initialized, unless ``coordinator`` says otherwise (``LocalCoordinator()``: this
    process alone writes, e.g. Lightning's rank-0-only checkpoint IO).
    """
    parent, name = split_url(url)
    storage = open_storage(parent, storage_options)
    coordinator = coordinator or default_coordinator()
    flat = save_flow.prepare(state, coordinator.rank)
    opts = save_flow.SaveOptions(compression=compression, overwrite=overwrite)
    save_flow.persist(storage, name, flat, step=None, metadata=metadata, options=opts,
                      coordinator=coordinator)


def load(
    url: str | os.PathLike[str],
    *,
    into: Any = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    per_rank: str = "error",
) -> Any:
    """Load the checkpoint folder at ``url`` (no collective: every rank reads what it needs).

    ``into=None`` returns new CPU tensors; ``into=state`` loads in place (only the parts of
    sharded tensors this rank holds, whatever the saved sharding) and returns it. ``per_rank``:
    what ``PerRank`` values become on another world size (``"error"``, ``"rank0"``, ``"all"``).
    """
    parent, name = split_url(url)
    storage = open_storage(parent, storage_options)
    rank, world = _rank_world()
    return load_flow.load_checkpoint(
        storage, name, into, verify=verify, rank=rank, world_size=world, per_rank=per_rank
    )


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def load_metadata(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Any:
    """The user metadata saved with the checkpoint at ``url`` (reads only the manifest)."""
    from ckptlib.engine.scan import read_manifest
    from ckptlib.format import tree as tree_codec

    parent, name = split_url(url)
    m = read_manifest(open_storage(parent, storage_options), name)
    return tree_codec.decode(m.metadata, (), f"{url}/manifest.json")
