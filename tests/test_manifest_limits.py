"""Oversized manifests are refused by their size, before a byte of them is read.

The limit (``format.schema.MAX_MANIFEST_BYTES``, arithmetic in docs/format.md) is checked on
``storage.size`` before the manifest is opened, and again on the open file, so a storage that
reports a wrong size still never makes the reader read more than the limit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlib
from ckptlib.backends import ReadHandle, Storage, open_storage
from ckptlib.engine.scan import check_step, read_manifest
from ckptlib.format.schema import MANIFEST_NAME, MAX_MANIFEST_BYTES


class Counting:
    """Wraps a storage's ``open_read``/``size``: counts opens and bytes read; ``size`` may lie."""

    def __init__(self, storage: Storage, lie: int | None = None) -> None:
        self.opened: list[str] = []
        self.bytes_read = 0
        real_open, real_size = storage.open_read, storage.size

        def open_read(path: str) -> ReadHandle:
            self.opened.append(path)
            h = real_open(path)
            real_read_into = h.read_into

            def read_into(start: int, out: memoryview) -> None:
                self.bytes_read += len(out)
                real_read_into(start, out)

            h.read_into = read_into  # type: ignore[method-assign]
            return h

        def size(path: str) -> int | None:
            return lie if lie is not None and path.endswith(MANIFEST_NAME) else real_size(path)

        storage.open_read = open_read  # type: ignore[method-assign]
        storage.size = size  # type: ignore[method-assign]


def _oversized(tmp_path: Path) -> Path:
    """A real checkpoint whose manifest is a sparse file one byte over the limit."""
    ck = tmp_path / "ck"
    ckptlib.save({"w": torch.arange(10.0)}, str(ck))
    with open(ck / MANIFEST_NAME, "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    return ck


def test_limit_fits_the_format() -> None:
    """The limit stays below the 400 MiB hostile manifest that timed out reading (issue 13)."""
    assert 64 << 20 <= MAX_MANIFEST_BYTES < 400 << 20


def test_oversized_manifest_is_refused_without_reading(tmp_path: Path) -> None:
    _oversized(tmp_path)
    storage = open_storage(str(tmp_path))
    counter = Counting(storage)
    t = time.monotonic()
    with pytest.raises(ckptlib.CorruptCheckpointError) as ei:
        read_manifest(storage, "ck")
    msg = str(ei.value)
    assert f"{MAX_MANIFEST_BYTES + 1} bytes" in msg and f"{MAX_MANIFEST_BYTES} byte limit" in msg, msg
    assert MANIFEST_NAME in msg
    assert counter.opened == [] and counter.bytes_read == 0
    info = check_step(storage, "ck")
    assert info.status == "corrupt" and "limit" in info.reason
    assert counter.opened == [] and counter.bytes_read == 0
    assert time.monotonic() - t < 5  # nothing is read: no time goes with the size


def test_public_load_refuses_oversized_manifest(tmp_path: Path) -> None:
    ck = _oversized(tmp_path)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="limit"):
        ckptlib.load(str(ck))


def test_size_that_lies_still_reads_nothing_past_the_limit(tmp_path: Path) -> None:
    """``storage.size`` says 100 bytes; the open file says otherwise: refused, nothing read."""
    _oversized(tmp_path)
    storage = open_storage(str(tmp_path))
    counter = Counting(storage, lie=100)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="limit"):
        read_manifest(storage, "ck")
    assert counter.opened == [f"ck/{MANIFEST_NAME}"] and counter.bytes_read == 0


def test_manifest_under_the_limit_is_read(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    state: dict[str, Any] = {"w": torch.arange(10.0)}
    ckptlib.save(state, str(ck))
    storage = open_storage(str(tmp_path))
    counter = Counting(storage)
    m = read_manifest(storage, "ck")
    assert list(m.tensors) == ["/w"]
    assert counter.bytes_read == (ck / MANIFEST_NAME).stat().st_size


def test_save_whose_manifest_readers_would_refuse_fails_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A state with a long non-tensor value (a 257 MiB str, a sampler's list of 50M indices) used to
    # commit a manifest over MAX_MANIFEST_BYTES: save() returned, every load then raised
    # CorruptCheckpointError. Now the save fails with CommitError naming the limit, on the one-shot
    # and the manager path, and nothing is committed. The limit is lowered to 1 MiB for the writer
    # and the reader alike (the real one needs a 256 MiB value).
    from ckptlib.engine import scan
    from ckptlib.format import build

    limit = 1 << 20
    monkeypatch.setattr(build, "MAX_MANIFEST_BYTES", limit, raising=False)
    monkeypatch.setattr(scan, "MAX_MANIFEST_BYTES", limit)
    fits = {"w": torch.ones(2), "ids": list(range(1000))}
    ckptlib.save(fits, tmp_path / "ok")
    assert ckptlib.load(tmp_path / "ok")["ids"] == fits["ids"]
    state = {"w": torch.ones(2), "ids": list(range(200_000))}  # ~1.3 MB of JSON
    with pytest.raises(ckptlib.CommitError, match=f"manifest would be .* over the {limit} bytes"):
        ckptlib.save(state, tmp_path / "ck")
    assert not (tmp_path / "ck").exists() or list((tmp_path / "ck").iterdir()) == []  # staging removed
    with ckptlib.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
        mgr.save(1, fits).wait()
        with pytest.raises(ckptlib.CommitError, match="manifest would be"):
            mgr.save(2, state).wait()
        assert mgr.latest_step() == 1
        assert [(i.step, i.status) for i in mgr.steps()] == [(1, "committed")]
