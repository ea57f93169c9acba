"""bench/bench_gpu.py on a machine without a GPU: the one-line refusal (exit 2), and its CPU smoke
run (the same code paths on CPU tensors) writing every figure the GPU run will write.

Timings are not checked (they are the benchmark's output); what is checked is that every section,
saver, per-save figure and ratio is there, that every bitwise check passed and could have failed
(its control, and the state really mutated right after each async save), that a size the budget
cannot hold is skipped with a reason, and that nothing is left behind in --dir or /dev/shm.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "bench_gpu.py"
NO_GPU = "no CUDA device: bench_gpu.py needs one GPU (torch.cuda.is_available() is False)"
SAVERS = ("ckptlib", "torch.save", "dcp", "ckptlib+tier", "dcp+stager", "ckptlib.overlap")
SUMMARY = ("blocked_first_s", "blocked_s", "step_increase_first_s", "step_increase_s", "durable_s", "persisted_s",
           "plain_iter_s", "during_slowdown", "new_pinned_bytes_first", "new_pinned_bytes_later",
           "new_pinned_allocs_later", "arena_bytes", "arena_reused", "copy_floor_s", "reuse_ok",
           "staging_freed_on_close")
ROW = ("save_s", "wait_s", "blocked_s", "iter_s", "durable_s", "plain_iter_s", "step_increase_s", "during_steps",
       "during_iter_s", "during_slowdown")
MACHINE = ("torch", "cuda", "python", "ckptlib", "cpus", "host_mem_total", "host_mem_available", "disk_free", "disk_fs",
           "shm", "shm_free", "gpu", "gpu_free_bytes", "gpu_total_bytes")


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",  # no GPU, even on a machine with one
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(BENCH), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_without_a_gpu_it_exits_2_with_one_clear_line(tmp_path: Path) -> None:
    proc = run("--json", str(tmp_path / "never.json"), "--dir", str(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == NO_GPU
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written, no folders made


def test_cpu_smoke_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    where = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)  # a few MiB; fsync costs nothing there
    # 64 GiB cannot fit the budget left after the first size: it must be skipped, with the reason
    proc = run("--cpu-smoke", "--sizes", "0.001,64", "--dir", where, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["exit_code"] == 0 and r["errors"] == [] and r["complete"] is True
    assert set(r["seconds_per_gib_saved"]) == set(SAVERS)
    assert set(MACHINE) <= set(r["machine"]) and r["machine"]["gpu"] is None
    assert not os.path.exists(r["machine"]["shm"])  # the tmpfs folder of the memory tier is gone
    assert not os.path.exists(r["machine"]["dir"])  # and so is every checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json"]

    b = r["bitwise"]
    assert b["ok"] is True and b["control_detects_flip"] is True
    assert b["dtypes"] == {"bfloat16": 30, "float32": 30} and b["non_contiguous"] > 0
    assert len(b["checks"]) == 5 and all(c["ok"] and c["n_mismatches"] == 0 for c in b["checks"].values())
    assert b["mutated_after_save"] == {"default": 60, "tier": 60, "overlap": 60}  # a late copy would have shown
    assert set(b["pinned"]) == {"default", "tier", "overlap"}

    assert list(r["sizes"]) == ["0.001 GiB"]
    assert [s["what"] for s in r["skipped"]] == ["64 GiB"] and "--budget-s" in r["skipped"][0]["reason"]
    assert "SKIP 64 GiB:" in proc.stdout
    size = r["sizes"]["0.001 GiB"]
    assert size["bytes"] == (2**30 // 1000) // 64 * 64 and size["tensors"] > 50
    assert list(size["savers"]) == list(SAVERS)
    for name, x in size["savers"].items():
        assert len(x["saves"]) == 2, name
        assert set(SUMMARY) <= set(x["summary"]), name
        for row in x["saves"]:
            assert set(ROW) <= set(row), (name, row)
            assert row["durable_s"] >= 0 and row["blocked_s"] >= row["save_s"] >= 0, (name, row)
        # On the CPU the memory tier's snapshot lands in its files (ckptlib/engine/mapped_arena.py):
        # it holds no staging arena to reuse or free. A CUDA state still stages through pinned memory.
        reuses = name.startswith("ckptlib") and name != "ckptlib+tier"
        expect = True if reuses else None
        assert x["summary"]["arena_reused"] is x["summary"]["reuse_ok"] is x["summary"]["staging_freed_on_close"] \
            is expect, name
        assert ("persisted_s" in x["saves"][0]) is (name == "ckptlib+tier"), name
    ck = size["savers"]["ckptlib"]["summary"]
    assert ck["copy_floor_s"] > 0 and ck["arena_bytes"] >= size["bytes"]
    for a, b_ in (("ckptlib", "torch.save"), ("ckptlib", "dcp"), ("ckptlib", "dcp+stager"), ("ckptlib+tier", "ckptlib")):
        for key in ("blocked", "step_increase", "durable"):
            assert math.isfinite(size["ratios"][f"{a} / {b_}: {key}"]), (a, b_, key)
    assert "## Bitwise" in proc.stdout and "| ckptlib+tier |" in proc.stdout and "Ratios:" in proc.stdout


def test_fits_names_the_resource_that_is_short(tmp_path: Path) -> None:
    saved = list(sys.path)
    try:
        sys.path.insert(0, str(BENCH.parent))
        import bench_gpu
    finally:
        sys.path[:] = saved
    gib = bench_gpu.GIB
    args = SimpleNamespace(host_mem_gib=None)
    ctx = SimpleNamespace(args=args, work=str(tmp_path), shm=str(tmp_path), host_free=lambda: 2 * gib)
    assert bench_gpu.fits(ctx, "torch.save", gib // 2) is None
    assert "host memory" in bench_gpu.fits(ctx, "ckptlib", gib)  # 1 GiB staging + 2 GiB margin > 2 GiB
    assert "MemAvailable" in bench_gpu.fits(ctx, "ckptlib", gib)
    assert "disk" in bench_gpu.fits(ctx, "ckptlib", 1 << 60)
    args.host_mem_gib = 2.0  # the planned memory, named in the reason
    assert "--host-mem-gib" in bench_gpu.fits(ctx, "ckptlib", gib)
    ctx.host_free = lambda: 7 * gib // 2
    assert bench_gpu.fits(ctx, "ckptlib", gib) is None
    assert "host memory" in bench_gpu.fits(ctx, "ckptlib+tier", gib)  # staging + its tmpfs copy
