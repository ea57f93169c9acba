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


@needs_thp
def test_advice_covers_the_aligned_interior_only() -> None:
    t = torch.empty(9 * hugepages.HUGE + 12345, dtype=torch.uint8)
    assert hugepages.advise(t)
    start = t.data_ptr()
    lo = (start + hugepages.HUGE - 1) & ~(hugepages.HUGE - 1)
    hi = (start + t.nbytes) & ~(hugepages.HUGE - 1)
    inside = _mapping(lo)
    assert inside["THPeligible"] == "1"
    # madvise splits the mapping at the advised range: it starts at lo and ends at hi
    assert (int(inside["lo"]), int(inside["hi"])) == (lo, hi)
    if lo > start:  # the unaligned head stays in a mapping that was not advised
        assert int(_mapping(lo - 1)["hi"]) == lo
    t.fill_(7)  # still ordinary, writable memory
    assert int(t.sum()) == 7 * t.numel()


def test_small_and_non_cpu_tensors_are_left_alone() -> None:
    assert not hugepages.advise(torch.empty(hugepages.MIN_BYTES - 1, dtype=torch.uint8))
    assert not hugepages.advise(torch.empty(1 << 24, dtype=torch.uint8, device="meta"))


@needs_thp
def test_fresh_load_tensors_are_huge_page_eligible(tmp_path: Path) -> None:
    # In a fresh process: memory advised by other tests could otherwise be reused here.
    code = f"""
import sys, torch, ckptlib
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_hugepages import _mapping
from ckptlib.engine.hugepages import HUGE
g = torch.Generator().manual_seed(0)
state = {{"big": torch.randn(3 << 20, generator=g), "small": torch.randn(100, generator=g)}}
ckptlib.save(state, {str(tmp_path / "c")!r})
out = ckptlib.load({str(tmp_path / "c")!r})
assert torch.equal(out["big"], state["big"]) and torch.equal(out["small"], state["small"])
p = out["big"].data_ptr()
print(_mapping((p + HUGE - 1) & ~(HUGE - 1))["THPeligible"])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1"]
