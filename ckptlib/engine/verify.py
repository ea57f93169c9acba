"""Deep verification: read every chunk of a checkpoint and check checksums and codecs.

Called by ``check_step(deep=True)`` (CLI ``verify``, ``CheckpointManager.steps(deep=True)``)
on the caller's thread. Memory stays bounded by streaming each chunk in pieces, whatever the
manifest claims. The rules are format/'s: :class:`~ckptlib.format.checksum.Hasher` (checksums)
and :func:`~ckptlib.format.codec.check_frame` (the strict one-frame zstd rule).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Container

from ckptlib.backends import ReadHandle, Storage, join
from ckptlib.errors import CorruptCheckpointError
from ckptlib.format.checksum import Hasher
from ckptlib.format.codec import check_frame
from ckptlib.format.dtypes import ITEMSIZE
from ckptlib.format.schema import Manifest, volume

PIECE = 8 << 20


def verify_chunks(
    storage: Storage,
    folder: str,
    m: Manifest,
    progress: Callable[[int], None] | None = None,
    files: Container[int] | None = None,
) -> None:
    """Raise ``CorruptCheckpointError`` at the first bad chunk or pack.

    Reads every stored byte the manifest references, file by file in offset order, and calls
    ``progress(n)`` as it goes (``n`` bytes checked). ``files``: only these indices into
    ``m.files`` (ranks splitting one verification between them); None checks every file.
    """
    ranges: dict[int, list[tuple[int, int, str, str, int, str]]] = {}
    for name, t in m.tensors.items():
        itemsize = ITEMSIZE[t.dtype]
        for i, c in enumerate(t.chunks):
            label = f"chunk {i} of tensor {name!r}"
            ranges.setdefault(c.file, []).append((c.start, c.length, c.checksum, c.codec, volume(c.shape) * itemsize, label))
    for i, p in enumerate(m.packs):
        ranges.setdefault(p.file, []).append((p.start, p.length, p.checksum, p.codec, p.raw_length, f"pack {i}"))
    for fidx, items in sorted(ranges.items()):
        if files is not None and fidx not in files:
            continue
        path = join(folder, m.files[fidx].path)
        where = f"{storage.url.rstrip('/')}/{path}"
        with storage.open_read(path) as h:
            if h.size != m.files[fidx].size:
                raise CorruptCheckpointError(f"size is {h.size}, manifest records {m.files[fidx].size}", where)
            buf = memoryview(bytearray(min(PIECE, max((it[1] for it in items), default=0))))  # reused
            for start, length, digest, codec, raw, label in sorted(items):
                _verify_range(h, start, length, digest, codec, raw, label, m.checksum_algorithm, where, progress,
                              buf)


def _verify_range(
    h: ReadHandle,
    start: int,
    length: int,
    digest: str,
    codec: str,
    raw: int,
    label: str,
    algorithm: str,
    where: str,
    progress: Callable[[int], None] | None,
    buf: memoryview,
) -> None:
    """Check one chunk or pack, read piece by piece into ``buf`` (at least one piece long)."""
    hasher = Hasher(algorithm)
    stored = io.BytesIO() if codec != "raw" else None
    pos = 0
    while pos < length:
        n = min(PIECE, length - pos)
        data = buf[:n]
        h.read_into(start + pos, data)
        hasher.update(data)
        if stored is not None:
            stored.write(data)
        pos += n
        if progress:
            progress(n)
    if hasher.hexdigest() != digest:
        raise CorruptCheckpointError(
            f"checksum mismatch in {label} at bytes [{start}, {start + length})", where
        )
    if stored is not None:
        check_frame(stored.getvalue(), raw, f"{where} ({label})")
