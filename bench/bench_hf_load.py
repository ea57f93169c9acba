#!/usr/bin/env python3
"""Memory and bytes of loading a Hugging Face safetensors folder into 2 ranks' shards.

Builds a folder of ``--gib`` GiB (float32 tensors of 8192 x 4096, 128 MiB each, random values)
as Hugging Face writes it: ``--files`` shard files + ``model.safetensors.index.json``, with the
safetensors package. Then ``--world`` rank processes (gloo, 127.0.0.1) each allocate their
``ckptlib.Shard`` targets (an even row split of every tensor) and, one after the other in the same
run, measure two ways to fill them (``--split rows``: each rank holds a block of rows, which
ckptlib reads straight into place; ``--split cols``: a block of columns, so every chunk goes
through a bounded read buffer and is copied from there):

* ``ckptlib``: ``ckptlib.load(folder, into=targets, select="model")``;
* ``naive``: what users do today, ``safetensors.torch.load_file`` of every file (the whole model
  in this process), then a copy of the rank's rows.

For each: the rank's peak extra RSS (VmHWM of /proc/self/status, reset through
/proc/self/clear_refs just before, minus VmRSS then: the targets are allocated and touched
before), the bytes its read calls returned (``rchar`` of /proc/self/io) and the wall time.
Every loaded shard is compared bitwise with the folder's rows. Page cache is warm (the folder
was just written). Run ``--help`` for options.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROWS, COLS = 8192, 4096  # 128 MiB float32 tensors


def status(field: str) -> int:
    """A /proc/self/status field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(fn) -> dict[str, float]:
    gc.collect()
    reset = reset_peak()
    rss, hwm0, io0, t0 = status("VmRSS"), status("VmHWM"), rchar(), time.perf_counter()
    fn()
    seconds, io1, hwm1 = time.perf_counter() - t0, rchar(), status("VmHWM")
    return {"peak_extra_rss": hwm1 - (rss if reset else hwm0), "bytes_read": io1 - io0, "seconds": seconds,
            "peak_reset": reset}


def rank_main(rank: int, world: int, port: str, folder: str, out: str, split: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    import ckptlib

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    index = json.loads(Path(folder, "model.safetensors.index.json").read_text())["weight_map"]
    dim = 0 if split == "rows" else 1
    n = (ROWS, COLS)[dim]
    lo, hi = rank * n // world, (rank + 1) * n // world
    box, offset = ((hi - lo, COLS), (lo, 0)) if dim == 0 else ((ROWS, hi - lo), (0, lo))

    def targets() -> dict:
        return {"model": {k: ckptlib.Shard(torch.zeros(box), (ROWS, COLS), offset) for k in index}}

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(dim, lo, hi - lo)

    def check(state: dict) -> bool:
        from safetensors import safe_open

        ok = True
        for k, file in index.items():
            with safe_open(os.path.join(folder, file), "pt") as f:
                ok &= torch.equal(mine(f.get_tensor(k)), state["model"][k].local)
        return ok

    first = next(iter(index))
    warm = {"model": {first: ckptlib.Shard(torch.zeros(1, COLS), (ROWS, COLS), (0, 0))}}
    ckptlib.load(folder, into=warm, select="model", strict=False)  # warm-up (imports): one row
    result: dict[str, object] = {"rank": rank, "own_bytes": len(index) * (hi - lo) * (ROWS * COLS // n) * 4}
    for name in ("ckptlib", "naive"):
        state = targets()
        if name == "ckptlib":
            fig = measure(lambda state=state: ckptlib.load(folder, into=state, select="model"))
        else:
            def naive(state: dict = state) -> None:
                from safetensors.torch import load_file

                full: dict[str, torch.Tensor] = {}
                for file in sorted(set(index.values())):
                    full.update(load_file(os.path.join(folder, file)))
                for k, s in state["model"].items():
                    s.local.copy_(mine(full[k]))
            fig = measure(naive)
        fig["bitwise"] = check(state)
        result[name] = fig
        del state
    Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def build(folder: Path, gib: float, files: int) -> int:
    from safetensors.torch import save_file

    count = max(files, round(gib * (1 << 30) / (ROWS * COLS * 4)))
    g = torch.Generator().manual_seed(0)
    names = [f"layers.{i}.weight" for i in range(count)]
    per = -(-count // files)
    weight_map = {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {n: torch.randn(ROWS, COLS, generator=g) for n in names[i * per:(i + 1) * per]}
        save_file(part, str(folder / file))
        weight_map.update({n: file for n in part})
        del part
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(p.stat().st_size for p in folder.iterdir())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="folder size in GiB (default 1)")
    ap.add_argument("--files", type=int, default=2, help="shard files (default 2)")
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--split", choices=("rows", "cols"), default="rows", help="what each rank holds (default rows)")
    ap.add_argument("--dir", type=Path, help="where to write (default: a temporary folder, removed)")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--rank", nargs=6, metavar=("RANK", "WORLD", "PORT", "FOLDER", "OUT", "SPLIT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        rank, world, port, folder, out, split = args.rank
        rank_main(int(rank), int(world), port, folder, out, split)
        return 0

    work = Path(tempfile.mkdtemp(prefix="ckptlib-bench-hf-", dir=args.dir))
    try:
        folder = work / "hf"
        folder.mkdir()
        size = build(folder, args.gib, args.files)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from launcher import free_port

        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(args.world), port, str(folder),
                                   str(work / f"rank{r}.json"), args.split]) for r in range(args.world)]
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise SystemExit(f"a rank failed (exit {p.returncode})")
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(args.world)]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mib = 1 << 20
    print(f"folder: {size / mib:.0f} MiB in {args.files} files + index; {args.world} ranks, Shard targets ({args.split})")
    print("| rank | way | peak extra RSS | vs folder | bytes read | own rows | time | bitwise |")
    print("|---|---|---|---|---|---|---|---|")
    for r in ranks:
        for way in ("ckptlib", "naive"):
            f = r[way]
            print(f"| {r['rank']} | {way} | {f['peak_extra_rss'] / mib:.0f} MiB | {f['peak_extra_rss'] / size:.3f} | "
                  f"{f['bytes_read'] / mib:.1f} MiB | {r['own_bytes'] / mib:.0f} MiB | {f['seconds']:.2f} s | "
                  f"{f['bitwise']} |")
    if args.json:
        args.json.write_text(json.dumps({"folder_bytes": size, "files": args.files, "split": args.split, "ranks": ranks},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
