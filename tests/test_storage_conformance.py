"""The shared storage conformance suite, run against each backend."""

from __future__ import annotations

import os
import uuid

import pytest

from ckptlib.backends import open_storage
from ckptlib.backends.base import Storage
from ckptlib.errors import CorruptCheckpointError
from ckptlib.testing.storage_suite import StorageSuite


class TestPosix(StorageSuite):
    @pytest.fixture
    def storage(self, tmp_path) -> Storage:
        return open_storage(tmp_path / "root")


class TestFileUrl(StorageSuite):
    @pytest.fixture
    def storage(self, tmp_path) -> Storage:
        return open_storage(f"file://{tmp_path}/root")


class TestMemory(StorageSuite):
    @pytest.fixture
    def storage(self) -> Storage:
        return open_storage(f"memory://conformance-{uuid.uuid4().hex}")


def test_posix_refuses_symlinks_and_fifos(tmp_path):
    s = open_storage(tmp_path)
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", tmp_path / "link")
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        s.open_read("link")
    os.mkdir(tmp_path / "d")
    os.symlink(tmp_path / "d", tmp_path / "dlink")
    (tmp_path / "d" / "f").write_bytes(b"x")
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        s.open_read("dlink/f")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CorruptCheckpointError, match="regular file"):
        s.open_read("fifo")


def test_posix_fsync_failure_is_raised(tmp_path, monkeypatch):
    s = open_storage(tmp_path)
    w = s.open_write("f.bin")
    w.write(b"abc")

    def bad_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", bad_fsync)
    with pytest.raises(OSError, match="fsync"):
        w.close()
