"""Run I/O tasks on a small thread pool with one deadline (writer, reader, status scan).

Called on the caller's thread by ``engine.reader.ChunkReader.read``,
``engine.writer.write_files`` and ``engine.scan.scan``; the tasks run on pool threads named
``name``, which are gone when the call returns (but a task stuck at the deadline).

The first failure is raised on the caller's thread, once, and only after every task that had
already started has finished (tasks not yet started are cancelled): the caller frees the
destination tensors and closes the file handles as soon as the call returns, so no task may
still be writing into them. A task stuck in the kernel at the deadline (a hung network file
system) is the one exception: it is left behind and the caller gets
:class:`StorageTimeoutError` instead of hanging; tasks keep references to their own buffers, so
a straggler never writes into freed memory.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ckptlib.errors import StorageTimeoutError

DEFAULT_TIMEOUT = 3600.0


def cpu_share(wanted: int) -> int:
    """``wanted`` threads, but when several ranks share this machine (``LOCAL_WORLD_SIZE`` > 1,
    set by torchrun) at most this process's share of the CPUs it may run on, and at least 1.
    Called by ``engine.writer.write_files`` to size its writer threads (one per payload file):
    four ranks with two writer threads each on two cores ran 8 write streams that contended for
    the CPUs and the disk, where one stream per rank keeps the disk as busy. Not used for reads:
    one reader thread per rank cannot overlap checksums with reads, and was not faster."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        local = 1
    if local <= 1:
        return max(1, wanted)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(wanted, cpus // local))


class _Pool:
    """The threads of one :func:`run_all` call. Daemons, unlike ``ThreadPoolExecutor``'s, which
    interpreter exit joins: a task stuck at the deadline (left behind) never holds up the exit
    of a process that gave up on it (``ckptlib ls --timeout`` on a stalled remote)."""

    def __init__(self, threads: int, name: str) -> None:
        self._failed = False
        self._work: queue.SimpleQueue[tuple[cf.Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, task: Callable[[], Any]) -> cf.Future[Any]:
        fut: cf.Future[Any] = cf.Future()
        self._work.put((fut, task))
        return fut

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            fut, task = item
            if self._failed:
                fut.cancel()  # after a failure no task starts (the caller cancels them too, later)
            if not fut.set_running_or_notify_cancel():  # cancelled, here or by the caller: waiters are told
                continue
            try:
                fut.set_result(task())
            except BaseException as e:  # the caller's thread raises it
                self._failed = True
                fut.set_exception(e)

    def shutdown(self, wait_until: float | None) -> None:
        """End the threads once the queue is drained; ``wait_until`` (a ``time.monotonic()``
        deadline): join them until then, or None: leave them (a task is stuck)."""
        for _ in self._threads:
            self._work.put(None)
        if wait_until is not None:
            for t in self._threads:
                t.join(max(1.0, wait_until - time.monotonic()))


def run_all(
    tasks: Sequence[Callable[[], Any]], *, threads: int, name: str, timeout: float | None = None
) -> list[Any]:
    limit = DEFAULT_TIMEOUT if timeout is None else timeout
    if threads <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    deadline = time.monotonic() + limit
    pool = _Pool(min(threads, len(tasks)), name)
    futs = [pool.submit(t) for t in tasks]
    try:
        done, pending = cf.wait(futs, timeout=limit, return_when=cf.FIRST_EXCEPTION)
        failed = [f for f in futs if f in done and not f.cancelled() and f.exception() is not None]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        if pending:
            raise StorageTimeoutError(f"{name}: {len(pending)} I/O task(s) still running after {limit:.0f}s")
        return [f.result(timeout=0) for f in futs]
    finally:
        for f in futs:
            f.cancel()
        # Let the tasks already running finish (bounded by what is left of the deadline); then
        # the idle threads end before the call returns, unless a task is stuck (left behind).
        _, stuck = cf.wait(futs, timeout=max(0.0, deadline - time.monotonic()))
        pool.shutdown(None if stuck else deadline)
