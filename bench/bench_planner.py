"""Planner scaling: writer assignment + manifest building for T tensors x W ranks, simulated
(no processes). Prints seconds per phase for growing sizes, so growth can be read off.

    python bench/bench_planner.py [--tensors 10000] [--ranks 128 256 512 1024]
"""

from __future__ import annotations

import argparse
import time

from ckptlib.format.build import WrittenChunk, build_body, encode_body
from ckptlib.plan.assign import PieceDesc, assign, digest


def manifest_bytes(pieces: list[tuple[str, tuple[int, ...], tuple[int, ...], int]], world: int) -> bytes:
    results = []
    per_rank: list[list[WrittenChunk]] = [[] for _ in range(world)]
    for i, (name, off, shape, nbytes) in enumerate(pieces):
        r = i % world
        per_rank[r].append(WrittenChunk(name, f"p/r{r:05d}-0.bin", 0, nbytes, "0" * 16, off, shape, "raw", "float32"))
    for r in range(world):
        results.append({"files": [(f"p/r{r:05d}-0.bin", 1 << 40)], "chunks": per_rank[r], "tree": None,
                        "shapes": {}})
    shapes = {p[0]: (len(pieces),) for p in pieces}
    results[0]["shapes"] = shapes
    return encode_body(build_body(results, 1, "ab" * 16, 0.0, "rename", None, "x/p", tree=None))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--sharded-tensors", type=int, default=1_000,
                    help="tensors sharded over every rank (FSDP-style) in the second scenario")
    args = ap.parse_args()
    print("| scenario | ranks | pieces | assign s | manifest build+encode s |")
    print("|---|---:|---:|---:|---:|")
    for world in args.ranks:
        rep = [PieceDesc(f"layer{i}.weight", (0, 0), (256, 256), 256 * 256 * 4, "float32", (256, 256))
               for i in range(args.tensors)]
        d = digest(rep)
        t = time.perf_counter()
        assign(rep, [d] * world, [[] for _ in range(world)])
        ta = time.perf_counter() - t
        t = time.perf_counter()
        manifest_bytes([(p.name, p.offset, p.shape, p.nbytes) for p in rep], world)
        tb = time.perf_counter() - t
        print(f"| {args.tensors} replicated tensors | {world} | {args.tensors} | {ta:.3f} | {tb:.3f} |")
    for world in args.ranks:
        n = args.sharded_tensors
        sharded = [[PieceDesc(f"layer{i}.weight", (r * 4, 0), (4, 256), 4 * 256 * 4, "float32", (4 * world, 256))
                    for i in range(n)] for r in range(world)]
        t = time.perf_counter()
        assign([], [digest([])] * world, sharded)
        ta = time.perf_counter() - t
        pieces = [(p.name, p.offset, p.shape, p.nbytes) for rank in sharded for p in rank]
        t = time.perf_counter()
        manifest_bytes(pieces, world)
        tb = time.perf_counter() - t
        print(f"| {n} tensors sharded over every rank | {world} | {n * world} | {ta:.3f} | {tb:.3f} |")


if __name__ == "__main__":
    main()
