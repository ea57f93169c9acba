"""Deep verification: read every chunk of a checkpoint and check checksums and codecs.

Called by ``check_step(deep=True)`` (CLI ``verify``, ``CheckpointManager.steps(deep=True)``)
on the caller's thread. Memory stays bounded by streaming each chunk in pieces, whatever the
manifest claims.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Container

import crc32c
import xxhash
import zstandard

from ckptlib.backends import Storage, join
from ckptlib.errors import CorruptCheckpointError
from ckptlib.format.dtypes import ITEMSIZE
from ckptlib.format.manifest import Manifest

PIECE = 8 << 20
_SLICE = 4096  # input bytes per completeness step: bounds each step's output


class _Hasher:
    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.h = xxhash.xxh3_64() if algorithm == "xxh3_64" else None
        self.crc = 0

    def update(self, data) -> None:
        if self.h is not None:
            self.h.update(data)
        else:
            self.crc = crc32c.crc32c(data, self.crc)

    def hexdigest(self) -> str:
        return self.h.hexdigest() if self.h is not None else f"{self.crc:08x}"


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
    ranges: dict[int, list[tuple[int, int, str, str, int]]] = {}
    for name, t in m.tensors.items():
        itemsize = ITEMSIZE[t.dtype]
        for i, c in enumerate(t.chunks):
            raw = itemsize
            for s in c.shape:
                raw *= s
            label = f"chunk {i} of tensor {name!r}"
            ranges.setdefault(c.file, []).append((c.start, c.length, c.checksum, c.codec, raw, label))
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
            for start, length, digest, codec, raw, label in sorted(items):
                _verify_range(h, start, length, digest, codec, raw, label, m.checksum_algorithm, where, progress)


def _verify_range(h, start, length, digest, codec, raw, label, algorithm, where, progress) -> None:
    hasher = _Hasher(algorithm)
    stored = io.BytesIO() if codec != "raw" else None
    pos = 0
    while pos < length:
        n = min(PIECE, length - pos)
        data = h.read(start + pos, n)
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
        _check_zstd(stored.getvalue(), raw, f"{where} ({label})")


def _check_zstd(data: bytes, raw_size: int, where: str) -> None:
    """``data`` must be one complete zstd frame expanding to exactly ``raw_size`` bytes.

    The same rules as :func:`ckptlib.format.codec.decompress_frame` (what loads use), checked
    without ever holding the raw bytes: the output is streamed in ``PIECE``-sized reads and
    discarded, then the frame is walked again with small input slices to prove it is complete
    and that nothing follows it.
    """
    try:
        params = zstandard.get_frame_parameters(data)
        if params.content_size not in (zstandard.CONTENTSIZE_UNKNOWN, raw_size):
            raise CorruptCheckpointError(f"zstd frame declares {params.content_size} bytes, expected {raw_size}", where)
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=False)
        total = 0
        while True:
            piece = reader.read(min(PIECE, raw_size + 1 - total))
            if not piece:
                break
            total += len(piece)
            if total > raw_size:
                break
        if total == raw_size:  # the output is bounded: now prove the frame ends where the data ends
            dobj = zstandard.ZstdDecompressor().decompressobj()
            for off in range(0, len(data), _SLICE):
                dobj.decompress(data[off : off + _SLICE])
                if dobj.eof:
                    if off + _SLICE < len(data) or dobj.unused_data:
                        raise CorruptCheckpointError("zstd data has bytes after its frame", where)
                    break
            if not dobj.eof:
                raise CorruptCheckpointError("zstd frame is incomplete (truncated)", where)
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"zstd data is damaged ({e})", where) from None
    if total != raw_size:
        raise CorruptCheckpointError(f"zstd data expands to {'more than ' if total > raw_size else ''}"
                                     f"{min(total, raw_size)} bytes, expected {raw_size}", where)
