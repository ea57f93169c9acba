"""Format v2 sharding descriptions: which rank's index file holds which box of a tensor. Pure.

A v2 manifest describes every tensor once (``tensors[name]``): dtype, global shape and either
- a **grid** (``"grid": block, "ranks": [first, step]``): the tensor is cut into cells of
  ``block`` elements per dimension (the last cell of a dimension may be shorter), numbered in
  row-major order; cell ``k`` is held by rank ``first + k * step`` (``step`` 0: one rank holds
  every cell, e.g. a replicated tensor written once); or
- explicit **boxes** (``"boxes": [[rank, offset, shape], ...]``) when the pieces form no grid.

Who calls what: the coordinator describes tensors with :func:`grid_json` / :func:`boxes_json`
(``format.build.build_body``); manifest decoding validates them with :func:`decode_sharding`;
a loading rank asks :meth:`Sharding.ranks_for` which index files cover a box (time
proportional to the cells it overlaps), and :func:`check_index` checks that the pieces an index
file lists tile exactly the cells the manifest gives its rank, before any is used.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ckptlib.format.index_file import CODEC_NAMES, IndexTable, digest_hex
from ckptlib.format.schema import MAX_ZSTD_RATIO, Chunk, Pack, Piece, volume
from ckptlib.format.validate import Checker

Box = tuple[tuple[int, ...], tuple[int, ...]]


def grid_json(block: tuple[int, ...], first: int, step: int) -> dict[str, Any]:
    return {"grid": list(block), "ranks": [first, step]}


def boxes_json(boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]]) -> dict[str, Any]:
    return {"boxes": [[r, list(o), list(s)] for r, o, s in boxes]}


@dataclass(frozen=True, slots=True)
class Sharding:
    shape: tuple[int, ...]
    block: tuple[int, ...] | None = None
    first: int = 0
    step: int = 0
    boxes: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    counts: tuple[int, ...] = field(default=(), compare=False)
    """Grid: cells per dimension (computed)."""

    def __post_init__(self) -> None:
        if self.block is not None:
            counts = tuple(-(-n // b) for n, b in zip(self.shape, self.block, strict=True))
            object.__setattr__(self, "counts", counts)

    def cell_box(self, k: int) -> Box:
        """Cell ``k`` in row-major order (the save planner's numbering, ``plan.grid.cell``)."""
        assert self.block is not None
        idx = []
        for c in reversed(self.counts):
            k, i = divmod(k, c)
            idx.append(i)
        off = tuple(i * b for i, b in zip(reversed(idx), self.block, strict=True))
        return off, tuple(min(b, n - o) for o, b, n in zip(off, self.block, self.shape, strict=True))

    def rank_boxes(self, rank: int) -> list[Box]:
        """The boxes the manifest says ``rank``'s index file holds (O(1) for a grid with step)."""
        if self.block is None:
            return [(o, s) for r, o, s in self.boxes if r == rank]
        ncells = volume(self.counts)
        if self.step == 0:  # one cell (decode_sharding), held by ``first``
            return [self.cell_box(0)] if rank == self.first else []
        k, rem = divmod(rank - self.first, self.step)
        return [self.cell_box(k)] if rem == 0 and 0 <= k < ncells else []

    def ranks_held(self) -> set[int]:
        """Every rank that holds a part of the tensor (O(cells): at most the world size)."""
        if self.block is None:
            return {r for r, _, _ in self.boxes}
        if self.step == 0:
            return {self.first}
        return set(range(self.first, self.first + volume(self.counts) * self.step, self.step))

    def ranks_for(self, offset: tuple[int, ...], shape: tuple[int, ...]) -> set[int]:
        """Ranks whose index files hold pieces overlapping the box ``offset``/``shape``."""
        if not all(shape) and self.shape:
            return set()
        if self.block is None:
            return {r for r, o, s in self.boxes if _overlaps(o, s, offset, shape)}
        if self.step == 0:
            return {self.first}
        ranges = [range(o // b, -(-(o + n) // b)) for o, n, b in zip(offset, shape, self.block, strict=True)]
        counts = self.counts
        out = set()
        for idx in itertools.product(*ranges):
            k = 0
            for i, c in zip(idx, counts, strict=True):
                k = k * c + i
            out.add(self.first + k * self.step)
        return out


def _overlaps(o1: tuple[int, ...], s1: tuple[int, ...], o2: tuple[int, ...], s2: tuple[int, ...]) -> bool:
    return all(a < b + m and b < a + n for a, n, b, m in zip(o1, s1, o2, s2, strict=True))


def decode_sharding(name: str, t: dict[str, Any], shape: tuple[int, ...], world_size: int,
                    v: Checker) -> Sharding:
    """Validate a tensor's sharding against its shape and the saving world size."""
    what = f"tensor {name!r:.200}"
    if "grid" in t:
        block = v.shape(t["grid"], f"{what} grid")
        if len(block) != len(shape) or any(b < 1 for b in block):
            raise v.fail(f"{what}: grid must give a block of at least 1 per dimension")
        ranks = v.lst(t.get("ranks"), f"{what} ranks")
        if len(ranks) != 2:
            raise v.fail(f"{what}: ranks must be [first, step]")
        first = v.int_(ranks[0], f"{what} first rank", 0, world_size - 1)
        step = v.int_(ranks[1], f"{what} rank step", 0, world_size)
        if not all(shape):
            raise v.fail(f"{what}: an empty tensor is described by boxes, not a grid")
        s = Sharding(shape, block, first, step)
        ncells = 1
        for c in s.counts:
            ncells *= c
        if step == 0 and ncells != 1:
            raise v.fail(f"{what}: ranks [first, 0] (one rank holds it) needs a grid of one cell")
        if step and first + (ncells - 1) * step >= world_size:
            raise v.fail(f"{what}: grid has {ncells} cells, more than the saving ranks can hold")
        return s
    raw = v.lst(t.get("boxes"), f"{what} boxes")
    boxes = []
    for j, b in enumerate(raw):
        if type(b) is not list or len(b) != 3:
            raise v.fail(f"{what} box {j} must be [rank, offset, shape]")
        rank = v.int_(b[0], f"{what} box {j} rank", 0, world_size - 1)
        off = v.shape(b[1], f"{what} box {j} offset")
        box = v.shape(b[2], f"{what} box {j} shape")
        if len(off) != len(shape) or len(box) != len(shape) or any(
            o + n > size for o, n, size in zip(off, box, shape, strict=True)
        ):
            raise v.fail(f"{what} box {j}: lies outside the tensor's shape {list(shape)}")
        boxes.append((rank, off, box))
    if not boxes:
        raise v.fail(f"{what}: no boxes")
    from ckptlib.format.decode import check_tiling  # one tiling check for v1 chunks and v2 boxes

    check_tiling(shape, [Piece(0, 0, o, s) for _, o, s in boxes], what, v)
    return Sharding(shape, boxes=tuple(boxes))


@dataclass(slots=True)
class RankPieces:
    """What one index file holds, converted to manifest records (global file/pack indices)."""

    packs: list[Pack]
    chunks: dict[str, list[Chunk]]
    pieces: dict[str, list[Piece]]


def check_index(table: IndexTable, rank: int, file_base: int, pack_base: int,
                tensors: dict[str, tuple[str, tuple[int, ...], Sharding]], itemsizes: dict[str, int],
                algorithm: str, v: Checker) -> RankPieces:
    """Validate ``table`` (rank ``rank``'s index) against the manifest's tensors and convert it.

    Every piece must belong to a tensor the manifest lists, have its rank, lie inside the
    tensor, hold exactly its raw size (raw codec) or a possible compressed size, and the pieces
    of each tensor must tile exactly the boxes the sharding gives this rank. Members lie inside
    their pack and do not overlap. Time is linear in the file's pieces (plus the per-tensor
    tiling check for tensors cut into more than one piece per cell).
    """
    c = table.cols
    names = table.names
    packs = [
        Pack(file_base + f, s, n, digest_hex(d, algorithm), CODEC_NAMES[k], raw)
        for f, s, n, d, k, raw in zip(c["pack_file"].tolist(), c["pack_start"].tolist(), c["pack_length"].tolist(),
                                      c["pack_checksum"].tolist(), c["pack_codec"].tolist(),
                                      c["pack_raw_length"].tolist(), strict=True)
    ]
    chunks: dict[str, list[Chunk]] = {}
    pieces: dict[str, list[Piece]] = {}
    meta = []
    for n in names:
        info = tensors.get(n)
        if info is None:
            raise v.fail(f"index of rank {rank} lists tensor {n!r:.200}, which the manifest does not")
        meta.append(info)
    box = c["chunk_box"].tolist()
    for i, (t, f, s, n, d, k, nd, b0) in enumerate(zip(
        c["chunk_tensor"].tolist(), c["chunk_file"].tolist(), c["chunk_start"].tolist(), c["chunk_length"].tolist(),
        c["chunk_checksum"].tolist(), c["chunk_codec"].tolist(), c["chunk_ndim"].tolist(),
        table.chunk_box_start.tolist(), strict=True,
    )):
        dtype, shape, _ = meta[t]
        off, shp = _box(box, b0, nd, shape, f"chunk {i} of {names[t]!r:.200}", v)
        raw = volume(shp) * itemsizes[dtype]
        codec = CODEC_NAMES[k]
        if (codec == "raw" and n != raw) or (codec != "raw" and raw > n * MAX_ZSTD_RATIO + 65536):
            raise v.fail(f"index of rank {rank}: chunk {i} of {names[t]!r:.200} stores {n} bytes for {raw} raw")
        chunks.setdefault(names[t], []).append(Chunk(file_base + f, s, n, digest_hex(d, algorithm), off, shp, codec))
    mbox = c["member_box"].tolist()
    ext: list[tuple[int, int, int]] = []
    for i, (t, p, ro, nd, b0) in enumerate(zip(
        c["member_tensor"].tolist(), c["member_pack"].tolist(), c["member_offset"].tolist(),
        c["member_ndim"].tolist(), table.member_box_start.tolist(), strict=True,
    )):
        dtype, shape, _ = meta[t]
        off, shp = _box(mbox, b0, nd, shape, f"packed piece {i} of {names[t]!r:.200}", v)
        end = ro + volume(shp) * itemsizes[dtype]
        if end > packs[p].raw_length:
            raise v.fail(f"index of rank {rank}: packed piece {i} of {names[t]!r:.200} ends past its pack")
        if end > ro:
            ext.append((p, ro, end))
        pieces.setdefault(names[t], []).append(Piece(pack_base + p, ro, off, shp))
    ext.sort()
    for (p1, _, e1), (p2, s2, _) in itertools.pairwise(ext):
        if p1 == p2 and s2 < e1:
            raise v.fail(f"index of rank {rank}: two members of pack {p1} overlap")
    from ckptlib.format.decode import check_tiling

    for t, n in enumerate(names):
        dtype, shape, sh = meta[t]
        mine = [*chunks.get(n, ()), *pieces.get(n, ())]
        cells = sh.rank_boxes(rank)
        what = f"index of rank {rank}: tensor {n!r:.200}"
        if not cells:
            raise v.fail(f"{what}: the manifest gives this rank no part of the tensor")
        if len(cells) == 1 and len(mine) == 1 and (mine[0].offset, mine[0].shape) == cells[0]:
            continue
        _check_cells(shape, cells, mine, what, check_tiling, v)
    return RankPieces(packs, chunks, pieces)


def _box(flat: list[int], b0: int, nd: int, shape: tuple[int, ...], what: str, v: Checker) -> Box:
    off = tuple(flat[b0 : b0 + nd])
    shp = tuple(flat[b0 + nd : b0 + 2 * nd])
    if nd != len(shape) or any(o + n > size for o, n, size in zip(off, shp, shape, strict=True)):
        raise v.fail(f"index: {what} lies outside the tensor's shape {list(shape)}")
    return off, shp


def _check_cells(shape: tuple[int, ...], cells: list[Box], mine: list[Chunk | Piece], what: str,
                 check_tiling: Any, v: Checker) -> None:
    """Pieces must tile the given cells exactly: each lies in one cell, each cell is tiled."""
    groups: list[list[Piece]] = [[] for _ in cells]
    for p in mine:
        for j, (co, cs) in enumerate(cells):
            if all(o <= a and a + n <= o + s for a, n, o, s in zip(p.offset, p.shape, co, cs, strict=True)):
                rel = tuple(a - o for a, o in zip(p.offset, co, strict=True))
                groups[j].append(Piece(0, 0, rel, p.shape))
                break
        else:
            if volume(p.shape) or not shape:
                raise v.fail(f"{what}: a piece lies outside the boxes the manifest gives this rank")
    for (_, cs), g in zip(cells, groups, strict=True):
        if volume(cs) and not g:
            raise v.fail(f"{what}: pieces do not cover the tensor's boxes (gap)")
        if len(g) == 1 and g[0].shape == cs:
            continue
        check_tiling(cs, g, what, v)
