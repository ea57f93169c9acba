#!/usr/bin/env python3
"""Megatron-Core dist_checkpointing: ckptlib's strategy vs Megatron's default ``torch_dist``.

Both contenders go through the same entry points, ``dist_checkpointing.save(sd, dir,
sharded_strategy=...)`` and ``dist_checkpointing.load(sd, dir, ...)``, on the same sharded
state: a GPT-like model (bfloat16 weights, float32 norms/biases) plus fp32 Adam moments,
described as ShardedTensors for tensor-parallel size = world size (``--world`` processes over
gloo on 127.0.0.1, default 1). Megatron's torch_dist strategy calls a few CUDA helpers even
for CPU tensors; they are replaced by no-ops here (``torch.cuda.synchronize``,
``torch.cuda.current_device``).

Paired alternating rounds: round r runs the contenders in an order rotated by r, each saving
into a fresh folder (both fsync their files: ckptlib always, torch_dist with
``sync_files=True`` by default), then loading it back into a preallocated state (warm page
cache). Each load is checked once against the saved tensors. Reported: per-contender median
seconds and the median of the per-round ratios ckptlib / torch_dist.

    python bench/bench_megatron.py                  # ~0.5 GiB, 5 rounds, 1 process
    python bench/bench_megatron.py --gib 1 --world 2 --rounds 5 --dir /nvme/tmp
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def cuda_shim() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def build_state(gib: float, tp: int, tp_rank: int) -> dict[str, tuple[torch.Tensor, int | None]]:
    """This rank's local tensors: name -> (tensor, split axis or None)."""
    d = 1024
    vocab = 8192
    # Per block: bf16 weights qkv(3dd) + proj(dd) + mlp(8dd) = 24dd bytes, plus two fp32 Adam
    # moments of the same shapes (96dd bytes); the embedding likewise (10 bytes per element).
    blocks = max(1, round((gib * 2**30 - vocab * d * 10) / (120 * d * d)))
    g = torch.Generator().manual_seed(0)
    out: dict[str, tuple[torch.Tensor, int | None]] = {}

    def add(name: str, shape: tuple[int, ...], dtype: torch.dtype, axis: int | None) -> None:
        local = list(shape)
        if axis is not None:
            local[axis] //= tp
        out[name] = (torch.randn(local, generator=g).to(dtype), axis)

    add("embedding.word", (vocab, d), torch.bfloat16, 0)
    for b in range(blocks):
        add(f"layers.{b}.qkv.weight", (3 * d, d), torch.bfloat16, 0)
        add(f"layers.{b}.proj.weight", (d, d), torch.bfloat16, 1)
        add(f"layers.{b}.fc1.weight", (4 * d, d), torch.bfloat16, 0)
        add(f"layers.{b}.fc2.weight", (d, 4 * d), torch.bfloat16, 1)
        add(f"layers.{b}.ln.weight", (d,), torch.float32, None)
        add(f"layers.{b}.ln.bias", (d,), torch.float32, None)
    for name, (t, axis) in list(out.items()):
        for m in ("exp_avg", "exp_avg_sq"):
            out[f"optimizer.{m}.{name}"] = (torch.randn(t.shape, generator=g), axis)
    return out


def sharded(state: dict, tp: int, tp_rank: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    sd = {}
    for name, (t, axis) in state.items():
        if axis is None:
            sd[name] = ShardedTensor.from_rank_offsets(name, t, replica_id=tp_rank)
        else:
            sd[name] = ShardedTensor.from_rank_offsets(name, t, (axis, tp_rank, tp))
    return sd


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    cuda_shim()
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    from ckptlib.integrations import megatron as ck

    state = build_state(args.gib, world, rank)
    nbytes = sum(t.numel() * t.element_size() for t, _ in state.values())
    target = {k: (torch.empty_like(t), a) for k, (t, a) in state.items()}
    contenders = {
        "ckptlib": (
            lambda: ck.SaveStrategy(),
            lambda: ck.LoadStrategy(),
            lambda: ck.LoadCommonStrategy(),
        ),
        "torch_dist": (
            lambda: TorchDistSaveShardedStrategy("torch_dist", 1),
            lambda: TorchDistLoadShardedStrategy(),
            lambda: None,
        ),
    }
    names = list(contenders)
    times: dict[str, dict[str, list[float]]] = {n: {"save": [], "load": []} for n in names}
    root = Path(args.dir)
    checked = set()
    for rnd in range(args.warmup + args.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for name in order:
            save_s, load_s, common_s = contenders[name]
            ckdir = root / f"r{rnd}-{name}"
            if rank == 0:
                ckdir.mkdir(parents=True)
            dist.barrier()
            t0 = time.perf_counter()
            mdc.save(sharded(state, world, rank), str(ckdir), sharded_strategy=save_s())
            dist.barrier()
            t1 = time.perf_counter()
            kw = {"common_strategy": common_s()} if common_s() is not None else {}
            loaded = mdc.load(
                sharded(target, world, rank), str(ckdir), sharded_strategy=load_s(), **kw
            )
            dist.barrier()
            t2 = time.perf_counter()
            if name not in checked:
                for k, (t, _) in state.items():
                    assert torch.equal(loaded[k], t), f"{name}: {k} differs after load"
                checked.add(name)
            if rnd >= args.warmup:
                times[name]["save"].append(t1 - t0)
                times[name]["load"].append(t2 - t1)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckdir)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"times": times, "bytes_per_rank": nbytes}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--gib", type=float, default=0.5, help="state size per rank (weights + Adam moments)"
    )
    ap.add_argument("--world", type=int, default=1, help="processes (= tensor-parallel size)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp folder)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--_worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        rank, port, out_path = int(args._worker[0]), int(args._worker[1]), args._worker[2]
        worker(rank, args.world, port, args, out_path)
        return
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="bench-megatron-")
        args.dir = tmp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = os.path.join(args.dir, "result.json")
    import subprocess

    argv = list(sys.argv[1:])
    if "--dir" not in argv:
        argv += ["--dir", args.dir]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *argv, "--_worker", str(r), str(port), out_path]
        )
        for r in range(args.world)
    ]
    rcs = [p.wait(timeout=3600) for p in procs]
    if any(rcs):
        sys.exit(f"worker failed: {rcs}")
    res = json.loads(Path(out_path).read_text())
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    report(res, args)


def report(res: dict, args: argparse.Namespace) -> None:
    t = res["times"]
    gib = res["bytes_per_rank"] / 2**30
    import megatron.core

    lines = [
        f"# bench_megatron {dt.datetime.now().isoformat(timespec='minutes')}",
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus; torch {torch.__version__}; "
        f"megatron-core {megatron.core.__version__}",
        f"state: {gib:.2f} GiB per rank x {args.world} rank(s); {args.rounds} rounds (+{args.warmup} warmup); dir {args.dir}",
        "",
        "| op | ckptlib s (median) | torch_dist s (median) | median ratio ckptlib/torch_dist | ckptlib GB/s |",
        "|---|---|---|---|---|",
    ]
    summary = {}
    for op in ("save", "load"):
        a, b = t["ckptlib"][op], t["torch_dist"][op]
        ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
        ma, mb = statistics.median(a), statistics.median(b)
        rate = res["bytes_per_rank"] * args.world / ma / 1e9
        lines.append(f"| {op} | {ma:.3f} | {mb:.3f} | {ratio:.2f} | {rate:.2f} |")
        summary[op] = {
            "ckptlib": ma,
            "torch_dist": mb,
            "ratio": ratio,
            "ckptlib_all": a,
            "torch_dist_all": b,
        }
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
