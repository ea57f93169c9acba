"""One rank of tests/test_old_formats.py's 2-rank restore of an old fixture (gloo, 127.0.0.1).

usage: restore_rank.py ROOT RANK WORLD FIXTURE_WORLD RESULT
Restores ROOT/run into Shard pieces and a DTensor laid out for this job, compares every byte
with make.expected and writes RESULT (JSON: the step and the paths that differ)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import make

import ckptlib


def main(root: str, rank: int, world: int, fixture_world: int, result: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    want = make.expected(0, fixture_world)
    st: dict = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
                "plain": {k: torch.zeros_like(v) for k, v in want["plain"].items()}, "vals": None, "rng": None}
    pieces: dict = {}
    if fixture_world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        for k, (shape, dt, dim) in make.SHARDED.items():
            g = torch.zeros(shape, dtype=getattr(torch, dt))
            if k == "dt":  # a DTensor sharded along the other dimension than it was saved
                pieces[k] = distribute_tensor(g, init_device_mesh("cpu", (world,)), [Shard(1)])
                continue
            n = -(-shape[dim] // world)
            start, length = min(rank * n, shape[dim]), max(0, min(n, shape[dim] - rank * n))
            off = [0] * len(shape)
            off[dim] = start
            pieces[k] = ckptlib.Shard(g.narrow(dim, start, length).clone(), shape, off)
        st["sharded"] = pieces
    with ckptlib.CheckpointManager(os.path.join(root, "run")) as m:
        step = m.restore(st, per_rank="rank0" if world != fixture_world else "error")
    bad = []
    for part in ("model", "plain"):
        for k, v in want[part].items():
            if not torch.equal(v.reshape(-1).view(torch.uint8), st[part][k].reshape(-1).view(torch.uint8)) \
                    if v.dtype != torch.bool else not torch.equal(v, st[part][k]):
                bad.append(f"/{part}/{k}")
    if st["vals"] != want["vals"]:
        bad.append("/vals")
    if fixture_world == world and st["rng"] != ("rank", rank, bytes([rank]) * 3):
        bad.append("/rng")
    for k, p in pieces.items():
        g = want["sharded"][k]
        if isinstance(p, ckptlib.Shard):
            exp = g
            for d, (o, n) in enumerate(zip(p.global_offset, p.local.shape, strict=True)):
                exp = exp.narrow(d, o, n)
            local = p.local
        else:
            exp, local = g, p.full_tensor()
        if not torch.equal(exp.contiguous().view(torch.uint8), local.contiguous().view(torch.uint8)):
            bad.append(f"/sharded/{k}")
    with open(result, "w") as f:
        json.dump({"step": step, "bad": bad}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
