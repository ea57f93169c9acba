"""The one storage conformance suite, run against memory, POSIX and S3 (SeaweedFS and moto).

The ``storage`` fixture (conftest) is parametrized over the backends; the tests are the
shipped :class:`ckptlib.testing.storage_suite.StorageSuite`, unchanged for every backend.
"""

from __future__ import annotations

import os

import pytest

from ckptlib.backends import open_storage
from ckptlib.errors import CorruptCheckpointError
from ckptlib.testing.storage_suite import StorageSuite


class TestStorage(StorageSuite):
    pass


def test_file_url_is_posix(tmp_path):
    s = open_storage(f"file://{tmp_path}/root")
    assert type(s).__name__ == "PosixStorage" and s.supports_atomic_rename


def test_s3_url_is_s3(seaweed):
    s = open_storage("s3://ckptlib-tests/x", seaweed.storage_options())
    assert type(s).__name__ == "S3Storage"
    assert s.supports_conditional_put and not s.supports_atomic_rename
    off = open_storage("s3://ckptlib-tests/x", seaweed.storage_options(ckptlib_conditional_put=False))
    assert not off.supports_conditional_put


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


def test_posix_open_write_makes_folders_only_when_missing(tmp_path, monkeypatch):
    """A file in an existing folder is created with one open (no mkdir: on a parallel file system
    each is a metadata round trip, per file per rank); a missing folder is still made; an existing
    file is still refused, and a file where a folder should be is a clear error."""
    s = open_storage(tmp_path)
    made: list[str] = []
    real = os.makedirs

    def counting(path, *a, **k):
        made.append(str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "makedirs", counting)
    w = s.open_write("a/b/f.bin")
    w.write(b"one")
    w.close()
    assert made and made[0] == str(tmp_path / "a" / "b")  # (os.makedirs recurses for "a")
    before = len(made)
    w = s.open_write("a/b/g.bin")
    w.write(b"two")
    w.close()
    assert len(made) == before  # the folder was there: no mkdir
    assert (tmp_path / "a" / "b" / "f.bin").read_bytes() == b"one"
    assert (tmp_path / "a" / "b" / "g.bin").read_bytes() == b"two"
    with pytest.raises(FileExistsError):
        s.open_write("a/b/f.bin")
    assert (tmp_path / "a" / "b" / "f.bin").read_bytes() == b"one"
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(OSError):
        s.open_write("plain/sub/h.bin")
    assert (tmp_path / "plain").read_bytes() == b"x"
