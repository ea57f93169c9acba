"""Run I/O tasks on a small thread pool with one deadline (writer and reader).

The first failure is raised; a task stuck in the kernel at the deadline (a hung network file
system) is left behind and the caller gets :class:`StorageTimeoutError` instead of hanging.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any

from ckptlib.errors import StorageTimeoutError

DEFAULT_TIMEOUT = 3600.0


def run_all(
    tasks: Sequence[Callable[[], Any]], *, threads: int, name: str, timeout: float | None = None
) -> list[Any]:
    limit = DEFAULT_TIMEOUT if timeout is None else timeout
    if threads <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    pool = cf.ThreadPoolExecutor(min(threads, len(tasks)), thread_name_prefix=name)
    futs = [pool.submit(t) for t in tasks]
    try:
        done, pending = cf.wait(futs, timeout=limit, return_when=cf.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        if pending:
            done, pending = cf.wait(pending, timeout=max(0.0, limit))
            if pending:
                raise StorageTimeoutError(f"{name}: {len(pending)} I/O task(s) still running after {limit:.0f}s")
            for f in done:
                if f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
        return [f.result(timeout=0) for f in futs]
    finally:
        for f in futs:
            f.cancel()
        pool.shutdown(wait=False)
