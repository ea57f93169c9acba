"""Memory-tier arena files (ckptlib/engine/mapped_arena.py) that a SIGKILLed process left on
the node: ``ckptlib prune --local`` lists and removes them, never one a live process holds.

A live arena is locked (``flock``) by the process that maps it; the lock dies with the process,
so a free lock proves the owner gone (any pid namespace, any rank, no pid reuse question)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from distributed.test_tiers import finish_job, start_job

from ckptlib.cli.main import main
from ckptlib.engine.mapped_arena import ARENA_DIR, Ring


def _prune(capsys: pytest.CaptureFixture[str], tmp_path: Path, *extra: str) -> dict:
    capsys.readouterr()
    code = main(["prune", str(tmp_path / "persist"), "--local", str(tmp_path / "node{node}"), "--tier", "local",
                 "--json", *extra])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    return doc


def test_prune_local_removes_the_arena_of_a_killed_process(
    tmp_path: Path, shm_node: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = {"url": str(tmp_path / "persist"), "local": str(tmp_path / "node{node}"), "persist_every": 2,
            "big": True, "mode": "save", "steps": [1, 2, 3]}
    # Killed in its first save's write, holding its snapshot's arena (not adopted yet).
    (o,) = finish_job(*start_job(tmp_path, [0], args, rank_env={0: {"CKPTLIB_TEST_KILL_AT": "write:0::1"}}))
    assert o.result is None and o.returncode == -signal.SIGKILL, o.log
    left = sorted((shm_node / ARENA_DIR).iterdir())
    assert left and all(p.stat().st_size > 0 for p in left), left

    dry = _prune(capsys, tmp_path, "--dry-run")
    rows = [r for n in dry["local"]["nodes"] for r in n["debris"] if r["kind"] == "arena"]
    assert sorted(r["path"] for r in rows) == sorted(f"{ARENA_DIR}/{p.name}" for p in left)
    assert all(r["removable"] and r["bytes"] == p.stat().st_size for r, p in zip(rows, left, strict=True))
    assert sorted((shm_node / ARENA_DIR).iterdir()) == left  # a dry run removes nothing

    done = _prune(capsys, tmp_path)
    (node,) = done["local"]["nodes"]
    assert sorted(node["debris_removed"]) == sorted(r["path"] for r in rows)
    assert node["bytes_freed"] >= sum(r["bytes"] for r in rows)
    assert not (shm_node / ARENA_DIR).exists() or not list((shm_node / ARENA_DIR).iterdir())


def test_prune_local_never_removes_an_arena_a_live_process_maps(
    tmp_path: Path, shm_node: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ring = Ring(str(shm_node), rank=7, keep=2)
    arena = ring.take(1 << 20)
    assert arena is not None
    arena.tensor.fill_(3)
    path = shm_node / ARENA_DIR / arena.name
    doc = _prune(capsys, tmp_path)
    (node,) = doc["local"]["nodes"]
    assert not [r for r in node["debris"] if r["kind"] == "arena"], node["debris"]
    assert path.exists() and path.read_bytes() == bytes([3]) * (1 << 20)
    assert torch.equal(arena.tensor[:4], torch.full((4,), 3, dtype=torch.uint8))
    ring.release()
    assert not path.exists()
