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
    """Ranks disagree about a tensor (dtype, global shape, or the set of replicated tensors).
    ``ranks``: the ranks whose plain (replicated) tensors differ from rank 0's, if that is why."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


NAMED = 4
"""How many of the ranks whose plain tensors differ get rank 0's list back on the failure path
(:func:`ckptlib.engine.save_plan.plan_items`), so that their own error names the tensors
(:func:`difference`): bounded, as every rank may differ at 4,096 ranks."""


def digest(pieces: Sequence[PieceDesc]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in pieces:
        h.update(repr((p.name, p.offset, p.shape, p.dtype, p.global_shape)).encode())
    return h.hexdigest()


def difference(reference: Sequence[PieceDesc], mine: Sequence[PieceDesc], limit: int = 4) -> str:
    """What differs between rank 0's plain tensors (``reference``) and this rank's (``mine``),
    by name: tensors only on one side, dtype or shape differences, else the first position
    where the order differs ("" when the lists agree). A rank whose digest differed, on the
    failure path of :func:`ckptlib.engine.save_plan.plan_items`; at most ``limit`` named."""
    ref = {(p.name, p.offset): p for p in reference}
    own = {(p.name, p.offset): p for p in mine}

    def label(p: PieceDesc) -> str:
        return repr(p.name) + (f"@{list(p.offset)}" if any(p.offset) else "")

    said = []
    for key, p in own.items():
        q = ref.get(key)
        if q is None:
            said.append(f"{label(p)} only here ({p.dtype} {list(p.shape)})")
        elif (q.dtype, q.shape, q.global_shape) != (p.dtype, p.shape, p.global_shape):
            said.append(f"{label(p)} is {p.dtype} {list(p.shape)} here, {q.dtype} {list(q.shape)} on rank 0")
    said += [f"{label(q)} only on rank 0 ({q.dtype} {list(q.shape)})" for key, q in ref.items() if key not in own]
    if said:
        return "; ".join(said[:limit]) + (f"; and {len(said) - limit} more" if len(said) > limit else "")
    for i, (p, q) in enumerate(zip(mine, reference, strict=False)):
        if (p.name, p.offset) != (q.name, q.offset):
            return (f"the same tensors in another order (at position {i}: {label(p)} here, {label(q)} on "
                    "rank 0): build the state in the same order on every rank")
    return ""


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
    odd = [r for r, d in enumerate(digests) if d != want]
    if odd:
        shown = ", ".join(map(str, odd[:8])) + (f" and {len(odd) - 8} more" if len(odd) > 8 else "")
        who = f"rank {odd[0]} holds" if len(odd) == 1 else f"{len(odd)} ranks ({shown}) hold"
        named = odd[:NAMED]
        whose = (f"rank {odd[0]}'s own error names them" if len(odd) == 1 else
                 f"the errors of ranks {', '.join(map(str, named[:-1]))} and {named[-1]} name them")
        raise PlanError(
            f"{who} a different set of plain (replicated) tensors than rank 0 (names, dtypes, shapes or "
            f"order; {whose}); plain tensors must be identical on every rank (wrap "
            "per-rank state in ckptlib.PerRank, shards in ckptlib.Shard)", odd)
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
