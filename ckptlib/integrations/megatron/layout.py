"""What a Megatron checkpoint directory written through ckptlib holds, and checks on it.

One directory (e.g. ``save_dir/iter_0000100``) holds Megatron's ``common.pt`` (its xxh3 and
size recorded in our manifest), ``ckptlib/`` (one checkpoint) and Megatron's ``metadata.json``,
written last (docs/integrations/megatron.md, "What is stored, and how"). Nothing is unpickled
on load except ``common.pt``, read with ``torch.load(weights_only=True)`` after its checksum
matched. Used on the training thread by :mod:`.save`, :mod:`.load` and
:mod:`.resume`: names, the ShardedTensor -> box view (:func:`piece`), the ``common.pt`` record.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from ckptlib.backends import open_storage
from ckptlib.engine.scan import read_manifest
from ckptlib.errors import CorruptCheckpointError, UnsupportedValueError
from ckptlib.format import tree as tree_codec
from ckptlib.format.checksum import checksum

BACKEND = "ckptlib"
VERSION = 1
FOLDER = "ckptlib"
"""Sub-folder of a Megatron checkpoint directory that holds the ckptlib checkpoint."""
COMMON = "common.pt"
ITER_RE = re.compile(r"^iter_(\d{7,})$")


def piece(st: ShardedTensor) -> torch.Tensor:
    """The local data viewed with the global tensor's rank (prepended axes as size 1)."""
    if st.flattened_range is not None:
        raise UnsupportedValueError(
            f"ShardedTensor {st.key!r} has a flattened_range; ckptlib stores boxes only "
            "(Megatron-Core 0.16 rejects flattened ranges too): save the unflattened tensor"
        )
    if st.data is None:
        raise UnsupportedValueError(f"ShardedTensor {st.key!r} has no data")
    t = st.data
    for _ in range(st.prepend_axis_num):
        t = t.unsqueeze(0)
    if tuple(t.shape) != (1,) * st.prepend_axis_num + tuple(st.local_shape):
        raise UnsupportedValueError(
            f"ShardedTensor {st.key!r}: data shape {list(st.data.shape)} != local_shape"
        )
    return t


def common_record(checkpoint_dir: str) -> dict[str, Any] | None:
    """Size and xxh3 of ``common.pt`` (None if absent), recorded by the save strategy."""
    p = Path(checkpoint_dir) / COMMON
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return None
    return {"file": COMMON, "size": len(data), "xxh3_64": checksum(data)}


def iteration_of(checkpoint_dir: str) -> int | None:
    """The iteration an ``iter_NNNNNNN`` folder names (None for other names)."""
    m = ITER_RE.match(Path(checkpoint_dir).name)
    return int(m.group(1)) if m else None


def read_small(checkpoint_dir: str, name: str, limit: int) -> bytes:
    """The bytes of ``name`` in ``checkpoint_dir``, a regular file of at most ``limit`` bytes, read
    through ckptlib's storage (never through a symlink, never blocking on a FIFO, never past
    ``limit``: a ``/dev/zero`` or a FIFO in its place is refused, not read forever). Raises
    ``FileNotFoundError`` when absent, :class:`CorruptCheckpointError` otherwise. Called on the
    training thread (:func:`check_common`, the resume planner's ``metadata.json``)."""
    storage = open_storage(checkpoint_dir)
    where = os.path.join(checkpoint_dir, name)
    size = storage.size(name)  # None: absent, or not a regular file (a symlink, a FIFO, a folder)
    if size is None and storage.exists(name):
        raise CorruptCheckpointError("is not a regular file; refused", where)
    if size is not None and size > limit:
        raise CorruptCheckpointError(f"{size} bytes, over the {limit} bytes expected", where)
    return storage.read(name)


def check_common(checkpoint_dir: str, meta: Any) -> bytes | None:
    """``common.pt``'s bytes, checked against the record in ``meta`` (``CorruptCheckpointError``
    unless they match); None when ``meta`` records none (nothing is read)."""
    rec = (meta or {}).get("megatron", {}).get("common") if isinstance(meta, dict) else None
    where = os.path.join(checkpoint_dir, COMMON)
    if rec is None:
        return None
    try:
        data = read_small(checkpoint_dir, COMMON, rec["size"])
    except FileNotFoundError:
        raise CorruptCheckpointError("common.pt is missing", where) from None
    if len(data) != rec["size"] or checksum(data) != rec["xxh3_64"]:
        raise CorruptCheckpointError(
            "common.pt does not match the checksum recorded in the manifest", where
        )
    return data


def metadata(checkpoint_dir: str) -> Any:
    """The decoded metadata of the ckptlib checkpoint in ``checkpoint_dir``."""
    m = read_manifest(open_storage(checkpoint_dir), FOLDER, pieces=False)
    return tree_codec.decode(m.metadata, (), os.path.join(checkpoint_dir, FOLDER, "manifest.json"))
