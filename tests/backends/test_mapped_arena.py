"""A memory tier's snapshot lands in the tier's file (ckptlib/engine/mapped_arena.py): the
staging arena is a mapped file on the memory root that the save adopts as its payload file, and
retention hands it back for a later save. Real files under a unique /dev/shm folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import ckptlib
from ckptlib.backends.posix import SPARE_DIR, PosixStorage
from ckptlib.cli.main import main as cli_main
from ckptlib.engine import writer
from ckptlib.engine.mapped_arena import ARENA_DIR


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 19, generator=g), "b": torch.randn(4096, generator=g),
            "h": torch.randn(5, 3, generator=g).half(), "i": torch.arange(7) * step, "e": torch.empty(0)}


def zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state(0).items()}


def payload(node: Path) -> list[Path]:
    return sorted(node.glob("step-*/*/*.bin"))


def node_of(shm: Path) -> Path:
    return next(p for p in shm.iterdir() if p.is_dir())


def test_every_save_adopts_its_snapshot_and_retention_hands_the_pages_back(tmp_path: Path, shm: Path,
                                                                            monkeypatch) -> None:
    """The payload file is the file the snapshot was copied into (never written by the writer),
    three files take turns over 8 saves (2 kept, 1 retired), and every kept step restores bitwise
    and passes the deep check."""
    written: list[str] = []
    for name in ("write_files", "write_files_indexed"):  # either way the writer could write a payload
        real = getattr(writer, name)
        monkeypatch.setattr(f"ckptlib.engine.save.{name}",
                            lambda *a, _real=real, **k: written.append(a[1]) or _real(*a, **k))
    inodes: set[int] = set()
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(shm / "{node}"), persist_every=10**6,
                                   local_keep_last=2) as mgr:
        ring = mgr._stager.ring
        assert ring is not None
        for step in range(1, 9):
            mgr.save(step, state(step)).wait()
            node = node_of(shm)
            newest = payload(node)[-1]
            mapped = {a.ident for a in ring._arenas}
            st = newest.stat()
            assert (st.st_dev, st.st_ino) in mapped  # the snapshot's own file, adopted
            manifest = newest.parent.parent / "manifest.json"
            # readable like the save's other files (an operator's `ckptlib verify` on the node)
            assert st.st_mode & 0o777 == manifest.stat().st_mode & 0o777, (oct(st.st_mode), oct(manifest.stat().st_mode))
            inodes.add(st.st_ino)
        for step in (7, 8):
            got = zeros()
            assert mgr.restore(got, step=step) == step
            for k, v in state(step).items():
                assert torch.equal(got[k], v), (step, k)
    assert written == []  # no payload file was written a second time
    assert len(inodes) == 3, inodes
    assert cli_main(["verify", "--all", str(node)]) == 0
    assert not (node / ARENA_DIR).exists()  # close() removed the free arena and its folder


def test_a_compressed_save_writes_as_before_and_keeps_its_arena(tmp_path: Path, shm: Path) -> None:
    """The writer's other path (zstd here) reads the mapped arena like any staging memory: the
    arena is not adopted, stays in its folder and serves the next save."""
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(shm / "{node}"), persist_every=10**6,
                                   local_keep_last=1, compression="zstd") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step)).wait()
            arenas = os.listdir(node_of(shm) / ARENA_DIR)
            assert len(arenas) == 1, arenas
            idents = {(p.stat().st_dev, p.stat().st_ino) for p in payload(node_of(shm))}
            assert not idents & {a.ident for a in mgr._stager.ring._arenas}
        got = zeros()
        assert mgr.restore(got) == 3
    for k, v in state(3).items():
        assert torch.equal(got[k], v), k


def test_a_spare_taken_by_another_writer_is_never_written_through(tmp_path: Path, shm: Path) -> None:
    """Retention moved an adopted file to the spares and another writer took it (a restore's
    write-back reuses spares by name): later saves must not write into it through the old
    mapping."""
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(shm / "{node}"), persist_every=10**6,
                                   local_keep_last=1) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step)).wait()
        node = node_of(shm)
        spares = os.listdir(node / SPARE_DIR)
        assert spares == ["r00000-0.bin"]
        other = PosixStorage(str(node))
        mine = bytes(range(256)) * 4096
        w = other.open_write("elsewhere/x/r00000-0.bin")  # takes the spare by its name
        w.write(mine)
        w.close()
        assert not os.listdir(node / SPARE_DIR)
        for step in range(3, 7):
            mgr.save(step, state(step)).wait()
        assert (node / "elsewhere/x/r00000-0.bin").read_bytes() == mine
        got = zeros()
        assert mgr.restore(got) == 6
    for k, v in state(6).items():
        assert torch.equal(got[k], v), k


def test_files_of_a_dead_process_are_removed_and_a_full_root_falls_back(tmp_path: Path, shm: Path,
                                                                         monkeypatch) -> None:
    """What a crashed run left in the arena folder goes at the next run's first save; when the
    memory root has no room for the arena (posix_fallocate fails), the snapshot uses ordinary
    memory and the save still commits."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    node = shm / "0"
    (node / ARENA_DIR).mkdir(parents=True)
    left = node / ARENA_DIR / f"r00000-{pid}-1"
    left.write_bytes(b"x" * 4096)
    monkeypatch.setenv("CKPTLIB_NODE", "0")
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(shm / "{node}"), persist_every=10**6,
                                   local_keep_last=1) as mgr:
        mgr.save(1, state(1)).wait()
        assert not left.exists()
        assert len(os.listdir(node / ARENA_DIR)) == 0  # its arena was adopted

        def full(fd: int, off: int, n: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        mgr._stager.ring.release()
        mgr.save(2, state(2)).wait()
        assert mgr._stager.ring._arenas == []
        got = zeros()
        assert mgr.restore(got) == 2
    for k, v in state(2).items():
        assert torch.equal(got[k], v), k
