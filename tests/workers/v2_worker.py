"""One rank of a format v2 test job (gloo on 127.0.0.1). Started by tests/distributed/test_v2_reshard.py.

usage: v2_worker.py SCENARIO RANK WORLD PORT ROOT [JSON-ARGS]
Writes ROOT/result-<scenario>-<rank>.json with what it observed; exits 0 unless it crashed.
Every tensor's content is a pure function of its name, so any rank can compute the expected
bytes of any box. Sharding kinds: ``chunk`` (torch.chunk-style blocks of ceil(n/world) rows:
a regular grid), ``uneven`` (the first parts one larger: explicit boxes unless it divides).
"""

from __future__ import annotations

import os
import sys
import zlib

import torch

import ckptlib

SHAPES = {"w": (37, 8), "u": (41, 6), "col": (6, 30), "plain": (16, 16), "v": (40, 4)}


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(SHAPES[name], generator=g)


def bounds(n: int, world: int, rank: int, kind: str) -> tuple[int, int]:
    if kind == "chunk":
        b = -(-n // world)
        return min(rank * b, n), min((rank + 1) * b, n) - min(rank * b, n)
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def shard(name: str, dim: int, kind: str, world: int, rank: int, zero: bool = False) -> ckptlib.Shard:
    t = torch.zeros(SHAPES[name]) if zero else full(name)
    start, length = bounds(t.shape[dim], world, rank, kind)
    offset = [0] * t.dim()
    offset[dim] = start
    return ckptlib.Shard(t.narrow(dim, start, length).clone(), t.shape, offset)


# name -> (dim, kind) when saving and when loading (a different layout: a resharding load)
SAVE = {"w": (0, "chunk"), "u": (0, "uneven"), "col": (1, "chunk"), "v": (0, "chunk")}
LOAD = {"w": (0, "chunk"), "u": (1, "chunk"), "col": (0, "uneven"), "v": (0, "chunk")}


def make(world: int, rank: int, layout: dict, zero: bool = False) -> dict:
    state: dict = {k: shard(k, d, kind, world, rank, zero) for k, (d, kind) in layout.items()}
    state["plain"] = torch.zeros(SHAPES["plain"]) if zero else full("plain")
    state["rng"] = ckptlib.PerRank(torch.full((3,), -1 if zero else rank, dtype=torch.int64))
    state["lr"] = 0.0 if zero else 0.25
    return state


def sc_save(rank: int, world: int, root: str, args: dict) -> dict:
    layout = {k: SAVE[k] for k in args.get("tensors", SAVE)}
    ckptlib.save(make(world, rank, layout), os.path.join(root, args.get("name", "ck")))
    return {}


def sc_load(rank: int, world: int, root: str, args: dict) -> dict:
    from ckptlib.backends import open_storage
    from ckptlib.engine.load import load_checkpoint

    layout = {k: LOAD[k] for k in args.get("tensors", LOAD)}
    target = make(world, rank, layout, zero=True)
    stats: dict[str, int] = {}
    load_checkpoint(open_storage(root), args.get("name", "ck"), target, rank=rank, world_size=world,
                    per_rank="rank0", stats=stats)
    bad = []
    boxes = {}
    for k in layout:
        s = target[k]
        want = full(k)
        for d, (o, n) in enumerate(zip(s.global_offset, s.local.shape, strict=True)):
            want = want.narrow(d, o, n)
        if not torch.equal(s.local, want):
            bad.append(k)
        boxes[k] = [list(s.global_offset), list(s.local.shape)]
    if not torch.equal(target["plain"], full("plain")):
        bad.append("plain")
    if target["rng"].value.tolist() != [0, 0, 0] or target["lr"] != 0.25:
        bad.append("rng/lr")
    return {"bad": bad, "stats": stats, "boxes": boxes}


if __name__ == "__main__":
    from scenario_main import run  # the shared command line (tests import this module too)

    sys.exit(run(globals(), timeout_s=60))
