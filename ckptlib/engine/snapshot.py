"""Snapshots: a training-safe copy of every tensor, taken on the caller's thread.

Called by the manager's ``save()`` for async saves, before it hands the save to its
background thread. After :meth:`Stager.snapshot` returns, the training loop may mutate its
state freely: the background thread reads only the staged copies.

Staging buffers are allocated once and reused by later saves of tensors with the same name,
shape and dtype (fresh allocations cost several times a copy into warm memory). Reuse is safe
because the manager never snapshots while a previous save still reads its buffers.
"""

from __future__ import annotations

import torch

from ckptlib.plan.flatten import FlatState, TensorItem


class Stager:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def snapshot(self, flat: FlatState) -> FlatState:
        items = []
        keep: dict[str, torch.Tensor] = {}
        for it in flat.items:
            src = it.tensor
            buf = self._buffers.get(it.name)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            buf.copy_(src)
            keep[it.name] = buf
            items.append(TensorItem(it.name, buf, it.global_shape, it.global_offset, it.replicated))
        self._buffers = keep
        return FlatState(flat.tree, items)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        self._buffers = {}
