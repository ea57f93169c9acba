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

Before, every async save started a thread: about 0.1 ms of CPU per save per rank, and the
training thread's ``save()`` waited until the new thread had been scheduled (on a busy node,
most of ``save()``'s time: ``docs/scale.md``, "One persist thread per manager").

A thread that has been idle for :attr:`IDLE_S` ends by itself (a manager never closed leaves no
thread behind for long) and the next submit starts a new one; so does a submit in a forked child,
where the parent's thread does not exist.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from ckptlib.errors import CommitTimeoutError

log = logging.getLogger("ckptlib")

IDLE_NAME = "ckptlib-persist"

_Jobs = queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], str] | None]


class PersistWorker:
    """One persist thread, reused by every save of one manager (module docstring)."""

    IDLE_S = 60.0
    """Seconds without a job after which the thread ends (the next submit starts another)."""

    def __init__(self, nice: int | None = None) -> None:
        self._nice = nice
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: _Jobs = queue.SimpleQueue()  # the current thread's own queue
        self._runner: threading.Thread | None = None  # the thread given the last job
        self._done = threading.Event()
        self._done.set()

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> None:
        """Training thread: run ``fn(*args)`` on the persist thread (``name`` while it runs).
        The caller makes sure the previous job is over (:meth:`busy` is False)."""
        self._done.clear()
        with self._lock:
            t = self._thread
            if t is None or not t.is_alive():  # first save, idle spell over, or a forked child
                self._jobs = queue.SimpleQueue()
                t = threading.Thread(target=self._run, args=(self._jobs,), name=IDLE_NAME, daemon=True)
                self._thread = t
                t.start()
            self._runner = t
            self._jobs.put((fn, args, name))

    def busy(self) -> bool:
        """Is a submitted job not yet finished? (False in a forked child: its thread is gone.)"""
        t = self._runner
        return not self._done.is_set() and t is not None and t.is_alive()

    def join(self, limit: float) -> None:
        """Training thread: wait until the submitted job is over, at most ``limit`` seconds."""
        if self.busy() and not self._done.wait(limit):
            raise CommitTimeoutError(f"background save still running after {limit:.0f}s")

    def stop(self, wait: float) -> None:
        """``close``: let the thread end after the job it runs, if any, waiting for it at most
        ``wait`` seconds. A later submit starts a new thread."""
        with self._lock:
            t, self._thread = self._thread, None
            if t is not None:
                self._jobs.put(None)
        if t is not None and wait > 0 and t is not threading.current_thread():
            t.join(wait)

    def _run(self, jobs: _Jobs) -> None:
        lower_priority(self._nice)
        me = threading.current_thread()
        while True:
            try:
                job = jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:  # a submit puts under this lock: no job is left behind
                    if jobs.empty():
                        if self._thread is me:
                            self._thread = None
                        return
                continue
            if job is None:
                return
            self._one(me, *job)
            job = None  # hold no state of a finished save while idle

    def _one(self, me: threading.Thread, fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> None:
        me.name = name
        try:
            fn(*args)
        except BaseException:  # the job hands its errors to its handle; never lose the thread
            log.exception("ckptlib: the persist thread's job failed")
        finally:
            me.name = IDLE_NAME
            self._done.set()


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
