"""Huge-page advice for fresh load tensors and the staging arena (ckptlib/engine/hugepages.py).

The kernel's answer is read back from /proc/self/smaps: a range we advised must show up as a
mapping of its own with ``THPeligible: 1``, and nothing outside the tensor's memory may be
advised."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.engine import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages not set to never",
)


def _mapping(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``addr`` (plus its range)."""
    cur: dict[str, str] | None = None
    found: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = {"lo": str(lo), "hi": str(hi)}
            if found is None and lo <= addr < hi:
                found = cur
        elif cur is not None and ":" in head:
            cur[head.rstrip(":")] = " ".join(line.split()[1:])
    assert found is not None, f"no mapping holds {addr:#x}"
    return found


def _in_fresh_process(call: str) -> None:
    """Run ``call`` (an expression on this module) in a new interpreter. Mappings that other
    tests advised may be reused by the allocator in this process, which would hide a missing
    or misplaced advice; a fresh process has none."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_hugepages as m; {call}"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def _check_interior() -> None:
    t = torch.empty(9 * hugepages.HUGE + 12345, dtype=torch.uint8)
    assert hugepages.advise(t)
    start = t.data_ptr()
    lo = (start + hugepages.HUGE - 1) & ~(hugepages.HUGE - 1)
    hi = (start + t.nbytes) & ~(hugepages.HUGE - 1)
    inside = _mapping(lo)
    assert inside["THPeligible"] == "1", inside
    # madvise splits the mapping at the advised range: it starts at lo and ends at hi
    assert (int(inside["lo"]), int(inside["hi"])) == (lo, hi), (inside, lo, hi)
    if lo > start:  # the unaligned head stays in a mapping that was not advised
        assert int(_mapping(lo - 1)["hi"]) == lo
    t.fill_(7)  # still ordinary, writable memory
    assert int(t.sum()) == 7 * t.numel()


def _check_fresh_load(folder: str) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(3 << 20, generator=g), "small": torch.randn(100, generator=g)}
    ckptlib.save(state, folder)
    out = ckptlib.load(folder)
    assert torch.equal(out["big"], state["big"]) and torch.equal(out["small"], state["small"])
    p = out["big"].data_ptr()
    inside = _mapping((p + hugepages.HUGE - 1) & ~(hugepages.HUGE - 1))
    assert inside["THPeligible"] == "1", inside


@needs_thp
def test_advice_covers_the_aligned_interior_only() -> None:
    _in_fresh_process("m._check_interior()")


def test_small_and_non_cpu_tensors_are_left_alone() -> None:
    assert not hugepages.advise(torch.empty(hugepages.MIN_BYTES - 1, dtype=torch.uint8))
    assert not hugepages.advise(torch.empty(1 << 24, dtype=torch.uint8, device="meta"))


@needs_thp
def test_fresh_load_tensors_are_huge_page_eligible(tmp_path: Path) -> None:
    _in_fresh_process(f"m._check_fresh_load({str(tmp_path / 'c')!r})")
