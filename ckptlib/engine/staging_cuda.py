"""The CUDA part of a snapshot: pinned host memory, a side-stream copy, event completion.

Called by :func:`ckptlib.engine.snapshot.copy_round` on whichever thread stages a round; only
this module touches ``torch.cuda``. :func:`mark_ready` (training thread, in ``save()``) records
an event on each device's current stream; :func:`copy_async` makes the side stream wait for it,
copies with ``_foreach_copy_(non_blocking=True)`` to pinned host memory, ``record_stream``s the
sources (the allocator cannot reuse them before the copy ran) and records an event that
:meth:`PendingCopy.wait` polls until the deadline (``Event.synchronize`` cannot time out).
Tested against a fake ``torch.cuda`` namespace in ``tests/test_async.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ckptlib.errors import CommitTimeoutError

_streams: dict[Any, Any] = {}
_lock = threading.Lock()
POLL_SECONDS = 0.0005

cuda: Any = torch.cuda
"""The CUDA namespace used here; tests replace it with a fake."""


def alloc_pinned(nbytes: int) -> torch.Tensor:
    """A page-locked uint8 host buffer (so device-to-host copies run asynchronously)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def side_stream(device: torch.device) -> Any:
    """One reused side stream per device, created on first use."""
    with _lock:
        s = _streams.get(device)
        if s is None:
            s = _streams[device] = cuda.Stream(device=device)
        return s


class PendingCopy:
    """A queued device-to-host copy; :meth:`wait` returns once its bytes are in host memory."""

    def __init__(self, event: Any, device: torch.device) -> None:
        self.event = event
        self.device = device

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self, deadline: float, sleep=time.sleep) -> None:
        """Poll the event until done; raise :class:`CommitTimeoutError` at ``deadline``."""
        while not self.event.query():
            if time.monotonic() >= deadline:
                raise CommitTimeoutError(f"device-to-host snapshot copy on {self.device} timed out")
            sleep(POLL_SECONDS)


def mark_ready(devices: list[torch.device]) -> dict[torch.device, Any]:
    """Training thread: an event on the current stream of each device, marking the point
    after which the snapshot reads the tensors."""
    out = {}
    for dev in devices:
        ev = cuda.Event()
        ev.record(cuda.current_stream(dev))
        out[dev] = ev
    return out


def copy_async(
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    device: torch.device,
    ready: Any = None,
) -> PendingCopy:
    """Queue the copy of ``srcs`` (all on ``device``) into pinned ``dsts`` on a side stream,
    after ``ready`` (an event from :func:`mark_ready`) or the caller's current stream."""
    stream = side_stream(device)
    if ready is not None:
        stream.wait_event(ready)
    else:
        stream.wait_stream(cuda.current_stream(device))
    with cuda.stream(stream), torch.no_grad():
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
        for s in srcs:
            s.record_stream(stream)
        event = cuda.Event()
        event.record(stream)
    return PendingCopy(event, device)
