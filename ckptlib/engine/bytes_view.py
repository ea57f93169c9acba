"""Boxes of saved tensors held by CPU tensors, and their zero-copy byte views (writer, reader)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class Box:
    """The box ``shape`` at ``offset`` (global coordinates) of saved tensor ``name``, held by the
    CPU tensor ``tensor``: the reader's destination (:class:`~ckptlib.engine.reader.Request`) or
    the writer's source (:class:`~ckptlib.engine.writer.ChunkJob`)."""

    name: str
    tensor: torch.Tensor
    offset: tuple[int, ...]
    shape: tuple[int, ...]


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    flat = t.reshape(-1)
    if t.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()
