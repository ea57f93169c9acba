"""Planner and manifest scaling, format v1 vs v2, simulated (no processes, no payload I/O).

T tensors fully sharded (FSDP-style, dim 0, one piece per rank per tensor) over W ranks: T x W
pieces. Measured side by side in one run, on the coordinator:
- v1: assign every piece (``plan.assign``), build the body from every chunk record, encode it;
- v2: the grid proposal from the coordinator's own pieces (``plan.grid.propose``), the union of
  every rank's exception list, the tensor descriptions (``describe``), the body from one summary
  per rank (``format.build.build_body`` with ``layout``), encode it.
and the size of ``manifest.json``. Per rank (in parallel on a real job, so reported apart):
v2's grid check (``conform``); the manifest decode every loading rank does (v1: every piece;
v2: O(ranks + tensors)); and v2's own-piece load planning for a rank loading its own cells of
every tensor: choosing index files from the sharding, decoding and checking its one index file,
and planning the reads (``Reader._tasks``). v2 figures are the best of 3 rounds interleaved over the rank counts, each itself the best of 3
runs (the coordinator: of 7), v1's
of one (it takes minutes).

    python bench/bench_planner.py [--tensors 10000] [--ranks 128 1024 4096] [--v1-max-pieces 2000000]
                                  [--v1-decode-max-pieces 300000]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from ckptlib.engine.reader import Reader, Request
from ckptlib.format.build import WrittenChunk, build_body, encode_body
from ckptlib.format.decode import decode
from ckptlib.format.dtypes import ITEMSIZE
from ckptlib.format.index_file import build_index, decode_index
from ckptlib.format.sharding import check_index
from ckptlib.format.validate import Checker
from ckptlib.plan.assign import PieceDesc, assign, digest
from ckptlib.plan.grid import conform, describe, propose

ROWS = 4  # rows per rank per tensor
COLS = 256
PREFIX = "x/" + "ab" * 16


def piece(i: int, world: int, rank: int) -> PieceDesc:
    return PieceDesc(f"layers.{i}.weight", (rank * ROWS, 0), (ROWS, COLS), ROWS * COLS * 4, "float32",
                     (ROWS * world, COLS))


def written(pieces: list[PieceDesc], rank: int) -> list[WrittenChunk]:
    path = f"{PREFIX}/r{rank:05d}-0.bin"
    n = ROWS * COLS * 4
    return [WrittenChunk(p.name, path, i * n, n, f"{i:016x}", p.offset, p.shape, "raw", p.dtype)
            for i, p in enumerate(pieces)]


REPEAT = 3


def timed(fn, repeat: int = 1):  # type: ignore[no-untyped-def]
    """``fn()``'s result and its best time of ``repeat`` runs (a shared machine is noisy)."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def v1(tensors: int, world: int, decode_too: bool) -> tuple[float, int, float | None]:
    """Coordinator seconds, manifest bytes, one rank's manifest decode seconds (load planning)."""
    sharded = [[piece(i, world, r) for i in range(tensors)] for r in range(world)]
    chunks = [written(sharded[r], r) for r in range(world)]
    size = tensors * ROWS * COLS * 4
    results = [{"files": [(f"{PREFIX}/r{r:05d}-0.bin", size)], "chunks": chunks[r], "tree": None,
                "shapes": {p.name: p.global_shape for p in sharded[0]} if r == 0 else {}} for r in range(world)]

    def coordinator() -> bytes:
        assign([], [digest([])] * world, sharded)
        return encode_body(build_body(results, 1, "ab" * 16, 0.0, "rename", None, PREFIX, tree=None))

    data, t = timed(coordinator)
    t_decode = timed(lambda: decode(data))[1] if decode_too else None
    return t, len(data), t_decode


def v2(tensors: int, world: int) -> dict[str, float]:
    mine0 = [piece(i, world, 0) for i in range(tensors)]
    mine1 = [piece(i, world, 1) for i in range(tensors)]
    proposal = propose(mine0)
    # per rank, in parallel on a real job: the grid check
    odd1, t_conform = timed(lambda: conform(proposal, mine1, 1), REPEAT)
    assert odd1 == []
    index = build_index([(f"{PREFIX}/r00001-0.bin", tensors * ROWS * COLS * 4)], written(mine1, 1))
    summary = {"path": f"{PREFIX}/r{{:05d}}-index.bin", "size": len(index.data), "checksum": "0" * 16,
               "counts": index.counts}
    summaries = [{"files": [(f"{PREFIX}/r{r:05d}-0.bin", tensors * ROWS * COLS * 4)],
                  "index": {**summary, "path": summary["path"].format(r)}, "tree": None} for r in range(world)]
    odds: list[list[str]] = [[] for _ in range(world)]

    def coordinator() -> bytes:
        prop = propose(mine0)
        union = set().union(*odds)
        layout = describe(prop, union, [], [], [])
        return encode_body(build_body(summaries, 1, "ab" * 16, 0.0, "rename", None, PREFIX, tree=None, layout=layout))

    data, t_coord = timed(coordinator, 2 * REPEAT + 1)

    m0, t_decode = timed(lambda: decode(data), REPEAT)

    def load_plan() -> int:
        m = decode(data)  # a fresh copy (pieces get added to it); its time is t_decode
        t0 = time.perf_counter()
        need = set()
        for sh in m.sharding.values():
            need |= sh.ranks_for((ROWS, 0), (ROWS, COLS))  # rank 1's own cell
        assert need == {1}
        ix = m.indexes[1]
        v = Checker("bench")
        table = decode_index(index.data, ix.counts, 1, [m.files[1].size], m.checksum_algorithm, v)
        tens = {n: (e.dtype, e.shape, m.sharding[n]) for n, e in m.tensors.items()}
        got = check_index(table, 1, ix.first_file, 0, tens, ITEMSIZE, m.checksum_algorithm, v)
        for n, cs in got.chunks.items():
            m.tensors[n].chunks.extend(cs)
        dest = torch.empty(ROWS, COLS)
        reqs = [Request(n, dest, (ROWS, 0), (ROWS, COLS)) for n in m.tensors]
        tasks, _ = Reader(None, "", m)._tasks(reqs)  # type: ignore[arg-type]  # planning only, no I/O
        assert len(tasks) == tensors
        return time.perf_counter() - t0

    t_own = min(load_plan() for _ in range(REPEAT))
    assert len(m0.tensors) == tensors
    return {"coord": t_coord, "bytes": len(data), "conform": t_conform, "decode": t_decode, "own": t_own}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--v1-max-pieces", type=int, default=2_000_000,
                    help="run v1 only up to this many pieces (it needs ~1 KB of RAM per piece)")
    ap.add_argument("--v1-decode-max-pieces", type=int, default=300_000,
                    help="time v1's manifest decode (its load planning) only up to this many pieces")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the v2 measurements")
    args = ap.parse_args()
    print("| ranks | pieces | v1 coordinator s | v2 coordinator s | v1/v2 | v1 manifest.json | v2 manifest.json "
          "| v2 per-rank grid check s | v1 manifest decode s | v2 manifest decode s | v2 own-piece load planning s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    # v2 first, rounds interleaved over the rank counts (best of each): a shared machine's load
    # drifts, and v1's millions of objects would slow whatever runs right after them.
    v2s = {w: v2(args.tensors, w) for w in args.ranks}
    for _ in range(args.rounds - 1):
        for w in args.ranks:
            again = v2(args.tensors, w)
            v2s[w] = {k: min(v2s[w][k], again[k]) for k in again}
    for world in args.ranks:
        pieces = args.tensors * world
        r2 = v2s[world]
        if pieces <= args.v1_max_pieces:
            t1, b1, d1 = v1(args.tensors, world, pieces <= args.v1_decode_max_pieces)
            v1_cols = f"{t1:.2f} | {r2['coord']:.3f} | {t1 / r2['coord']:.0f}x | {b1 / 2**20:.1f} MiB"
            v1_load = f"{d1:.2f}" if d1 is not None else "(not run)"
        else:
            v1_cols = f"(not run) | {r2['coord']:.3f} | - | -"
            v1_load = "-"
        print(f"| {world:,} | {pieces:,} | {v1_cols} | {r2['bytes'] / 2**20:.2f} MiB | {r2['conform']:.3f} | "
              f"{v1_load} | {r2['decode']:.3f} | {r2['own']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
