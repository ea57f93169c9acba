"""Ask Linux to back large fresh CPU buffers with transparent huge pages.

A freshly allocated buffer costs one page fault per 4 KiB page the first time it is written:
about 0.5 s per GiB on a VM when ``read`` fills it (measured on the project machine, where the
same reads into already-touched memory take 0.2 s per GiB). With 2 MiB pages the faults drop
512-fold and filling a fresh buffer costs 0.15-0.35 s per GiB. Distributions commonly ship
``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``madvise``, so the kernel uses huge
pages only where a program asks with ``madvise(MADV_HUGEPAGE)``; this module asks.

Called on the caller's thread, right after allocation and before the first write, by
:func:`ckptlib.engine.load._alloc` (the tensors a fresh ``load`` returns) and
:func:`ckptlib.engine.snapshot._alloc` (the async staging arena). The advice covers the
2 MiB-aligned part of the buffer only, so it never touches memory outside the tensor. It
is advice: a kernel without THP, a setting of ``never``, another OS or a failing call all
leave the buffer as it was, and nothing is raised.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

HUGE = 2 << 20
MIN_BYTES = 2 * HUGE  # smaller buffers keep 4 KiB pages (no aligned 2 MiB page inside, or one)
_MADV_HUGEPAGE = 14

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _madvise = None


def advise(t: torch.Tensor) -> bool:
    """Advise huge pages for the aligned interior of ``t``'s memory (a fresh CPU tensor that
    has not been written yet). Returns whether the kernel accepted the advice."""
    if _madvise is None or t.device.type != "cpu":
        return False
    nbytes = t.untyped_storage().nbytes()
    if nbytes < MIN_BYTES:
        return False
    start = t.untyped_storage().data_ptr()
    lo = (start + HUGE - 1) & ~(HUGE - 1)
    hi = (start + nbytes) & ~(HUGE - 1)
    if hi <= lo:
        return False
    return _madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0
