"""Who writes what: deduplicate replicas and balance bytes across ranks. Pure.

Called by the coordinator during a distributed save. Each rank describes its pieces in two
lists: *replicated* pieces (plain tensors, identical on every rank; only rank 0 sends the
list, the others send a digest of theirs so the coordinator can check they agree) and
*sharded* pieces (``Shard``/DTensor boxes, ``PerRank`` tensors). A piece is identified by
``(name, global offset, shape)``; each distinct piece is written exactly once, by the
least-loaded rank holding it, largest pieces first.

Cost: O(R log W) for R replicated pieces (a heap over ranks) plus O(S log S) for S sharded
pieces in total, so planning stays linear-ish at 10,000 tensors x 1,024 ranks.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PieceDesc:
    name: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    dtype: str
    global_shape: tuple[int, ...]


class PlanError(ValueError):
    """Ranks disagree about a tensor (dtype, global shape, or the set of replicated tensors)."""


def digest(pieces: Sequence[PieceDesc]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in pieces:
        h.update(repr((p.name, p.offset, p.shape, p.dtype, p.global_shape)).encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Plan:
    replicated: list[int]
    """Positions in this rank's replicated list that it writes."""
    sharded: list[int]
    """Positions in this rank's sharded list that it writes."""


def assign(
    replicated: Sequence[PieceDesc],
    digests: Sequence[str],
    sharded: Sequence[Sequence[PieceDesc]],
    base_load: Sequence[int] | None = None,
) -> list[Plan]:
    """Each distinct piece to one rank (module docstring). ``base_load[r]``: bytes rank r
    writes anyway (its grid pieces, format v2), counted when balancing."""
    world = len(sharded)
    want = digest(replicated)
    for r, d in enumerate(digests):
        if d != want:
            raise PlanError(
                f"rank {r} holds a different set of plain (replicated) tensors than rank 0; plain "
                "tensors must be identical on every rank (wrap per-rank state in ckptlib.PerRank, "
                "shards in ckptlib.Shard)"
            )
    meta: dict[str, tuple[str, tuple[int, ...]]] = {p.name: (p.dtype, p.global_shape) for p in replicated}
    rep_out: list[list[int]] = [[] for _ in range(world)]
    shard_out: list[list[int]] = [[] for _ in range(world)]
    load = list(base_load) if base_load is not None else [0] * world
    # Sharded pieces: a piece held by one rank is written by it (the common case, O(1) each);
    # pieces held by several ranks (replicas of a shard) go to the least-loaded holder.
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, int]]] = {}
    for rank, pieces in enumerate(sharded):
        for i, p in enumerate(pieces):
            known = meta.setdefault(p.name, (p.dtype, p.global_shape))
            if known != (p.dtype, p.global_shape):
                raise PlanError(
                    f"tensor {p.name!r}: ranks disagree: {known[0]} {list(known[1])} vs "
                    f"rank {rank} has {p.dtype} {list(p.global_shape)}"
                )
            holders.setdefault((p.name, p.offset, p.shape), []).append((rank, i))
    shared = []
    for hs in holders.values():
        if len(hs) == 1:
            r, i = hs[0]
            shard_out[r].append(i)
            load[r] += sharded[r][i].nbytes
        else:
            shared.append(hs)
    for hs in sorted(shared, key=lambda hs: -sharded[hs[0][0]][hs[0][1]].nbytes):
        r, i = min(hs, key=lambda h: (load[h[0]], h[0]))
        shard_out[r].append(i)
        load[r] += sharded[r][i].nbytes
    heap = [(load[r], r) for r in range(world)]
    heapq.heapify(heap)
    for i in sorted(range(len(replicated)), key=lambda i: -replicated[i].nbytes):
        _, r = heapq.heappop(heap)
        rep_out[r].append(i)
        load[r] += replicated[i].nbytes
        heapq.heappush(heap, (load[r], r))
    return [Plan(sorted(a), sorted(b)) for a, b in zip(rep_out, shard_out, strict=True)]
