"""``check_files_together``: the payload size check of a load that every rank runs together with
no judge of its own (a plain Megatron ``LoadStrategy``, DeepSpeed's ``load_checkpoint``). The
coordinator asks every size and shares one verdict; every rank raises the same error or none.

A 6-rank step (one payload file per rank) saved by ckptlib's save flow on simulated ranks, on
the local disk; the checks run on 6 simulated ranks of one process (``tests/test_scan_reads.py``'s
way), each with its own counting storage.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import CountingStorage, wide_step

from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import Coordinator, LocalCoordinator
from ckptlib.engine.scan import check_files_together, read_manifest
from ckptlib.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ckptlib.format import layout
from ckptlib.format.schema import Manifest
from ckptlib.testing.simulation import SimCoordinator, World

WORLD = 6
FOLDER = layout.step_dir(1)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for path, data in wide_step(WORLD).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    return tmp_path


def payload_files(root: Path) -> list[Path]:
    return sorted((root / FOLDER).rglob("*.bin"))


def on_ranks(fn: Callable[[int, Coordinator], Any]) -> list[Any]:
    """``fn(rank, coordinator)`` on WORLD simulated ranks; each rank's result or the exception it
    raised, in rank order."""
    world = World(WORLD, seed=3, dead_after=30.0)
    coords = [SimCoordinator(world, r) for r in range(WORLD)]

    def catching(rank: int) -> Any:
        try:
            return fn(rank, coords[rank])
        except CheckpointError as e:
            return e

    threads = [world.spawn(r, functools.partial(catching, r)) for r in range(WORLD)]
    world.run(until=600)
    assert all(t.finished and t.error is None for t in threads), [t.error for t in threads]
    return [t.result for t in threads]


def check_on_ranks(root: Path, manifest_of: Callable[[int, Callable[[], Manifest]], Manifest] = lambda r, read: read()
                   ) -> tuple[list[Any], list[int]]:
    """Every rank reads the manifest (``manifest_of(rank, read)``) and checks together: (each
    rank's outcome, its payload size requests)."""
    stores = [CountingStorage(open_storage(str(root)), kinds=("size",)) for _ in range(WORLD)]

    def one(rank: int, coord: Coordinator) -> Any:
        m = manifest_of(rank, lambda: read_manifest(stores[rank], FOLDER, pieces=False))
        check_files_together(coord, stores[rank], FOLDER, m, label="test load", timeout=60.0)
        return "ok"

    got = on_ranks(one)
    return got, [sum(n for p, n in s.calls.items() if p.endswith(".bin")) for s in stores]


def test_the_coordinator_alone_asks_the_sizes(root: Path) -> None:
    """A good step: every rank goes on; the coordinator asked each payload file's size once, the
    other ranks none (each rank asked all of them with ``check_files``: N² for N ranks)."""
    got, asked = check_on_ranks(root)
    assert got == ["ok"] * WORLD, got
    assert asked == [len(payload_files(root))] + [0] * (WORLD - 1), asked
    assert len(payload_files(root)) == WORLD


def test_a_cut_file_fails_every_rank_with_the_same_error(root: Path) -> None:
    victim = payload_files(root)[4]
    os.truncate(victim, victim.stat().st_size - 1)
    got, asked = check_on_ranks(root)
    assert all(isinstance(e, CorruptCheckpointError) for e in got), got
    assert len({str(e) for e in got}) == 1 and victim.name in str(got[3]) and "size" in str(got[3]), got
    assert all(e.path.endswith(victim.name) for e in got), [e.path for e in got]
    assert asked[1:] == [0] * (WORLD - 1), asked


def test_a_missing_file_fails_every_rank_as_damage(root: Path) -> None:
    victim = payload_files(root)[0]
    victim.unlink()
    got, _ = check_on_ranks(root)
    assert all(isinstance(e, CorruptCheckpointError) for e in got), got
    assert len({str(e) for e in got}) == 1 and "missing" in str(got[2]), got


def test_a_step_deleted_after_it_was_opened_is_not_found_on_every_rank(root: Path) -> None:
    opened = read_manifest(open_storage(str(root)), FOLDER, pieces=False)
    shutil.rmtree(root / FOLDER)  # pruned between the ranks' reads of the manifest and the check
    got, _ = check_on_ranks(root, lambda r, read: opened)
    assert all(isinstance(e, CheckpointNotFoundError) for e in got), got
    assert len({str(e) for e in got}) == 1 and "deleted while it was being read" in str(got[5]), got


def test_ranks_that_opened_different_saves_all_fail(root: Path) -> None:
    """Rank 3 opened another save of the step (say, its node saw the folder before an
    overwrite): no rank loads, and every rank says which ranks differ."""
    got, asked = check_on_ranks(root, lambda r, read: dataclasses.replace(read(), save_id="other") if r == 3 else read())
    assert all(type(e) is CheckpointError for e in got), got
    assert len({str(e) for e in got}) == 1, got
    assert "rank 3" in str(got[0]) and "different checkpoints" in str(got[0]), got[0]
    assert asked == [0] * WORLD, asked  # nothing checked: the ranks disagree on what to check


def test_one_process_checks_alone(root: Path) -> None:
    store = CountingStorage(open_storage(str(root)), kinds=("size",))
    m = read_manifest(store, FOLDER, pieces=False)
    check_files_together(LocalCoordinator(), store, FOLDER, m, label="test load", timeout=60.0)
    assert sum(store.calls.values()) == WORLD
    victim = payload_files(root)[1]
    os.truncate(victim, 0)
    with pytest.raises(CorruptCheckpointError, match="size"):
        check_files_together(LocalCoordinator(), store, FOLDER, m, label="test load", timeout=60.0)
