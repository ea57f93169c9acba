"""Public wrappers a user puts into ``state``: :class:`Shard` and :class:`PerRank`. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shard:
    """A piece of a larger tensor, for frameworks that shard by hand (e.g. Megatron).

    ``local`` holds the elements ``global[offset[0]:offset[0]+local.shape[0], ...]``.
    """

    local: torch.Tensor
    global_shape: Sequence[int]
    global_offset: Sequence[int]

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise TypeError("Shard.local must be a torch.Tensor")
        gs, go = tuple(self.global_shape), tuple(self.global_offset)
        if len(gs) != self.local.dim() or len(go) != self.local.dim():
            raise ValueError("Shard: global_shape and global_offset need one entry per dimension")
        for d, (size, off, n) in enumerate(zip(gs, go, self.local.shape, strict=True)):
            if off < 0 or off + n > size:
                raise ValueError(f"Shard: dimension {d} piece [{off}, {off + n}) lies outside [0, {size})")
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "global_offset", go)


@dataclass(frozen=True)
class PerRank:
    """A value that differs per rank (RNG state, data-loader position): saved for each rank
    and restored to the same rank."""

    value: Any
