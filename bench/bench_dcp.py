#!/usr/bin/env python3
"""DCP storage benchmark: ckptlib's StorageWriter/Reader against DCP's FileSystemWriter/Reader.

One process (DCP single-process mode), one state dict shaped like a model + optimizer: a few
large tensors plus many small ones (biases, norms, step counters) and plain values. Paired,
alternating rounds: round r runs the two contenders in order (ckptlib, dcp) when r is even and
(dcp, ckptlib) when odd, each saving into a fresh folder on the same file system and loading
back into preallocated tensors; folders are removed after each round. Both sides fsync
(FileSystemWriter's default ``sync_files=True``; ckptlib always makes payloads durable and
commits atomically). Loads verify checksums on the ckptlib side (its default).

Reported: per-contender median seconds, and the median over rounds of the per-round ratio
ckptlib / dcp (below 1: ckptlib faster). Run ``python bench/bench_dcp.py --help``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from ckptlib.integrations.dcp import CkptlibReader, CkptlibWriter

warnings.filterwarnings("ignore", "torch.distributed is disabled")


def make_state(mib: int, small: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n_big = max(1, mib // 16)
    state: dict = {
        "model": {},
        "optim": {"state": {}, "lr": 1e-3, "betas": (0.9, 0.95)},
        "step": 1000,
    }
    for i in range(n_big):  # 16 MiB each: half parameters, half optimizer moments
        t = torch.randn(2048, 2048, generator=g)
        (state["model"] if i % 2 == 0 else state["optim"]["state"])[f"big{i}"] = t
    for i in range(small):  # 4 KiB each
        state["model"][f"small{i}"] = torch.randn(1024, generator=g)
    return state


def empty_like(state):
    if isinstance(state, dict):
        return {k: empty_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    return state


def run_one(kind: str, state: dict, target: dict, folder: str) -> tuple[float, float]:
    if kind == "ckptlib":
        writer, reader = CkptlibWriter(folder), CkptlibReader(folder)
    else:
        writer, reader = dcp.FileSystemWriter(folder), dcp.FileSystemReader(folder)
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=writer)
    t1 = time.perf_counter()
    dcp.load(target, storage_reader=reader)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=int, default=512, help="bytes of large tensors (16 MiB each)")
    ap.add_argument("--small", type=int, default=2000, help="number of 4 KiB tensors")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the timings and ratios here")
    args = ap.parse_args()

    state = make_state(args.mib, args.small)
    target = empty_like(state)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    base = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir)
    times: dict[str, dict[str, list[float]]] = {
        k: {"save": [], "load": []} for k in ("ckptlib", "dcp")
    }
    ratios: dict[str, list[float]] = {"save": [], "load": []}
    try:
        for r in range(args.rounds + 1):  # round 0 warms up (imports, page cache), not counted
            order = ("ckptlib", "dcp") if r % 2 == 0 else ("dcp", "ckptlib")
            got = {}
            for kind in order:
                folder = os.path.join(base, f"{kind}-{r}")
                got[kind] = run_one(kind, state, target, folder)
                for a, b in zip(_tensors(state), _tensors(target), strict=True):
                    assert torch.equal(a, b), "round trip mismatch"
                shutil.rmtree(folder)
            if r == 0:
                continue
            for kind in order:
                times[kind]["save"].append(got[kind][0])
                times[kind]["load"].append(got[kind][1])
            ratios["save"].append(got["ckptlib"][0] / got["dcp"][0])
            ratios["load"].append(got["ckptlib"][1] / got["dcp"][1])
    finally:
        shutil.rmtree(base, ignore_errors=True)

    gib = nbytes / 2**30
    print(
        f"# bench_dcp  {dt.datetime.now().isoformat(timespec='minutes')}  {platform.node()}  "
        f"{platform.processor() or platform.machine()}  cpus={os.cpu_count()}  torch {torch.__version__}"
    )
    print(
        f"state: {gib:.3f} GiB in {len(list(_tensors(state)))} tensors "
        f"({args.mib // 16} x 16 MiB + {args.small} x 4 KiB), {args.rounds} paired rounds, dir {args.dir or tempfile.gettempdir()}"
    )
    print("| op | ckptlib median s | dcp FileSystem median s | median ratio ckptlib/dcp |")
    print("|---|---|---|---|")
    for op in ("save", "load"):
        c, d = statistics.median(times["ckptlib"][op]), statistics.median(times["dcp"][op])
        print(
            f"| {op} | {c:.3f} ({gib / c:.2f} GiB/s) | {d:.3f} ({gib / d:.2f} GiB/s) | "
            f"{statistics.median(ratios[op]):.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
                       "bytes": nbytes, "times": times, "ratios": ratios}, f, indent=1)


def _tensors(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, torch.Tensor):
        yield x


if __name__ == "__main__":
    main()
