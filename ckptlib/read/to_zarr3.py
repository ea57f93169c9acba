"""Export a checkpoint as zarr3 arrays through tensorstore, one array per tensor.

Called by ``ckptlib export --to zarr3`` (:mod:`ckptlib.cli.export`) or directly, on the
caller's thread. Each tensor becomes the array ``OUT/<its path>`` (zstd-compressed chunks of
about :data:`CHUNK_BYTES` along dimension 0), with groups above it, written block by block
from :meth:`CheckpointView.blocks`: memory stays around one block plus the checkpoint chunks
it overlaps (one block being read while the previous one is compressed and written),
whatever the state's size. Attributes: ``ckptlib_path`` (the tensor's name),
``ckptlib_dtype`` (its dtype) and ``ckptlib_stored_as`` (``native``, or ``bits``: the raw bits
as an unsigned int of the same width, for dtypes zarr3 lacks; see :mod:`ckptlib.read.dtypes`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from ckptlib.read.dtypes import ZARR3_NATIVE, to_numpy, zarr3_dtype
from ckptlib.read.view import BLOCK_BYTES, CheckpointView

CHUNK_BYTES = 4 << 20
ZSTD_LEVEL = 3


def array_key(name: str) -> str:
    """The zarr3 node path of tensor ``name`` (each part percent-encoded; ``.``/``..`` kept safe)."""
    parts = [quote(p, safe="") for p in name.split("/") if p]
    return "/".join("%2E" * len(p) if p in (".", "..") else p for p in parts)


def _base(out: str) -> str:
    return out.rstrip("/") if "://" in out else "file://" + os.path.abspath(out)


def export_zarr3(
    view: CheckpointView, out: str, select: str | None = None, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Write every tensor of ``view`` (under ``select``) as a zarr3 array below ``out`` (a
    local folder or a tensorstore kvstore URL); returns a summary. Existing arrays are replaced."""
    import tensorstore as ts

    base = _base(out)
    kv = ts.KvStore.open(base + "/").result()
    group = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()
    groups: set[str] = set()
    arrays = []
    for info in view.tensors(select):
        key = array_key(info.name)
        parts = key.split("/")
        for i in range(len(parts)):
            g = "/".join(parts[:i])
            if g not in groups:
                kv.write(f"{g}/zarr.json" if g else "zarr.json", group).result()
                groups.add(g)
        row = view.manifest.tensors[info.name].nbytes // max(1, info.shape[0]) if info.shape else info.nbytes
        rows = max(1, CHUNK_BYTES // max(row, 1))
        chunk = [max(1, min(rows, s)) if d == 0 else max(1, s) for d, s in enumerate(info.shape)]
        stored_as = "native" if info.dtype in ZARR3_NATIVE else "bits"
        arr = ts.open({
            "driver": "zarr3",
            "kvstore": f"{base}/{key}/",
            "metadata": {
                "shape": list(info.shape),
                "data_type": zarr3_dtype(info.dtype),
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                           {"name": "zstd", "configuration": {"level": ZSTD_LEVEL, "checksum": False}}],
                "attributes": {"ckptlib_path": info.name, "ckptlib_dtype": info.dtype, "ckptlib_stored_as": stored_as},
            },
            "create": True,
            "delete_existing": True,
        }).result()
        step = chunk[0] * row if info.shape else 1
        pending: Any = None  # the previous block's commit: encoding it overlaps reading the next
        for start, block in view.blocks(info.name, max(step, BLOCK_BYTES // max(step, 1) * step)):
            target = arr[start : start + block.shape[0]] if info.shape else arr
            written = target.write(to_numpy(block, info.dtype))
            written.copy.result()  # tensorstore holds its own copy: the block buffer is free again
            if pending is not None:
                pending.result()
            pending = written.commit
            if progress is not None:
                progress(block.numel() * block.element_size())
        if pending is not None:
            pending.result()
        arrays.append({"name": info.name, "path": key, "dtype": info.dtype, "zarr_dtype": zarr3_dtype(info.dtype),
                       "stored_as": stored_as, "shape": list(info.shape), "bytes": info.nbytes})
    return {"format": "zarr3", "out": out, "step": view.step, "tensors": len(arrays),
            "bytes": sum(a["bytes"] for a in arrays), "arrays": arrays}
