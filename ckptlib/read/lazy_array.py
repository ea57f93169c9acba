"""``CheckpointView.array``: a read-only lazy tensorstore array whose chunks are ckptlib reads.

Called by :meth:`ckptlib.read.view.CheckpointView.array`. tensorstore's ``virtual_chunked``
driver calls :func:`_fill` on its own threads for each chunk it needs; that calls
``view.read`` for exactly the chunk's box, so slicing the array reads only overlapping
ckptlib chunks, checksums verified. The array's chunks follow the checkpoint's own chunking
along dimension 0. Dtypes tensorstore lacks (complex32) come back as their raw bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptlib.errors import require
from ckptlib.read.dtypes import TENSORSTORE_NATIVE, bits_dtype, to_numpy

if TYPE_CHECKING:
    from ckptlib.read.view import CheckpointView


def lazy_array(view: CheckpointView, name: str) -> Any:
    ts = require("tensorstore", "zarr", "CheckpointView.array()")

    info = view.info(name)
    entry = view.manifest.tensors[name]
    native = info.dtype in TENSORSTORE_NATIVE
    chunk = list(info.shape)
    rows = [c.shape[0] for c in entry.chunks if c.shape] + [p.shape[0] for p in entry.pieces if p.shape]
    if chunk and rows and min(rows) > 0:
        chunk[0] = min(rows)

    def _fill(domain: Any, array: Any, params: Any) -> None:
        box = tuple(slice(d.inclusive_min, d.exclusive_max) for d in domain)
        array[...] = to_numpy(view.read(name, box), info.dtype, TENSORSTORE_NATIVE).view(array.dtype)

    layout = ts.ChunkLayout(read_chunk_shape=chunk) if chunk and all(chunk) else None
    return ts.virtual_chunked(
        _fill,
        dtype=ts.dtype(info.dtype if native else bits_dtype(info.dtype)),
        shape=list(info.shape),
        chunk_layout=layout,
    )
