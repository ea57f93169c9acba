"""One rank of a 2-process gloo job that saves to and restores from S3 (tests/backends/test_s3.py).

usage: s3_worker.py RANK WORLD PORT URL OUT_JSON STORAGE_OPTIONS_JSON
Each rank holds one row-shard of a 16 MiB tensor (a multipart upload per rank), plus a
small replicated tensor; every value is a pure function of its name and rank, so each rank
checks its restored bytes exactly. Writes OUT_JSON with what it observed; exits 0 unless it crashed.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import ckptlib

ROWS, COLS = 4096, 1024


def full() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(ROWS, COLS, generator=g)


def state(rank: int, world: int, zero: bool = False) -> dict:
    rows = ROWS // world
    local = full()[rank * rows : (rank + 1) * rows].clone()
    if zero:
        local.zero_()
    return {
        "w": ckptlib.Shard(local, (ROWS, COLS), (rank * rows, 0)),
        "shared": torch.zeros(16) if zero else torch.arange(16, dtype=torch.float32),
    }


def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    url, out_path, opts = sys.argv[4], sys.argv[5], json.loads(sys.argv[6])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    out: dict = {}
    try:
        with ckptlib.CheckpointManager(url, storage_options=opts, async_save=False) as mgr:
            mgr.save(1, state(rank, world))
            target = state(rank, world, zero=True)
            out["restored"] = mgr.restore(target)
            expect = state(rank, world)
            out["exact"] = bool(
                torch.equal(target["w"].local, expect["w"].local)
                and torch.equal(target["shared"], expect["shared"])
            )
    except Exception:
        out["crash"] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
