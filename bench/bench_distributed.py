"""Save/load throughput with 1, 2 and 4 ranks on the same total bytes, against the raw disk.

Each job is a real multi-process gloo job on 127.0.0.1. Every rank holds a 1/W row-shard of
each tensor (``ckptlib.Shard``), so the total bytes stay the same across world sizes. The raw
baseline writes the same total bytes from W processes (one file each, write + fsync). Loads are
cold: files are dropped from the page cache (fsync + POSIX_FADV_DONTNEED) before each load.

    python bench/bench_distributed.py [--gib 1.0] [--ranks 1 2 4] [--rounds 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta


def drop_cache(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def worker(mode: str, rank: int, world: int, port: int, root: str, gib: float) -> None:
    import torch
    import torch.distributed as dist

    import ckptlib

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=300))
    n_tensors = 16
    rows = int(gib * (1 << 30) / 4 / 4096 / n_tensors)
    rows -= rows % 4
    per = rows // world
    g = torch.Generator().manual_seed(rank)
    state = {f"w{i}": ckptlib.Shard(torch.randn(per, 4096, generator=g), (rows, 4096), (rank * per, 0))
             for i in range(n_tensors)}
    nbytes = sum(s.local.numel() * 4 for s in state.values())
    if world > 1:
        dist.barrier()
    t = time.perf_counter()
    if mode == "raw":
        path = os.path.join(root, f"raw-{rank}.bin")
        with open(path, "wb") as f:
            for s in state.values():
                f.write(s.local.numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
    elif mode == "save":
        ckptlib.save(state, os.path.join(root, "ck"))
    elif mode == "load":
        target = {k: ckptlib.Shard(torch.empty_like(s.local), s.global_shape, s.global_offset)
                  for k, s in state.items()}
        ckptlib.load(os.path.join(root, "ck"), into=target)
    elif mode == "rawload":
        with open(os.path.join(root, f"raw-{rank}.bin"), "rb") as f:
            while f.read(64 << 20):
                pass
    if world > 1:
        dist.barrier()
    elapsed = time.perf_counter() - t
    if rank == 0:
        print(json.dumps({"seconds": elapsed, "bytes": nbytes * world}))
    if world > 1:
        dist.destroy_process_group()


def job(mode: str, world: int, root: str, gib: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", mode, str(r), str(world), str(port), root,
                               str(gib)], stdout=subprocess.PIPE) for r in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    return json.loads(outs[0].decode().strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, rank, world, port, root, gib = sys.argv[2:8]
        worker(mode, int(rank), int(world), int(port), root, float(gib))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None, help="also write the median seconds per world size here")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ckptlib-bench-dist-", dir=args.dir)
    rows = []
    try:
        for world in args.ranks:
            times: dict[str, list[float]] = {"raw": [], "save": [], "rawload": [], "load": []}
            total = 0
            for _ in range(args.rounds):
                root = tempfile.mkdtemp(dir=base)
                for mode in ("raw", "save"):
                    r = job(mode, world, root, args.gib)
                    times[mode].append(r["seconds"])
                    total = r["bytes"]
                drop_cache(root)
                for mode in ("rawload", "load"):
                    r = job(mode, world, root, args.gib)
                    times[mode].append(r["seconds"])
                    drop_cache(root)
                shutil.rmtree(root)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append((world, total, med))
        print("| ranks | GiB | raw write+fsync GB/s | ckptlib save GB/s | save/raw | raw cold read GB/s | "
              "ckptlib load GB/s | load/raw |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for world, total, med in rows:
            gb = total / 1e9
            print(f"| {world} | {total / (1 << 30):.2f} | {gb / med['raw']:.2f} | {gb / med['save']:.2f} | "
                  f"{med['save'] / med['raw']:.2f} | {gb / med['rawload']:.2f} | {gb / med['load']:.2f} | "
                  f"{med['load'] / med['rawload']:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": sys.argv, "gib": args.gib, "rounds": args.rounds,
                           "rows": [{"ranks": w, "bytes": b, "median_s": m} for w, b, m in rows]}, f, indent=1)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
