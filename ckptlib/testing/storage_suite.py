"""A storage conformance suite, shipped so every backend (ours or a user's) runs the same tests.

Use: subclass :class:`StorageSuite` in a test module and provide a ``storage`` pytest fixture
returning a fresh, empty :class:`~ckptlib.backends.Storage` whose root exists (``makedirs("")``
was called). The tests exercise only the public interface and the capability flags; ckptlib
runs them against memory, POSIX and S3 (``tests/backends/test_conformance.py``).
"""

from __future__ import annotations

import os
import threading
import time

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

    def test_write_into_an_existing_folder_only(self, storage: Storage) -> None:
        """``open_write_in`` (a save's ranks writing into its staging folder) writes the file
        where its folder exists; a storage with folders refuses a missing one and makes nothing."""
        storage.makedirs("staging/id")
        w = storage.open_write_in("staging/id/r00000-0.bin")
        w.write(b"payload")
        w.close()
        assert storage.size("staging/id/r00000-0.bin") == 7
        if storage.supports_atomic_rename:  # storages with folders
            with pytest.raises(FileNotFoundError):
                storage.open_write_in("removed/id/r00001-0.bin")
            assert not storage.exists("removed")

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

    def test_large_write_in_pieces(self, storage: Storage) -> None:
        """Bigger than an S3 part (multipart, parallel parts), written in uneven pieces."""
        data = os.urandom(1 << 20) * 12 + b"tail"
        w = storage.open_write("big/payload.bin")
        pos = 0
        for n in (1, 3 << 20, 7 << 20, 100, 5 << 20):
            w.write(memoryview(data)[pos : pos + n])
            pos += n
        w.write(data[pos:])
        w.close()
        assert storage.size("big/payload.bin") == len(data)
        with storage.open_read("big/payload.bin") as h:
            assert h.size == len(data)
            buf = bytearray(len(data))
            h.read_into(0, memoryview(buf))
            assert bytes(buf) == data
            assert h.read(len(data) - 10, 10) == data[-10:]
            assert h.read((5 << 20) - 3, 6) == data[(5 << 20) - 3 : (5 << 20) + 3]

    def test_large_abort_leaves_nothing(self, storage: Storage) -> None:
        w = storage.open_write("big/aborted.bin")
        w.write(os.urandom(1 << 20) * 11)
        w.abort()
        assert storage.size("big/aborted.bin") is None
        assert storage.list_uploads("") == []

    def test_empty_file(self, storage: Storage) -> None:
        w = storage.open_write("e/empty.bin")
        w.close()
        assert storage.size("e/empty.bin") == 0
        assert storage.read("e/empty.bin") == b""

    def test_read_whole(self, storage: Storage) -> None:
        storage.put_atomic("w/m.json", b'{"a": 1}')
        assert storage.read("w/m.json") == b'{"a": 1}'
        with pytest.raises(FileNotFoundError):
            storage.read("w/none.json")

    def test_listdir_unchecked_lists_what_listdir_lists(self, storage: Storage) -> None:
        storage.put_atomic("u/a/x", b"1")
        storage.put_atomic("u/b", b"2")
        assert {(e.name, e.is_dir) for e in storage.listdir_unchecked("u")} == {("a", True), ("b", False)}
        storage.delete("u/a/x")  # the empty folder may stay in an unchecked listing (and on POSIX in both)
        assert {e.name for e in storage.listdir("u")} <= {e.name for e in storage.listdir_unchecked("u")}
        assert {e.name for e in storage.listdir_unchecked("u")} - {"a"} == {"b"}

    def test_file_sizes(self, storage: Storage) -> None:
        """None (the caller asks ``size`` file by file), or every file directly under the folder
        with its size: no sub-folder, nothing from a folder beside it; a missing folder is empty."""
        storage.put_atomic("f/a.bin", b"12345")
        storage.put_atomic("f/empty", b"")
        storage.put_atomic("f/sub/c.bin", b"1")
        storage.put_atomic("f2/d.bin", b"12")
        sizes = storage.file_sizes("f")
        if sizes is None:
            return
        assert sizes == {"a.bin": 5, "empty": 0}
        assert storage.file_sizes("f/sub") == {"c.bin": 1}
        assert storage.file_sizes("missing") == {}

    def test_read_small(self, storage: Storage) -> None:
        storage.put_atomic("s/m.json", b'{"a": 1}')
        assert storage.read_small("s/m.json", 8) == (b'{"a": 1}', 8)  # exactly at the limit
        assert storage.read_small("s/m.json", 100) == (b'{"a": 1}', 8)
        assert storage.read_small("s/m.json", 7) == (None, 8)  # over it: not read, its size said
        storage.put_atomic("s/empty", b"")
        assert storage.read_small("s/empty", 10) == (b"", 0)
        with pytest.raises(FileNotFoundError):
            storage.read_small("s/none.json", 10)

    def test_exists(self, storage: Storage) -> None:
        storage.put_atomic("x/y/z", b"1")
        assert storage.exists("x/y/z") and storage.exists("x/y") and storage.exists("x")
        assert not storage.exists("x/q")

    def test_deleted_folder_not_listed(self, storage: Storage) -> None:
        """A deleted step must not come back as an empty folder (some S3 servers keep one)."""
        storage.put_atomic("keep/a", b"1")
        storage.put_atomic("gone/sub/b", b"2")
        storage.delete_tree("gone")
        assert {e.name for e in storage.listdir("")} == {"keep"}
        assert not storage.exists("gone")

    def test_delete_then_recreate(self, storage: Storage) -> None:
        storage.put_atomic("r/m", b"old")
        storage.delete("r/m")
        assert storage.size("r/m") is None
        storage.put_atomic("r/m", b"new")
        assert storage.read("r/m") == b"new"

    def test_create_only_race_has_one_winner(self, storage: Storage) -> None:
        """Many writers race to create one commit point: exactly one wins, the rest are told."""
        if not (storage.supports_conditional_put or storage.supports_atomic_rename):
            pytest.skip("no create-only primitive")
        n = 6
        start = threading.Barrier(n)
        wins, losses = [], []

        def racer(i: int) -> None:
            start.wait(timeout=30)
            try:
                if storage.supports_conditional_put:
                    storage.put_if_absent("race/manifest.json", f"writer {i}".encode())
                else:
                    storage.rename(f"race-src-{i}", "race/step")
                wins.append(i)
            except FileExistsError:
                losses.append(i)

        if not storage.supports_conditional_put:
            storage.makedirs("race")
            for i in range(n):
                storage.put_atomic(f"race-src-{i}/manifest.json", f"writer {i}".encode())
        threads = [threading.Thread(target=racer, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(wins) == 1 and len(losses) == n - 1, (wins, losses)
        where = "race/manifest.json" if storage.supports_conditional_put else "race/step/manifest.json"
        assert storage.read(where) == f"writer {wins[0]}".encode()

    def test_optional_extras(self, storage: Storage) -> None:
        """The declared extras answer (a default or the backend's own), never AttributeError."""
        storage.put_atomic("ex/a", b"1")
        t = storage.tree_modified("ex")
        assert t is None or abs(t - time.time()) < 3600
        assert storage.tree_modified("missing-folder") is None
        assert storage.list_uploads("ex") == []
        storage.abort_upload("ex/never-started", "no-such-upload")
        with storage.deadline(60.0):
            assert storage.read("ex/a") == b"1"
