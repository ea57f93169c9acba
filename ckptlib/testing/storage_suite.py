"""A storage conformance suite, shipped so every backend (ours or a user's) runs the same tests.

Use: subclass :class:`StorageSuite` in a test module and provide a ``storage`` pytest fixture
returning a fresh, empty :class:`~ckptlib.backends.Storage`. The tests exercise only the
public interface and the capability flags.
"""

from __future__ import annotations

import pytest

from ckptlib.backends import Storage
from ckptlib.errors import CorruptCheckpointError


class StorageSuite:
    def test_write_then_read(self, storage: Storage) -> None:
        w = storage.open_write("a/b/file.bin")
        w.write(b"hello ")
        w.write(memoryview(b"world"))
        w.close()
        assert storage.size("a/b/file.bin") == 11
        with storage.open_read("a/b/file.bin") as h:
            assert h.size == 11
            assert h.read(6, 5) == b"world"
            buf = bytearray(5)
            h.read_into(0, memoryview(buf))
            assert bytes(buf) == b"hello"

    def test_short_read_is_corrupt(self, storage: Storage) -> None:
        storage.put_atomic("f", b"abc")
        with storage.open_read("f") as h, pytest.raises(CorruptCheckpointError):
            h.read(1, 10)

    def test_missing(self, storage: Storage) -> None:
        assert storage.size("nope") is None
        assert not storage.exists("nope")
        with pytest.raises(FileNotFoundError):
            storage.open_read("nope")
        storage.delete("nope")
        storage.delete_tree("nope-dir")

    def test_put_atomic_replaces(self, storage: Storage) -> None:
        storage.put_atomic("m.json", b"one")
        storage.put_atomic("m.json", b"two!")
        assert storage.read("m.json") == b"two!"

    def test_listdir(self, storage: Storage) -> None:
        storage.put_atomic("d/x", b"1")
        storage.put_atomic("d/sub/y", b"2")
        entries = {e.name: e.is_dir for e in storage.listdir("d")}
        assert entries == {"x": False, "sub": True}

    def test_delete_tree(self, storage: Storage) -> None:
        storage.put_atomic("t/a", b"1")
        storage.put_atomic("t/b/c", b"2")
        storage.delete_tree("t")
        assert storage.size("t/a") is None and storage.size("t/b/c") is None
        with pytest.raises(ValueError):
            storage.delete_tree("")

    def test_abort_discards(self, storage: Storage) -> None:
        w = storage.open_write("partial.bin")
        w.write(b"x" * 100)
        w.abort()
        assert storage.size("partial.bin") is None

    def test_capabilities(self, storage: Storage) -> None:
        if storage.supports_atomic_rename:
            storage.put_atomic("src/f", b"1")
            storage.put_atomic("dst/g", b"2")
            with pytest.raises(FileExistsError):
                storage.rename("src", "dst")
            storage.rename("src", "moved")
            assert storage.read("moved/f") == b"1"
        if storage.supports_conditional_put:
            storage.put_if_absent("once", b"first")
            with pytest.raises(FileExistsError):
                storage.put_if_absent("once", b"second")
            assert storage.read("once") == b"first"
