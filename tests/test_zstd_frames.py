"""Strict zstd frame rules shared by loads (format/codec.py) and deep verify (engine/verify.py).

A stored zstd chunk must be exactly one complete frame that expands to exactly the recorded
raw size. Regression: an incomplete frame whose partial output happened to match the recorded
size used to be accepted by both paths (found by tests/chaos/test_fuzz_decoding.py).
"""

from __future__ import annotations

import pytest
import zstandard

from ckptlib.errors import CorruptCheckpointError
from ckptlib.format.codec import check_frame, decompress_frame

GOOD = zstandard.ZstdCompressor(write_content_size=True).compress(b"a" * 100_000)
NO_SIZE = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(range(256)) * 400)
EMPTY = zstandard.ZstdCompressor().compress(b"")

CASES = {
    "complete": (GOOD, 100_000, True),
    "no-declared-size": (NO_SIZE, 102_400, True),
    "empty": (EMPTY, 0, True),
    "incomplete-partial-output-matches": (b"(\xb5/\xfd\x00\x00\x08\x00\x00\x00", 1, False),
    "truncated": (GOOD[:-3], 100_000, False),
    "two-frames": (GOOD + GOOD, 200_000, False),
    "trailing-bytes": (GOOD + b"x", 100_000, False),
    "declares-more-than-recorded": (GOOD, 99_999, False),
    "shorter-than-recorded": (GOOD, 100_001, False),
    "expands-past-recorded": (NO_SIZE, 1000, False),
    "not-zstd": (b"hello world", 11, False),
}


@pytest.mark.parametrize("check", [decompress_frame, check_frame], ids=["load", "verify"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_frame_rules(case: str, check) -> None:
    data, raw_size, ok = CASES[case]
    if ok:
        out = check(data, raw_size, "w")
        if out is not None:
            assert len(out) == raw_size
    else:
        with pytest.raises(CorruptCheckpointError):
            check(data, raw_size, "w")


def test_load_output_is_exact() -> None:
    assert decompress_frame(NO_SIZE, 102_400, "w") == bytes(range(256)) * 400
