#!/usr/bin/env python3
"""Read-view benchmark: one 1 MiB slice vs a full load, and export throughput vs a raw copy.

Builds a float32 state of ``--gib`` GiB (tensors of 8192 x 4096 rows, i.e. 128 MiB each,
random values), saves it with ``ckptlib.save`` and then, in one process and one run:

* ``slice``: ``ckptlib.open(path).read(name, rows)`` of one 1 MiB slice (64 rows), including
  opening the view (manifest read and validation), against ``ckptlib.load(path)`` of everything;
* ``export``: ``export_zarr3`` (tensorstore, zstd level 3) and ``export_safetensors`` of the
  whole state, against a raw copy of the payload files (``shutil.copyfile``).

Page cache is warm for every contender (each reads the same files first), so the ratios
compare work done, not disk speed. Medians over ``--rounds``. Run ``--help`` for options.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import ckptlib
from ckptlib.read.to_safetensors import export_safetensors
from ckptlib.read.to_zarr3 import export_zarr3

ROWS, COLS = 8192, 4096  # 128 MiB float32 tensors
SLICE_ROWS = 64  # 64 rows x 16 KiB = 1 MiB


def timed(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds for the read rows (default 3)")
    ap.add_argument("--export-rounds", type=int, default=1, help="rounds for the export rows (default 1)")
    ap.add_argument("--dir", type=Path, help="where to write (default: a temporary folder, removed)")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ckptlib-bench-read-", dir=args.dir))
    try:
        count = max(1, round(args.gib * (1 << 30) / (ROWS * COLS * 4)))
        g = torch.Generator().manual_seed(0)
        state = {"model": {f"w{i}": torch.randn(ROWS, COLS, generator=g) for i in range(count)}}
        nbytes = sum(t.nbytes for t in state["model"].values())
        path = work / "ck"
        ckptlib.save(state, path)
        del state
        payload = [p for p in path.rglob("*.bin")]

        def one_slice() -> None:
            with ckptlib.open(path) as ck:
                ck.read(f"/model/w{count // 2}", slice(ROWS // 2, ROWS // 2 + SLICE_ROWS))

        with ckptlib.open(path) as ck:
            ck.read(f"/model/w{count // 2}", slice(ROWS // 2, ROWS // 2 + SLICE_ROWS))
            slice_bytes_read = ck.bytes_read
        ckptlib.load(path)  # warm the page cache
        t_slice = timed(one_slice, args.rounds)
        t_load = timed(lambda: ckptlib.load(path), args.rounds)

        def raw_copy() -> None:
            out = work / "raw"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            for i, p in enumerate(payload):
                shutil.copyfile(p, out / f"{i}.bin")

        def zarr3() -> None:
            with ckptlib.open(path) as ck:
                export_zarr3(ck, str(work / "zarr"))

        def safetensors() -> None:
            with ckptlib.open(path) as ck:
                export_safetensors(ck, str(work / "st"), "model")

        t_raw = timed(raw_copy, args.export_rounds)
        t_zarr = timed(zarr3, args.export_rounds)
        t_st = timed(safetensors, args.export_rounds)
        mib = nbytes / (1 << 20)
        res = {
            "state_bytes": nbytes, "slice_bytes": SLICE_ROWS * COLS * 4, "slice_bytes_read": slice_bytes_read,
            "slice_s": t_slice, "full_load_s": t_load, "load_over_slice": t_load / t_slice,
            "raw_copy_mib_s": mib / t_raw, "zarr3_mib_s": mib / t_zarr, "safetensors_mib_s": mib / t_st,
            "zarr3_over_raw": t_raw / t_zarr, "safetensors_over_raw": t_raw / t_st,
        }
        print(f"state {mib:.0f} MiB in {count} tensors; page cache warm; medians")
        print(f"1 MiB slice (open + read): {t_slice * 1e3:.1f} ms, {slice_bytes_read / (1 << 20):.1f} MiB read "
              f"| full load: {t_load:.2f} s | full load / slice = {t_load / t_slice:.0f}x")
        print(f"raw copy {mib / t_raw:.0f} MiB/s | zarr3 export {mib / t_zarr:.0f} MiB/s "
              f"({t_raw / t_zarr:.2f}x raw) | safetensors export {mib / t_st:.0f} MiB/s ({t_raw / t_st:.2f}x raw)")
        if args.json:
            args.json.write_text(json.dumps(res, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
