"""A status scan reads no piece index file, and a restore reads only the index files its boxes
need (format v2, issue 15): reads counted per file by a storage wrapper.

The 4-rank v2 checkpoints are saved in one process: four simulated ranks of the same save
(:func:`on_ranks`). The restores run the same way, through ``engine.resume.restore`` end to end.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import CountingStorage

import ckptlib
from ckptlib.backends import Storage, open_storage
from ckptlib.coord.coordinator import Coordinator
from ckptlib.engine import resume
from ckptlib.engine import save as save_flow
from ckptlib.engine.scan import check_step, read_manifest, scan
from ckptlib.format import layout
from ckptlib.testing.simulation import SimCoordinator, World

WORLD = 4
ROWS = 32  # /w: 8 rows per rank, a regular grid


def on_ranks(fn: Callable[[int, Coordinator], Any]) -> list[Any]:
    """``fn(rank, coordinator)`` on WORLD simulated ranks of one process (ckptlib/testing/
    simulation.py: threads run one at a time, their meetings over an in-memory store); their
    results in rank order (errors raised)."""
    world = World(WORLD, seed=7, dead_after=30.0)
    coords = [SimCoordinator(world, r) for r in range(WORLD)]
    threads = [world.spawn(r, functools.partial(fn, r, coords[r])) for r in range(WORLD)]
    world.run(until=600)
    assert all(t.finished for t in threads), "a rank hung"
    for t in threads:
        if t.error is not None:
            raise t.error
    return [t.result for t in threads]


def values(step: int) -> torch.Tensor:
    return torch.arange(ROWS * 6, dtype=torch.float32).reshape(ROWS, 6) + 1000 * step


def rank_state(rank: int, step: int, zero: bool = False) -> dict[str, Any]:
    n = ROWS // WORLD
    full = torch.zeros(ROWS, 6) if zero else values(step)
    return {
        "w": ckptlib.Shard(full[rank * n : (rank + 1) * n].clone(), (ROWS, 6), (rank * n, 0)),
        "plain": torch.zeros(5) if zero else torch.full((5,), float(step)),
        "rng": ckptlib.PerRank(torch.full((3,), -1 if zero else rank, dtype=torch.int64)),
    }


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A manager root with steps 5 and 6, each saved by 4 ranks in format v2."""
    monkeypatch.setenv("CKPTLIB_FORMAT_VERSION", "2")
    storage = open_storage(str(tmp_path))
    for step in (5, 6):
        on_ranks(lambda r, c, step=step: save_flow.persist(
            storage, layout.step_dir(step), save_flow.prepare(rank_state(r, step), r), step=step, coordinator=c))
    m = read_manifest(storage, layout.step_dir(6), pieces=False)
    assert m.version == 2 and len(m.indexes) == WORLD
    return tmp_path


def index_paths(storage: Storage, folder: str) -> dict[int, str]:
    m = read_manifest(storage, folder, pieces=False)
    return {ix.rank: f"{folder}/{ix.path}" for ix in m.indexes}


def tails(storage: Storage, folder: str) -> bool:
    """Every rank's index lies at the end of its payload file (docs/format.md 7.1)."""
    return all(ix.tail for ix in read_manifest(storage, folder, pieces=False).indexes)


def needed(storage: Storage, folder: str, rank: int) -> set[int]:
    """Ranks whose index files hold pieces of what ``rank`` restores (from the sharding)."""
    m = read_manifest(storage, folder, pieces=False)
    n = ROWS // WORLD
    boxes = [("/w", (rank * n, 0), (n, 6)), ("/plain", (0,), (5,)), (f"/rng/@rank{rank}", (0,), (3,))]
    return set().union(*(m.sharding[name].ranks_for(off, shape) for name, off, shape in boxes))


def restore_all(root: Path) -> list[tuple[int | None, dict[str, Any], CountingStorage]]:
    def one(rank: int, coord: Coordinator) -> tuple[int | None, dict[str, Any], CountingStorage]:
        storage = CountingStorage(open_storage(str(root)), kinds=("open_read", "read"))
        state = rank_state(rank, 0, zero=True)
        return resume.restore(storage, state, coord, timeout=60), state, storage

    return on_ranks(one)


def test_status_scan_reads_no_index_file(root: Path) -> None:
    storage = CountingStorage(open_storage(str(root)), kinds=("open_read", "read"))
    folder = layout.step_dir(6)
    info = check_step(storage, folder, 6)
    assert info.status == "committed", info
    assert set(storage.calls) == {f"{folder}/manifest.json"}, storage.calls
    assert [i.status for i in scan(storage)] == ["committed", "committed"]
    assert not set(storage.calls) & {p for s in (5, 6) for p in index_paths(storage, layout.step_dir(s)).values()}
    storage.calls.clear()
    assert check_step(storage, folder, 6, deep=True).status == "committed"
    assert set(index_paths(storage, folder).values()) <= set(storage.calls)  # deep: every one


def test_restore_reads_only_overlapping_index_files(root: Path) -> None:
    folder = layout.step_dir(6)
    outcomes = restore_all(root)
    plain = open_storage(str(root))
    paths = index_paths(plain, folder)
    for rank, (step, state, storage) in enumerate(outcomes):
        assert step == 6
        n = ROWS // WORLD
        assert torch.equal(state["w"].local, values(6)[rank * n : (rank + 1) * n])
        assert torch.equal(state["plain"], torch.full((5,), 6.0))
        assert state["rng"].value.tolist() == [rank] * 3
        read = {p for p in storage.calls if p in paths.values()}
        want = {paths[r] for r in needed(plain, folder, rank)}
        assert read == want, (rank, sorted(read), sorted(want))
        assert len(read) < WORLD, (rank, read)  # not every rank's file
        # Each index read once; an index at the end of its rank's payload file (the layout a plain
        # save writes) shares the file with the pieces this rank then reads from it: two opens.
        opens = 2 if tails(plain, folder) else 1
        assert all(storage.calls[p] == opens for p in read), storage.calls
    assert not any(p in outcomes[1][2].calls for p in index_paths(plain, layout.step_dir(5)).values())


def test_damaged_index_file_falls_back_to_the_older_step(root: Path) -> None:
    """Rank 2's index file of step 6 damaged in place (same size): the scan still calls step 6
    committed (it reads no index file); the loads that need it find the damage, and every
    rank falls back to step 5 together, with step 5's bytes."""
    plain = open_storage(str(root))
    folder = layout.step_dir(6)
    path = root / index_paths(plain, folder)[2]
    data = bytearray(path.read_bytes())
    (ix,) = [ix for ix in read_manifest(plain, folder, pieces=False).indexes if ix.rank == 2]
    data[len(data) - ix.size // 2] ^= 0x10  # in the index's bytes (the file's last ix.size)
    path.write_bytes(bytes(data))
    assert check_step(plain, folder, 6).status == "committed"
    deep = check_step(plain, folder, 6, deep=True)
    assert deep.status == "corrupt" and "index" in deep.reason and "checksum" in deep.reason, deep
    outcomes = restore_all(root)
    n = ROWS // WORLD
    for rank, (step, state, _) in enumerate(outcomes):
        assert step == 5, rank
        assert torch.equal(state["w"].local, values(5)[rank * n : (rank + 1) * n])
        assert torch.equal(state["plain"], torch.full((5,), 5.0))
    assert any(2 in needed(plain, folder, r) for r in range(WORLD))
