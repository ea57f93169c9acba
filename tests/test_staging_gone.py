"""A rank's files go into the staging folder its coordinator made, and only there.

``writer.create`` opens each payload and piece index file with ``Storage.open_write_in``:
the create itself is the check that the folder still exists (no ``stat`` before it, one
metadata call per file on a parallel file system), and a rank that comes late to a save its
coordinator gave up (and whose staging folder it removed) gets a ``CommitError`` instead of
making the folder again, whenever the folder goes: before the payload, between the payload
and the index, or while a file is open (the simulated store's model of it). A tier save's
replica stream (``ckptlib.tiers.replicas``) follows the same rule for the files it receives.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from ckptlib.backends.posix import PosixStorage
from ckptlib.engine.writer import split_chunks, write_files, write_index
from ckptlib.errors import CommitError
from ckptlib.testing.simulation import SimStorage, World
from ckptlib.tiers.replicas import REPLICA_DIR, _write_round

STAGING = "step-00000007.tmp-ab12/ab12"


class _Counting(PosixStorage):
    """Counts the calls that ask the file system about a path before writing."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.asked: list[str] = []

    def exists(self, path: str = "") -> bool:
        self.asked.append(f"exists {path}")
        return super().exists(path)

    def size(self, path: str) -> int | None:
        self.asked.append(f"size {path}")
        return super().size(path)


def _jobs() -> list:
    t = torch.arange(1 << 18, dtype=torch.float32).reshape(1024, 256)  # 1 MiB: one raw chunk, not packed
    return split_chunks("w", t, (0, 0), 1 << 20)


def test_files_go_into_the_existing_folder_with_nothing_asked_first(tmp_path) -> None:
    storage = _Counting(str(tmp_path))
    storage.makedirs(STAGING)
    made: list[str] = []
    real = os.makedirs

    def counting(path, *a, **k):
        made.append(str(path))
        return real(path, *a, **k)

    os.makedirs = counting  # type: ignore[assignment]
    try:
        files, written = write_files(storage, STAGING, 3, _jobs(), num_files=1)
        summary = write_index(storage, STAGING, 3, files, written)
    finally:
        os.makedirs = real  # type: ignore[assignment]
    assert storage.asked == [] and made == []  # the creates were the only calls that named the folder
    assert summary is not None
    assert sorted(os.listdir(tmp_path / STAGING)) == sorted(
        [os.path.basename(p) for p, _ in files] + [os.path.basename(summary["path"])])
    c = written[0]
    with open(tmp_path / c.file, "rb") as f:
        f.seek(c.start)
        back = torch.frombuffer(bytearray(f.read(c.length)), dtype=torch.float32).view(c.shape)
    assert torch.equal(back, _jobs()[0].tensor)


def test_a_removed_staging_folder_is_never_made_again(tmp_path) -> None:
    storage = PosixStorage(str(tmp_path))
    storage.makedirs(STAGING)
    files, written = write_files(storage, STAGING, 1, _jobs(), num_files=1)
    shutil.rmtree(tmp_path / STAGING.split("/")[0])  # the coordinator gave the save up
    with pytest.raises(CommitError, match="is gone: the save was abandoned"):
        write_index(storage, STAGING, 1, files, written)  # between the payload and the index
    with pytest.raises(CommitError, match="is gone: the save was abandoned"):
        write_files(storage, STAGING, 2, _jobs(), num_files=1)  # a rank that had not written yet
    assert os.listdir(tmp_path) == []


def test_a_late_replica_stream_does_not_make_a_removed_staging_folder_again(tmp_path) -> None:
    """A tier save's peer writes replicas of its sources' files under the staging folder
    (``replicas/``); once the save is given up and the folder removed, a later round of the
    stream fails instead of making the folder again (without its marker)."""
    storage = PosixStorage(str(tmp_path))
    work, sub = STAGING.split("/")
    storage.makedirs(STAGING)
    writers: dict = {}
    folders: set[str] = set()
    a, b = f"{sub}/r00001-0.bin", f"{sub}/r00002-0.bin"
    sizes = {(1, a): 8, (2, b): 4}
    _write_round(storage, work, writers, folders, sizes, [(1, (a, 0, 4))], [b"abcd"], 0, False)  # round 0
    assert os.listdir(tmp_path / work / REPLICA_DIR / sub) == ["r00001-0.bin"] and list(writers) == [(1, a)]
    shutil.rmtree(tmp_path / work)  # the save is given up
    with pytest.raises(CommitError, match="is gone: the save was abandoned"):  # round 1: a new source's file
        _write_round(storage, work, writers, folders, sizes, [(2, (b, 0, 4))], [b"efgh"], 0, False)
    with pytest.raises(CommitError, match="is gone: the save was abandoned"):  # a save whose stream starts late
        _write_round(storage, work, {}, set(), sizes, [(2, (b, 0, 4))], [b"efgh"], 0, False)
    writers.pop((1, a)).abort()
    assert os.listdir(tmp_path) == []


def test_the_simulated_store_models_the_same_folder_rules() -> None:
    storage = SimStorage(World(1, seed=1))
    storage.makedirs(STAGING)
    late = storage.open_write_in(f"{STAGING}/r00001-0.bin")  # open while the folder exists
    late.write(b"late bytes")
    storage.delete_tree(STAGING.split("/")[0])  # ... then the coordinator gives the save up
    late.close()
    assert not storage.exists(STAGING.split("/")[0])  # the bytes went with the folder
    with pytest.raises(CommitError, match="is gone"):
        write_files(storage, STAGING, 2, _jobs(), num_files=1)
    assert not storage.exists(STAGING.split("/")[0])
    free = storage.open_write("elsewhere/new.bin")  # open_write still makes the folder
    free.write(b"x")
    free.close()
    assert storage.size("elsewhere/new.bin") == 1


def test_a_staging_folder_deleted_from_outside_fails_the_save_saying_so(tmp_path, monkeypatch) -> None:
    """Something outside ckptlib deletes a save's staging folder before its manifest is written
    (single process: no rank fenced it): the save fails once, saying the folder disappeared (not
    that another rank fenced it), the previous step stands and the next save commits."""
    import ckptlib
    from ckptlib.format import layout

    root = tmp_path / "run"
    state = {"w": torch.arange(1000.0), "step": 1}
    mgr = ckptlib.CheckpointManager(root, keep_last=1)
    mgr.save(1, state).wait(timeout=60)
    real = PosixStorage.put_atomic

    def deleted_first(self: PosixStorage, path: str, data: bytes) -> None:
        if path.endswith("manifest.json"):
            shutil.rmtree(os.path.join(self.root, path.split("/")[0]))
        real(self, path, data)

    monkeypatch.setattr(PosixStorage, "put_atomic", deleted_first)
    handle = mgr.save(2, state)
    with pytest.raises(CommitError, match="disappeared during the save") as e:
        handle.wait(timeout=60)
    assert "another rank" not in str(e.value)
    mgr.wait()  # raised once
    monkeypatch.undo()
    assert os.listdir(root) == [layout.step_dir(1)]
    mgr.save(3, state).wait(timeout=60)
    mgr.close()
    assert os.listdir(root) == [layout.step_dir(3)]
