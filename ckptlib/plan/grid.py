"""Sharded tensors as regular grids, agreed without sending every piece to the coordinator. Pure.

Who calls what, during a distributed save (engine/save.py ``_plan``, the saving thread):
1. the coordinator calls :func:`propose` on its own sharded pieces and shares the proposal:
   for each tensor it holds as one non-empty piece at the origin, a grid whose block is that
   piece's shape (FSDP/DTensor-style sharding: rank ``k`` holds cell ``k``);
2. every rank calls :func:`conform` on its own pieces: the names of the tensors for which its
   pieces are *not* exactly cell ``rank`` of the proposed grid (or that were not proposed);
3. the coordinator unites those names (O(ranks) lists, usually empty); only the pieces of those
   tensors travel to it, and :func:`ckptlib.plan.assign.assign` deduplicates and balances them.
   :func:`describe` then gives the manifest's sharding of every tensor.

Each rank does O(its pieces) work; the coordinator O(ranks + tensors + pieces of the exceptions),
never O(pieces) for tensors that form grids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ckptlib.format.sharding import boxes_json, grid_json
from ckptlib.plan.assign import PieceDesc

Proposal = list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]
"""``(name, dtype, global shape, block)`` per tensor proposed as a grid."""


def propose(pieces: Sequence[PieceDesc]) -> Proposal:
    """Coordinator: a grid per tensor it holds as exactly one non-empty piece at the origin."""
    count: dict[str, int] = {}
    for p in pieces:
        count[p.name] = count.get(p.name, 0) + 1
    return [
        (p.name, p.dtype, p.global_shape, p.shape)
        for p in pieces
        if count[p.name] == 1 and all(p.shape) and not any(p.offset)
    ]


def cell(k: int, gshape: tuple[int, ...], block: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box of cell ``k`` (row-major) of the grid, or None when there is no such cell."""
    counts = [-(-g // b) for g, b in zip(gshape, block, strict=True)]
    idx = []
    for c in reversed(counts):
        k, i = divmod(k, c)
        idx.append(i)
    if k:
        return None
    idx.reverse()
    off = tuple(i * b for i, b in zip(idx, block, strict=True))
    return off, tuple(min(b, g - o) for o, b, g in zip(off, block, gshape, strict=True))


def conform(proposal: Proposal, mine: Sequence[PieceDesc], rank: int) -> list[str]:
    """This rank: names whose pieces here differ from cell ``rank`` of the proposed grid, and
    names of its pieces that were not proposed. Empty pieces (``torch.chunk`` gives trailing
    ranks of a small tensor zero rows) count as holding nothing; the caller does not write
    them. O(len(proposal) + len(mine))."""
    by_name: dict[str, list[PieceDesc]] = {}
    for p in mine:
        by_name.setdefault(p.name, []).append(p)
    odd = []
    for name, dtype, gshape, block in proposal:
        ps = [p for p in by_name.pop(name, []) if all(p.shape)]  # empty pieces hold nothing
        want = cell(rank, gshape, block)
        if want is None:
            ok = not ps
        else:
            ok = (len(ps) == 1 and (ps[0].offset, ps[0].shape) == want and ps[0].dtype == dtype
                  and ps[0].global_shape == gshape)  # fmt: skip
        if not ok:
            odd.append(name)
    odd += by_name
    return odd


def describe(
    proposal: Proposal,
    odd: set[str],
    replicated: Sequence[PieceDesc],
    replicated_writer: Sequence[int],
    explicit: Iterable[tuple[int, PieceDesc]],
) -> dict[str, dict[str, Any]]:
    """Coordinator: the manifest's ``tensors`` (dtype, shape and sharding) of every tensor.

    ``replicated_writer[i]``: the rank writing ``replicated[i]`` (a whole plain tensor);
    ``explicit``: ``(writer rank, piece)`` for every distinct piece of the ``odd`` tensors.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, dtype, gshape, block in proposal:
        if name not in odd:
            out[name] = {"dtype": dtype, "shape": list(gshape), **grid_json(block, 0, 1)}
    boxes: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
    meta: dict[str, PieceDesc] = {}
    for p, r in zip(replicated, replicated_writer, strict=True):
        boxes.setdefault(p.name, []).append((r, p.offset, p.shape))
        meta[p.name] = p
    for r, p in explicit:
        boxes.setdefault(p.name, []).append((r, p.offset, p.shape))
        meta[p.name] = p
    for name, bs in boxes.items():
        p = meta[name]
        head: dict[str, Any] = {"dtype": p.dtype, "shape": list(p.global_shape)}
        if len(bs) == 1 and bs[0][2] == p.global_shape and all(p.global_shape):
            out[name] = {**head, **grid_json(p.global_shape, bs[0][0], 0)}  # held whole by one rank
        else:
            out[name] = {**head, **boxes_json(sorted(bs, key=lambda b: (b[1], b[0])))}
    return out
