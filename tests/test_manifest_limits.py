"""Oversized manifests are refused by their size, before a byte of them is read.

The limit (``format.schema.MAX_MANIFEST_BYTES``, arithmetic in docs/format.md) is checked on
the open file's size (``Storage.read_small``: one open here; on object stores the answer of
one ranged GET) before a byte is read, so a storage whose ``size`` reports a wrong size never
makes the reader read more than the limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import patch_creates

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
    with pytest.raises(ckptlib.CorruptCheckpointError) as ei:
        read_manifest(storage, "ck")
    msg = str(ei.value)
    assert f"{MAX_MANIFEST_BYTES + 1} bytes" in msg and f"{MAX_MANIFEST_BYTES} byte limit" in msg, msg
    assert MANIFEST_NAME in msg
    assert counter.opened == [f"ck/{MANIFEST_NAME}"] and counter.bytes_read == 0  # opened for its size only
    info = check_step(storage, "ck")
    assert info.status == "corrupt" and "limit" in info.reason
    assert counter.bytes_read == 0


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


def _recording_creates(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of every file a save creates on a POSIX storage (payload and index files)."""
    created: list[str] = []

    def wrap(real: Any) -> Any:
        def create(self: Any, path: str) -> Any:
            created.append(path)
            return real(self, path)
        return create

    patch_creates(monkeypatch, wrap)
    return created


@pytest.mark.parametrize("over", ["tree", "names"])
def test_a_manifest_certain_to_be_over_the_limit_fails_before_any_payload_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, over: str
) -> None:
    # The manifest's size was checked only at the commit, after every payload byte was written
    # (a big state's whole write, then the refusal). A long non-tensor value (the tree) or names
    # enough to be over the limit are now refused before the first payload file is created. The
    # limit is lowered to 64 KiB for the writer and the reader alike.
    from ckptlib.engine import scan
    from ckptlib.format import build

    limit = 64 << 10
    monkeypatch.setattr(build, "MAX_MANIFEST_BYTES", limit)
    monkeypatch.setattr(scan, "MAX_MANIFEST_BYTES", limit)
    created = _recording_creates(monkeypatch)
    if over == "tree":
        state: dict[str, Any] = {"w": torch.ones(1000), "ids": list(range(20_000))}  # ~110 KB of JSON
    else:
        state = {f"{'p' * 200}{i}": torch.ones(1) for i in range(400)}  # ~80 KB of names
    with pytest.raises(ckptlib.CommitError, match=f"manifest would be .* over the {limit} bytes") as one_shot:
        ckptlib.save(state, tmp_path / "ck")
    with ckptlib.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(ckptlib.CommitError, match="manifest would be") as managed:
            mgr.save(1, state).wait(timeout=60)
        assert mgr.latest_step() is None
    assert [p for p in created if not p.endswith("/.ckptlib")] == []  # staging markers only: no payload
    assert "at least" in str(one_shot.value) and "at least" in str(managed.value)  # the early floor's refusal
    fits = {"w": torch.ones(2), "ids": list(range(1000))}
    ckptlib.save(fits, tmp_path / "ok")
    assert any(p.startswith("ok.tmp-") and not p.endswith("/.ckptlib") for p in created), created
    assert ckptlib.load(tmp_path / "ok")["ids"] == fits["ids"]


def test_the_early_floor_never_exceeds_the_manifest_written(tmp_path: Path) -> None:
    # The early refusal must never refuse a manifest that fits: its floor is at most the size of
    # the manifest the commit writes, for names with escapes and non-ASCII characters, empty and
    # packed tensors, nested values and long lists.
    from ckptlib.format.build import manifest_floor
    from ckptlib.plan.flatten import flatten

    states: list[dict[str, Any]] = [
        {"w": torch.ones(3)},
        {"é\"\\\n名": torch.ones(2), "empty": torch.ones(0), "big": torch.ones(300_000), "x": [1.5, "s", None]},
        {f"k{i}": {"w": torch.ones(1), "cfg": {"lr": 0.1, "ids": list(range(i))}} for i in range(300)},
        {"ids": list(range(50_000)), "s": "z" * 10_000},
    ]
    for k, state in enumerate(states):
        ckptlib.save(state, tmp_path / f"s{k}")
        flat = flatten(state)
        floor = manifest_floor([it.name for it in flat.items], flat.tree)
        size = (tmp_path / f"s{k}" / MANIFEST_NAME).stat().st_size
        assert 0 < floor <= size, (k, floor, size)


@pytest.mark.parametrize("version", [1, 2])
def test_one_ranks_names_over_the_limit_fail_the_save_on_every_rank_before_any_write(
    monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    # Several simulated ranks (ckptlib/testing/simulation.py): rank 1 alone holds names enough to
    # be over the limit. Its early refusal goes with the plan, so every rank fails the save with
    # it (none waits for the others) and no rank writes a payload file.
    import functools

    from ckptlib.engine.save import SaveOptions, persist, prepare
    from ckptlib.format import build, layout
    from ckptlib.testing.simulation import SimCoordinator, SimStorage, World

    monkeypatch.setattr(build, "MAX_MANIFEST_BYTES", 64 << 10)
    w = World(2, seed=3, dead_after=10.0)
    storage = SimStorage(w)
    coords = [SimCoordinator(w, r) for r in range(2)]

    def body(r: int) -> None:
        state: dict[str, Any] = {"w": ckptlib.Shard(torch.full((2, 3), float(r)), (4, 3), (2 * r, 0))}
        if r == 1:
            state.update({f"{'p' * 200}{i}": torch.ones(1) for i in range(400)})
        persist(storage, layout.step_dir(7), prepare(state, r), step=7, coordinator=coords[r],
                options=SaveOptions(num_files=1, format_version=version))

    threads = [w.spawn(r, functools.partial(body, r)) for r in range(2)]
    w.run(until=600)
    for t in threads:
        assert isinstance(t.error, ckptlib.CommitError) and "manifest would be at least" in str(t.error), t.error
    assert not storage.commits and not [k for k in storage.files if not k.endswith("/.ckptlib")], storage.files
