"""Fault injection for tests: a wrapper around any fsspec filesystem, and one around any
:class:`~ckptlib.backends.Storage`, driven by the same :class:`Fault` rules.

Which calls a :class:`Fault` picks and what each kind does: docs/storage.md ("Fault injection
for tests"). :meth:`FaultInjector.verify` (called on leaving the ``with`` block of either
wrapper) raises ``AssertionError`` naming any fault that never fired.

A :class:`Bandwidth` limit on a :class:`FaultyStorage` (``bandwidth=``) paces every byte read
or written through it; :func:`throttle_url` puts one on whatever storage ckptlib opens at one
URL, so a POSIX folder can stand in for a shared file system of a given bandwidth per
process (bench/bench_tiers.py).

Thread-safe: the save and load paths call storage from several threads.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fsspec.spec import AbstractFileSystem

from ckptlib.backends.base import Entry, ReadHandle, Storage, WriteStream
from ckptlib.errors import StorageError

KINDS = ("error", "slow", "truncate", "stale_listing", "delay_visibility", "fixed_listing")


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0"))


@dataclass
class Fault:
    op: str
    """Operation name (``pipe_file``, ``cat_file``, ``ls``, ``open_read``, ``listdir``, ``close``...)
    or ``*`` for any."""
    path: str = "*"
    """``fnmatch`` glob on the path the operation gets (relative for storages)."""
    kind: str = "error"
    calls: Collection[int] | None = (1,)
    """Matching calls (1-based) that fault; ``None``: every matching call (unless ``every``)."""
    every: int | None = None
    """Fault every ``every``-th matching call instead of ``calls`` (a steady rate)."""
    error: BaseException | Callable[[], BaseException] | None = None
    delay: float = 0.0
    keep: int = 0
    hidden_for: int = 1
    listing: Any = None
    """``fixed_listing``: what the chosen listings return (``Entry`` list for storages, what
    fsspec's ``ls`` returns for filesystems)."""
    rank: int | None = None
    """Only in the process of this rank (torch.distributed's, else ``$RANK``, else 0)."""
    seen: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {KINDS}")
        if self.every is not None:
            self.calls = None

    def matches(self, op: str, path: str) -> bool:
        if self.rank is not None and self.rank != _rank():
            return False
        return (self.op in ("*", op)) and fnmatch.fnmatchcase(path.lstrip("/"), self.path.lstrip("/"))

    def choose(self) -> bool:
        """Count one matching call; True if this one faults."""
        self.seen += 1
        if self.every is not None:
            return self.seen % self.every == 0
        return self.calls is None or self.seen in self.calls

    def make_error(self, op: str, path: str) -> BaseException:
        if self.error is None:
            return StorageError(f"injected fault: {op} {path}")
        if isinstance(self.error, BaseException):
            return self.error
        return self.error()

    def __repr__(self) -> str:
        sel = f"every={self.every}" if self.every else f"calls={self.calls}"
        return f"Fault({self.kind} {self.op} {self.path!r} {sel}, fired {self.fired})"


class FaultInjector:
    """The shared rule engine behind both wrappers."""

    def __init__(self, faults: Iterable[Fault], sleep: Callable[[float], None] = time.sleep) -> None:
        self.faults = list(faults)
        self.sleep = sleep
        self._lock = threading.Lock()
        self._hidden: dict[str, list[Any]] = {}  # path -> [reads still hidden, fault]
        self._snapshots: dict[tuple[int, str], Any] = {}
        self.calls: list[tuple[str, str]] = []

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def before(self, op: str, path: str) -> list[Fault]:
        """Apply ``error``/``slow`` faults for a call; return the other chosen faults."""
        chosen = []
        with self._lock:
            self.calls.append((op, path))
            for f in self.faults:
                if f.kind == "delay_visibility" or not f.matches(op, path):
                    continue
                if f.kind == "stale_listing":
                    chosen.append(f)  # decides per call in listing()
                    continue
                if f.choose():
                    chosen.append(f)
        for f in chosen:
            if f.kind == "slow":
                with self._lock:
                    f.fired += 1
                self.sleep(f.delay)
            elif f.kind == "error":
                with self._lock:
                    f.fired += 1
                raise f.make_error(op, path)
        return [f for f in chosen if f.kind in ("truncate", "stale_listing", "fixed_listing")]

    def truncate(self, chosen: list[Fault], data: bytes) -> bytes:
        for f in chosen:
            if f.kind == "truncate":
                with self._lock:
                    f.fired += 1
                return data[: f.keep]
        return data

    def wrote(self, op: str, path: str) -> None:
        with self._lock:
            for f in self.faults:
                if f.kind == "delay_visibility" and f.matches(op, path) and f.choose():
                    self._hidden[path.lstrip("/")] = [f.hidden_for, f]  # fires when a read misses

    def hidden(self, path: str) -> bool:
        """True if a read of ``path`` must miss now (consumes one hidden read)."""
        key = path.lstrip("/")
        with self._lock:
            entry = self._hidden.get(key)
            if entry is None or entry[0] <= 0:
                return False
            entry[0] -= 1
            entry[1].fired += 1
            return True

    def is_hidden(self, path: str) -> bool:
        with self._lock:
            entry = self._hidden.get(path.lstrip("/"))
            return entry is not None and entry[0] > 0

    def listing(self, chosen: list[Fault], path: str, real: Callable[[], Any]) -> Any:
        for f in chosen:
            if f.kind == "fixed_listing":
                with self._lock:
                    f.fired += 1
                return list(f.listing or [])
            if f.kind != "stale_listing":
                continue
            key = (id(f), path.rstrip("/"))
            with self._lock:
                snap = self._snapshots.get(key)
                f.seen += 1
            if snap is None:
                out = real()
                with self._lock:
                    self._snapshots[key] = out
                return out
            with self._lock:
                f.fired += 1
            return snap
        return real()

    def verify(self) -> None:
        unfired = [f for f in self.faults if f.fired == 0]
        if unfired:
            raise AssertionError(f"configured faults that never fired: {unfired}")


class _VerifyOnExit:
    """What both wrappers share: ``with wrapper:`` checks on a clean exit that every configured
    fault fired; :meth:`_read` applies a read's faults."""

    injector: FaultInjector

    def _read(self, op: str, path: str) -> None:
        self.injector.before(op, path)
        if self.injector.hidden(path):
            raise FileNotFoundError(path)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            self.injector.verify()

    def verify(self) -> None:
        self.injector.verify()


class FaultyFileSystem(_VerifyOnExit, AbstractFileSystem):
    """An fsspec filesystem that forwards to ``fs`` and injects :class:`Fault` s on the way.

    Use with ``FsspecStorage(url, fs=FaultyFileSystem(inner, faults))``. Operation names are
    fsspec's: ``pipe_file``, ``cat_file``, ``info``, ``ls``, ``exists``, ``rm_file``, ``rm``,
    ``find``, ``open``.
    """

    protocol = "faulty"
    cachable = False

    def __init__(self, fs: AbstractFileSystem, faults: Iterable[Fault] = (), **kw: Any) -> None:
        super().__init__()
        self.fs = fs
        self.protocol = fs.protocol  # capability checks see the wrapped filesystem's protocol
        self.injector = FaultInjector(faults, **kw)

    def pipe_file(self, path, value, **kw):
        chosen = self.injector.before("pipe_file", path)
        self.fs.pipe_file(path, self.injector.truncate(chosen, bytes(value)), **kw)
        self.injector.wrote("pipe_file", path)

    def cat_file(self, path, start=None, end=None, **kw):
        self._read("cat_file", path)
        return self.fs.cat_file(path, start=start, end=end, **kw)

    def info(self, path, **kw):
        self._read("info", path)
        return self.fs.info(path, **kw)

    def exists(self, path, **kw):
        self.injector.before("exists", path)
        if self.injector.hidden(path):
            return False
        return self.fs.exists(path, **kw)

    def ls(self, path, detail=True, **kw):
        chosen = self.injector.before("ls", path)
        out = self.injector.listing(chosen, path, lambda: self.fs.ls(path, detail=detail, **kw))
        return [
            e for e in out
            if not self.injector.is_hidden(e["name"] if isinstance(e, dict) else e)
        ]

    def find(self, path, **kw):
        self.injector.before("find", path)
        return self.fs.find(path, **kw)

    def rm_file(self, path, **kw):
        self.injector.before("rm_file", path)
        return self.fs.rm_file(path, **kw)

    def rm(self, path, recursive=False, **kw):
        self.injector.before("rm", path)
        return self.fs.rm(path, recursive=recursive, **kw)

    def makedirs(self, path, exist_ok=False):
        return self.fs.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path, create_parents=True, **kw):
        return self.fs.mkdir(path, create_parents=create_parents, **kw)

    def _open(self, path, mode="rb", **kw):
        if "r" in mode:
            self._read("open", path)
        else:
            self.injector.before("open", path)
        return self.fs._open(path, mode=mode, **kw)


class _FaultyWrite(WriteStream):
    def __init__(self, owner: FaultyStorage, path: str, inner: WriteStream) -> None:
        self.owner, self.path, self.inner = owner, path, inner
        self.written = 0

    def write(self, data) -> None:
        chosen = self.owner.injector.before("write", self.path)
        data = memoryview(data).cast("B")
        for f in chosen:
            if f.kind == "truncate":
                keep = max(0, f.keep - self.written)
                with self.owner.injector._lock:
                    f.fired += 1
                data = data[:keep]
        self.written += len(data)
        self.inner.write(data)
        self.owner._spend(len(data))

    def close(self) -> None:
        self.owner.injector.before("close", self.path)
        self.inner.close()
        self.owner.injector.wrote("close", self.path)

    def abort(self) -> None:
        self.inner.abort()


class FaultyStorage(_VerifyOnExit, Storage):
    """A :class:`Storage` that forwards to ``inner`` and injects :class:`Fault` s.

    Operation names are the Storage methods' (``open_write``, which ``open_write_in`` counts
    as too, ``write``, ``close``, ``put_atomic``, ``put_if_absent``, ``rename``, ``open_read``,
    ``read``, ``size``, ``listdir``, ``exists``, ``delete``, ``delete_tree``); paths are
    relative to the root.
    Works for every backend, including POSIX, whose own calls do not go through fsspec.
    """

    def __init__(self, inner: Storage, faults: Iterable[Fault] = (), *, bandwidth: Bandwidth | None = None,
                 **kw: Any) -> None:
        """``bandwidth``: pace every byte written or read through this storage (see
        :class:`Bandwidth`); None: no limit."""
        self.inner = inner
        self.url = inner.url
        self.supports_atomic_rename = inner.supports_atomic_rename
        self.supports_conditional_put = inner.supports_conditional_put
        self.injector = FaultInjector(faults, **kw)
        self.bandwidth = bandwidth

    def _spend(self, nbytes: int) -> None:
        if self.bandwidth is not None:
            self.bandwidth.spend(nbytes)

    def __getattr__(self, name: str) -> Any:  # backend-specific attributes (stats, fs, ...)
        return getattr(self.inner, name)

    # Storage's optional extras have defaults, so they must be forwarded by name. Not
    # ``file_sizes``: its default (None) makes a step's check ask ``size`` file by file, where
    # the faults on ``size`` apply.
    def tree_modified(self, path: str) -> float | None:
        return self.inner.tree_modified(path)

    def list_uploads(self, path: str = "") -> list[tuple[str, str, float]]:
        return self.inner.list_uploads(path)

    def abort_upload(self, path: str, upload_id: str) -> None:
        self.inner.abort_upload(path, upload_id)

    def deadline(self, seconds: float) -> contextlib.AbstractContextManager[Any]:
        return self.inner.deadline(seconds)

    def recycle(self, folder: str, keep: Collection[str] = ()) -> None:
        self.inner.recycle(folder, keep)

    def release_spares(self) -> None:
        self.inner.release_spares()

    def dead_arenas(self, *, remove: bool = False, only: Collection[str] | None = None) -> list[tuple[str, int]]:
        return self.inner.dead_arenas(remove=remove, only=only)

    def open_write(self, path: str) -> WriteStream:
        self.injector.before("open_write", path)
        return _FaultyWrite(self, path, self.inner.open_write(path))

    def open_write_in(self, path: str) -> WriteStream:
        self.injector.before("open_write", path)
        return _FaultyWrite(self, path, self.inner.open_write_in(path))

    def put_atomic(self, path: str, data: bytes) -> None:
        chosen = self.injector.before("put_atomic", path)
        self.inner.put_atomic(path, self.injector.truncate(chosen, bytes(data)))
        self._spend(len(data))
        self.injector.wrote("put_atomic", path)

    def put_if_absent(self, path: str, data: bytes) -> None:
        chosen = self.injector.before("put_if_absent", path)
        self.inner.put_if_absent(path, self.injector.truncate(chosen, bytes(data)))
        self._spend(len(data))
        self.injector.wrote("put_if_absent", path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)

    def rename(self, src: str, dst: str) -> None:
        self.injector.before("rename", src)
        self.inner.rename(src, dst)

    def sync_dir(self, path: str) -> None:
        self.injector.before("sync_dir", path)
        self.inner.sync_dir(path)

    def open_read(self, path: str) -> ReadHandle:
        self._read("open_read", path)
        inner = self.inner.open_read(path)
        return inner if self.bandwidth is None else _PacedRead(inner, self.bandwidth)

    def read(self, path: str) -> bytes:
        self._read("read", path)
        data = self.inner.read(path)
        self._spend(len(data))
        return data

    def size(self, path: str) -> int | None:
        self.injector.before("size", path)
        if self.injector.hidden(path):
            return None
        return self.inner.size(path)

    def listdir(self, path: str = "") -> list[Entry]:
        chosen = self.injector.before("listdir", path)
        out = self.injector.listing(chosen, path, lambda: self.inner.listdir(path))
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        return [e for e in out if not self.injector.is_hidden(prefix + e.name)]

    def exists(self, path: str = "") -> bool:
        self.injector.before("exists", path)
        if self.injector.hidden(path):
            return False
        return self.inner.exists(path)

    def delete(self, path: str) -> None:
        self.injector.before("delete", path)
        self.inner.delete(path)

    def delete_tree(self, path: str) -> None:
        self.injector.before("delete_tree", path)
        self.inner.delete_tree(path)

    def close(self) -> None:
        self.inner.close()


class Bandwidth:
    """A bandwidth limit of ``rate`` bytes/s shared by every stream that spends on it (one per
    process stands for that process's link to a shared file system).

    :meth:`spend` is called on the thread that just moved ``n`` bytes; it books them on a
    virtual clock right after the bytes booked before (never earlier than now: idle time earns
    no burst) and sleeps until their slot has passed. So concurrent streams share the rate, and
    a stream's average rate is ``rate`` whatever its call sizes. Thread-safe.
    """

    def __init__(self, rate: float, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate!r}")
        self.rate = float(rate)
        self.sleep, self.clock = sleep, clock
        self.nbytes = 0
        """Bytes spent so far."""
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the bytes booked so far have gone through

    def spend(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            now = self.clock()
            self._free_at = max(self._free_at, now) + nbytes / self.rate
            self.nbytes += nbytes
            wait = self._free_at - now
        if wait > 0:
            self.sleep(wait)


class _PacedRead(ReadHandle):
    """A read handle whose bytes go through a :class:`Bandwidth`."""

    def __init__(self, inner: ReadHandle, bandwidth: Bandwidth) -> None:
        self.inner, self.bandwidth = inner, bandwidth
        self.size = inner.size

    def read_into(self, start: int, out: memoryview) -> None:
        self.inner.read_into(start, out)
        self.bandwidth.spend(out.nbytes)

    def close(self) -> None:
        self.inner.close()


def _url_key(url: str | os.PathLike[str]) -> str:
    url = os.fspath(url)
    for scheme in ("file://", "local://"):
        if url.startswith(scheme):
            url = url[len(scheme):] or "/"
    return os.path.abspath(url) if "://" not in url else url.rstrip("/")


@contextlib.contextmanager
def throttle_url(url: str | os.PathLike[str], rate: float) -> Iterator[Bandwidth]:
    """Within the block, the storage ckptlib opens at exactly ``url`` (a CheckpointManager's
    persistent tier, ``ckptlib.save``/``load``, the CLI) comes wrapped in a
    :class:`FaultyStorage` whose reads and writes share one :class:`Bandwidth` of ``rate``
    bytes/s (yielded; its ``nbytes`` counts what went through). Other URLs (a manager's
    ``local=`` folders) are untouched. Training thread, before the storage is opened.

    Works by replacing ``open_storage`` in ``ckptlib.backends`` and in every ckptlib module that
    took the name (a module first imported inside the block takes the replacement); on exit every
    one of them gets the original back.
    Test and benchmark use only: the library's API has no such option.
    """
    import ckptlib.backends as backends

    original = backends.open_storage
    key = _url_key(url)
    bandwidth = Bandwidth(rate)

    def opened(u: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
        storage = original(u, storage_options)
        return FaultyStorage(storage, bandwidth=bandwidth) if _url_key(u) == key else storage

    def swap(old: Any, new: Any) -> None:
        for name, mod in list(sys.modules.items()):
            if (name == "ckptlib" or name.startswith("ckptlib.")) and getattr(mod, "open_storage", None) is old:
                setattr(mod, "open_storage", new)  # noqa: B010 - a module attribute

    swap(original, opened)
    try:
        yield bandwidth
    finally:
        swap(opened, original)  # also in modules first imported inside the block
