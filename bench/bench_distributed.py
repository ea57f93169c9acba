"""Save/load throughput with 1, 2 and 4 ranks on the same total bytes, against the raw disk.

Each job is a real multi-process gloo job on 127.0.0.1, launched like torchrun would
(``LOCAL_WORLD_SIZE`` set to the number of ranks on this machine). Every rank holds a 1/W
row-shard of each tensor (``ckptlib.Shard``), so the total bytes stay the same across world
sizes, and saves with the default options (format v2 when several ranks save; the version used
is read back from the manifest and reported). The raw baseline writes the same bytes from W
processes, straight from the tensors' memory (one file each, write + fsync); the raw read reads
each file back into tensors of the same shape, as ``ckptlib.load(into=...)`` does. Loads are
cold: files are dropped from the page cache (fsync + ``POSIX_FADV_DONTNEED``) before each load.

Timed: from a barrier after setup to a barrier after the last rank returns. Setup, not timed:
``init_process_group``, ckptlib's modules (imported on first use) and its coordinator (created once per process on the first
collective save, like the process group; its cost is measured and reported as
``coordinator_setup_s``). Each round runs raw and ckptlib side by side (the order alternates
between rounds); ratios are per round (ckptlib / raw of the same round), then the median, which
holds up better than a ratio of medians on a machine shared with other work.

    python bench/bench_distributed.py [--gib 0.5] [--ranks 1 2 4] [--rounds 5] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

N_TENSORS = 16


def drop_cache(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _read_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.readv(fd, [view])
        if n == 0:
            raise EOFError("raw file is shorter than expected")
        view = view[n:]


def worker(mode: str, rank: int, world: int, port: int, root: str, gib: float) -> None:
    import torch
    import torch.distributed as dist

    import ckptlib
    import ckptlib.api  # imported on first use otherwise; a training process has them by then
    import ckptlib.backends.posix
    import ckptlib.engine.load
    from ckptlib.coord.coordinator import default_coordinator

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=300))
    rows = int(gib * (1 << 30) / 4 / 4096 / N_TENSORS)
    rows -= rows % 4
    per = rows // world
    g = torch.Generator().manual_seed(rank)
    state = {f"w{i}": ckptlib.Shard(torch.randn(per, 4096, generator=g), (rows, 4096), (rank * per, 0))
             for i in range(N_TENSORS)}
    nbytes = sum(s.local.numel() * 4 for s in state.values())
    setup = 0.0
    if mode in ("save", "load"):
        t = time.perf_counter()
        default_coordinator()  # collective, once per process (load needs none: created for parity)
        setup = time.perf_counter() - t
    target = {k: ckptlib.Shard(torch.empty_like(s.local), s.global_shape, s.global_offset)
              for k, s in state.items()}
    if world > 1:
        dist.barrier()
    t = time.perf_counter()
    raw = os.path.join(root, f"raw-{rank}.bin")
    if mode == "raw":
        fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for s in state.values():
                _write_all(fd, memoryview(s.local.numpy()).cast("B"))
            os.fsync(fd)
        finally:
            os.close(fd)
    elif mode == "save":
        ckptlib.save(state, os.path.join(root, "ck"))
    elif mode == "load":
        ckptlib.load(os.path.join(root, "ck"), into=target)
    elif mode == "rawload":
        fd = os.open(raw, os.O_RDONLY)
        try:
            for s in target.values():
                _read_all(fd, memoryview(s.local.numpy()).cast("B"))
        finally:
            os.close(fd)
    if world > 1:
        dist.barrier()
    elapsed = time.perf_counter() - t
    if mode == "load":  # what was read is what was saved
        for k, s in state.items():
            if not torch.equal(s.local, target[k].local):
                raise SystemExit(f"rank {rank}: {k} loaded wrong bytes")
    if rank == 0:
        out: dict[str, Any] = {"seconds": elapsed, "bytes": nbytes * world, "setup_s": setup}
        if mode == "save":
            with open(os.path.join(root, "ck", "manifest.json"), "rb") as f:
                out["format_version"] = json.loads(f.read())["format_version"]
        print(json.dumps(out))
    if world > 1:
        dist.destroy_process_group()


def job(mode: str, world: int, root: str, gib: float) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LOCAL_WORLD_SIZE": str(world)}  # as torchrun sets it
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", mode, str(r), str(world), str(port), root,
                               str(gib)], stdout=subprocess.PIPE, env=env) for r in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    codes = [p.returncode for p in procs]
    if any(codes):
        raise SystemExit(f"{mode} job with {world} ranks failed: exit codes {codes}")
    return json.loads(outs[0].decode().strip().splitlines()[-1])


def run_world(world: int, rounds: int, base: str, gib: float) -> dict[str, Any]:
    times: dict[str, list[float]] = {"raw": [], "save": [], "rawload": [], "load": []}
    setup: list[float] = []
    versions: set[int] = set()
    total = 0
    for i in range(rounds):
        root = tempfile.mkdtemp(dir=base)
        flip = i % 2 == 1  # alternate which of the pair goes first
        for mode in ("save", "raw") if flip else ("raw", "save"):
            r = job(mode, world, root, gib)
            times[mode].append(r["seconds"])
            total = r["bytes"]
            if mode == "save":
                setup.append(r["setup_s"])
                versions.add(r["format_version"])
        drop_cache(root)
        for mode in ("load", "rawload") if flip else ("rawload", "load"):
            r = job(mode, world, root, gib)
            times[mode].append(r["seconds"])
            drop_cache(root)
        shutil.rmtree(root)
    save_ratios = [s / r for s, r in zip(times["save"], times["raw"], strict=True)]
    load_ratios = [s / r for s, r in zip(times["load"], times["rawload"], strict=True)]
    return {"ranks": world, "bytes": total, "format_version": sorted(versions),
            "median_s": {k: statistics.median(v) for k, v in times.items()}, "seconds": times,
            "save_ratio": statistics.median(save_ratios), "save_ratio_range": [min(save_ratios), max(save_ratios)],
            "load_ratio": statistics.median(load_ratios), "load_ratio_range": [min(load_ratios), max(load_ratios)],
            "coordinator_setup_s": statistics.median(setup)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, rank, world, port, root, gib = sys.argv[2:8]
        worker(mode, int(rank), int(world), int(port), root, float(gib))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None, help="also write every time and ratio here")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ckptlib-bench-dist-", dir=args.dir)
    load_before = os.getloadavg()
    started = time.time()
    rows = []
    try:
        for world in args.ranks:
            rows.append(run_world(world, args.rounds, base, args.gib))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}; {args.rounds} rounds")
    print("| ranks | GiB | format | raw write+fsync GB/s | ckptlib save GB/s | save/raw (min-max) | "
          "raw cold read GB/s | ckptlib load GB/s | load/raw (min-max) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        gb, med = row["bytes"] / 1e9, row["median_s"]
        version = "/".join(f"v{v}" for v in row["format_version"])
        print(f"| {row['ranks']} | {row['bytes'] / (1 << 30):.2f} | {version} | {gb / med['raw']:.2f} | "
              f"{gb / med['save']:.2f} | {row['save_ratio']:.2f} ({row['save_ratio_range'][0]:.2f}-"
              f"{row['save_ratio_range'][1]:.2f}) | {gb / med['rawload']:.2f} | {gb / med['load']:.2f} | "
              f"{row['load_ratio']:.2f} ({row['load_ratio_range'][0]:.2f}-{row['load_ratio_range'][1]:.2f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "gib": args.gib, "rounds": args.rounds,
                       "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
                       "wall_s": round(time.time() - started, 1), "cpus": os.cpu_count(),
                       "machine": platform.processor() or platform.machine(),
                       "loadavg_before": load_before, "loadavg_after": load_after, "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
