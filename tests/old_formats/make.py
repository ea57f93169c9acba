"""Write the old-format fixtures of tests/test_old_formats.py with an older ckptlib.

usage (one process per rank; WORLD 1 or 2; the ckptlib imported is whatever PYTHONPATH holds,
e.g. a ``git worktree`` of the release named in FIXTURES):

    PYTHONPATH=<worktree> python tests/old_formats/make.py OUT RANK WORLD PORT

then ``tar czf tests/old_formats/<name>.tar.gz -C OUT .`` once every rank exited 0. Every value
is a pure function of its name (:func:`expected`, integer arithmetic only: the same bits on every
machine and torch version), so the test knows each byte it must read back.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

FIXTURES = {
    # name: (commit that wrote it, what it holds)
    "v1-14c93c8-w1": ("14c93c8", "format v1 before the packed table ('packed' pieces in tensors), 1 rank"),
    "v1-14c93c8-w2": ("14c93c8", "format v1, 2 ranks: Shard and DTensor pieces, per-rank values"),
    "v2-09bb324-w1": ("09bb324", "format v2 as first released (every save v2), 1 rank"),
    "v2-92458a9-w2": ("92458a9", "format v2 with index files of their own (before the index at a payload's end), "
                                 "2 ranks, and its local tier"),
}
SHARDED = {"rows": ((41, 16), "float32", 0), "cols": ((8, 30), "bfloat16", 1), "dt": ((12, 6), "float32", 0)}


def bits(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose bytes are a hash of (name, position): every bit pattern, NaNs included."""
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    seed = sum(name.encode()) * 7919
    i = torch.arange(n * itemsize, dtype=torch.int64)
    raw = ((i * 2654435761 + seed) >> 7) % 251
    if dtype == torch.bool:
        return (raw % 2 == 1).reshape(shape)
    return raw.to(torch.uint8).view(dtype).reshape(shape)


def expected(rank: int, world: int) -> dict[str, Any]:
    """The full (unsharded) state every fixture holds, as ``ckptlib.load`` returns it."""
    out: dict[str, Any] = {
        "model": {"w": bits("model.w", (130, 130), torch.float32),  # 66 KiB: a chunk of its own
                  "b": bits("model.b", (130,), torch.float32)},
        "plain": {"f16": bits("f16", (17, 3), torch.float16), "bf16": bits("bf16", (9,), torch.bfloat16),
                  "i64": bits("i64", (5, 5), torch.int64), "u8": bits("u8", (33,), torch.uint8),
                  "b": bits("b", (4, 4), torch.bool), "scalar": bits("scalar", (), torch.float64),
                  "empty": torch.empty(0, 4), "c64": bits("c64", (3,), torch.complex64),
                  "f8": bits("f8", (6,), torch.float8_e4m3fn)},
        "vals": {"step": 1200, "lr": 3e-4, "loss": float("inf"), "name": "gpt \u00e9\U0001f600",
                 "blob": b"\x00\x01" * 10, "bigblob": bytes(range(256)) * 20, "none": None,
                 "tup": (1, 2.5, "x"), "dtype": torch.bfloat16, 7: [True, False, {"k": -1}]},
    }
    if world > 1:
        out["sharded"] = {k: bits(k, shape, getattr(torch, dt)) for k, (shape, dt, _) in SHARDED.items()}
    return out


def _state(rank: int, world: int) -> dict[str, Any]:
    import ckptlib

    st = expected(rank, world)
    st["rng"] = ckptlib.PerRank(("rank", rank, bytes([rank]) * 3))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        for k, (_shape, _dt, dim) in SHARDED.items():
            g = st["sharded"][k]
            if k == "dt":
                st["sharded"][k] = distribute_tensor(g, init_device_mesh("cpu", (world,)), [Shard(0)])
                continue
            base, extra = divmod(g.shape[dim], world)
            start = rank * base + min(rank, extra)
            n = base + (1 if rank < extra else 0)
            off = [0] * g.dim()
            off[dim] = start
            st["sharded"][k] = ckptlib.Shard(g.narrow(dim, start, n).clone(), g.shape, off)
    return st


def main(out: str, rank: int, world: int, port: str) -> None:
    if world > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    import ckptlib

    st = _state(rank, world)
    with ckptlib.CheckpointManager(os.path.join(out, "run"), compression="zstd") as m:
        m.save(10, st, metadata={"run": "old"}).wait()
        m.save(20, st).wait()
    ckptlib.save(st, os.path.join(out, "oneshot"))
    if "local" in ckptlib.CheckpointManager.__init__.__code__.co_varnames:
        with ckptlib.CheckpointManager(os.path.join(out, "tiered"), local=os.path.join(out, "local"),
                                       persist_every=2, async_save=False) as m:
            for step in (1, 2, 3):
                m.save(step, st).wait()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
