"""Run I/O tasks on a small thread pool with one deadline (writer and reader).

Called on the caller's thread by ``engine.reader.ChunkReader.read`` and
``engine.writer.write_files``; the tasks run on pool threads named ``name``.

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


def run_all(
    tasks: Sequence[Callable[[], Any]], *, threads: int, name: str, timeout: float | None = None
) -> list[Any]:
    limit = DEFAULT_TIMEOUT if timeout is None else timeout
    if threads <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    deadline = time.monotonic() + limit
    pool = cf.ThreadPoolExecutor(min(threads, len(tasks)), thread_name_prefix=name)
    futs = [pool.submit(t) for t in tasks]
    try:
        done, pending = cf.wait(futs, timeout=limit, return_when=cf.FIRST_EXCEPTION)
        failed = [f for f in futs if f in done and f.exception() is not None]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        if pending:
            raise StorageTimeoutError(f"{name}: {len(pending)} I/O task(s) still running after {limit:.0f}s")
        return [f.result(timeout=0) for f in futs]
    finally:
        for f in futs:
            f.cancel()
        # Let the tasks already running finish (bounded by what is left of the deadline).
        cf.wait(futs, timeout=max(0.0, deadline - time.monotonic()))
        pool.shutdown(wait=False)
