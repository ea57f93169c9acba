"""Export a checkpoint as zarr3 arrays through tensorstore, one array per tensor.

Called by ``ckptlib export --to zarr3`` (:mod:`ckptlib.cli.export`) or directly, on the
caller's thread. Each tensor becomes the array ``OUT/<its path>`` (zstd-compressed chunks of
about :data:`CHUNK_BYTES` along dimension 0), with groups above it, written block by block
from :meth:`CheckpointView.blocks`: memory stays around one block plus the checkpoint chunks
it overlaps (one block being read while the previous one is compressed and written),
whatever the state's size. Attributes: ``ckptlib_path`` (the tensor's name),
``ckptlib_dtype`` (its dtype) and ``ckptlib_stored_as`` (``native``, or ``bits``: the raw bits
as an unsigned int of the same width, for dtypes zarr3 lacks; see :mod:`ckptlib.read.dtypes`).
A local ``out`` (a path or ``file://`` URL) is written as a staging folder beside it that
replaces it only when every array is complete (:mod:`ckptlib.read.staging`): a failed export
leaves ``out`` as it was. Any other kvstore URL is written in place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from ckptlib.errors import require
from ckptlib.read.dtypes import ZARR3_NATIVE, to_numpy, zarr3_dtype
from ckptlib.read.staging import staged
from ckptlib.read.view import BLOCK_BYTES, CheckpointView

CHUNK_BYTES = 4 << 20
ZSTD_LEVEL = 3


def array_key(name: str) -> str:
    """The zarr3 node path of tensor ``name`` (each part percent-encoded; ``.``, ``..`` and
    ``zarr.json``, which would name another node or a node's metadata file, with ``.`` as ``%2E``)."""
    parts = [quote(p, safe="") for p in name.split("/") if p]
    return "/".join(p.replace(".", "%2E") if p in (".", "..", "zarr.json") else p for p in parts)


def _local(out: str) -> str | None:
    """The folder ``out`` names on this machine (a path or ``file://`` URL); None for other URLs."""
    if out.startswith("file://"):
        return out[len("file://"):]
    return None if "://" in out else out


def owns(out: str, name: str) -> bool:
    """Whether ``out/name`` is an entry an export writes (:mod:`ckptlib.read.staging`): the root
    ``zarr.json``, or a folder holding a ``zarr.json`` (a group or array node)."""
    path = os.path.join(out, name)
    if os.path.islink(path):
        return False
    return os.path.isfile(path) if name == "zarr.json" else os.path.isfile(os.path.join(path, "zarr.json"))


def export_zarr3(
    view: CheckpointView, out: str, select: str | None = None, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Write every tensor of ``view`` (under ``select``) as a zarr3 array below ``out``; returns a
    summary. A local ``out`` may be missing, empty or an earlier export (then replaced as a
    whole); anything else there raises ``FileExistsError`` before anything is written, and an
    error while writing (a corrupt chunk) leaves it as it was. Another tensorstore kvstore URL is
    written in place: existing arrays are replaced, and a failed export can leave some written."""
    local = _local(out)
    if local is None:
        return _write(view, out.rstrip("/"), out, select, progress)
    with staged(local, owns, "zarr3") as folder:
        return _write(view, "file://" + folder, out, select, progress)


def _write(view: CheckpointView, base: str, out: str, select: str | None,
           progress: Callable[[int], None] | None) -> dict[str, Any]:
    """Write the arrays below the kvstore URL ``base``; the summary names ``out``."""
    ts = require("tensorstore", "zarr", "export to zarr3")

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
            "kvstore": f"{base}/{quote(key, safe='/')}/",  # a URL is percent-decoded once: to ``key`` itself
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
