"""The command line's deadline on storage: a stalled remote fails a command within ``--timeout``.

Who calls what, on which thread:
- :func:`ckptlib.cli.main.main` (the caller's thread) makes a :class:`Watch` and calls
  :func:`run`, which runs the command on a daemon worker thread and polls the watch;
- :func:`ckptlib.cli.target.open_target` (the worker) wraps the storage it opens with
  :func:`watched`: every storage call, and every call on a handle it returned, is in flight in
  the watch until it returns;
- when one call has been in flight for ``timeout`` seconds, :func:`run` raises
  :class:`StalledError` on the caller's thread (the worker is left blocked; it is a daemon);
  on a terminal it also shows a status line on stderr while a call takes more than a second;
- on Ctrl-C (``KeyboardInterrupt`` on the caller's thread), :func:`run` raises it in the worker
  too and waits up to :data:`INTERRUPT_GRACE` seconds for the worker to unwind (an export
  deletes its staging folder, docs/cli.md "Exit status") before re-raising it to ``main``.
The worker's own exception, if any, is raised once, on the caller's thread.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ckptlib.backends import Storage

from .output import CliError

T = TypeVar("T")

DEFAULT_TIMEOUT = 60.0
"""Seconds one storage call may take before the command gives up (``--timeout``)."""
ENV = "CKPTLIB_CLI_TIMEOUT"
STATUS_AFTER = 1.0
"""A call in flight this long shows the status line (terminals only)."""
POLL = 0.1
INTERRUPT_GRACE = 10.0
"""Seconds Ctrl-C waits for the worker to undo what it started (a second Ctrl-C stops waiting)."""


class StalledError(CliError):
    """A storage call got no answer within the deadline (exit status 2)."""


def resolve_timeout(value: float | None) -> float:
    """``--timeout``, else ``$CKPTLIB_CLI_TIMEOUT``, else 60 s; 0 means no deadline."""
    if value is not None:
        return value
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        raise CliError(f"{ENV}={raw!r} is not a number of seconds") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise CliError(f"{ENV}={raw!r} must be a finite number of seconds >= 0 (0: no deadline)")
    return seconds


class Watch:
    """Storage calls in flight, for one command (any thread; a lock guards the table)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[float, str]] = {}
        self._ids = itertools.count()

    def begin(self, label: str) -> int:
        key = next(self._ids)
        with self._lock:
            self._calls[key] = (time.monotonic(), label)
        return key

    def end(self, key: int) -> None:
        with self._lock:
            self._calls.pop(key, None)

    def oldest(self) -> tuple[float, str] | None:
        """(seconds in flight, label) of the longest-running call, or None."""
        with self._lock:
            if not self._calls:
                return None
            start, label = min(self._calls.values())
        return time.monotonic() - start, label


_current: Watch | None = None

UNBOUNDED = frozenset({"delete_tree", "tree_modified", "deadline", "close"})
"""Calls whose duration grows with the size of a tree (one call, many requests or a walk of a
whole folder on a parallel file system): not timed, each request in them keeps the backend's
own bounds (docs/storage.md, "Retries and deadlines")."""


class _Watched:
    """Forwards to ``inner``; calls are recorded in ``watch`` while in flight, and what they
    return that has methods of its own (read/write handles) is watched the same way."""

    def __init__(self, inner: Any, watch: Watch, where: str) -> None:
        self._inner, self._watch, self._where = inner, watch, where

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr) or name in UNBOUNDED:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            what = f"{name} {args[0]}" if args and isinstance(args[0], str) and args[0] else name
            key = self._watch.begin(f"{self._where}: {what}")
            try:
                result = attr(*args, **kwargs)
            finally:
                self._watch.end(key)
            if name.startswith("open_"):
                return _Watched(result, self._watch, f"{self._where}/{args[0]}" if args else self._where)
            return result

        return call

    def __enter__(self) -> _Watched:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def watched(storage: Storage, where: str) -> Storage:
    """``storage`` with its calls watched by the running command's deadline (unchanged when no
    command is running, e.g. a library caller of the CLI's helpers)."""
    if _current is None or _current.timeout <= 0:
        return storage
    return cast(Storage, _Watched(storage, _current, where))


def run(fn: Callable[[], T], watch: Watch, *, status: bool) -> T:
    """Run ``fn`` on a worker thread under ``watch``; see the module docstring."""
    global _current
    box: dict[str, Any] = {}

    finished = threading.Event()

    def work() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # raised again on the caller's thread, once
            box["error"] = e
        finally:
            finished.set()

    _current = watch
    worker = threading.Thread(target=work, name="ckptlib-cli", daemon=True)
    shown = False
    try:
        worker.start()
        while worker.is_alive():
            worker.join(POLL)
            late = watch.oldest()
            if late is not None and watch.timeout > 0 and late[0] >= watch.timeout:
                raise StalledError(
                    f"{late[1]}: no answer from storage within {watch.timeout:g} s (stalled or "
                    f"unreachable?); gave up. Wait longer with --timeout SECONDS or {ENV} "
                    "(0: no deadline)"
                )
            if status:
                if late is not None and late[0] >= STATUS_AFTER:
                    limit = f", giving up at {watch.timeout:g} s" if watch.timeout > 0 else ""
                    sys.stderr.write(f"\r\x1b[Kckptlib: waiting {late[0]:.0f} s for {late[1]}{limit}")
                    sys.stderr.flush()
                    shown = True
                elif shown:
                    sys.stderr.write("\r\x1b[K")
                    shown = False
    except KeyboardInterrupt:
        _interrupt(worker, finished)
        raise
    finally:
        if shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
        _current = None
    if "error" in box:
        raise box["error"]
    return cast(T, box["result"])


def _interrupt(worker: threading.Thread, finished: threading.Event) -> None:
    """Raise ``KeyboardInterrupt`` in ``worker`` (at its next Python instruction: a storage call in
    progress finishes first) and wait up to :data:`INTERRUPT_GRACE` seconds for it to end, so its
    ``finally``/``except`` blocks run before the process exits (daemon threads are stopped dead
    at exit). Called by :func:`run` on the caller's thread. ``finished`` (set by the worker), not
    ``worker.is_alive()``: a ``join`` that Ctrl-C interrupted can leave the thread marked as
    stopped while it still runs (CPython 3.11, the bpo-45274 handling in Thread.join)."""
    if worker.ident is None or finished.is_set():
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(KeyboardInterrupt))
    finished.wait(INTERRUPT_GRACE)
