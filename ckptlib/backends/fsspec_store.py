"""Storage over any fsspec filesystem (``memory://`` here; object stores build on it).

Object-store semantics: no folder rename, whole-object puts are atomic. The commit protocol
therefore publishes manifests with :meth:`put_if_absent` when ``supports_conditional_put`` is
set, else with a plain put followed by a read-back check (see ``ckptlib.engine.commit``).
``memory://`` is process-local; its create-only put is made atomic by a lock.

Tests can hand in a ready filesystem (``FsspecStorage(url, fs=...)``), e.g. the fault-injecting
wrapper :class:`ckptlib.testing.faults.FaultyFileSystem` around a memory filesystem.
"""

from __future__ import annotations

import threading
from typing import Any

import fsspec
from fsspec.registry import known_implementations

from ckptlib.backends.base import Entry, RangeRead, ReadHandle, Storage, WriteStream, join
from ckptlib.errors import CorruptCheckpointError, MissingDependencyError, StorageError


def _url_to_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """fsspec's filesystem and path for ``url`` (called by :class:`FsspecStorage` on the caller's
    thread). A scheme whose package is not installed (``gs://`` without gcsfs, ``az://`` without
    adlfs) is a :class:`MissingDependencyError` naming the package, not fsspec's bare ImportError."""
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        scheme = url.split("://", 1)[0]
        known = known_implementations.get(scheme, {})
        package = str(known.get("class", "")).split(".")[0] or scheme
        raise MissingDependencyError(f"a root at {scheme}://", "", package) from e


class _FsWrite(WriteStream):
    def __init__(self, store: FsspecStorage, path: str) -> None:
        self.store = store
        self.path = path
        self.parts: list[bytes] = []
        self.done = False

    def write(self, data) -> None:
        self.parts.append(bytes(memoryview(data).cast("B")))

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.store._put(self.path, b"".join(self.parts))
            self.parts.clear()

    def abort(self) -> None:
        self.done = True
        self.parts.clear()


class FsspecStorage(Storage):
    supports_atomic_rename = False

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, *, fs: Any = None
    ) -> None:
        if fs is None:
            fs, path = _url_to_fs(url, storage_options)
        else:
            path = url.split("://", 1)[-1]
        self.fs = fs
        self.base = path.rstrip("/")
        self.url = url
        self._lock = threading.Lock()
        protocol = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
        self.supports_conditional_put = "memory" in protocol

    def _full(self, path: str) -> str:
        return join(self.base, path) if path else self.base

    def _put(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._full(path), data)
        except Exception as e:
            raise StorageError(f"put {self.url}/{path}: {e}") from e

    def open_write(self, path: str) -> WriteStream:
        return _FsWrite(self, path)

    def put_atomic(self, path: str, data: bytes) -> None:
        self._put(path, data)

    def put_if_absent(self, path: str, data: bytes) -> None:
        if not self.supports_conditional_put:
            super().put_if_absent(path, data)
        with self._lock:
            if self.fs.exists(self._full(path)):
                raise FileExistsError(f"{self.url}/{path} already exists")
            self._put(path, data)

    def makedirs(self, path: str) -> None:
        pass  # object stores have no folders

    def open_read(self, path: str) -> ReadHandle:
        size = self.size(path)
        if size is None:
            raise FileNotFoundError(f"{self.url}/{path}")
        return RangeRead(self, path, size)

    def _read_range(self, path: str, start: int, out: memoryview) -> None:
        try:
            data = self.fs.cat_file(self._full(path), start=start, end=start + len(out))
        except FileNotFoundError:
            raise
        except Exception as e:
            raise StorageError(f"read {path}: {e}") from e
        if len(data) != len(out):
            raise CorruptCheckpointError(f"short read ({len(data)} of {len(out)} bytes)", path)
        out[:] = data

    def size(self, path: str) -> int | None:
        try:
            info = self.fs.info(self._full(path))
        except FileNotFoundError:
            return None
        if info.get("type") != "file":
            return None
        return int(info["size"])

    def _children(self, path: str) -> list[tuple[str, dict[str, Any]]]:
        """One ``ls`` of folder ``path`` with details: (name, info) of each entry directly under
        it (:meth:`listdir`, :meth:`file_sizes`); ``FileNotFoundError`` as ``fs.ls``."""
        full = self._full(path)
        return [(info["name"].rstrip("/").rsplit("/", 1)[-1], info) for info in self.fs.ls(full, detail=True)
                if info["name"].rstrip("/") != full.rstrip("/")]

    def file_sizes(self, path: str) -> dict[str, int] | None:
        """One ``ls`` of folder ``path``: the size of every file directly under it."""
        try:
            children = self._children(path)
        except FileNotFoundError:
            return {}
        return {name: int(info["size"]) for name, info in children if info.get("type") == "file"}

    def listdir(self, path: str = "") -> list[Entry]:
        try:
            children = self._children(path)
        except FileNotFoundError:
            if path == "" and self.supports_conditional_put:
                return []  # an empty in-memory root
            raise
        return [Entry(name, info.get("type") == "directory") for name, info in children]

    def exists(self, path: str = "") -> bool:
        return bool(self.fs.exists(self._full(path)))

    def tree_modified(self, path: str) -> float | None:
        """Newest creation/modification time of any file under folder ``path`` (None: none)."""
        try:
            infos = self.fs.find(self._full(path), detail=True)
        except FileNotFoundError:
            return None
        times = []
        for info in infos.values():
            t = info.get("mtime", info.get("created", info.get("LastModified")))
            if hasattr(t, "timestamp"):
                t = t.timestamp()
            if t is not None:
                times.append(float(t))
        return max(times, default=None)

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(self._full(path))
        except FileNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        if not path:
            raise ValueError("refusing to delete the storage root")
        try:
            self.fs.rm(self._full(path), recursive=True)
        except FileNotFoundError:
            pass
