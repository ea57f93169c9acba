#!/usr/bin/env python3
"""Save/load benchmark: ckptlib against raw write+fsync, torch.save/torch.load and torch DCP.

Two workloads, built directly as tensors:

* ``gpt``   -- a GPT-like state dict (vocab 50257 embedding, N transformer blocks with
  attention/MLP weights in bfloat16, biases/LayerNorms/embeddings in float32), ~``--gib`` GiB.
* ``small`` -- 20,000 tensors of 1-16 KiB each (seeded sizes, mixed dtypes) in one flat dict.

All contenders run in one process, in paired alternating rounds (round r runs the contenders
in an order rotated by r), each writing into its own fresh folder. Every save is timed up to
and including its own fsync; every load is timed cold (each written file fsynced and dropped
from the page cache with POSIX_FADV_DONTNEED, residency checked with mincore) and warm (after a
full read of the files). Each load variant is checked once against the original tensors, so a
broken contender cannot look fast. The report gives per-contender medians and the median of
the per-round ratios, with the project targets marked PASS/MISS.

Run ``python bench/bench_save_load.py --help``; see bench/README.md for how to read it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import ctypes.util
import dataclasses
import datetime as dt
import gc
import importlib.metadata
import inspect
import io
import json
import mmap
import os
import platform
import pstats
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
GB = 1e9
IO_CHUNK = 64 * 2**20  # bytes per read() call for large transfers
# Bytes per write() call. On the reference VM, 2 GiB written in 16-64 MiB write() calls took
# 2-5x longer than in 1-8 MiB calls (same data, same fsync), so the floor uses 4 MiB.
WRITE_CHUNK = 4 * 2**20
RAW_STAGING = 16 * 2**20  # small tensors are packed into a buffer this big before writing
RAW_DIRECT_MIN = 4 * 2**20  # tensors at least this big are written straight from their memory
RAW_SEGMENT_MIN = 2**20  # raw.read gives tensors at least this big their own buffer
RAW_ALIGN = 8  # raw layout aligns each tensor so a byte buffer can be viewed as any dtype
BENCH_DIR = Path(__file__).resolve().parent


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Workload:
    name: str
    description: str
    state: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.state.values())

    @property
    def ntensors(self) -> int:
        return len(self.state)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=dtype)


def build_gpt(gib: float, seed: int) -> Workload:
    """A GPT-2-style state dict sized to about ``gib`` GiB (weights tied, so no lm_head)."""
    target = gib * GIB
    vocab, ctx = 50257, 2048
    f32, bf16 = torch.float32, torch.bfloat16
    d = 128
    for cand in (2048, 1536, 1024, 768, 512, 256, 128):
        if vocab * cand * 4 <= 0.4 * target:
            d = cand
            break
    per_layer = 12 * d * d * 2 + (3 * d + d + 4 * d + d + 4 * d) * 4
    fixed = (vocab + ctx + 2) * d * 4
    n_layers = max(1, round((target - fixed) / per_layer))
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {
        "wte.weight": _randn((vocab, d), f32, gen),
        "wpe.weight": _randn((ctx, d), f32, gen),
    }
    for i in range(n_layers):
        p = f"h.{i}."
        sd[p + "ln_1.weight"] = _randn((d,), f32, gen)
        sd[p + "ln_1.bias"] = _randn((d,), f32, gen)
        sd[p + "attn.c_attn.weight"] = _randn((3 * d, d), bf16, gen)
        sd[p + "attn.c_attn.bias"] = _randn((3 * d,), f32, gen)
        sd[p + "attn.c_proj.weight"] = _randn((d, d), bf16, gen)
        sd[p + "attn.c_proj.bias"] = _randn((d,), f32, gen)
        sd[p + "ln_2.weight"] = _randn((d,), f32, gen)
        sd[p + "ln_2.bias"] = _randn((d,), f32, gen)
        sd[p + "mlp.c_fc.weight"] = _randn((4 * d, d), bf16, gen)
        sd[p + "mlp.c_fc.bias"] = _randn((4 * d,), f32, gen)
        sd[p + "mlp.c_proj.weight"] = _randn((d, 4 * d), bf16, gen)
        sd[p + "mlp.c_proj.bias"] = _randn((d,), f32, gen)
    sd["ln_f.weight"] = _randn((d,), f32, gen)
    sd["ln_f.bias"] = _randn((d,), f32, gen)
    wl = Workload("gpt", "", sd)
    wl.description = (
        f"GPT-like state dict: vocab {vocab} x d {d}, {n_layers} layers, "
        f"{wl.ntensors} tensors, {wl.nbytes / GIB:.2f} GiB "
        "(matmul weights bfloat16; embeddings, biases, LayerNorms float32)"
    )
    return wl


SMALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)


def build_small(count: int, seed: int) -> Workload:
    """``count`` tensors of 1-16 KiB each, seeded sizes, shapes and dtypes."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i in range(count):
        dtype = rng.choice(SMALL_DTYPES)
        item = torch.empty((), dtype=dtype).element_size()
        numel = max(1, rng.randint(1024, 16 * 1024) // item)
        if numel >= 128 and rng.random() < 0.5:
            shape: tuple[int, ...] = (numel // 32, 32)
        else:
            shape = (numel,)
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=gen, dtype=dtype)
        else:
            hi = 256 if dtype == torch.uint8 else 2**31 - 1
            t = torch.randint(0, hi, shape, generator=gen, dtype=dtype)
        sd[f"blocks.{i // 16}.p{i % 16}"] = t
    wl = Workload("small", "", sd)
    wl.description = (
        f"{count} tensors of 1-16 KiB (seeded sizes; float32/bfloat16/float16/int64/int32/uint8,"
        f" 1-D and 2-D), {wl.nbytes / 2**20:.1f} MiB"
    )
    return wl


# --------------------------------------------------------------------------------------------
# Page cache control
# --------------------------------------------------------------------------------------------
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
_malloc_trim = getattr(_libc, "malloc_trim", None)
if _malloc_trim is not None:
    _malloc_trim.argtypes = [ctypes.c_size_t]


def list_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def drop_cache(files: list[Path]) -> None:
    """Write back and evict each file from the page cache (never touches /proc/sys/vm)."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(files: list[Path]) -> None:
    buf = bytearray(IO_CHUNK)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def resident_pages(files: list[Path]) -> tuple[int, int]:
    """(resident, total) page counts of ``files`` according to mincore(2)."""
    resident = total = 0
    for p in files:
        size = p.stat().st_size
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                continue
            try:
                n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
                vec = (ctypes.c_ubyte * n)()
                if _libc.mincore(addr, size, vec) == 0:
                    resident += sum(1 for b in bytes(vec) if b & 1)
                    total += n
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident, total


# --------------------------------------------------------------------------------------------
# Contenders
# --------------------------------------------------------------------------------------------
LoadFn = Callable[[Path, Any], Any]


@dataclasses.dataclass
class LoadVariant:
    key: str  # row name in the report, e.g. "torch.load"
    fn: LoadFn  # (folder, target) -> loaded state (flat dict of tensors)
    target: str | None = None  # None: returns new tensors; "dict"/"flat": loads in place


@dataclasses.dataclass
class Contender:
    name: str
    save: Callable[[dict[str, torch.Tensor], Path], None]
    loads: list[LoadVariant]


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data[:WRITE_CHUNK])
        data = data[n:]


def _read_into(f: io.RawIOBase, buf: torch.Tensor) -> None:
    """Fill ``buf`` (uint8) from the current position of ``f``."""
    view = memoryview(buf.numpy())
    pos, end = 0, len(view)
    while pos < end:
        n = f.readinto(view[pos : min(end, pos + IO_CHUNK)])
        if not n:
            raise EOFError(f"short read at {pos} of {end}")
        pos += n


class Raw:
    """The same tensor bytes, concatenated (8-byte aligned) into one file: the I/O floor.

    ``load`` returns new tensors the way a packing loader would: every tensor of at least
    RAW_SEGMENT_MIN bytes gets its own fresh buffer, runs of smaller ones share buffers of up to
    RAW_STAGING bytes (so the allocator sees what it sees under torch.load); ``load_into`` reads
    the whole file into one preallocated buffer, the pure read floor.
    """

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.layout: list[tuple[str, torch.dtype, torch.Size, int, int]] = []
        off = 0
        for k, t in state.items():
            off = -(-off // RAW_ALIGN) * RAW_ALIGN
            self.layout.append((k, t.dtype, t.shape, off, t.nbytes))
            off += t.nbytes
        self.total = off
        self._staging = bytearray(RAW_STAGING)
        # Segments: (file start, file end, first layout index, end layout index).
        self.segments: list[tuple[int, int, int, int]] = []
        i = 0
        while i < len(self.layout):
            start = self.layout[i][3]
            j = i + 1
            if self.layout[i][4] < RAW_SEGMENT_MIN:
                while (
                    j < len(self.layout)
                    and self.layout[j][4] < RAW_SEGMENT_MIN
                    and self.layout[j][3] + self.layout[j][4] - start <= RAW_STAGING
                ):
                    j += 1
            self.segments.append((start, self.layout[j - 1][3] + self.layout[j - 1][4], i, j))
            i = j

    def save(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        folder.mkdir(parents=True)
        fd = os.open(folder / "data.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            staging = memoryview(self._staging)
            fill = written = 0
            for k, _dtype, _shape, off, n in self.layout:
                pad = off - (written + fill)
                if fill + pad + n > len(staging) or n >= RAW_DIRECT_MIN:
                    _write_all(fd, staging[:fill])
                    written += fill
                    fill = 0
                if pad:
                    staging[fill : fill + pad] = bytes(pad)
                    fill += pad
                if n >= RAW_DIRECT_MIN:
                    _write_all(fd, staging[:fill])
                    written += fill
                    fill = 0
                    _write_all(fd, _byte_view(state[k]))
                    written += n
                else:
                    staging[fill : fill + n] = _byte_view(state[k])
                    fill += n
            _write_all(fd, staging[:fill])
            os.fsync(fd)
        finally:
            os.close(fd)

    def _views(self, buf: torch.Tensor, base: int, i: int, j: int) -> Iterator[tuple[str, Any]]:
        for k, dtype, shape, off, n in self.layout[i:j]:
            yield k, buf[off - base : off - base + n].view(dtype).view(shape)

    def load(self, folder: Path, _target: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        pos = 0
        with open(folder / "data.bin", "rb", buffering=0) as f:
            for start, end, i, j in self.segments:
                if start != pos:
                    f.seek(start)
                buf = torch.empty(end - start, dtype=torch.uint8)
                _read_into(f, buf)
                pos = end
                out.update(self._views(buf, start, i, j))
        return out

    def load_into(self, folder: Path, target: torch.Tensor) -> dict[str, torch.Tensor]:
        with open(folder / "data.bin", "rb", buffering=0) as f:
            _read_into(f, target)
        return dict(self._views(target, 0, 0, len(self.layout)))


def torch_save(state: dict[str, torch.Tensor], folder: Path) -> None:
    folder.mkdir(parents=True)
    with open(folder / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(folder: Path, _target: Any) -> Any:
    return torch.load(folder / "state.pt", weights_only=True)


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def dcp_save(state: dict[str, torch.Tensor], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with _quiet_dcp():
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def dcp_load_into(folder: Path, target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    with _quiet_dcp():
        dcp.load(target, checkpoint_id=str(folder), no_dist=True)
    return target


def dcp_fsync_note() -> str:
    try:
        from torch.distributed.checkpoint import FileSystemWriter

        default = inspect.signature(FileSystemWriter.__init__).parameters["sync_files"].default
    except Exception as exc:  # pragma: no cover - informational only
        return f"could not inspect FileSystemWriter: {exc}"
    if default:
        return (
            "default FileSystemWriter (sync_files=True): fsyncs every data file and the "
            ".metadata file (no directory fsync)"
        )
    return f"default FileSystemWriter has sync_files={default!r}: DCP does NOT fsync"


def make_ckptlib_contenders(ckptlib: Any, with_zstd: bool, noverify: bool) -> list[Contender]:
    def save_plain(state: dict[str, torch.Tensor], folder: Path) -> None:
        ckptlib.save(state, str(folder))

    def save_zstd(state: dict[str, torch.Tensor], folder: Path) -> None:
        ckptlib.save(state, str(folder), compression="zstd")

    def load_new(folder: Path, _target: Any) -> Any:
        return ckptlib.load(str(folder))

    def load_new_noverify(folder: Path, _target: Any) -> Any:
        return ckptlib.load(str(folder), verify=False)

    def load_into(folder: Path, target: Any) -> Any:
        return ckptlib.load(str(folder), into=target)

    def loads(prefix: str) -> list[LoadVariant]:
        out = [
            LoadVariant(f"{prefix}.load", load_new),
            LoadVariant(f"{prefix}.load(into)", load_into, "dict"),
        ]
        if noverify:
            out.append(LoadVariant(f"{prefix}.load(verify=False)", load_new_noverify))
        return out

    out = [Contender("ckptlib", save_plain, loads("ckptlib"))]
    if with_zstd:
        out.append(Contender("ckptlib+zstd", save_zstd, loads("ckptlib+zstd")))
    return out


def make_contenders(
    wl: Workload, names: list[str], ckptlib: Any, zstd: bool, noverify: bool
) -> list[Contender]:
    raw = Raw(wl.state)
    pool = {
        "raw": Contender(
            "raw",
            raw.save,
            [
                LoadVariant("raw.read", raw.load),
                LoadVariant("raw.read(into)", raw.load_into, "flat"),
            ],
        ),
        "torch.save": Contender(
            "torch.save",
            torch_save,
            [LoadVariant("torch.load", torch_load)],
        ),
        "dcp": Contender(
            "dcp",
            dcp_save,
            [LoadVariant("dcp.load(into)", dcp_load_into, "dict")],
        ),
    }
    out = [pool[n] for n in names if n in pool]
    if "ckptlib" in names and ckptlib is not None:
        out += make_ckptlib_contenders(ckptlib, zstd, noverify)
    return out


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------
def check_equal(expected: dict[str, torch.Tensor], got: Any) -> str | None:
    """None if ``got`` holds exactly the tensors of ``expected``, else what differs."""
    if not isinstance(got, dict):
        return f"returned {type(got).__name__}, expected dict"
    missing = expected.keys() - got.keys()
    extra = got.keys() - expected.keys()
    if missing or extra:
        return (
            f"keys differ: {len(missing)} missing (e.g. {sorted(missing)[:2]}), {len(extra)} extra"
        )
    for k, want in expected.items():
        t = got[k]
        if not isinstance(t, torch.Tensor):
            return f"{k}: {type(t).__name__}, expected Tensor"
        if t.dtype != want.dtype or t.shape != want.shape:
            return f"{k}: {t.dtype}{tuple(t.shape)}, expected {want.dtype}{tuple(want.shape)}"
        if not torch.equal(t, want):
            return f"{k}: values differ"
    return None


@dataclasses.dataclass
class Results:
    """Per-row timings for one workload; ``None`` marks a round without a valid time."""

    rounds: int
    save: dict[str, list[float | None]] = dataclasses.field(default_factory=dict)
    load_cold: dict[str, list[float | None]] = dataclasses.field(default_factory=dict)
    load_warm: dict[str, list[float | None]] = dataclasses.field(default_factory=dict)
    disk_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    verified: dict[str, str] = dataclasses.field(default_factory=dict)
    residency_after_drop: float = 0.0  # max fraction of written pages still cached when cold

    def slot(self, table: dict[str, list[float | None]], key: str) -> list[float | None]:
        return table.setdefault(key, [None] * self.rounds)


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc malloc_trim), so every
    timed operation starts from the same allocator state: new tensors pay first-touch page
    faults, as in a freshly started resume process."""
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    release_memory()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _fmt_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def run_workload(
    wl: Workload,
    contenders: list[Contender],
    rounds: int,
    warmup: int,
    base: Path,
    log: Callable[[str], None],
) -> Results:
    """Warm-up rounds (negative r) run and verify everything but record no times."""
    res = Results(rounds)
    targets: dict[str, Any] = {}
    if any(lv.target == "dict" for c in contenders for lv in c.loads):
        targets["dict"] = {k: torch.empty_like(v) for k, v in wl.state.items()}
    raw = next((c for c in contenders if c.name == "raw"), None)
    if raw is not None:
        targets["flat"] = torch.empty(Raw(wl.state).total, dtype=torch.uint8)
    broken: set[str] = set()
    for r in range(-warmup, rounds):
        k = r % len(contenders)
        order = contenders[k:] + contenders[:k]
        what = f"warm-up {r + warmup + 1}/{warmup}" if r < 0 else f"round {r + 1}/{rounds}"
        log(f"[{wl.name}] {what}: {' -> '.join(c.name for c in order)}")
        for c in order:
            if c.name in broken:
                continue
            folder = base / f"{wl.name}-r{r}-{c.name.replace('+', '_')}"
            # Flush everything (including the previous folder's deletion, whose block discards
            # an ext4 `discard` mount would otherwise bill to the next fsync) before timing.
            os.sync()
            try:
                t, _ = _timed(lambda c=c, folder=folder: c.save(wl.state, folder))
            except Exception as exc:
                res.errors[c.name] = f"save: {_fmt_exc(exc)}"
                log(f"  {c.name}: SAVE FAILED {res.errors[c.name]}")
                traceback.print_exc(file=sys.stderr)
                broken.add(c.name)
                shutil.rmtree(folder, ignore_errors=True)
                continue
            if r >= 0:
                res.slot(res.save, c.name)[r] = t
            files = list_files(folder)
            res.disk_bytes[c.name] = sum(p.stat().st_size for p in files)
            line = [f"  {c.name}: save {t:.3f}s"]
            for lv in c.loads:
                if lv.key in broken:
                    continue
                target = targets.get(lv.target) if lv.target else None
                verify = lv.key not in res.verified
                if verify and isinstance(target, torch.Tensor):
                    target.zero_()
                elif verify and isinstance(target, dict):
                    _zero(target)
                drop_cache(files)
                resident, total = resident_pages(files)
                if total:
                    res.residency_after_drop = max(res.residency_after_drop, resident / total)
                try:
                    t_cold, out = _timed(lambda lv=lv, folder=folder, tg=target: lv.fn(folder, tg))
                    if verify:
                        problem = check_equal(wl.state, out)
                        if problem is None and isinstance(target, dict):
                            inner = check_equal(wl.state, target)
                            problem = inner and f"preallocated target not filled: {inner}"
                        res.verified[lv.key] = problem or "ok"
                        if problem:
                            raise AssertionError(f"wrong data: {problem}")
                    del out
                    warm_cache(files)
                    t_warm, out = _timed(lambda lv=lv, folder=folder, tg=target: lv.fn(folder, tg))
                    del out
                except Exception as exc:
                    res.errors[lv.key] = f"load: {_fmt_exc(exc)}"
                    log(f"  {lv.key}: LOAD FAILED {res.errors[lv.key]}")
                    if not isinstance(exc, AssertionError):
                        traceback.print_exc(file=sys.stderr)
                    broken.add(lv.key)
                    res.load_cold.pop(lv.key, None)
                    res.load_warm.pop(lv.key, None)
                    continue
                finally:
                    gc.collect()
                if r >= 0:
                    res.slot(res.load_cold, lv.key)[r] = t_cold
                    res.slot(res.load_warm, lv.key)[r] = t_warm
                line.append(f"{lv.key} cold {t_cold:.3f}s warm {t_warm:.3f}s")
            log(" | ".join(line))
            shutil.rmtree(folder, ignore_errors=True)
    return res


def _zero(state: dict[str, torch.Tensor]) -> None:
    for t in state.values():
        t.zero_()


# --------------------------------------------------------------------------------------------
# Profiling (only with --profile): a wall-clock stack sampler over all threads + cProfile
# --------------------------------------------------------------------------------------------
_IDLE = {
    ("threading.py", "wait"),
    ("threading.py", "_wait_for_tstate_lock"),
    ("queue.py", "get"),
    ("thread.py", "_worker"),
    ("selectors.py", "select"),
}


class StackSampler:
    """Samples every thread's Python stack; C calls are charged to the calling Python line."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.ticks = 0
        self.self_counts: Counter[str] = Counter()
        self.incl_counts: Counter[str] = Counter()
        self.thread_counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    @staticmethod
    def _where(frame: Any, line: bool) -> str:
        code = frame.f_code
        path = Path(code.co_filename)
        parts = path.parts
        short = "/".join(parts[-3:]) if "site-packages" in parts or "lib" in parts else path.name
        if "ckptlib" in parts:
            short = "/".join(parts[parts.index("ckptlib") :])
        return f"{code.co_name} ({short}:{frame.f_lineno})" if line else f"{code.co_name} ({short})"

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            self.ticks += 1
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                if (Path(frame.f_code.co_filename).name, frame.f_code.co_name) in _IDLE:
                    continue
                self.thread_counts[names.get(tid, str(tid))] += 1
                self.self_counts[self._where(frame, True)] += 1
                seen: set[str] = set()
                f = frame
                while f is not None:
                    key = self._where(f, False)
                    if "ckptlib" in Path(f.f_code.co_filename).parts and key not in seen:
                        seen.add(key)
                        self.incl_counts[key] += 1
                    f = f.f_back

    def __enter__(self) -> StackSampler:
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval / 4)  # let the sampler in while others hold the GIL
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)

    def report(self, top: int) -> str:
        ticks = max(1, self.ticks)
        lines = [f"sampled {self.ticks} ticks of {self.interval * 1e3:.0f} ms (wall)"]
        lines.append(
            "busy samples by thread: "
            + ", ".join(f"{n} {c / ticks:.0%}" for n, c in self.thread_counts.most_common())
        )
        lines.append("top self (line running, or calling into C), share of wall time:")
        lines += [f"  {c / ticks:6.1%}  {k}" for k, c in self.self_counts.most_common(top)]
        lines.append("top inclusive ckptlib functions (on some thread's stack), share of wall:")
        lines += [f"  {c / ticks:6.1%}  {k}" for k, c in self.incl_counts.most_common(top)]
        return "\n".join(lines)


def profile_ckptlib(wl: Workload, ckptlib: Any, base: Path, top: int) -> str:
    out: list[str] = []
    folder = base / f"{wl.name}-profile"
    target = {k: torch.empty_like(v) for k, v in wl.state.items()}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("ckptlib.save", lambda: ckptlib.save(wl.state, str(folder))),
        ("ckptlib.load (cold)", lambda: ckptlib.load(str(folder))),
        ("ckptlib.load(into) (cold)", lambda: ckptlib.load(str(folder), into=target)),
    ]
    try:
        for name, fn in steps:
            if name != "ckptlib.save":
                drop_cache(list_files(folder))
            os.sync()
            gc.collect()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            with StackSampler() as sampler:
                prof.enable()
                try:
                    result = fn()
                finally:
                    prof.disable()
            wall = time.perf_counter() - t0
            del result
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
            cp = "\n".join(
                ln for ln in s.getvalue().splitlines()[4:] if ln.strip() and "Ordered by" not in ln
            )
            out.append(
                f"#### {wl.name}: {name} — {wall:.3f} s under profilers\n\n```\n"
                f"{sampler.report(top)}\n\ncProfile (calling thread only), by tottime:\n{cp}\n```"
            )
    except Exception as exc:
        out.append(f"#### {wl.name}: profiling failed: {_fmt_exc(exc)}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return "\n\n".join(out)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    workload: str
    table: str  # "save" | "load_cold" | "load_warm"
    row: str
    ref: str
    limit: float
    text: str


TARGETS = (
    Target("gpt", "save", "ckptlib", "dcp", 0.9, "sync save <= 0.9x DCP save"),
    Target("gpt", "save", "ckptlib", "raw", 1.15, "sync save <= 1.15x raw write+fsync"),
    Target("gpt", "load_cold", "ckptlib.load", "torch.load", 0.7, "cold load <= 0.7x torch.load"),
    Target("small", "save", "ckptlib", "torch.save", 0.3, "save <= 0.3x torch.save"),
    Target("small", "load_cold", "ckptlib.load", "torch.load", 0.3, "cold load <= 0.3x torch.load"),
    Target("small", "load_warm", "ckptlib.load", "torch.load", 0.3, "warm load <= 0.3x torch.load"),
)
REFS = {
    "save": ("raw", "torch.save", "dcp"),
    "load_cold": ("raw.read", "torch.load", "dcp.load(into)"),
    "load_warm": ("raw.read", "torch.load", "dcp.load(into)"),
}
TABLE_TITLES = {
    "save": "Save (timed through fsync)",
    "load_cold": "Load, cold (files dropped from page cache)",
    "load_warm": "Load, warm (files in page cache)",
}


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ratios(a: list[float | None], b: list[float | None]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True) if x is not None and y]


def summarize(wl: Workload, res: Results) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for table in ("save", "load_cold", "load_warm"):
        rows = getattr(res, table)
        tab: dict[str, Any] = {}
        for key, times in rows.items():
            med = _median(times)
            entry: dict[str, Any] = {
                "times_s": times,
                "median_s": med,
                "gb_per_s": wl.nbytes / GB / med if med else None,
                "ratios": {},
            }
            for ref in REFS[table]:
                if ref in rows and ref != key:
                    rs = ratios(times, rows[ref])
                    if rs:
                        entry["ratios"][ref] = {
                            "median": statistics.median(rs),
                            "min": min(rs),
                            "max": max(rs),
                            "per_round": rs,
                        }
            tab[key] = entry
        out[table] = tab
    return out


def target_rows(wl_name: str, summary: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for tg in TARGETS:
        if tg.workload != wl_name:
            continue
        entry = summary.get(tg.table, {}).get(tg.row)
        rat = (entry or {}).get("ratios", {}).get(tg.ref)
        rows.append(
            {
                "workload": wl_name,
                "target": tg.text,
                "row": tg.row,
                "ref": tg.ref,
                "limit": tg.limit,
                "median": rat["median"] if rat else None,
                "min": rat["min"] if rat else None,
                "max": rat["max"] if rat else None,
                "result": ("PASS" if rat["median"] <= tg.limit else "MISS") if rat else "N/A",
            }
        )
    return rows


def _cell_ratio(wl: str, table: str, row: str, ref: str, rat: dict[str, Any] | None) -> str:
    if rat is None:
        return ""
    txt = f"{rat['median']:.2f}"
    for tg in TARGETS:
        if (tg.workload, tg.table, tg.row, tg.ref) == (wl, table, row, ref):
            verdict = "PASS" if rat["median"] <= tg.limit else "MISS"
            txt = f"**{txt}** (<= {tg.limit:.2f} {verdict})"
    return txt


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 4 else f"{n / 2**20:.1f} MiB"


def render_workload(wl: Workload, res: Results, summary: dict[str, Any]) -> str:
    lines = [f"## {wl.name}: {wl.description}", ""]
    lines.append(
        f"{wl.nbytes:,} bytes of tensor data; GB/s below = these bytes / median time (GB = 1e9)."
    )
    lines.append("")
    for table in ("save", "load_cold", "load_warm"):
        tab = summary[table]
        if not tab:
            continue
        refs = [r for r in REFS[table] if r in tab]
        lines.append(f"### {TABLE_TITLES[table]}")
        lines.append("")
        head = ["contender", "median s", "min-max s", "GB/s"]
        if table == "save":
            head.append("on disk")
        head += [f"vs {r}" for r in refs]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
        for key, e in tab.items():
            vals = [t for t in e["times_s"] if t is not None]
            cells = [
                key,
                f"{e['median_s']:.3f}" if e["median_s"] is not None else "-",
                f"{min(vals):.3f}-{max(vals):.3f}" if vals else "-",
                f"{e['gb_per_s']:.2f}" if e["gb_per_s"] else "-",
            ]
            if table == "save":
                cells.append(_size(res.disk_bytes[key]) if key in res.disk_bytes else "-")
            for ref in refs:
                cells.append(
                    "1.00 (ref)"
                    if ref == key
                    else _cell_ratio(wl.name, table, key, ref, e["ratios"].get(ref))
                )
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if res.errors:
        lines.append("**Failures** (these rows are missing or incomplete above):")
        lines.append("")
        lines += [f"- `{k}`: {v}" for k, v in res.errors.items()]
        lines.append("")
    checks = ", ".join(f"{k}: {v}" for k, v in res.verified.items())
    lines.append(f"Correctness (first load of each variant vs originals): {checks}.")
    lines.append(
        f"Max page-cache residency right after each drop: {res.residency_after_drop:.1%} "
        "of the written pages."
    )
    lines.append("")
    return "\n".join(lines)


def render_targets(rows: list[dict[str, Any]]) -> str:
    lines = [
        "## Targets (median of per-round ratios; min-max over rounds)",
        "",
        "| workload | target | ratio | min-max | result |",
        "|---|---|---:|---:|---|",
    ]
    for r in rows:
        if r["median"] is None:
            lines.append(f"| {r['workload']} | {r['target']} | - | - | N/A |")
        else:
            lines.append(
                f"| {r['workload']} | {r['target']} | {r['median']:.2f} | "
                f"{r['min']:.2f}-{r['max']:.2f} | **{r['result']}** |"
            )
    lines.append("")
    return "\n".join(lines)


def machine_info(base: Path) -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["ram_gib"] = round(int(line.split()[1]) * 1024 / GIB, 1)
    # Disk: the mount holding ``base`` (longest matching mount point) and its block device.
    best = ("", "?", "?")
    with contextlib.suppress(OSError):
        real = str(base.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
    disk = f"{best[1]} ({best[2]}, mounted at {best[0]})"
    blk = Path("/sys/class/block") / Path(best[1]).name
    with contextlib.suppress(OSError):
        rot = (blk / "queue/rotational").read_text().strip()
        if not rot.isdigit():
            rot = (blk.resolve().parent / "queue/rotational").read_text().strip()
        disk += ", rotational" if rot == "1" else ", non-rotational"
    usage = shutil.disk_usage(base)
    info["disk"] = f"{disk}, {usage.free / GIB:.0f} GiB free"
    info["dir"] = str(base)
    return info


def ckptlib_version(mod: Any) -> str:
    if mod is None:
        return "not importable"
    ver = getattr(mod, "__version__", None)
    if ver is None:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            ver = importlib.metadata.version("ckptlib")
    return str(ver)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------
CONTENDER_NAMES = ("raw", "torch.save", "dcp", "ckptlib")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="GPT workload size in GiB (2.0)")
    p.add_argument("--quick", action="store_true", help="GPT workload of 0.25 GiB")
    p.add_argument("--small-count", type=int, default=20_000, help="small tensors (20000)")
    p.add_argument("--rounds", type=int, default=5, help="paired alternating rounds (5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    p.add_argument("--workloads", default="gpt,small", help="comma list of gpt,small")
    p.add_argument(
        "--contenders",
        default=",".join(CONTENDER_NAMES),
        help="comma list of " + ", ".join(CONTENDER_NAMES),
    )
    p.add_argument("--no-zstd", action="store_true", help="skip ckptlib+zstd on `small`")
    p.add_argument("--zstd-gpt", action="store_true", help="also run ckptlib+zstd on `gpt`")
    p.add_argument("--noverify-row", action="store_true", help="add ckptlib.load(verify=False)")
    p.add_argument("--dir", type=Path, help="where checkpoints go (default: new tmp dir)")
    p.add_argument("--keep", action="store_true", help="keep --dir's bench folder afterwards")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write all timings and ratios as JSON here")
    p.add_argument("--out", type=Path, help="Markdown report path (default bench/results/...)")
    p.add_argument("--no-out", action="store_true", help="print the report only")
    p.add_argument("--profile", action="store_true", help="profile ckptlib save/load afterwards")
    p.add_argument("--profile-top", type=int, default=15)
    args = p.parse_args(argv)
    if args.quick:
        args.gib = 0.25
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now(dt.timezone.utc)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        import ckptlib
    except Exception as exc:
        log(f"ckptlib not importable ({_fmt_exc(exc)}); running the baselines only")
        ckptlib = None

    workload_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = set(names) - set(CONTENDER_NAMES) | set(workload_names) - {"gpt", "small"}
    if unknown:
        log(f"unknown contender/workload: {sorted(unknown)}")
        return 2

    own_dir = args.dir is None
    root = Path(tempfile.mkdtemp(prefix="ckptlib-bench-")) if own_dir else args.dir
    root.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    info = machine_info(base)
    info["ckptlib"] = ckptlib_version(ckptlib)
    info["dcp_fsync"] = dcp_fsync_note()
    log(f"machine: {info}")

    report_parts: list[str] = []
    all_targets: list[dict[str, Any]] = []
    json_out: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "argv": sys.argv,
        "machine": info,
        "workloads": {},
    }
    profiles: list[str] = []
    try:
        for wname in workload_names:
            t0 = time.perf_counter()
            if wname == "gpt":
                wl = build_gpt(args.gib, args.seed)
            else:
                wl = build_small(args.small_count, args.seed)
            log(f"[{wl.name}] built in {time.perf_counter() - t0:.1f}s: {wl.description}")
            free = shutil.disk_usage(base).free
            if free < 3 * wl.nbytes:
                log(f"warning: only {free / GIB:.1f} GiB free under {base}")
            zstd = not args.no_zstd and (wl.name == "small" or args.zstd_gpt)
            contenders = make_contenders(wl, names, ckptlib, zstd, args.noverify_row)
            res = run_workload(wl, contenders, args.rounds, args.warmup, base, log)
            summary = summarize(wl, res)
            trows = target_rows(wl.name, summary)
            all_targets += trows
            report_parts.append(render_workload(wl, res, summary))
            json_out["workloads"][wl.name] = {
                "description": wl.description,
                "bytes": wl.nbytes,
                "tensors": wl.ntensors,
                "disk_bytes": res.disk_bytes,
                "errors": res.errors,
                "verified": res.verified,
                "residency_after_drop": res.residency_after_drop,
                "summary": summary,
                "targets": trows,
            }
            if args.profile and ckptlib is not None:
                log(f"[{wl.name}] profiling ckptlib")
                profiles.append(profile_ckptlib(wl, ckptlib, base, args.profile_top))
            del wl, contenders, res
            gc.collect()
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
            if own_dir:
                shutil.rmtree(root, ignore_errors=True)

    elapsed = time.perf_counter() - t_start
    header = [
        f"# ckptlib save/load benchmark — {started:%Y-%m-%d %H:%M} UTC",
        "",
        f"- command: `{shlex.join([Path(sys.executable).name, *sys.argv])}` ({elapsed:.0f} s)",
        f"- machine: {info.get('cpu', '?')}, nproc {info['nproc']}, "
        f"RAM {info.get('ram_gib', '?')} GiB, torch threads {info['torch_threads']}",
        f"- disk: {info['disk']}; checkpoints under `{info['dir']}`",
        f"- versions: python {info['python']}, torch {info['torch']}, ckptlib {info['ckptlib']}",
        f"- method: {args.warmup} untimed warm-up round(s), then {args.rounds} paired alternating "
        "rounds in one process (round r rotates the contender order by r); each save into a "
        "fresh folder; per-row median time and median of per-round ratios (row time / "
        "reference time in the same round).",
        "- cold load: every written file fsynced + `posix_fadvise(DONTNEED)` before the load; "
        "warm load: right after reading every file once. On a VM disk a cold read may still be "
        "served by the host's cache.",
        "- contenders: `raw` = the tensor bytes concatenated into one file (small tensors "
        "packed into a 16 MiB buffer, large ones written straight from their memory, 4 MiB "
        "per write() call) + fsync; "
        "read back sequentially into fresh buffers (`raw.read`) or one preallocated buffer "
        "(`raw.read(into)`). `torch.save` = torch.save into an open file + flush + fsync; "
        "`torch.load(weights_only=True)`. `dcp` = torch.distributed.checkpoint save/load "
        f"without a process group; {info['dcp_fsync']}. `ckptlib` = `ckptlib.save(sd, path)`, "
        "`ckptlib.load(path)` (verify=True default) and `ckptlib.load(path, into=sd)`; its "
        "time includes its whole commit.",
        "- before every save: `os.sync()` (so no contender pays for earlier write-back or "
        "for block discards of the previous round's deleted folders).",
        "- before every timed operation: `gc.collect()` + glibc `malloc_trim(0)`, so loads that "
        "return new tensors pay first-touch page faults as a fresh resume process would.",
        "- into-loads (`dcp.load(into)`, `ckptlib.load(into)`, `raw.read(into)`) fill "
        "preallocated tensors; the others return new tensors.",
        "",
    ]
    report = "\n".join(header) + render_targets(all_targets) + "\n" + "\n".join(report_parts)
    if profiles:
        report += "\n## Profiles (one extra save + cold loads per workload)\n\n"
        report += "\n\n".join(profiles) + "\n"
    print(report)
    if not args.no_out:
        out = args.out
        if out is None:
            suffix = "-quick" if args.quick else ""
            out = BENCH_DIR / "results" / f"{started:%Y-%m-%d}-save_load{suffix}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
        log(f"report written to {out}")
    if args.json:
        json_out["elapsed_s"] = elapsed
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(json_out, indent=1, default=str))
        log(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
