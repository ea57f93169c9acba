#!/usr/bin/env python3
"""GPU benchmark: bitwise CUDA round trips, the training stall of async saves, pinned-buffer reuse.

Needs one CUDA device: without one it prints one line and exits 2. ``--cpu-smoke`` runs the same
code paths on CPU tensors with tiny sizes (tests/test_bench_gpu.py). One process, in order:

1. **bitwise** -- a few hundred device tensors (bf16 and fp32; scalars to 4-D; transposed and
   strided views; NaN, +-inf, -0.0) saved and read back into fresh device tensors, compared bit
   for bit on the device (``torch.equal`` of same-size integer views): ``ckptlib.save`` +
   ``load(into=)`` and ``load()``; ``CheckpointManager.save`` (async) with matmuls and an add
   queued on the training stream just before the call and every tensor negated right after it
   returns (the checkpoint must hold the values at the call); the memory tier (restored by a fresh
   manager, and the drained disk copy); overlap mode (the optimizer step mutates right after
   ``save()``). A control flips one bit of a loaded tensor, which must be caught.
2. **stall** -- per size (``--sizes`` GiB, ascending, built to exactly that many bytes: bf16
   matmul weights, fp32 master weights and vectors), one saver after another, each saving inside a
   training loop on the device. A step = forward+backward (matmuls of activations with the state's
   weights, ``--step-ms``) + an optimizer step adding to every state tensor in place + a device
   synchronize. Per save: **blocked** = time in the save call + what the loop had to wait for
   before its optimizer step (DCP with a stager: its staging future; overlap: the step pre-hook);
   **step +** = that step's time minus the median of the plain steps before it; **durable** = call
   to fsynced and committed; **persisted** (memory tier) = call to committed on disk. Training
   goes on while a save persists (**slowdown** = those steps' median / the plain median). Savers:
   ``ckptlib`` (``CheckpointManager.save``), ``torch.save`` (file + fsync), ``dcp``
   (``async_save`` as shipped: a fresh host copy per save), ``ckptlib+tier``
   (``local=/dev/shm/<unique>/{node}``), ``dcp+stager`` (one reused ``DefaultStager``: pinned
   memory, async staging, non-blocking copies) and, when asked for, ``ckptlib.overlap``.
3. **pinned reuse** -- per ckptlib save: new pinned host allocations and bytes
   (``torch.cuda.host_memory_stats``) and whether the staging arena is still the first save's
   (same tensor object and address); first save against later ones; the copy floor (the state
   copied into that arena with one ``_foreach_copy_``); and whether ``close()`` let it go.

Each saver's files are deleted after each save, its staging memory released before the next. A
size or saver that does not fit the free disk, host memory (``MemAvailable``, or
``--host-mem-gib``), /dev/shm, GPU memory, or the time left of ``--budget-s`` (predicted from
the seconds per GiB measured at the smaller sizes) is skipped with a printed reason. Exit codes:
0 ran (skips allowed), 1 a bitwise check or a ckptlib save failed or a later ckptlib save
allocated staging memory, 2 no CUDA device, 3 ckptlib not importable. ``--json OUT``: every
figure and the machine, rewritten after each section. docs/performance.md, "GPU".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # this checkout's ckptlib; bench_async's helpers

from gpu_savers import Trainer, host_stats, make_saver, pinned_delta, step_dir  # noqa: E402

GIB = 2**30
MARGIN = GIB  # left free on every resource beyond what a saver needs
NO_GPU = "no CUDA device: bench_gpu.py needs one GPU (torch.cuda.is_available() is False)"
SAVERS = ("ckptlib", "torch.save", "dcp", "ckptlib+tier", "dcp+stager", "ckptlib.overlap")
"""In the order they run at each size: when time runs short, the last ones are skipped."""
REUSES = ("ckptlib", "ckptlib+tier", "dcp+stager", "ckptlib.overlap")
"""Savers that reuse staging memory, so their first save differs from later ones."""
BITS = {2: torch.int16, 4: torch.int32}


# ----------------------------------------------------------------------------- machine, context
def meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = int(v.split()[0]) * 1024
    return out


def fs_type(path: str) -> str:
    best, kind = "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            p = line.split()
            if len(p) > 2 and os.path.realpath(path).startswith(p[1]) and len(p[1]) > len(best):
                best, kind = p[1], p[2]
    return kind


class Ctx:
    """What every section shares: device, folders, options, the budget's clock, skips, errors."""

    def __init__(self, args: argparse.Namespace, dev: torch.device, work: str, shm: str) -> None:
        self.args, self.dev, self.work, self.shm = args, dev, work, shm
        self.t0 = time.monotonic()
        self.skipped: list[dict[str, str]] = []
        self.errors: list[dict[str, str]] = []

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def skip(self, what: str, reason: str) -> None:
        print(f"SKIP {what}: {reason}", flush=True)
        self.skipped.append({"what": what, "reason": reason})

    def error(self, what: str, e: BaseException) -> None:
        print(f"ERROR {what}: {type(e).__name__}: {e}", flush=True)
        self.errors.append({"what": what, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})

    def host_free(self) -> int:
        mi = meminfo()
        if self.args.host_mem_gib is None:
            return mi.get("MemAvailable", 0)
        # a VM that grows its memory on demand under-reports it: the planned total minus what is in use
        return int(self.args.host_mem_gib * GIB) - (mi.get("MemTotal", 0) - mi.get("MemAvailable", 0))

    def machine(self) -> dict[str, Any]:
        import ckptlib

        mi = meminfo()
        d: dict[str, Any] = {
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "ckptlib": ckptlib.__version__, "cpus": os.cpu_count(), "platform": platform.platform(),
            "host_mem_total": mi.get("MemTotal"), "host_mem_available": mi.get("MemAvailable"),
            "dir": self.work, "disk_free": shutil.disk_usage(self.work).free, "disk_fs": fs_type(self.work),
            "shm": self.shm, "shm_free": shutil.disk_usage(self.shm).free, "shm_fs": fs_type(self.shm), "device": str(self.dev),
            "gpu": None, "gpu_free_bytes": None, "gpu_total_bytes": None,
        }
        if self.dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.dev)
            p = torch.cuda.get_device_properties(self.dev)
            d.update(gpu=p.name, gpu_free_bytes=free, gpu_total_bytes=total, gpu_capability=f"{p.major}.{p.minor}",
                     gpus=torch.cuda.device_count())
        return d


def release_memory(ctx: Ctx) -> None:
    """Untimed, between savers: collect; on a GPU also hand cached pinned and device memory back
    and flush the disk."""
    gc.collect()
    if ctx.dev.type == "cuda":
        ctx.sync()
        empty = getattr(torch._C, "_host_emptyCache", None)  # freed pinned blocks stay cached otherwise
        if empty is not None:
            empty()
        torch.cuda.empty_cache()
        os.sync()  # the next saver starts with the disk's write-back done (CPU smoke: not worth it)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.element_size()])


def mismatches(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names whose dtype, shape or any bit differs (compared on the expected tensor's device)."""
    bad = []
    for k, e in expected.items():
        g = got.get(k)
        if (not isinstance(g, torch.Tensor) or g.dtype != e.dtype or g.shape != e.shape
                or not torch.equal(bits(e), bits(g.to(e.device)))):
            bad.append(k)
    return bad


# ----------------------------------------------------------------------------- states, training
def mixed_state(dev: torch.device, n: int) -> dict[str, torch.Tensor]:
    """``n`` bf16/fp32 tensors of mixed shapes; some transposed or strided, some with NaN/inf/-0.0."""
    shapes = [(), (1,), (7,), (1000,), (4096,), (33, 17), (128, 256), (3, 5, 7), (64, 1024), (2, 3, 4, 5), (257, 129)]
    g = torch.Generator(device=dev).manual_seed(7)
    sd: dict[str, torch.Tensor] = {}
    for i in range(n):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        shape = shapes[i % len(shapes)]
        t = torch.randn(shape, generator=g, device=dev).to(dtype)
        if i % 7 == 0 and t.numel() >= 4:
            t.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], dtype=dtype)
        if len(shape) == 2 and i % 3 == 0:
            t = t.t()
        elif len(shape) == 1 and i % 5 == 0 and shape[0] > 2:
            t = t[::2]
        sd[f"t{i:04d}.{str(dtype)[6:]}"] = t
    return sd


LAYER = [("qkv", (3, 1), torch.bfloat16), ("proj", (1, 1), torch.bfloat16), ("fc", (4, 1), torch.bfloat16),
         ("fc2", (1, 4), torch.bfloat16), ("proj.master", (1, 1), torch.float32), ("ln.w", (1,), torch.float32),
         ("ln.b", (1,), torch.float32), ("fc.b", (4,), torch.float32)]
"""One layer of the sized state: name, shape in multiples of the width d, dtype."""


def layer_bytes(d: int) -> int:
    return sum(torch.Size([m * d for m in s]).numel() * (2 if dt == torch.bfloat16 else 4) for _, s, dt in LAYER)


def sized_state(nbytes: int, dev: torch.device, width: int) -> dict[str, torch.Tensor]:
    """A GPT-like state of exactly ``nbytes`` (each tensor a multiple of 64 bytes, so the staging
    arena is exactly ``nbytes``): layers of ``LAYER`` at width ``d`` (``width``, halved until two
    layers fit), the rest in one bf16 tensor."""
    d = width
    while d > 16 and 2 * layer_bytes(d) > nbytes:
        d //= 2
    g = torch.Generator(device=dev).manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    left, i = nbytes, 0
    while left >= layer_bytes(d):
        for name, s, dtype in LAYER:
            sd[f"h.{i}.{name}"] = torch.randn([m * d for m in s], generator=g, device=dev).to(dtype)
        left -= layer_bytes(d)
        i += 1
    if left:
        sd["rest"] = torch.randn(left // 2, generator=g, device=dev).to(torch.bfloat16)
    return sd


# ----------------------------------------------------------------------------- bitwise
def run_bitwise(ctx: Ctx) -> dict[str, Any]:
    from bench_async import StepOpt

    import ckptlib

    t_start = time.perf_counter()
    sd = mixed_state(ctx.dev, ctx.args.bitwise_tensors)
    out: dict[str, Any] = {
        "tensors": len(sd), "bytes": sum(t.nbytes for t in sd.values()),
        "dtypes": {str(k)[6:]: sum(t.dtype == k for t in sd.values()) for k in (torch.bfloat16, torch.float32)},
        "non_contiguous": sum(not t.is_contiguous() for t in sd.values()), "checks": {}, "pinned": {},
        "mutated_after_save": {},
    }
    root = os.path.join(ctx.work, "bitwise")
    n = 4096 if ctx.dev.type == "cuda" else 64
    big = torch.randn(n, n, device=ctx.dev)

    def target() -> dict[str, torch.Tensor]:
        return {k: torch.full_like(v, 7) for k, v in sd.items()}  # keeps each tensor's strides

    def snapshot_point() -> dict[str, torch.Tensor]:
        """Work queued on the training stream just before a save (on a GPU some 50 ms of matmuls,
        then an add to every tensor); the values the save must hold."""
        for _ in range(20 if ctx.dev.type == "cuda" else 2):
            big.copy_(torch.tanh(big @ big / n**0.5))
        torch._foreach_add_(list(sd.values()), 1.0)
        return {k: v.clone() for k, v in sd.items()}

    loaded: dict[str, torch.Tensor] = {}

    def sync_save() -> tuple[dict, dict]:
        expected = {k: v.clone() for k, v in sd.items()}
        ckptlib.save(sd, os.path.join(root, "sync"))
        loaded.update(ckptlib.load(os.path.join(root, "sync"), into=target()))
        return expected, loaded

    def fresh_load() -> tuple[dict, dict]:
        return {k: v.clone() for k, v in sd.items()}, ckptlib.load(os.path.join(root, "sync"))

    def managed(mode: str) -> tuple[dict, dict]:
        url = os.path.join(root, mode)
        kw: dict[str, Any] = {"overlap": mode == "overlap", "save_timeout": ctx.args.save_timeout}
        if mode == "tier":
            kw.update(local=os.path.join(ctx.shm, "bitwise") + "/{node}", local_keep_last=1)
        opt = StepOpt([torch.nn.Parameter(t, requires_grad=False) for t in sd.values()])
        s0 = host_stats()
        with ckptlib.CheckpointManager(url, **kw) as mgr:
            expected = snapshot_point()
            h = mgr.save(1, {"model": sd, "opt": opt} if mode == "overlap" else sd)
            if mode == "overlap":
                opt.step()  # waits in the pre-hook until the background copy is done
            else:
                torch._foreach_neg_(list(sd.values()))  # flips every sign bit: a late copy would show
            out["mutated_after_save"][mode] = len(mismatches(expected, sd))
            h.wait(ctx.args.save_timeout)
            if mode == "tier":
                h.wait_persisted(ctx.args.save_timeout)
            out["pinned"][mode] = {**pinned_delta(s0, host_stats()), "arena_bytes": mgr._stager.nbytes}
        path = os.path.join(url, step_dir(1))
        if mode == "overlap":
            return expected, ckptlib.load(path)["model"]
        if mode != "tier":
            return expected, ckptlib.load(path, into=target())
        got = target()
        with ckptlib.CheckpointManager(url, **kw) as fresh:
            fresh.restore(got)  # from the tmpfs copy
        disk = ckptlib.load(path, into=target())
        return ({**expected, **{"disk/" + k: v for k, v in expected.items()}},
                {**got, **{"disk/" + k: v for k, v in disk.items()}})

    checks: list[tuple[str, Callable[[], tuple[dict, dict]]]] = [
        ("save + load(into)", sync_save), ("save + load()", fresh_load),
        ("manager async save + load(into)", lambda: managed("default")),
        ("memory tier save + restore; its disk copy + load(into)", lambda: managed("tier")),
        ("overlap save + load()", lambda: managed("overlap")),
    ]
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            expected, got = fn()
            bad = mismatches(expected, got)
            out["checks"][name] = {"ok": not bad, "n_mismatches": len(bad), "mismatches": bad[:20]}
        except Exception as e:
            ctx.error(f"bitwise {name}", e)
            out["checks"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out["checks"][name]["seconds"] = time.perf_counter() - t0
        print(f"bitwise {name}: {'OK' if out['checks'][name]['ok'] else 'FAIL'}", flush=True)
    out["control_detects_flip"] = False
    if loaded:  # the control: one flipped bit in a copy of a loaded tensor must be caught
        k = next(k for k, v in loaded.items() if v.numel() and v.is_contiguous())
        flipped = loaded[k].clone()
        bits(flipped).view(-1)[0] ^= 1
        out["control_detects_flip"] = mismatches({k: loaded[k]}, {k: flipped}) == [k]
    out["ok"] = all(c["ok"] for c in out["checks"].values()) and out["control_detects_flip"]
    out["seconds"] = time.perf_counter() - t_start
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(os.path.join(ctx.shm, "bitwise"), ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- stall
def run_saver(ctx: Ctx, name: str, sd: dict[str, torch.Tensor], trainer: Trainer, saves: int) -> dict[str, Any]:
    """``saves`` saves by one saver inside the training loop; its files go after each save."""
    saver = make_saver(ctx, name, sd, trainer)
    rows: list[dict[str, Any]] = []
    try:
        for i in range(saves):
            base = statistics.median(trainer.step()["iter_s"] for _ in range(ctx.args.plain_steps))
            row: dict[str, Any] = trainer.step(saver)
            during: list[float] = []
            deadline = time.monotonic() + ctx.args.save_timeout
            while not saver.done() and len(during) < ctx.args.during_max and time.monotonic() < deadline:
                during.append(trainer.step()["iter_s"])  # training goes on while the save persists
            row.update(saver.finish(max(1.0, deadline - time.monotonic())))
            dmed = statistics.median(during) if during else None
            row.update(plain_iter_s=base, step_increase_s=row["iter_s"] - base, during_steps=len(during),
                       during_iter_s=dmed, during_slowdown=None if dmed is None else dmed / base, **saver.pinned())
            saver.cleanup()
            rows.append(row)
            print(f"  {name} save {i + 1}/{saves}: blocked {row['blocked_s']:.4f} s, step +{row['step_increase_s']:.4f} s,"
                  f" durable {row['durable_s']:.3f} s" + (f", persisted {row['persisted_s']:.3f} s" if "persisted_s" in row
                                                          else ""), flush=True)
        floor = saver.floor()
    finally:
        saver.close()
    gc.collect()
    first = getattr(saver, "first_arena", None)  # ckptlib: close() must let its staging arena go
    return {"saves": rows, "summary": {**summarize(rows, floor), "staging_freed_on_close": None if first is None
                                       else first() is None}}


def summarize(rows: list[dict[str, Any]], floor: float | None) -> dict[str, Any]:
    later = rows[1:] or rows

    def med(key: str, among: list[dict[str, Any]]) -> float | None:
        xs = [r[key] for r in among if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    def total(key: str) -> int | None:
        xs = [r.get(key) for r in rows[1:]]
        return None if not xs or None in xs else sum(xs)

    ptrs = {r.get("arena_ptr") for r in rows}
    reused = None if ptrs == {None} or len(rows) < 2 else len(ptrs) == 1 and all(r["arena_same"] for r in rows)
    later_bytes = total("new_pinned_bytes")
    return {
        "blocked_first_s": rows[0]["blocked_s"], "blocked_s": med("blocked_s", later),
        "step_increase_first_s": rows[0]["step_increase_s"], "step_increase_s": med("step_increase_s", later),
        "durable_s": med("durable_s", rows), "persisted_s": med("persisted_s", rows),
        "plain_iter_s": med("plain_iter_s", rows), "during_slowdown": med("during_slowdown", rows),
        "new_pinned_bytes_first": rows[0].get("new_pinned_bytes"), "new_pinned_bytes_later": later_bytes,
        "new_pinned_allocs_later": total("new_pinned_allocs"), "arena_bytes": rows[-1].get("arena_bytes"),
        "arena_reused": reused, "copy_floor_s": floor,
        "reuse_ok": None if reused is None else reused and not later_bytes,  # later saves allocate nothing
    }


RATIOS = [("ckptlib", "torch.save"), ("ckptlib", "dcp"), ("ckptlib", "dcp+stager"), ("ckptlib+tier", "ckptlib"),
          ("ckptlib+tier", "torch.save"), ("ckptlib+tier", "dcp"), ("ckptlib.overlap", "dcp+stager")]


def ratios(savers: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Side by side in this run: blocked, step increase and durable (later saves), a / b."""
    out: dict[str, float] = {}
    for a, b in RATIOS:
        sa, sb = savers.get(a, {}).get("summary"), savers.get(b, {}).get("summary")
        for key in ("blocked_s", "step_increase_s", "durable_s"):
            if sa and sb and sa.get(key) is not None and sb.get(key):
                out[f"{a} / {b}: {key[:-2]}"] = sa[key] / sb[key]
    ck = savers.get("ckptlib", {}).get("summary")
    if ck and ck.get("copy_floor_s"):
        out["ckptlib: blocked / copy floor"] = ck["blocked_s"] / ck["copy_floor_s"]
    return out


def saves_for(ctx: Ctx, name: str, size: float) -> int:
    """``--saves``, or 3 up to 1 GiB; above it 2, and 1 for savers that reuse nothing."""
    if ctx.args.saves:
        return ctx.args.saves
    return 3 if size <= 1 else 2 if name in REUSES else 1


def fits(ctx: Ctx, name: str, nbytes: int) -> str | None:
    """Why ``name`` cannot save ``nbytes`` here now (disk, host memory, /dev/shm), or None."""
    disk = shutil.disk_usage(ctx.work).free
    if disk < nbytes + MARGIN:
        return f"needs {gib(nbytes + MARGIN)} GiB free disk in {ctx.work}, {gib(disk)} free"
    need = {"torch.save": 0, "ckptlib+tier": 2 * nbytes}.get(name, nbytes) + 2 * MARGIN  # staging (+ tmpfs)
    host = ctx.host_free()
    if host < need:
        how = "--host-mem-gib" if ctx.args.host_mem_gib is not None else \
            "MemAvailable; a VM that grows its memory on demand: pass --host-mem-gib"
        return f"needs {gib(need)} GiB host memory, {gib(host)} free ({how})"
    shm = shutil.disk_usage(ctx.shm).free
    if name == "ckptlib+tier" and shm < nbytes + MARGIN:
        return f"needs {gib(nbytes + MARGIN)} GiB free in {os.path.dirname(ctx.shm)}, {gib(shm)} free"
    return None


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def run_size(ctx: Ctx, size: float, savers: list[str], rates: dict[str, float]) -> dict[str, Any] | None:
    """Every saver at one size. ``rates``: seconds per GiB saved, per saver, from smaller sizes."""
    nbytes = int(size * GIB) // 64 * 64
    label = f"{size:g} GiB"
    if ctx.dev.type == "cuda" and torch.cuda.mem_get_info(ctx.dev)[0] < nbytes + 2 * MARGIN:
        ctx.skip(label, f"needs {gib(nbytes + 2 * MARGIN)} GiB of GPU memory, {gib(torch.cuda.mem_get_info(ctx.dev)[0])} free")
        return None

    def predict(name: str) -> float | None:
        r = rates.get(name, max(rates.values())) if rates else None
        return None if r is None else r * size * saves_for(ctx, name, size)

    first = predict(savers[0])
    if first is not None and first > ctx.left():
        ctx.skip(label, f"{savers[0]} alone is predicted to take {first:.0f} s (from the smaller sizes), "
                        f"{ctx.left():.0f} s are left of --budget-s {ctx.args.budget_s:.0f}")
        return None
    t_size = time.monotonic()
    sd = sized_state(nbytes, ctx.dev, ctx.args.width)
    trainer = Trainer(ctx, sd, ctx.args.step_ms / 1000)
    res: dict[str, Any] = {"bytes": nbytes, "tensors": len(sd), "step_reps": trainer.reps, "savers": {}, "seconds": {}}
    print(f"== {label}: {len(sd)} tensors, {nbytes:,} bytes ==", flush=True)
    try:
        for name in savers:
            p = predict(name)
            reason = fits(ctx, name, nbytes) or (f"predicted {p:.0f} s > {ctx.left():.0f} s left of --budget-s"
                                                 if p is not None and p > ctx.left() else None)
            if reason:
                ctx.skip(f"{name} at {label}", reason)
                continue
            t0 = time.monotonic()
            try:
                res["savers"][name] = run_saver(ctx, name, sd, trainer, saves_for(ctx, name, size))
            except Exception as e:
                ctx.error(f"{name} at {label}", e)
                res["savers"][name] = {"error": f"{type(e).__name__}: {e}"}
            finally:
                release_memory(ctx)
            res["seconds"][name] = time.monotonic() - t0
            rates[name] = res["seconds"][name] / (size * saves_for(ctx, name, size))
    finally:
        del trainer, sd
        release_memory(ctx)
        shutil.rmtree(os.path.join(ctx.shm, "tier"), ignore_errors=True)
    res["ratios"] = ratios(res["savers"])
    res["seconds"]["total"] = time.monotonic() - t_size
    return res


# ----------------------------------------------------------------------------- report, main
def render(r: dict[str, Any]) -> str:
    m = r["machine"]

    def f(v: Any, p: int = 4) -> str:
        return "-" if v is None else f"{v:.{p}f}" if isinstance(v, float) else str(v)

    gpu = (f"{m['gpu']} (capability {m['gpu_capability']}, {gib(m['gpu_free_bytes'])} of {gib(m['gpu_total_bytes'])} "
           "GiB free)" if m["gpu"] else "no GPU (CPU smoke run)")
    L = ["# ckptlib GPU benchmark", "",
         f"- machine: {gpu}; torch {m['torch']} (CUDA {m['cuda']}), Python {m['python']}, ckptlib {m['ckptlib']}, "
         f"{m['cpus']} CPUs, host memory {gib(m['host_mem_total'] or 0)} GiB ({gib(m['host_mem_available'] or 0)} "
         f"available), checkpoints on {m['disk_fs']} ({gib(m['disk_free'])} GiB free), tier on {m['shm_fs']} "
         f"({gib(m['shm_free'])} GiB free)",
         f"- command: `python bench/bench_gpu.py {' '.join(r['argv'][1:])}`: {r['elapsed_s']:.0f} s (--budget-s "
         f"{r['budget_s']:.0f}), exit code {r['exit_code']}"]
    b = r["bitwise"]
    if b:
        L += ["", f"## Bitwise: {b['tensors']} tensors {b['dtypes']}, {b['non_contiguous']} non-contiguous, "
              f"{b['bytes']:,} bytes", "", "| check | result | tensors differing | s |", "|---|---|---:|---:|"]
        L += [f"| {k} | {'OK' if c['ok'] else ' '.join(['FAIL', c.get('error', '')]).strip()} | {c.get('n_mismatches', '-')} | "
              f"{c['seconds']:.2f} |" for k, c in b["checks"].items()]
        L += ["", f"Control (one flipped bit caught): {b['control_detects_flip']}. Tensors changed by the mutation "
              f"right after save(): {b['mutated_after_save']} (of {b['tensors']}). Staging at the first save (arena "
              "bytes / new pinned host bytes): " + ", ".join(
                  f"{k} {v['arena_bytes']:,} / {f(v['new_pinned_bytes'])}" for k, v in b["pinned"].items())]
    for label, s in r["sizes"].items():
        plain = next((x["summary"]["plain_iter_s"] for x in s["savers"].values() if "summary" in x), None)
        L += ["", f"## {label}: {s['tensors']} tensors, training step {f(plain, 3)} s", "",
              "| saver | saves | blocked, 1st s | blocked s | step +, 1st s | step + s | durable s | persisted s "
              "| slowdown while persisting | new pinned bytes after the 1st | staging reused | copy floor s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for name, x in s["savers"].items():
            q = x.get("summary")
            L.append(f"| {name} | error: {x['error']} |" if q is None else
                     f"| {name} | {len(x['saves'])} | {f(q['blocked_first_s'])} | {f(q['blocked_s'])} | "
                     f"{f(q['step_increase_first_s'])} | {f(q['step_increase_s'])} | {f(q['durable_s'], 3)} | "
                     f"{f(q['persisted_s'], 3)} | {f(q['during_slowdown'], 2)} | {f(q['new_pinned_bytes_later'])} | "
                     f"{f(q['reuse_ok'])} | {f(q['copy_floor_s'])} |")
        L += ["", "Ratios: " + "; ".join(f"{k} {v:.3f}" for k, v in s["ratios"].items())] if s["ratios"] else []
    L += ["", "## Skipped", ""] + [f"- {x['what']}: {x['reason']}" for x in r["skipped"]] if r["skipped"] else []
    L += ["", "## Errors", ""] + [f"- {x['what']}: {x['error']}" for x in r["errors"]] if r["errors"] else []
    return "\n".join(L) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sizes", default=None, help="state sizes in GiB, comma-separated (default 1,8,32; smoke 0.001)")
    ap.add_argument("--savers", default=None, help=f"comma-separated, run in this order; from {', '.join(SAVERS)} "
                    "(default: all but ckptlib.overlap; smoke: all)")
    ap.add_argument("--budget-s", type=float, default=None, help="plan the run to end within this (default 420 s)")
    ap.add_argument("--saves", type=int, default=None, help="saves per saver and size (default: 3 up to 1 GiB; "
                    "above, 2 for savers that reuse staging memory, 1 for the others)")
    ap.add_argument("--step-ms", type=float, default=None, help="forward+backward per training step (default 100)")
    ap.add_argument("--plain-steps", type=int, default=None, help="plain steps before each save (default 3; smoke 1)")
    ap.add_argument("--during-max", type=int, default=5000, help="most steps run while one save persists")
    ap.add_argument("--width", type=int, default=None, help="hidden size of the state's layers (default 4096; smoke 64)")
    ap.add_argument("--bitwise-tensors", type=int, default=None, help="tensors in the bitwise state (default 300)")
    ap.add_argument("--save-timeout", type=float, default=600.0, help="deadline of each wait for one save (s)")
    ap.add_argument("--host-mem-gib", type=float, default=None, help="host memory to plan with, not MemAvailable")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a new temporary folder, removed)")
    ap.add_argument("--shm", default="/dev/shm", help="tmpfs folder of the memory tier (default /dev/shm)")
    ap.add_argument("--json", default=None, help="write every figure and the machine description here")
    ap.add_argument("--cpu-smoke", "--dry-run", action="store_true", help="the same code paths on CPU tensors, tiny")
    a = ap.parse_args(argv)
    smoke = a.cpu_smoke
    a.sizes = sorted(float(x) for x in (a.sizes or ("0.001" if smoke else "1,8,32")).split(","))
    a.savers = (a.savers or ",".join(SAVERS if smoke else SAVERS[:-1])).split(",")
    if set(a.savers) - set(SAVERS):
        ap.error(f"unknown saver(s) {sorted(set(a.savers) - set(SAVERS))}; choose from {', '.join(SAVERS)}")
    a.budget_s = a.budget_s if a.budget_s is not None else 120.0 if smoke else 420.0
    a.step_ms = a.step_ms if a.step_ms is not None else 2.0 if smoke else 100.0
    a.plain_steps = a.plain_steps or (1 if smoke else 3)
    a.saves = a.saves or (2 if smoke else None)
    a.width = a.width or (64 if smoke else 4096)
    a.bitwise_tensors = a.bitwise_tensors or (60 if smoke else 300)
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    dev = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", torch.cuda.current_device())
    try:
        import ckptlib  # noqa: F401
    except ImportError as e:
        print(f"bench_gpu.py: cannot import ckptlib ({e}); docs/performance.md (GPU) says how to bring its "
              "dependencies to a machine without network", file=sys.stderr)
        return 3
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    work = tempfile.mkdtemp(prefix="ckptlib-gpu-", dir=args.dir)
    shm = os.path.join(args.shm if os.path.isdir(args.shm) else work, f"ckptlib-gpu-{uuid.uuid4().hex[:12]}")
    os.makedirs(shm)
    ctx = Ctx(args, dev, work, shm)
    r: dict[str, Any] = {"argv": sys.argv if argv is None else ["bench_gpu.py", *argv], "args": vars(args), "budget_s": args.budget_s, "machine": ctx.machine(),
                         "bitwise": None, "sizes": {}}
    print(f"bench_gpu: {r['machine']['gpu'] or 'CPU smoke run'}; sizes {args.sizes} GiB; savers {args.savers}; "
          f"budget {args.budget_s:.0f} s; checkpoints in {work} ({r['machine']['disk_fs']}); tier in {shm}", flush=True)
    rates: dict[str, float] = {}

    def dump(done: bool) -> None:
        """The JSON so far (after every section, so a run killed later still leaves its figures)."""
        reuse = [x["summary"]["reuse_ok"] for z in r["sizes"].values() for x in z["savers"].values() if "summary" in x]
        failed = (not (r["bitwise"] or {}).get("ok") or any(e["what"].startswith("ckptlib") for e in ctx.errors)
                  or False in reuse)
        r.update(skipped=ctx.skipped, errors=ctx.errors, elapsed_s=time.monotonic() - ctx.t0, exit_code=int(failed),
                 complete=done, seconds_per_gib_saved=rates)
        if args.json:
            Path(args.json).write_text(json.dumps(r, indent=1, default=str))

    try:
        r["bitwise"] = run_bitwise(ctx)
        release_memory(ctx)
        dump(False)
        for size in args.sizes:
            res = run_size(ctx, size, args.savers, rates)
            if res is not None:
                r["sizes"][f"{size:g} GiB"] = res
            dump(False)
    finally:
        shutil.rmtree(shm, ignore_errors=True)  # always: a tmpfs holds memory until removed
        shutil.rmtree(work, ignore_errors=True)
    dump(True)
    print(render(r), flush=True)
    return r["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
