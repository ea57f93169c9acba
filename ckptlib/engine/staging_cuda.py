"""The CUDA part of a snapshot: pinned host memory, a side-stream copy, event completion.

Called by :func:`ckptlib.engine.snapshot.copy_round` on whichever thread stages a round (the
training thread, or the snapshot thread in overlap mode). Only this module touches
``torch.cuda``; everything else in the snapshot is device-agnostic.

Protocol of :func:`copy_async`, per device:
0. :func:`mark_ready` runs on the training thread inside ``save()``: it records an event on
   the training thread's current stream of each device (the snapshot may then be copied
   from another thread, whose current stream is not the training thread's);
1. the side stream waits for that event (or, without one, for the calling thread's current
   stream), so kernels already queued that produce the tensors finish before they are read;
2. ``_foreach_copy_(dsts, srcs, non_blocking=True)`` on the side stream (device to pinned host);
3. every source is marked as used by the side stream (``record_stream``), so the caching
   allocator cannot hand its memory to new tensors before the copy ran, even if the training
   loop drops them meanwhile;
4. an event is recorded on the side stream; :meth:`PendingCopy.wait` polls it until it
   completes or the deadline passes (``Event.synchronize`` cannot time out).

Not exercised on a GPU in this project's CI (no GPU machine was available when it was
written); ``tests/test_async.py`` runs this logic against a fake ``torch.cuda`` namespace.
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
