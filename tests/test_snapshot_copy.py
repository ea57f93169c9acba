"""The host copy of a snapshot round: every byte lands in its destination, whatever the mix
of big (cut into lanes) and small (split in order) tensors."""

from __future__ import annotations

import pytest
import torch

from ckptlib.engine import snapshot


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_cpu_mixed_sizes(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(snapshot, "COPY_THREADS", threads)
    g = torch.Generator().manual_seed(0)
    srcs = [
        torch.randn(3_000_001, generator=g),  # big, odd length: uneven slices
        torch.randn(2000, 1000, generator=g).t(),  # big but not contiguous: copied whole
        *[torch.randint(0, 255, (int(n),), generator=g, dtype=torch.uint8)
          for n in torch.randint(1, 5000, (3000,), generator=g)],
        torch.randn(7, 5, generator=g, dtype=torch.float64),
        torch.tensor(3, dtype=torch.int64),  # 0-dim
    ]
    assert sum(s.nbytes for s in srcs) > snapshot.SPLIT_MIN_BYTES  # the split path runs
    dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    snapshot.copy_cpu(dsts, srcs)
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s)
