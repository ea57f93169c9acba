#!/usr/bin/env python3
"""DeepSpeed checkpoint save/load: ckptlib's engine vs DeepSpeed's default TorchCheckpointEngine.

One process, one rank (gloo, CPU), one DeepSpeed engine (ZeRO stage ``--stage``, an MLP of
``--mparams`` million fp32 parameters with Adam). Each round saves the *same* engine state with
both checkpoint engines (swapping ``engine.checkpoint_engine``) through the unchanged
``engine.save_checkpoint`` call, then loads each back with ``engine.load_checkpoint``; the order
of the two contenders alternates every round (paired rounds). Reported: per-contender medians
and the median of the per-round ratios ckptlib / torch.

What is timed:
- ``save``: the whole ``engine.save_checkpoint`` call. ckptlib's includes fsync of every file
  and the atomic commit; DeepSpeed's default does not fsync, so ``torch+fsync`` adds the time to
  fsync its files right after (what durability would cost it).
- ``load``: the whole ``engine.load_checkpoint`` call, cold: before it every file of both
  checkpoints is fsynced and dropped from the page cache (POSIX_FADV_DONTNEED). ckptlib's load
  verifies checksums of everything it reads; DeepSpeed's verifies nothing.

After the first round the ckptlib load is checked bitwise against the saved parameters.

    DS_ACCELERATOR=cpu .venv/bin/python bench/bench_deepspeed.py            # 5 rounds, 25M params
    DS_ACCELERATOR=cpu .venv/bin/python bench/bench_deepspeed.py --quick    # 2 rounds, 5M params
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in _files(root))


def _fsync_all(root: Path) -> None:
    for p in _files(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _drop_cache(root: Path) -> None:
    for p in _files(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _param_digest(engine) -> str:
    import torch

    h = hashlib.sha256()
    for _, p in engine.module.named_parameters():
        t = (p.ds_tensor if hasattr(p, "ds_tensor") else p.data).detach().contiguous()
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument(
        "--mparams", type=float, default=25.0, help="model size in millions of fp32 parameters"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--dir", default=None, help="where checkpoints go (default: a temporary folder)"
    )
    ap.add_argument("--quick", action="store_true", help="2 rounds, 5M parameters")
    ap.add_argument(
        "--out",
        default=None,
        help="report file (default bench/results/<date>-deepspeed-stage<S>.md)",
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.mparams = 2, 5.0

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    import deepspeed
    import deepspeed.ops
    import torch

    from ckptlib.integrations import deepspeed as ckds

    deepspeed.ops.__compatible_ops__ = {}
    deepspeed.init_distributed(dist_backend="gloo")
    width = 2048
    layers = max(1, round(args.mparams * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    x = torch.randn(2, width)
    engine.backward(engine(x).square().mean())
    engine.step()  # optimizer state exists

    rounds_seen = {"n": 0}
    ck = ckds.install(engine, step_fn=lambda e, tag: rounds_seen["n"])
    torch_engine = ck.previous
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-ds-"))
    base.mkdir(parents=True, exist_ok=True)
    saved = _param_digest(engine)
    times: dict[str, list[float]] = {
        k: []
        for k in ("ckptlib.save", "torch.save", "torch+fsync.save", "ckptlib.load", "torch.load")
    }
    sizes: dict[str, int] = {}
    try:
        for r in range(args.rounds):
            rounds_seen["n"] = r
            order = ["ckptlib", "torch"] if r % 2 == 0 else ["torch", "ckptlib"]
            dirs = {c: base / f"{c}-{r}" for c in order}
            for c in order:
                engine.checkpoint_engine = ck if c == "ckptlib" else torch_engine
                t0 = time.perf_counter()
                engine.save_checkpoint(str(dirs[c]), tag=f"round{r}")
                t1 = time.perf_counter()
                times[f"{c}.save"].append(t1 - t0)
                if c == "torch":
                    _fsync_all(dirs[c])
                    times["torch+fsync.save"].append(time.perf_counter() - t0)
                sizes[c] = _size(dirs[c])
            for c in order:
                _drop_cache(dirs[c])
            for c in order:
                engine.checkpoint_engine = ck if c == "ckptlib" else torch_engine
                t0 = time.perf_counter()
                path, _ = engine.load_checkpoint(str(dirs[c]), tag=f"round{r}")
                times[f"{c}.load"].append(time.perf_counter() - t0)
                assert path is not None, f"{c} load found nothing"
                if c == "ckptlib" and r == 0:
                    assert _param_digest(engine) == saved, "ckptlib load is not bitwise equal"
            for d in dirs.values():
                shutil.rmtree(d)
            print(
                f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()),
                flush=True,
            )
    finally:
        engine.checkpoint_engine = ck
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    gib = sizes["torch"] / 2**30
    lines = [
        f"# DeepSpeed checkpoint engines — {dt.date.today().isoformat()}",
        "",
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at the end; python {platform.python_version()}, "
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}",
        f"ZeRO stage {args.stage}, 1 rank, {layers} x Linear({width},{width}) = "
        f"{nparams / 1e6:.1f}M fp32 params + Adam; "
        f"{args.rounds} paired alternating rounds; checkpoint {gib:.3f} GiB (torch), "
        f"{sizes['ckptlib'] / 2**30:.3f} GiB (ckptlib)",
        "",
        "| operation | median s | GiB/s |",
        "|---|---|---|",
    ]
    for k, v in times.items():
        med = statistics.median(v)
        lines.append(f"| {k} | {med:.3f} | {gib / med:.2f} |")
    lines += [
        "",
        "| ratio (median of per-round ratios) | value |",
        "|---|---|",
        f"| ckptlib.save / torch.save (no fsync) | {ratio('ckptlib.save', 'torch.save'):.2f} |",
        f"| ckptlib.save / torch+fsync.save | {ratio('ckptlib.save', 'torch+fsync.save'):.2f} |",
        f"| ckptlib.load / torch.load (cold) | {ratio('ckptlib.load', 'torch.load'):.2f} |",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    out = (
        Path(args.out)
        if args.out
        else Path(__file__).resolve().parent
        / "results"
        / (
            f"{dt.date.today().isoformat()}-deepspeed-stage{args.stage}{'-quick' if args.quick else ''}.md"
        )
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
