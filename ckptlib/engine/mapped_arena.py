"""Staging memory that becomes the memory tier's payload file: one copy per save.

Who calls what, in order:

1. The manager makes one :class:`Ring` when its local tier is a memory file system (tmpfs,
   docs/tiers.md) and hands it to its :class:`~ckptlib.engine.snapshot.Stager`.
2. ``Stager.begin`` (training thread) asks :meth:`Ring.take` for an arena of the snapshot's
   size: a file under ``<local root>/.ckptlib-arena/``, kept mapped, that no step uses. The
   snapshot copies the state into it (the one copy).
3. The save's write (:func:`ckptlib.engine.save.write_state`, persist thread), when this rank
   writes every tensor it staged, calls :func:`ckptlib.engine.writer.adopt_arena`: it
   checksums the staged bytes where they lie and :meth:`Ring.adopt` renames the file into the
   step's staging folder as this rank's payload file. Nothing is written a second time.
   Otherwise the writer reads the arena like any staging memory and the file stays free.
4. When local retention retires the step, it moves the file into the spares
   (``.ckptlib-spare/``, :meth:`ckptlib.backends.posix.PosixStorage.recycle`). The next
   :meth:`Ring.take` moves it back by name, checks it is the same file (device, inode, one
   link, size) and hands it out again, still mapped: a steady run faults in no page and maps
   nothing.

Safety: a file is handed out only when it is in the arena folder (never adopted, or taken
back from the spares and checked); an adopted file that was deleted, or taken by someone
else, is unmapped and forgotten. Space is reserved with ``posix_fallocate`` before mapping, so
a full tmpfs gives ``None`` (the stager falls back to ordinary memory), never a SIGBUS.
Each arena file is locked (``flock``, :func:`ckptlib.backends.posix.lock_arena`) by the process
that maps it; the kernel drops the lock when the process dies. Files of dead processes (lock
free) are removed by the next :class:`Ring` on that root (any rank), by a node leader's cleanup
after each local commit and by ``ckptlib prune --local``
(:func:`ckptlib.backends.posix.sweep_arenas`). Single-threaded by contract: ``take`` on the training thread, ``adopt`` on the
persist thread, never at the same time (the manager joins a save before the next begins).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from ckptlib.backends.posix import ARENA_DIR, SPARE_DIR, lock_arena, rename_noreplace, sweep_arenas
from ckptlib.errors import StorageError

__all__ = ["ARENA_DIR", "Arena", "Ring"]
_SEQ = itertools.count(1)  # file names unique in this process, across its rings (managers)


def _move(src: str, dst: str) -> bool:
    """Rename unless ``dst`` exists (``ctypes.get_errno()`` says why not)."""
    return rename_noreplace is not None and rename_noreplace(src, dst) == 0


@dataclass(eq=False)
class Arena:
    """One mapped file: in the arena folder (free or in use by a snapshot) or adopted."""

    ring: Ring
    name: str
    """Its name in the arena folder."""
    fd: int
    mm: mmap.mmap
    tensor: torch.Tensor
    """The whole mapping as uint8 (the stager's arena)."""
    ident: tuple[int, int]
    """(device, inode) of the file."""
    adopted_as: str | None = None
    """The payload file name it was adopted as (its name among the spares once retired)."""
    plan: tuple[Any, Any] | None = None
    """The stager's (plan key, plan) attached to this arena's memory."""

    @property
    def nbytes(self) -> int:
        return len(self.mm)

    @property
    def base(self) -> int:
        """Address of the first byte of the mapping."""
        return self.tensor.data_ptr()


class Ring:
    """The mapped arenas of one rank on one memory root (module docstring). ``keep``: the most
    arenas held (local retention's steps, one in flight and one free)."""

    def __init__(self, root: str, rank: int, keep: int) -> None:
        self.root = os.path.abspath(root)
        self.rank = rank
        self.keep = max(2, keep)
        self.folder = os.path.join(self.root, ARENA_DIR)
        self._arenas: list[Arena] = []
        self._swept = False

    @property
    def held(self) -> int:
        """Bytes of the arenas not adopted (space on the memory root no step accounts for)."""
        return sum(a.nbytes for a in self._arenas if a.adopted_as is None)

    def take(self, nbytes: int) -> Arena | None:
        """A free arena of exactly ``nbytes`` (training thread, ``Stager.begin``), or None when
        the root has no room or the platform cannot rename without replacing."""
        if rename_noreplace is None or nbytes <= 0:
            return None
        self._reclaim()
        for a in self._arenas:
            if a.adopted_as is None and a.nbytes == nbytes:
                self._arenas.remove(a)  # the newest taken goes last: drops take the oldest first
                self._arenas.append(a)
                return a
        for a in [a for a in self._arenas if a.adopted_as is None]:
            self._drop(a)  # free but the wrong size: the state changed shape
        while len(self._arenas) >= self.keep:
            self._drop(self._arenas[0])
        return self._create(nbytes)

    def adopt(self, arena: Arena, dest: str) -> None:
        """Persist thread: make the arena's file ``dest`` (a full path in a staging folder on the
        same root), never replacing a file. Raises :class:`StorageError` (the staging folder is
        gone: the save was abandoned)."""
        src = os.path.join(self.folder, arena.name)
        if not _move(src, dest):
            err = ctypes.get_errno() or errno.ENOSYS
            raise StorageError(err, f"move staged memory {src} to {dest}: {os.strerror(err)}")
        arena.adopted_as = os.path.basename(dest)

    def release(self) -> None:
        """Unmap everything and remove the free files (``close()``); adopted files stay."""
        for a in list(self._arenas):
            self._drop(a)
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)  # only when empty: another rank of this node may still use it

    # ------------------------------------------------------------------ inside
    def _reclaim(self) -> None:
        """Take back adopted files that retention moved to the spares; forget deleted ones."""
        for a in list(self._arenas):
            if a.adopted_as is None:
                continue
            try:
                if os.fstat(a.fd).st_nlink == 0:
                    self._drop(a)
                    continue
            except OSError:
                self._drop(a)
                continue
            spare = os.path.join(self.root, SPARE_DIR, a.adopted_as)
            here = os.path.join(self.folder, a.name)
            if not _move(spare, here):
                continue  # still a step's file (or taken by another writer: dropped when over keep)
            try:
                st = os.stat(here)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == a.ident and st.st_nlink == 1 and st.st_size == a.nbytes:
                a.adopted_as = None
            else:  # another file by that name: a spare like any other, no longer wanted
                with contextlib.suppress(OSError):
                    os.unlink(here)

    def _create(self, nbytes: int) -> Arena | None:
        try:
            os.makedirs(self.folder, exist_ok=True)
            self._sweep()
        except OSError:
            return None
        name = f"r{self.rank:05d}-{os.getpid()}-{next(_SEQ)}"
        path = os.path.join(self.folder, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)  # as any payload file
        except OSError:
            return None
        try:
            if not lock_arena(fd):
                os.close(fd)  # a sweeper holds it (it took it between our create and our lock)
                return None
            st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)  # a sweeper took it between our create and our lock: not ours now
                return None
            os.posix_fallocate(fd, 0, nbytes)  # no room: an error now, never a SIGBUS later
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        arena = Arena(self, name, fd, mm, torch.frombuffer(mm, dtype=torch.uint8), (st.st_dev, st.st_ino))
        self._arenas.append(arena)
        return arena

    def _drop(self, a: Arena) -> None:
        """Forget ``a``: remove its file if it is still ours and free, unmap (once no view of it
        is alive: the mapping goes with the last tensor that uses it)."""
        self._arenas.remove(a)
        if a.adopted_as is None:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(self.folder, a.name))
                if (st.st_dev, st.st_ino) == a.ident:
                    os.unlink(os.path.join(self.folder, a.name))
        with contextlib.suppress(OSError):
            os.close(a.fd)
        a.plan = None
        a.tensor = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError, ValueError):
            a.mm.close()  # BufferError: a snapshot's views still use it (freed with them)

    def _sweep(self) -> None:
        """Once: remove the files of processes that are gone (their lock is free), any rank's."""
        if self._swept:
            return
        self._swept = True
        sweep_arenas(self.root, remove=True)
