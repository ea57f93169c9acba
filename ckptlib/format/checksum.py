"""Chunk checksums. Pure.

The writer checksums the *stored* bytes of every chunk (after compression), so a reader can
verify a chunk before decoding it. ``xxh3_64`` is the default (tens of GB/s and releases the
GIL on large inputs); ``crc32c`` is accepted for readers of foreign tools' conventions.
"""

from __future__ import annotations

import crc32c as _crc32c
import xxhash

DEFAULT_ALGORITHM = "xxh3_64"
ALGORITHMS = ("xxh3_64", "crc32c")


def checksum(data, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex digest of a bytes-like object (``bytes``, ``memoryview``, numpy/uint8 buffer)."""
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64_hexdigest(data)
    if algorithm == "crc32c":
        return f"{_crc32c.crc32c(data):08x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")
