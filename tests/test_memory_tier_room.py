"""The memory tier's up-front room check (ckptlib/tiers/local.py ``check_room``), one process.

The free space of the memory root is made small by replacing ``free_bytes`` where the check
reads it, so the tests need no tmpfs of their own size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.errors import CommitError
from ckptlib.tiers import local as local_tier

MIB = 1 << 20


def state(step: int) -> dict:
    return {"w": torch.full((MIB // 4,), float(step))}  # 1 MiB


def manager(tmp_path: Path, shm: Path) -> ckptlib.CheckpointManager:
    return ckptlib.CheckpointManager(tmp_path / "persistent", local=str(shm / "n0"), local_keep_last=2,
                                     persist_every=100)


def free_on_root(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    monkeypatch.setattr(local_tier, "free_bytes", lambda _url: nbytes)


def test_a_state_without_room_for_keep_last_plus_one_copies_is_refused_in_readable_units(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free_on_root(monkeypatch, MIB // 2)
    mgr = manager(tmp_path, shm)
    with pytest.raises(CommitError, match=r"not enough room") as e:
        mgr.save(1, state(1)).wait(timeout=60)
    assert "MiB missing" in str(e.value) and "0.00 GiB" not in str(e.value)
    assert not list((shm / "n0").glob("step-*"))
    mgr.close()


def test_a_relaunch_counts_the_steps_it_finds_on_the_root_as_room(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that fits keeps ``local_keep_last`` steps on the root; relaunched, it needs room for
    one more copy, not for ``local_keep_last + 1`` beside the ones it already holds."""
    with manager(tmp_path, shm) as mgr:
        for step in range(1, 4):
            mgr.save(step, state(step)).wait(timeout=60)
    free_on_root(monkeypatch, MIB + MIB // 2)  # room for one more step, not for three
    mgr = manager(tmp_path, shm)
    into = state(0)
    assert mgr.restore(into) == 3 and bool((into["w"] == 3).all())
    for step in range(4, 6):
        mgr.save(step, state(step)).wait(timeout=60)
    assert [i.step for i in mgr.steps() if i.tiers["local"] == "committed"] == [4, 5]
    mgr.close()


def test_a_dead_processs_arena_files_are_room_before_the_first_save(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed run leaves its mapped snapshot files in ``.ckptlib-arena/`` (no process holds
    their lock). The relaunch's room check frees them before it measures, also when its save
    stages in ordinary memory (no arena of its own to sweep them first)."""
    from ckptlib.backends.posix import ARENA_DIR

    dead = shm / "n0" / ARENA_DIR
    dead.mkdir(parents=True)
    (dead / "r00000-999999-1").write_bytes(b"\0" * (2 * MIB))  # nobody holds its lock

    def used() -> int:
        return sum(p.stat().st_size for p in shm.rglob("*") if p.is_file())

    monkeypatch.setattr(local_tier, "free_bytes", lambda _url: 4 * MIB - used())  # a 4 MiB tmpfs
    mgr = manager(tmp_path, shm)  # 3 copies of 1 MiB fit in 4 MiB, not beside the 2 MiB left behind
    mgr._stager.ring = None  # this save stages in ordinary memory
    mgr.save(1, state(1)).wait(timeout=60)
    assert not list(dead.iterdir())
    into = state(0)
    assert mgr.restore(into) == 1 and bool((into["w"] == 1).all())
    mgr.close()
