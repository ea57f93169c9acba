"""A memory root (tmpfs) reuses the pages of the step retention deleted (backends/posix.py:
``PosixStorage.recycle`` and ``open_write``): the reused file holds exactly the new bytes, a
create still refuses an existing file, only large payload files are kept, the spares never hold
more than one step, and a disk root deletes as before. Real files under a unique /dev/shm folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.backends.posix import SPARE_DIR, SPARE_MIN, PosixStorage
from ckptlib.cli.main import main as cli_main
from ckptlib.engine import retire

MiB = 1 << 20


def write(storage: PosixStorage, path: str, data: bytes) -> None:
    w = storage.open_write(path)
    w.write(data)
    w.close()


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(256)) * (n // 256) + bytes(n % 256)


def test_a_retired_file_is_reused_and_holds_exactly_the_new_bytes(shm: Path) -> None:
    s = PosixStorage(str(shm))
    assert s.memory
    old = pattern(3 * MiB, 1)
    write(s, "step-1.del-aa/id1/r00000-0.bin", old)
    write(s, "step-1.del-aa/.ckptlib", b"marker")
    inode = os.stat(shm / "step-1.del-aa/id1/r00000-0.bin").st_ino
    s.recycle("step-1.del-aa", keep=(".ckptlib",))
    assert sorted(os.listdir(shm / SPARE_DIR)) == ["r00000-0.bin"]
    assert (shm / "step-1.del-aa/.ckptlib").read_bytes() == b"marker"  # the marker goes last, by the caller

    shorter = pattern(2 * MiB + 5, 2)  # fewer bytes than the spare held: the rest is cut off
    write(s, "step-3.tmp-bb/id3/r00000-0.bin", shorter)
    got = shm / "step-3.tmp-bb/id3/r00000-0.bin"
    assert os.stat(got).st_ino == inode
    assert got.read_bytes() == shorter
    assert not os.listdir(shm / SPARE_DIR)

    # A second retirement puts it back; a longer file grows it.
    s.recycle("step-3.tmp-bb")
    longer = pattern(5 * MiB, 3)
    write(s, "step-5.tmp-cc/id5/r00000-0.bin", longer)
    assert os.stat(shm / "step-5.tmp-cc/id5/r00000-0.bin").st_ino == inode
    assert (shm / "step-5.tmp-cc/id5/r00000-0.bin").read_bytes() == longer


def test_a_create_still_refuses_an_existing_file_and_leaves_the_spare(shm: Path) -> None:
    s = PosixStorage(str(shm))
    write(s, "step-1.del-aa/x/r00000-0.bin", pattern(2 * MiB, 1))
    s.recycle("step-1.del-aa")
    write(s, "step-2.tmp-bb/x/r00000-0.bin.other", b"unrelated")  # another name: a new file
    existing = shm / "step-2.tmp-bb/x/r00000-0.bin"
    existing.write_bytes(b"already here")
    with pytest.raises(FileExistsError):
        s.open_write("step-2.tmp-bb/x/r00000-0.bin")
    assert existing.read_bytes() == b"already here"
    assert os.listdir(shm / SPARE_DIR) == ["r00000-0.bin"]


def test_a_create_without_parents_takes_no_spare_into_a_missing_folder(shm: Path) -> None:
    """A late rank of an abandoned save (its staging folder removed) on a memory root: the
    create fails, the folder is not made again, and the spare stays for the next save."""
    s = PosixStorage(str(shm))
    write(s, "step-1.del-aa/x/r00000-0.bin", pattern(2 * MiB, 1))
    s.recycle("step-1.del-aa")
    with pytest.raises(FileNotFoundError):
        s.open_write_in("step-2.tmp-bb/x/r00000-0.bin")
    assert not (shm / "step-2.tmp-bb").exists()
    assert os.listdir(shm / SPARE_DIR) == ["r00000-0.bin"]
    s.makedirs("step-2.tmp-bb/x")
    w = s.open_write_in("step-2.tmp-bb/x/r00000-0.bin")  # the folder is there: the spare is taken
    w.write(b"new")
    w.close()
    assert (shm / "step-2.tmp-bb/x/r00000-0.bin").read_bytes() == b"new"
    assert os.listdir(shm / SPARE_DIR) == []


def test_an_aborted_reused_file_is_removed(shm: Path) -> None:
    s = PosixStorage(str(shm))
    write(s, "step-1.del-aa/x/r00000-0.bin", pattern(2 * MiB, 1))
    s.recycle("step-1.del-aa")
    w = s.open_write("step-2.tmp-bb/x/r00000-0.bin")
    w.write(b"half")
    w.abort()
    assert not (shm / "step-2.tmp-bb/x/r00000-0.bin").exists()


def test_only_large_files_are_kept_and_the_spares_hold_one_step(shm: Path) -> None:
    s = PosixStorage(str(shm))
    write(s, "step-1.del-aa/x/r00000-0.bin", pattern(SPARE_MIN, 1))
    write(s, "step-1.del-aa/x/r00000-1.bin", pattern(SPARE_MIN - 1, 1))  # too small
    write(s, "step-1.del-aa/manifest.json", b"{}")
    s.recycle("step-1.del-aa")
    assert os.listdir(shm / SPARE_DIR) == ["r00000-0.bin"]
    write(s, "step-2.del-bb/y/r00001-0.bin", pattern(2 * MiB, 2))
    s.recycle("step-2.del-bb")  # the untaken spare of step 1 goes
    assert os.listdir(shm / SPARE_DIR) == ["r00001-0.bin"]
    assert (shm / "step-1.del-aa/x/r00000-1.bin").exists()  # left for the deletion that follows


def test_a_file_linked_elsewhere_is_never_reused(shm: Path) -> None:
    """A hard link made outside ckptlib (``cp -al`` of the tier) keeps its bytes: such a file is
    deleted, not recycled."""
    s = PosixStorage(str(shm))
    old = pattern(2 * MiB, 1)
    write(s, "step-1.del-aa/x/r00000-0.bin", old)
    os.link(shm / "step-1.del-aa/x/r00000-0.bin", shm / "backup.bin")
    s.recycle("step-1.del-aa")
    assert not os.listdir(shm / SPARE_DIR)
    write(s, "step-2.tmp-bb/x/r00000-0.bin", pattern(2 * MiB, 2))
    assert (shm / "backup.bin").read_bytes() == old


def test_a_disk_root_deletes_as_before(tmp_path: Path) -> None:
    s = PosixStorage(str(tmp_path))
    assert not s.memory
    write(s, "step-1/x/r00000-0.bin", pattern(2 * MiB, 1))
    retire.delete_step(s, "step-1")
    assert sorted(os.listdir(tmp_path)) == []


def test_saving_every_step_to_a_memory_tier_reuses_pages_and_restores_bitwise(tmp_path: Path, shm: Path) -> None:
    """Through the manager: local retention recycles, each newer step is written into the pages
    of a deleted one, and every step kept restores bitwise and passes the deep check."""
    def state(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(1 << 20, generator=g), "b": torch.randn(3 * 4096, generator=g)}

    inodes: list[int] = []
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(shm / "{node}"), persist_every=10**6,
                                   local_keep_last=1) as mgr:
        for step in range(1, 7):
            mgr.save(step, state(step)).wait()
            files = [p for p in shm.glob("*/step-*/*/*.bin") if p.stat().st_size >= SPARE_MIN]
            assert len(files) == 1, files
            inodes.append(files[0].stat().st_ino)
        got = {"w": torch.zeros(1 << 20), "b": torch.zeros(3 * 4096)}
        assert mgr.restore(got) == 6
    assert len(set(inodes)) == 2, inodes  # two sets of pages take turns (the kept step and the next)
    for k, v in state(6).items():
        assert torch.equal(got[k], v), k
    node = next(p for p in shm.iterdir())
    assert cli_main(["verify", "--all", str(node)]) == 0  # every chunk's checksum, every kept step


def test_close_and_prune_free_the_spares(tmp_path: Path, shm: Path) -> None:
    """The manager's close() frees the recycled pages; so does ``ckptlib prune --local`` (what a
    crashed job left)."""
    st = {"w": torch.randn(1 << 20)}
    mgr = ckptlib.CheckpointManager(tmp_path / "p", local=str(shm / "{node}"), persist_every=10**6, local_keep_last=1)
    for step in range(1, 4):
        mgr.save(step, st).wait()
    node = next(p for p in shm.iterdir())
    assert list((node / SPARE_DIR).iterdir())  # the step retention deleted last
    mgr.close()
    assert not (node / SPARE_DIR).exists()
    # As a crashed job leaves them: spares in place, then the CLI.
    s = PosixStorage(str(node))
    write(s, "step-9.del-aa/x/r00000-0.bin", pattern(2 * MiB, 1))
    s.recycle("step-9.del-aa")
    assert list((node / SPARE_DIR).iterdir())
    assert cli_main(["prune", str(tmp_path / "p"), "--local", str(shm / "{node}"), "--local-keep-last", "1", "--tier", "local"]) == 0
    assert not (node / SPARE_DIR).exists()
