"""Chunk codecs: raw, zstd, and zstd over byte-shuffled elements. Pure (no I/O).

Byte shuffling groups byte 0 of every element, then byte 1, ... which turns the slowly varying
exponent bytes of floats into long runs that zstd compresses well. The writer calls
:func:`encode` on worker threads (zstd releases the GIL); the reader calls :func:`decode`,
which never produces more than the recorded raw size: a frame that claims or expands to more
is a :class:`CorruptCheckpointError`. :func:`check_frame` is the same rule for deep
verification, which never holds a chunk's raw bytes.
"""

from __future__ import annotations

import io

import numpy as np
import zstandard

from ckptlib.errors import CorruptCheckpointError
from ckptlib.format.checksum import Bytes, as_buffer

DEFAULT_LEVEL = 3
_OUT_PIECE = 8 << 20  # output bytes per step of check_frame
_IN_SLICE = 4096  # input bytes per completeness step of check_frame: bounds each step's output


def shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize <= 1 or raw.size % itemsize:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T).reshape(-1)


def unshuffle(data: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize <= 1 or data.size % itemsize:
        return data
    return np.ascontiguousarray(data.reshape(itemsize, -1).T).reshape(-1)


def codec_for(compression: str | None, itemsize: int) -> str:
    if compression is None:
        return "raw"
    if compression != "zstd":
        raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
    return "zstd-shuffle" if itemsize > 1 else "zstd"


def encode(raw: np.ndarray, codec: str, itemsize: int, level: int = DEFAULT_LEVEL) -> np.ndarray | bytes:
    """Stored bytes for a uint8 array of raw element bytes."""
    if codec == "raw":
        return raw
    data = shuffle(raw, itemsize) if codec == "zstd-shuffle" else raw
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data.data)


def _check_declared(stored: bytes | bytearray | memoryview, raw_size: int, where: str) -> None:
    params = zstandard.get_frame_parameters(stored)
    if params.content_size not in (zstandard.CONTENTSIZE_UNKNOWN, raw_size):
        raise CorruptCheckpointError(f"zstd frame declares {params.content_size} bytes, expected {raw_size}", where)


def decompress_frame(stored: Bytes, raw_size: int, where: str) -> bytes:
    """The raw bytes of ``stored``, which must be exactly one complete zstd frame of ``raw_size``.

    The strict one-frame rule, for callers that hold the output (:func:`decode_into`, loads, on
    reader threads); :func:`check_frame` applies the same rule without holding it. Refused with
    :class:`CorruptCheckpointError`: a header that declares another size, output past
    ``raw_size`` (decompression is capped there: a frame without a declared size gets a
    ``raw_size`` buffer, never more), an incomplete or damaged frame, bytes after the frame, and
    output shorter than ``raw_size``.
    """
    stored = as_buffer(stored)
    try:
        _check_declared(stored, raw_size, where)
        # max_output_size=0 means "no limit" to python-zstandard: never pass 0.
        data = zstandard.ZstdDecompressor().decompress(
            stored, max_output_size=max(raw_size, 1), allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(
            f"zstd data is damaged, incomplete, or expands past the recorded {raw_size} bytes ({e})", where
        ) from None
    if len(data) != raw_size:
        raise CorruptCheckpointError(f"zstd data expands to {len(data)} bytes, expected {raw_size}", where)
    return data


def check_frame(stored: Bytes, raw_size: int, where: str) -> None:
    """:func:`decompress_frame`'s rule, checked without ever holding the raw bytes.

    Called by deep verification (engine/verify.py) on the caller's thread. The output is
    streamed in ``_OUT_PIECE``-sized reads and discarded, then the frame is walked again with
    small input slices (each bounds one step's output) to prove it is complete and that
    nothing follows it.
    """
    stored = as_buffer(stored)
    try:
        _check_declared(stored, raw_size, where)
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored), read_across_frames=False)
        total = 0
        while True:
            piece = reader.read(min(_OUT_PIECE, raw_size + 1 - total))
            if not piece:
                break
            total += len(piece)
            if total > raw_size:
                break
        if total == raw_size:  # the output is bounded: now prove the frame ends where the data ends
            dobj = zstandard.ZstdDecompressor().decompressobj()
            for off in range(0, len(stored), _IN_SLICE):
                dobj.decompress(stored[off : off + _IN_SLICE])
                if dobj.eof:
                    if off + _IN_SLICE < len(stored) or dobj.unused_data:
                        raise CorruptCheckpointError("zstd data has bytes after its frame", where)
                    break
            if not dobj.eof:
                raise CorruptCheckpointError("zstd frame is incomplete (truncated)", where)
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"zstd data is damaged ({e})", where) from None
    if total != raw_size:
        more = "more than " if total > raw_size else ""
        raise CorruptCheckpointError(f"zstd data expands to {more}{min(total, raw_size)} bytes, expected {raw_size}", where)


def decode_into(stored: Bytes, codec: str, itemsize: int, out: np.ndarray, where: str) -> None:
    """Decode ``stored`` into the uint8 array ``out`` whose size is the recorded raw size."""
    raw_size = out.size
    if codec == "raw":
        if len(stored) != raw_size:
            raise CorruptCheckpointError(f"chunk holds {len(stored)} bytes, expected {raw_size}", where)
        out[:] = np.frombuffer(stored, dtype=np.uint8)
        return
    data = decompress_frame(stored, raw_size, where)
    arr = np.frombuffer(data, dtype=np.uint8)
    out[:] = unshuffle(arr, itemsize) if codec == "zstd-shuffle" else arr
