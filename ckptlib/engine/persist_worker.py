"""The manager's persist thread: one long-lived thread per ``CheckpointManager`` that runs each
async save's write and commit, instead of a new thread per save.

Who calls what, in order, on which thread:

- The training thread (``CheckpointManager.save``) calls :meth:`PersistWorker.submit` with the
  save's job, only when :meth:`busy` is False (one save in flight at a time: the manager joins or
  skips first), then returns at once: no thread is created and none is waited for to start.
- The worker thread (named ``ckptlib-persist``; ``ckptlib-save-<step>`` while it runs a save)
  runs the job. The job (``CheckpointManager._persist``) catches its own errors and hands them
  to the save's handle; anything that still escapes is logged here, so the thread never dies
  of a job.
- The training thread waits with :meth:`join` (bounded; ``CommitTimeoutError`` past it) and
  ends the thread with :meth:`stop` from ``close``.

Before, every async save started a thread, and the training thread's ``save()`` waited until
the new thread had been scheduled: at 32 ranks on 2 cores ``save()`` took 0.95-1.67 ms then and
0.18-0.33 ms with this thread (``docs/scale.md``, "One persist thread per manager").

The thread ends with :meth:`PersistWorker.stop` (``close``) or, for a manager dropped without
``close``, when its worker is garbage-collected (a finalizer wakes the thread to end: the thread
holds no reference to the worker or the manager between saves). A forked child does not have the
parent's thread (a worker's first submit there would start one of its own; the manager refuses
to save in a child, ``CheckpointManager._check_process``). Only the training thread calls
``submit`` and ``stop``, so no lock is taken that a fork could leave held.

Interpreter exit (:func:`drain_at_exit`): a manager not closed registers its drain, which waits
for its in-flight save to commit. It runs from ``threading``'s exit hooks, when the main thread
has ended and before ``concurrent.futures`` refuses new work (the write's thread pools,
:mod:`ckptlib.engine.pool`) and before any ``atexit`` handler (``ckptlib.coord`` stops its pulses
and store workers from those): from an ``atexit`` handler the drain came too late, and a save
still writing when ``main`` returned or raised failed with "cannot schedule new futures after
interpreter shutdown" (no step, nothing reported).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook first, so that ours runs before it)
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ckptlib.errors import CommitTimeoutError

log = logging.getLogger("ckptlib")

IDLE_NAME = "ckptlib-persist"

_Jobs = queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], str] | None]


class PersistWorker:
    """One persist thread, reused by every save of one manager (module docstring)."""

    def __init__(self, nice: int | None = None) -> None:
        self._nice = nice
        self._thread: threading.Thread | None = None
        self._jobs: _Jobs = queue.SimpleQueue()  # the current thread's own queue
        self._done = threading.Event()
        self._done.set()

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> None:
        """Training thread: run ``fn(*args)`` on the persist thread (``name`` while it runs).
        The caller makes sure the previous job is over (:meth:`busy` is False)."""
        t = self._thread
        if t is None or not t.is_alive():  # the first save, after stop, or in a forked child
            jobs: _Jobs = queue.SimpleQueue()
            self._jobs = jobs
            self._done = done = threading.Event()
            t = threading.Thread(target=_serve, args=(jobs, done, self._nice), name=IDLE_NAME, daemon=True)
            weakref.finalize(self, jobs.put, None).atexit = False  # dropped without stop: end the thread
            self._thread = t
            t.start()
        self._done.clear()
        self._jobs.put((fn, args, name))

    def busy(self) -> bool:
        """Is a submitted job not yet finished? (False in a forked child: its thread is gone.)"""
        t = self._thread
        return not self._done.is_set() and t is not None and t.is_alive()

    def join(self, limit: float) -> None:
        """Training thread: wait until the submitted job is over, at most ``limit`` seconds."""
        if self.busy() and not self._done.wait(limit):
            raise CommitTimeoutError(f"background save still running after {limit:g}s of waiting; it goes on and "
                                     "may still commit while this process lives: wait() again to learn its outcome")

    def stop(self, wait: float) -> None:
        """``close``: let the thread end after the job it runs, if any, waiting for it at most
        ``wait`` seconds. A later submit starts a new thread."""
        t, self._thread = self._thread, None
        if t is None:
            return
        self._jobs.put(None)
        if wait > 0:
            t.join(wait)


def _serve(jobs: _Jobs, done: threading.Event, nice: int | None) -> None:
    """The persist thread's loop: run each job, mark it done, until ``None``."""
    lower_priority(nice)
    me = threading.current_thread()
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, args, name = job
        job = None
        me.name = name
        try:
            fn(*args)
        except BaseException:  # the job hands its errors to its handle; never lose the thread
            log.exception("ckptlib: the persist thread's job failed")
        finally:
            me.name = IDLE_NAME
            del fn, args  # hold no state of a finished save while idle
            done.set()


def lower_priority(nice: int | None) -> None:
    """Raise the calling thread's niceness by ``nice`` (Linux applies it per thread). Called once
    when a thread starts: by the persist thread here, by the drain thread (the manager's
    ``on_start``)."""
    if not nice or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


_AT_EXIT: dict[int, Callable[[], Any]] = {}


def drain_at_exit(fn: Callable[[], Any]) -> None:
    """Training thread (the manager's constructor): call ``fn`` (its drain, a
    ``weakref.finalize``) at interpreter exit, on the main thread, once that thread has ended and
    before the thread pools refuse work. Drains already run (managers garbage-collected without
    ``close``) are forgotten here, so a process making many managers keeps none of them."""
    for key, old in list(_AT_EXIT.items()):
        if getattr(old, "alive", True) is False:
            del _AT_EXIT[key]
    _AT_EXIT[id(fn)] = fn


def forget_at_exit(fn: Callable[[], Any]) -> None:
    """``close``: ``fn`` is not to run at exit (so closed managers do not accumulate here)."""
    _AT_EXIT.pop(id(fn), None)


def drain(handles: list[Any], pid: int) -> None:
    """The drain of a manager's in-flight saves (``handles``: its ``SaveHandle`` list): at
    interpreter exit (:func:`drain_at_exit`), or when a manager dropped without ``close`` is
    collected, on the thread that drops it: wait for each to commit or fail (bounded by its
    deadline). Not in a forked child (``pid``: the manager's process): the parent's saves never
    end there (no persist thread), and the child's exit waited ``save_timeout`` for them."""
    if os.getpid() != pid:
        return
    for h in list(handles):
        h._event.wait(h._timeout)


def _run_at_exit() -> None:
    """``threading``'s exit hook: the registered drains, newest first."""
    for fn in reversed(list(_AT_EXIT.values())):
        try:
            fn()
        except BaseException:  # one manager's drain never keeps another's from running
            log.exception("ckptlib: draining a save at interpreter exit failed")


_register = getattr(threading, "_register_atexit", None)  # as concurrent.futures does (Python 3.9+)
if _register is not None:
    _register(_run_at_exit)
else:  # pragma: no cover - a Python without it: atexit, as before (too late for the thread pools)
    atexit.register(_run_at_exit)
