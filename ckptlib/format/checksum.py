"""Chunk checksums. Pure.

:func:`checksum` hashes bytes in one call (writer threads, reader threads); :class:`Hasher`
is its incremental form for data read piece by piece (deep verification, engine/verify.py).
The writer checksums the *stored* bytes of every chunk (after compression), so a reader can
verify a chunk before decoding it. ``xxh3_64`` is the default (tens of GB/s and releases the
GIL on large inputs); ``crc32c`` is accepted for readers of foreign tools' conventions.
"""

from __future__ import annotations

import crc32c as _crc32c
import numpy as np
import xxhash

Bytes = bytes | bytearray | memoryview | np.ndarray
"""What checksums and codecs accept: any contiguous byte buffer (numpy: uint8 arrays)."""


def as_buffer(b: Bytes) -> bytes | bytearray | memoryview:
    """``b`` as a plain buffer (a numpy array's own memory, no copy), for hash/zstd calls."""
    return b.data if isinstance(b, np.ndarray) else b

DEFAULT_ALGORITHM = "xxh3_64"
ALGORITHMS = ("xxh3_64", "crc32c")
NO_CHECKSUM = "none"
"""``checksum_algorithm`` of an in-memory manifest describing files that carry no checksums
(Hugging Face safetensors, ``format/safetensors.py``): its chunks' ``checksum`` is empty, the
reader verifies nothing and may read any rows of a raw chunk. Never valid in a manifest file
(decoding accepts :data:`ALGORITHMS` only), and :func:`checksum` refuses it."""


def checksum(data: Bytes, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex digest of a bytes-like object (``bytes``, ``memoryview``, numpy/uint8 buffer)."""
    data = as_buffer(data)
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64_hexdigest(data)
    if algorithm == "crc32c":
        return f"{_crc32c.crc32c(data):08x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


class Hasher:
    """``checksum`` fed in pieces: ``hexdigest()`` equals ``checksum(all pieces joined)``."""

    __slots__ = ("_crc", "_xxh")

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}")
        self._xxh = xxhash.xxh3_64() if algorithm == "xxh3_64" else None
        self._crc = 0

    def update(self, data: Bytes) -> None:
        data = as_buffer(data)
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = _crc32c.crc32c(data, self._crc)

    def hexdigest(self) -> str:
        return self._xxh.hexdigest() if self._xxh is not None else f"{self._crc:08x}"
