"""POSIX storage for local NVMe and parallel file systems (GPFS, WEKA, Lustre, NFS).

Uses ``os`` calls directly rather than fsspec's local filesystem because durability needs
``fsync`` on files and folders, which fsspec does not expose. Every file is written with
``O_EXCL`` and fsynced on ``close()``; an fsync error is raised, never swallowed. Reads walk
the path one component at a time with ``O_NOFOLLOW`` so a checkpoint cannot point outside its
folder through a symlink, and open with ``O_NONBLOCK`` so a FIFO cannot hang the reader.
Folder renames use ``renameat2(RENAME_NOREPLACE)`` where the kernel has it, so two jobs
committing the same step cannot both win.

Parallel and network file systems: nothing here trusts a folder listing alone; a file that is
missing or short is retried for up to ``visibility_timeout`` seconds (0 on local file systems,
:data:`NETWORK_VISIBILITY_TIMEOUT` on network or parallel ones, told by :func:`mount_type`;
storage option ``visibility_timeout``). See docs/storage.md, "POSIX and parallel file systems".

Memory file systems (tmpfs, ramfs: ``/dev/shm``; ``PosixStorage.memory``): nothing is flushed
(no fsync, no write-back hints); a file there is as durable as the node's memory. The tiers use
such a root as a memory tier (docs/tiers.md). Pages are reused: a step that retention deletes
leaves its large files in the root's :data:`SPARE_DIR` (:meth:`PosixStorage.recycle`), and the
next file written under the same name inside a step folder is that file, overwritten and cut to
its new length (:meth:`PosixStorage.open_write`). Overwriting pages tmpfs already holds costs
about two thirds of filling new ones, and a save every step writes the same names every step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Collection
from typing import Any

from ckptlib.backends.base import Entry, ReadHandle, Storage, WriteStream
from ckptlib.backends.retry import RetryPolicy, call_sync
from ckptlib.errors import CorruptCheckpointError, StorageError

NETWORK_VISIBILITY_TIMEOUT = 10.0
NETWORK_FS_TYPES = frozenset(
    {"nfs", "nfs4", "lustre", "gpfs", "wekafs", "cifs", "smb3", "smbfs", "beegfs", "fuse.glusterfs",
     "glusterfs", "ceph", "fuse.ceph", "panfs", "orangefs", "9p", "fuse.s3fs", "fuse.gcsfuse"}
)


MEMORY_FS_TYPES = ("tmpfs", "ramfs")


def free_bytes(path: str) -> int:
    """Bytes free for an unprivileged writer on the file system holding ``path`` (its nearest
    existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def mount_type(path: str) -> str:
    """File-system type of the mount holding ``path`` (from /proc/self/mounts), or ``""``."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return ""
    path = os.path.realpath(path)
    best, kind = "", ""
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


class _NotYet(Exception):
    """A file is not (fully) visible yet: retried within the visibility timeout."""

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_SYNC_FILE_RANGE_WRITE = 2
WRITEBACK_MIN = 1 << 20  # writes at least this big start their writeback at once
SPARE_DIR = ".ckptlib-spare"
"""A memory root's files kept for reuse: at most one per name, all from the step retention deleted last."""
SPARE_MIN = 1 << 20  # smaller files are not worth keeping
ARENA_DIR = ".ckptlib-arena"
"""A memory root's mapped snapshot files (ckptlib/engine/mapped_arena.py). Each is locked
(:func:`lock_arena`) by the process that maps it; the kernel drops the lock when that process
dies, however it dies, so a file whose lock is free is a dead process's (:func:`sweep_arenas`)."""
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _renameat2 = getattr(_libc, "renameat2", None)
    _sync_file_range = getattr(_libc, "sync_file_range", None)
    if _sync_file_range is not None:
        _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except OSError:  # pragma: no cover - exotic platforms
    _renameat2 = _sync_file_range = None


def try_lock(fd: int) -> bool | None:
    """Take the exclusive ``flock`` of ``fd`` without waiting: True, False when another open
    file of it holds the lock, None when this file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def lock_arena(fd: int) -> bool:
    """Take the exclusive ``flock`` of an arena file without waiting (:func:`try_lock`): its
    owner right after it creates the file (``Ring``, training thread), a sweeper to prove the
    owner gone. False when another open file of it holds the lock (or the file system has no
    locks)."""
    return try_lock(fd) is True


class _FolderLock:
    """A folder's ``flock`` that :meth:`PosixStorage.hold` took: given up by ``close()``, by
    garbage collection, or by the kernel when the process ends."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


def sweep_arenas(root: str, *, remove: bool, only: Collection[str] | None = None) -> list[tuple[str, int]]:
    """The files in ``root``'s :data:`ARENA_DIR` that no live process holds (name, bytes), each
    removed under its lock when ``remove``; ``only``: just these names. Called by a ``Ring``'s
    first arena (training thread), a node leader's cleanup after a local commit and ``ckptlib
    prune --local``. A file is judged and removed while this call holds its lock, and its owner
    checks after locking that the name is still its file, so a file being created is never
    taken from its owner (the owner falls back to ordinary memory for that save). The folder
    is opened without following a symlink and every name is taken relative to that open
    folder: an :data:`ARENA_DIR` that is a symlink (to a folder outside the root) is not
    swept, so nothing outside the root is ever judged or deleted."""
    try:
        dfd = os.open(os.path.join(root, ARENA_DIR), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # missing, or a symlink (ELOOP) or not a folder: nothing of ours to sweep
        return []
    found: list[tuple[str, int]] = []
    try:
        for name in sorted(os.listdir(dfd)):
            if only is not None and name not in only:
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or not lock_arena(fd):
                    continue
                now = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    continue
                if remove:
                    os.unlink(name, dir_fd=dfd)
                found.append((name, st.st_size))
            except OSError:
                continue
            finally:
                os.close(fd)  # drops the lock
    except OSError:
        return found
    finally:
        os.close(dfd)
    return found


def _rename_noreplace(src: str, dst: str) -> int:
    """Rename ``src`` to ``dst`` unless ``dst`` exists: 0, or -1 with ``ctypes.get_errno()``."""
    assert _renameat2 is not None
    return int(_renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE))


rename_noreplace: Callable[[str, str], int] | None = None if _renameat2 is None else _rename_noreplace
"""Linux ``renameat2(RENAME_NOREPLACE)`` (None where the C library lacks it): the spares'
moves here and the mapped arenas' (ckptlib/engine/mapped_arena.py)."""


def _storage_error(op: str, path: str, e: OSError) -> StorageError:
    err = StorageError(e.errno, f"{op} {path}: {e.strerror or e}")
    err.filename = path
    return err


class _FolderMissing(Exception):
    """``open_write_in``: the folder of the file is missing."""


class _PosixWrite(WriteStream):
    """A new file written sequentially; ``close()`` fsyncs it.

    Every write of at least ``WRITEBACK_MIN`` bytes asks the kernel to start writing those
    pages to the device now (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not
    wait), so the disk works while the writer prepares the next bytes and the final fsync has
    little left to do: about 25% off a 1 GiB save on the reference VM. Only a hint: its errors
    are ignored, and durability and I/O errors are still decided by the fsync in ``close()``.
    """

    def __init__(self, fd: int, path: str, durable: bool = True, reused: bool = False) -> None:
        self.fd = fd
        self.path = path
        self.pos = 0
        self.durable = durable  # False on a memory file system: nothing to flush, no fsync
        self.reused = reused  # a recycled file (memory root): cut to what was written on close

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        start, size = self.pos, len(view)
        try:
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as e:
            raise _storage_error("write", self.path, e) from e
        self.pos += size
        if self.durable and size >= WRITEBACK_MIN and _sync_file_range is not None:
            _sync_file_range(self.fd, start, size, _SYNC_FILE_RANGE_WRITE)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            if self.reused:
                os.ftruncate(fd, self.pos)
            if self.durable:
                os.fsync(fd)
        except OSError as e:
            raise _storage_error("fsync", self.path, e) from e
        finally:
            os.close(fd)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except OSError:
            pass


class _PosixRead(ReadHandle):
    def __init__(self, fd: int, path: str, size: int, wait: Callable[[Callable[[], Any], str], Any]) -> None:
        self.fd = fd
        self.path = path
        self.size = size
        self._wait = wait

    def read_into(self, start: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" else out
        pos, total = 0, len(out)

        def attempt() -> None:
            nonlocal pos
            while pos < total:
                n = os.preadv(self.fd, [out[pos:]], start + pos)
                if n == 0:
                    raise _NotYet()
                pos += n

        try:
            self._wait(attempt, f"read {self.path}")
        except _NotYet:
            raise CorruptCheckpointError(
                f"file is shorter than expected (needed bytes up to {start + total})", self.path
            ) from None
        except OSError as e:
            raise _storage_error("read", self.path, e) from e

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        # A handle dropped unclosed (a ``ckptlib.open`` view never closed, a reader that
        # raised) gives its descriptor back when collected: a long job that opens views must
        # not run out of descriptors. ``close`` set fd to -1, so a number reused since is safe.
        try:
            self.close()
        except Exception:  # at interpreter exit the module may be half torn down: nothing to report to
            pass


class PosixStorage(Storage):
    supports_atomic_rename = True
    supports_conditional_put = False

    def __init__(self, root: str, *, visibility_timeout: float | None = None, **_ignored: Any) -> None:
        """``visibility_timeout``: seconds to keep retrying a missing or short file (None: by
        mount type). Other storage options are ignored (POSIX has no other settings). A leading
        ``~`` is the home folder, as in fsspec (never a folder named ``~``)."""
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        if visibility_timeout is None:
            probe = self.root
            while not os.path.exists(probe) and os.path.dirname(probe) != probe:
                probe = os.path.dirname(probe)
            kind = mount_type(probe)
            network = kind in NETWORK_FS_TYPES or kind.startswith("nfs")
            visibility_timeout = NETWORK_VISIBILITY_TIMEOUT if network else 0.0
        self.visibility_timeout = float(visibility_timeout)
        probe = self.root
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        self.memory = mount_type(probe) in MEMORY_FS_TYPES
        """A memory file system (tmpfs: ``/dev/shm``): nothing is flushed (no fsync), and what it
        holds survives a process crash, not a node reboot (docs/tiers.md, the memory tier)."""
        self._policy = RetryPolicy(
            attempts=1_000_000, attempt_timeout=float("inf"), deadline=self.visibility_timeout,
            backoff=0.02, backoff_max=1.0,
        )

    def _visible(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn``, retrying "not there (yet)" for up to ``visibility_timeout`` seconds."""
        if self.visibility_timeout <= 0:
            return fn()
        return call_sync(fn, what, self._policy, transient=lambda e: isinstance(e, FileNotFoundError | _NotYet))

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    # -- writing
    def open_write(self, path: str) -> WriteStream:
        return self._create(path, parents=True)

    def open_write_in(self, path: str) -> WriteStream:
        return self._create(path, parents=False)

    def _create(self, path: str, parents: bool) -> WriteStream:
        """Create ``path`` (``O_EXCL``: an existing file raises ``FileExistsError``) with one
        ``open``; its folder is made only when that open says it is missing, and only with
        ``parents`` (else ``FileNotFoundError``: :meth:`Storage.open_write_in`)."""
        full = self._p(path)
        if self.memory and (fd := self._reuse(path, full, parents)) >= 0:
            return _PosixWrite(fd, full, durable=False, reused=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:  # the folder is there nearly always (the save's staging folder): no mkdir per file
                fd = os.open(full, flags, 0o644)
            except FileNotFoundError:
                if not parents:
                    raise _FolderMissing() from None
                os.makedirs(os.path.dirname(full), exist_ok=True)
                fd = os.open(full, flags, 0o644)
        except _FolderMissing:
            raise FileNotFoundError(errno.ENOENT, "its folder is missing", full) from None
        except OSError as e:
            if e.errno == errno.EEXIST:
                raise FileExistsError(errno.EEXIST, "already exists", full) from None
            raise _storage_error("create", full, e) from e
        return _PosixWrite(fd, full, durable=not self.memory)

    @staticmethod
    def _spare_name(path: str) -> str | None:
        """The spare for a file at ``path``: its own name (payload names are unique inside a
        step folder: they carry the writing rank); None for a file directly in the root."""
        parts = [p for p in path.split("/") if p]
        return parts[-1] if len(parts) > 1 else None

    def _reuse(self, path: str, full: str, parents: bool = True) -> int:
        """Move the spare of ``path`` (if any) to ``full`` and open it for overwriting; -1 when
        there is none (or the kernel cannot rename without replacing). The move refuses an
        existing ``full`` (``FileExistsError``, as ``O_EXCL`` would); two writers never get the
        same spare (the loser's rename finds nothing)."""
        name = self._spare_name(path)
        if name is None or rename_noreplace is None:
            return -1
        src = os.path.join(self.root, SPARE_DIR, name)
        try:
            if parents:
                os.makedirs(os.path.dirname(full), exist_ok=True)
        except OSError as e:
            raise _storage_error("create", full, e) from e
        if rename_noreplace(src, full) != 0:
            if ctypes.get_errno() == errno.EEXIST:
                raise FileExistsError(errno.EEXIST, "already exists", full)
            return -1
        try:
            return os.open(full, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            try:
                os.unlink(full)
            except OSError:
                pass
            return -1

    def recycle(self, folder: str, keep: Collection[str] = ()) -> None:
        """Memory roots only (retention's :func:`ckptlib.engine.retire.delete_step`, after the
        step folder became a ``.del-`` folder): replace the spares with ``folder``'s files of
        at least :data:`SPARE_MIN` bytes and one link, except those named in ``keep``. Spares the
        last save did not take are removed first, so they hold at most one step. Best effort:
        an error leaves the rest to the deletion that follows."""
        if not self.memory or _renameat2 is None:
            return
        spare = os.path.join(self.root, SPARE_DIR)
        try:
            self.release_spares()
            os.makedirs(spare, exist_ok=True)
            for d, _, names in os.walk(self._p(folder)):
                for n in names:
                    full = os.path.join(d, n)
                    st = os.lstat(full)
                    # One link only: a file also linked elsewhere (cp -al) must never be overwritten.
                    if n not in keep and stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size >= SPARE_MIN:
                        os.rename(full, os.path.join(spare, n))
        except OSError:
            return

    def release_spares(self) -> None:
        if self.memory:
            shutil.rmtree(os.path.join(self.root, SPARE_DIR), ignore_errors=True)

    def dead_arenas(self, *, remove: bool = False, only: Collection[str] | None = None) -> list[tuple[str, int]]:
        if not self.memory:
            return []
        return sweep_arenas(self.root, remove=remove, only=only)

    def _open_folder(self, path: str) -> int | None:
        try:
            return os.open(self._p(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None

    def hold(self, path: str) -> _FolderLock | None:
        """:meth:`Storage.hold`: the folder's exclusive ``flock``, kept on an open descriptor."""
        fd = self._open_folder(path)
        if fd is not None and try_lock(fd):
            return _FolderLock(fd)
        if fd is not None:
            os.close(fd)
        return None

    def held(self, path: str) -> bool:
        """:meth:`Storage.held`: the folder's ``flock`` cannot be taken (a live process holds it)."""
        fd = self._open_folder(path)
        if fd is None:
            return False
        try:
            return try_lock(fd) is False
        finally:
            os.close(fd)  # drops the lock if this call took it

    def put_atomic(self, path: str, data: bytes) -> None:
        full = self._p(path)
        tmp = f"{full}.{uuid.uuid4().hex[:12]}.partial"
        w = self.open_write(os.path.relpath(tmp, self.root))
        try:
            w.write(data)
            w.close()
            os.replace(tmp, full)
        except BaseException:
            w.abort()
            raise
        self.sync_dir(os.path.dirname(path))

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(self._p(path), exist_ok=True)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTDIR):  # a file where a folder must be
                e = OSError(e.errno, f"{e.strerror}: it or a folder above it is a file, not a folder; "
                                     "move that file away or pass another path")
            raise _storage_error("mkdir", self._p(path), e) from e

    def rename(self, src: str, dst: str) -> None:
        s, d = self._p(src), self._p(dst)
        if _renameat2 is not None:
            rc = _renameat2(_AT_FDCWD, os.fsencode(s), _AT_FDCWD, os.fsencode(d), _RENAME_NOREPLACE)
            if rc == 0:
                return
            err = ctypes.get_errno()
            if err in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(err, "already exists", d)
            if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
                raise _storage_error("rename", s, OSError(err, os.strerror(err)))
        # Fallback for file systems without RENAME_NOREPLACE: check, then rename. A non-empty
        # target makes rename(2) fail with ENOTEMPTY, so a committed step is never replaced.
        if os.path.lexists(d):
            raise FileExistsError(errno.EEXIST, "already exists", d)
        try:
            os.rename(s, d)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(e.errno, "already exists", d) from None
            raise _storage_error("rename", s, e) from e

    def sync_dir(self, path: str) -> None:
        if self.memory:
            return
        full = self._p(path)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise _storage_error("open folder", full, e) from e
        try:
            os.fsync(fd)
        except OSError as e:
            raise _storage_error("fsync folder", full, e) from e
        finally:
            os.close(fd)

    # -- reading
    def open_read(self, path: str) -> ReadHandle:
        return self._visible(lambda: self._open_read(path), f"open {self._p(path)}")

    def _open_read(self, path: str) -> ReadHandle:
        full = self._p(path)
        parts = [p for p in path.split("/") if p]
        try:
            dfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such file", full) from None
        except OSError as e:
            raise _storage_error("open", self.root, e) from e
        try:
            for part in parts[:-1]:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                os.close(dfd)
                dfd = nfd
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such file", full) from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CorruptCheckpointError("is a symlink or passes through one; refused", full) from None
            raise _storage_error("open", full, e) from e
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CorruptCheckpointError("is not a regular file; refused", full)
        os.set_blocking(fd, True)
        return _PosixRead(fd, full, st.st_size, self._visible)

    def size(self, path: str) -> int | None:
        try:
            st = os.lstat(self._p(path))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _storage_error("stat", self._p(path), e) from e
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def listdir(self, path: str = "") -> list[Entry]:
        full = self._p(path)
        try:
            with os.scandir(full) as it:
                return [Entry(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such folder", full) from None
        except NotADirectoryError:
            raise FileNotFoundError(errno.ENOTDIR, "not a folder", full) from None
        except OSError as e:
            raise _storage_error("list", full, e) from e

    def exists(self, path: str = "") -> bool:
        return os.path.lexists(self._p(path))

    def tree_modified(self, path: str) -> float | None:
        """Newest modification time of anything under folder ``path`` (None: missing)."""
        full = self._p(path)
        newest: float | None = None
        for top, dirs, files in os.walk(full):
            for name in [*dirs, *files]:
                try:
                    t = os.lstat(os.path.join(top, name)).st_mtime
                except FileNotFoundError:
                    continue
                newest = t if newest is None else max(newest, t)
        try:
            t = os.lstat(full).st_mtime
        except FileNotFoundError:
            return newest
        return t if newest is None else max(newest, t)

    # -- deleting
    def delete(self, path: str) -> None:
        try:
            os.unlink(self._p(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _storage_error("delete", self._p(path), e) from e

    def delete_tree(self, path: str) -> None:
        full = self._p(path)
        if not path:
            raise ValueError("refusing to delete the storage root")
        try:
            if os.path.islink(full):
                os.unlink(full)
            else:
                shutil.rmtree(full)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _storage_error("delete", full, e) from e
