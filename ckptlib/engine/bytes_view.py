"""Zero-copy byte views of CPU tensors. Called by the writer and the reader."""

from __future__ import annotations

import numpy as np
import torch


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    flat = t.reshape(-1)
    if t.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()
