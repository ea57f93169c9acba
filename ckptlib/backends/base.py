"""The storage interface: a small, synchronous, bytes-level API with capability flags.

Who calls what (all methods are thread-safe and called from ckptlib's worker threads as well
as the caller's thread):
- the writer (every rank) calls :meth:`Storage.open_write_in` for its payload and piece index
  files, in the staging folder the coordinator made with :meth:`makedirs` and
  :meth:`open_write` (its marker), and ``close()``s each stream, which makes the bytes durable
  (fsync on POSIX, upload completion on S3);
- the committer (coordinator rank) publishes the manifest with :meth:`put_atomic` +
  :meth:`rename` where ``supports_atomic_rename``, else :meth:`put_if_absent` where
  ``supports_conditional_put``, else :meth:`put_atomic` followed by a read-back;
- the scanner and reader call :meth:`read`, :meth:`read_into`, :meth:`size`, :meth:`listdir`;
- retention and cleanup call :meth:`delete_tree` and :meth:`delete`, and judge debris with
  :meth:`tree_modified`, :meth:`list_uploads` and :meth:`abort_upload`;
- a save bounds all its operations with ``with storage.deadline(seconds):``.

The last four have defaults (nothing to report, nothing to bound), so callers call them
directly, never probing with ``getattr``; a backend overrides what it can do.

Paths are ``/``-separated and relative to the storage root. Backends raise
:class:`FileNotFoundError` for missing paths, :class:`FileExistsError` for a create-only
operation that lost, and :class:`ckptlib.errors.StorageError` for other I/O failures.
"""

from __future__ import annotations

import contextlib
import errno
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from ckptlib.errors import CorruptCheckpointError


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    is_dir: bool


class WriteStream(ABC):
    """A file being written sequentially. ``close()`` returns only once the bytes are durable;
    ``abort()`` discards a partial file. Used by one thread at a time."""

    @abstractmethod
    def write(self, data) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...


class ReadHandle(ABC):
    """An open file for random-access reads. Used by one thread at a time."""

    size: int

    @abstractmethod
    def read_into(self, start: int, out: memoryview) -> None:
        """Fill ``out`` with bytes from ``start``; a short read is a ``CorruptCheckpointError``."""

    def read(self, start: int, length: int) -> bytes:
        return bytes(self.read_buffer(start, length))

    def read_buffer(self, start: int, length: int) -> bytearray:
        """The bytes in a new ``bytearray``: one copy fewer than :meth:`read`, for callers that
        hand them on (peer transfers send a bytearray as it is)."""
        buf = bytearray(length)
        self.read_into(start, memoryview(buf))
        return buf

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> ReadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RangeRead(ReadHandle):
    """An object of known ``size`` on an object store: the bounds are checked here, the bytes
    fetched by ``store._read_range(path, start, out)``."""

    def __init__(self, store: Any, path: str, size: int) -> None:
        self.store, self.path, self.size = store, path, size

    def read_into(self, start: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        end = start + len(out)
        if end > self.size:
            raise CorruptCheckpointError(
                f"file is shorter than expected (needed bytes up to {end}, has {self.size})",
                f"{self.store.url}/{self.path}",
            )
        if len(out):
            self.store._read_range(self.path, start, out)

    def close(self) -> None:
        pass


class Held(Protocol):
    """What :meth:`Storage.hold` returns: ``close()`` gives the folder up (idempotent)."""

    def close(self) -> None: ...


class Storage(ABC):
    url: str
    """The root this storage was opened on (for messages)."""

    supports_atomic_rename: bool = False
    """``rename`` of a folder is atomic and refuses to replace an existing target."""

    supports_conditional_put: bool = False
    """``put_if_absent`` is a true create-only write (If-None-Match: * on S3)."""

    memory: bool = False
    """The bytes live in memory (tmpfs): nothing to flush, lost with the node (a memory tier)."""

    # -- writing
    @abstractmethod
    def open_write(self, path: str) -> WriteStream: ...

    def open_write_in(self, path: str) -> WriteStream:
        """:meth:`open_write` of a file whose folder must exist already: a missing folder raises
        ``FileNotFoundError`` and nothing is made. A save's ranks write their files into the
        staging folder their coordinator made this way (ckptlib/engine/writer.py ``create``), so
        a rank that comes late to a save the coordinator gave up and removed never makes that
        folder again. This default asks first (``exists``, on storages with folders; object
        stores have none) and then creates: two calls, and not atomic. :class:`PosixStorage`
        does it in one create that cannot make the folder."""
        if self.supports_atomic_rename and not self.exists(parent(path)):
            raise FileNotFoundError(errno.ENOENT, "its folder is missing", path)
        return self.open_write(path)

    @abstractmethod
    def put_atomic(self, path: str, data: bytes) -> None:
        """Write a whole small file so readers see either nothing or all of it; durable."""

    def put_if_absent(self, path: str, data: bytes) -> None:
        """Create ``path`` with ``data`` only if it does not exist, else ``FileExistsError``."""
        raise NotImplementedError(f"{type(self).__name__} has no conditional put")

    @abstractmethod
    def makedirs(self, path: str) -> None: ...

    def rename(self, src: str, dst: str) -> None:
        """Atomically rename a folder; ``FileExistsError`` if ``dst`` exists."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename")

    def sync_dir(self, path: str) -> None:  # noqa: B027 - optional hook, no-op by default
        """Make a folder's entries durable (fsync on POSIX; a no-op elsewhere)."""

    def recycle(self, folder: str, keep: Collection[str] = ()) -> None:  # noqa: B027 - optional hook
        """``folder`` (already invisible: a ``.del-`` folder) is about to be deleted: keep its
        large files' memory (not those named in ``keep``) for the next files written under the
        same names (a memory tier,
        :class:`ckptlib.backends.posix.PosixStorage`); a no-op elsewhere. Called by
        :func:`ckptlib.engine.retire.delete_step` before it deletes the rest."""

    def release_spares(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Free what :meth:`recycle` kept (the manager's ``close()``; ``ckptlib prune``)."""

    def dead_arenas(self, *, remove: bool = False, only: Collection[str] | None = None) -> list[tuple[str, int]]:
        """A memory tier's snapshot files (``.ckptlib-arena/``) whose process is gone: (name,
        bytes), removed when ``remove``; ``only``: just these names. Called by the local tier's
        cleanup (:func:`ckptlib.tiers.inventory.arena_debris`) and ``ckptlib prune --local``
        through :func:`ckptlib.engine.retire.remove_debris`. None elsewhere (the default)."""
        return []

    def hold(self, path: str) -> Held | None:
        """Mark the folder ``path`` in use by this process until the returned handle is closed
        (or the process ends, however it ends): :meth:`held` then says so in any other process.
        The coordinator holds a save's staging folder from its creation to its commit or abort
        (ckptlib/engine/commit.py ``begin``), so that the debris clean-up of another job or of
        ``ckptlib prune`` never deletes a save in flight. None where the storage cannot (object
        stores, the default; a file system without locks)."""
        return None

    def held(self, path: str) -> bool:
        """Whether another open handle holds ``path`` (:meth:`hold`); False where unknown.
        Called by the debris verdicts (:func:`ckptlib.engine.retire.find_debris`)."""
        return False


    # -- reading
    @abstractmethod
    def open_read(self, path: str) -> ReadHandle:
        """Open a regular file for reading. Symlinks and special files inside the checkpoint are
        refused with ``CorruptCheckpointError``; a missing file is ``FileNotFoundError``."""

    def read(self, path: str) -> bytes:
        """A whole (small) file."""
        with self.open_read(path) as h:
            return h.read(0, h.size)

    def read_small(self, path: str, limit: int) -> tuple[bytes | None, int]:
        """A whole small file (a manifest, an abort record, a claim) in as few requests as the
        backend allows: ``(its bytes, its size)``, or ``(None, its size)`` without reading a byte
        of it when it is over ``limit`` bytes. Errors as :meth:`open_read`. Callers: the manifest
        reads of :mod:`ckptlib.engine.scan` (``read_manifest``, ``read_capped``), on their own
        thread. Object stores answer it with one ranged GET (no HEAD first)."""
        with self.open_read(path) as h:
            if h.size > limit:
                return None, h.size
            return h.read(0, h.size), h.size

    @abstractmethod
    def size(self, path: str) -> int | None:
        """Size of a regular file, or ``None`` if there is none at ``path``."""

    def file_sizes(self, path: str) -> dict[str, int] | None:
        """The sizes of the files directly under folder ``path``, by name, from one listing (a
        missing folder: ``{}``), or None where asking :meth:`size` file by file costs no more (the
        default: a local file system answers a ``stat`` without a round trip). Object stores answer
        it with a listing of a page per 1,000 objects, so judging a step of 4,096 payload files
        costs 5 requests, not 4,096 HEADs. A listing may lag behind a write on some stores: the
        caller asks :meth:`size` of any file that the listing leaves out or sizes otherwise
        (:func:`ckptlib.engine.scan.check_files`, the caller's thread)."""
        return None

    @abstractmethod
    def listdir(self, path: str = "") -> list[Entry]:
        """Entries directly under ``path``; ``FileNotFoundError`` if it does not exist."""

    def listdir_unchecked(self, path: str = "") -> list[Entry]:
        """:meth:`listdir` without a backend's check that each folder still holds something
        (S3: one request per folder, for servers that keep a folder's entry after its objects
        are deleted), so a folder entry may be an empty one. Callers that look inside each
        folder anyway use it and pass over the empty ones (a step folder without a manifest is
        checked with :meth:`exists`: :mod:`ckptlib.engine.scan`, :mod:`ckptlib.engine.retire`)."""
        return self.listdir(path)

    @abstractmethod
    def exists(self, path: str = "") -> bool: ...

    # -- deleting
    @abstractmethod
    def delete(self, path: str) -> None:
        """Delete one file; missing is fine."""

    @abstractmethod
    def delete_tree(self, path: str) -> None:
        """Delete a folder and everything under it; missing is fine."""

    # -- optional extras, with defaults
    def tree_modified(self, path: str) -> float | None:
        """Unix time of the newest write under folder ``path``; None when it is empty or missing,
        or when the backend cannot tell (the default). Cleanup never counts None as old."""
        return None

    def list_uploads(self, path: str = "") -> list[tuple[str, str, float]]:
        """Incomplete multipart uploads under folder ``path``: ``(path, upload id, started)``,
        paths relative to the root, ``started`` in Unix seconds. Default: none."""
        return []

    def abort_upload(self, path: str, upload_id: str) -> None:  # noqa: B027 - default no-op
        """Abort one upload from :meth:`list_uploads` (one already gone is fine). Default:
        nothing to abort."""

    def deadline(self, seconds: float) -> contextlib.AbstractContextManager[Any]:
        """``with storage.deadline(seconds):`` every operation started inside the block (by any
        thread) must finish within ``seconds``. Default: a null context (each operation keeps
        its own bounds); S3 overrides it with its ``DeadlineScope``."""
        return contextlib.nullcontext()

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release resources (connections, thread pools)."""


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def parent(path: str) -> str:
    """The folder of ``path`` ("" for one in the root)."""
    return path.rsplit("/", 1)[0] if "/" in path else ""
