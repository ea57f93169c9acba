"""The work the GPU benchmark (bench_gpu.py) drives: the training step and the savers.

``Trainer.step(saver)`` is one training step on the device; it calls the saver's ``begin`` (the
save call) before forward+backward and its ``before_step`` before the optimizer step. The savers
(``torch.save``, DCP ``async_save`` with and without a reused stager, ckptlib's manager in its
default mode, with the memory tier and in overlap mode) all run on the training thread; their
background work is theirs. ``ctx`` is bench_gpu's ``Ctx`` (device, folders, options).
"""

from __future__ import annotations

import glob
import inspect
import os
import shutil
import socket
import time
import warnings
import weakref
from datetime import timedelta
from typing import Any

import torch

Ctx = Any  # bench_gpu.Ctx: .dev, .work, .shm, .args.save_timeout, .sync()


def host_stats() -> dict[str, int]:
    """The pinned host allocator's counters (empty on CPU and before CUDA is initialized)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    try:
        s = torch.cuda.host_memory_stats()
    except (RuntimeError, AttributeError):
        return {}
    return {k: int(v) for k, v in s.items() if isinstance(v, int | float)}


def pinned_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int | None]:
    def d(key: str) -> int | None:
        return after[key] - before.get(key, 0) if key in after else None

    return {"new_pinned_allocs": d("num_host_alloc"), "new_pinned_bytes": d("allocated_bytes.allocated"),
            "pinned_bytes_now": after.get("allocated_bytes.current")}


def step_dir(step: int) -> str:
    from ckptlib.format import layout

    return layout.step_dir(step)


class Trainer:
    """The training work on the device. Forward+backward: matmuls of activations with some of
    the state's bf16 weights (read only), repeated to last about ``step_s``; optimizer step:
    ``StepOpt`` (bench_async), which adds to every state tensor in place. Each step ends with a
    device synchronize, so step times are wall times."""

    def __init__(self, ctx: Ctx, sd: dict[str, torch.Tensor], step_s: float) -> None:
        from bench_async import StepOpt

        self.ctx = ctx
        self.weights = [t for k, t in sd.items() if k.endswith(("qkv", "proj", "fc"))][:6]
        b = 4096 if ctx.dev.type == "cuda" else 32
        self.x = torch.randn(b, self.weights[0].shape[1], device=ctx.dev, dtype=torch.bfloat16)
        self.outs = [torch.empty(b, w.shape[0], device=ctx.dev, dtype=torch.bfloat16) for w in self.weights]
        self.opt = StepOpt([torch.nn.Parameter(t, requires_grad=False) for t in sd.values()])
        self.reps = 1
        self.fwd_bwd()
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(3):
            self.fwd_bwd()
        ctx.sync()
        self.reps = max(1, round(step_s / ((time.perf_counter() - t0) / 3)))

    def fwd_bwd(self) -> None:
        with torch.no_grad():
            for _ in range(self.reps):
                for w, o in zip(self.weights, self.outs, strict=True):
                    torch.mm(self.x, w.t(), out=o)

    def step(self, saver: Saver | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        if saver is not None:
            saver.begin()
        t1 = time.perf_counter()
        self.fwd_bwd()
        if saver is not None:
            saver.before_step()
        self.opt.step()
        self.ctx.sync()
        t2 = time.perf_counter()
        waited = saver.waited() if saver is not None else 0.0
        return {"save_s": t1 - t0, "wait_s": waited, "blocked_s": t1 - t0 + waited, "iter_s": t2 - t0}


# ----------------------------------------------------------------------------- savers
class Saver:
    """One way of saving, driven by the loop: ``begin`` (the save call), ``before_step`` (what the
    loop must wait for before it mutates), ``done`` (persist finished), ``finish`` (waits; seconds
    from the call to durable / persisted), ``cleanup`` (deletes this save's files), ``close``."""

    name = ""

    def __init__(self, ctx: Ctx, sd: dict[str, torch.Tensor]) -> None:
        self.ctx, self.sd = ctx, sd
        self.root = os.path.join(ctx.work, self.name.replace("+", "-"))
        os.makedirs(self.root, exist_ok=True)
        self.n = 0
        self.t_call = self.durable_at = 0.0

    def begin(self) -> None:
        self.n += 1
        self.t_call = time.monotonic()
        self._begin()

    def _begin(self) -> None:
        raise NotImplementedError

    def before_step(self) -> None:
        pass

    def waited(self) -> float:
        return 0.0

    def done(self) -> bool:
        return True

    def finish(self, timeout: float) -> dict[str, float]:
        return {"durable_s": self.durable_at - self.t_call}

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root, exist_ok=True)

    def pinned(self) -> dict[str, Any]:
        return {}

    def floor(self) -> float | None:
        return None

    def close(self) -> None:
        pass


class TorchSave(Saver):
    name = "torch.save"

    def _begin(self) -> None:
        with open(os.path.join(self.root, f"{self.n}.pt"), "wb") as f:
            torch.save(self.sd, f)
            f.flush()
            os.fsync(f.fileno())
        self.durable_at = time.monotonic()


class Dcp(Saver):
    """``async_save`` as shipped (``stager=False``: a fresh host copy per save, made before it
    returns) or with one reused ``DefaultStager`` (staging on a helper thread)."""

    def __init__(self, ctx: Ctx, sd: dict[str, torch.Tensor], stager: bool) -> None:
        self.name = "dcp+stager" if stager else "dcp"
        super().__init__(ctx, sd)
        self.kw = dcp_kwargs()
        self.stager: Any = None
        if stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = ctx.dev.type == "cuda"  # pinned memory and non-blocking copies need a GPU
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=gpu))
        self.upload: Any = None
        self.staging: Any = None
        self.wait_s = 0.0

    def _begin(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.durable_at = 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stager = {} if self.stager is None else {"async_stager": self.stager}
            r = dcp.async_save(self.sd, checkpoint_id=os.path.join(self.root, str(self.n)), **stager, **self.kw)
        self.staging, self.upload = (r.staging_completion, r.upload_completion) if hasattr(r, "upload_completion") \
            else (None, r)
        self.upload.add_done_callback(lambda _: setattr(self, "durable_at", time.monotonic()))

    def before_step(self) -> None:
        t0 = time.perf_counter()
        if self.staging is not None:  # DCP has no hook: the loop waits by hand before it mutates
            self.staging.result(timeout=self.ctx.args.save_timeout)
        self.wait_s = time.perf_counter() - t0

    def waited(self) -> float:
        return self.wait_s

    def done(self) -> bool:
        return bool(self.upload.done())

    def finish(self, timeout: float) -> dict[str, float]:
        self.upload.result(timeout=timeout)
        limit = time.monotonic() + 5.0
        while not self.durable_at and time.monotonic() < limit:  # callbacks run just after result is set
            time.sleep(0.001)
        return {"durable_s": (self.durable_at or time.monotonic()) - self.t_call}

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        self.staging = self.upload = self.stager = None


class Ckptlib(Saver):
    """``CheckpointManager.save``: default, with the memory tier, or in overlap mode."""

    def __init__(self, ctx: Ctx, sd: dict[str, torch.Tensor], mode: str, opt: torch.optim.Optimizer) -> None:
        import ckptlib

        self.name = {"default": "ckptlib", "tier": "ckptlib+tier", "overlap": "ckptlib.overlap"}[mode]
        super().__init__(ctx, sd)
        self.local = os.path.join(ctx.shm, "tier") if mode == "tier" else None
        kw: dict[str, Any] = {"save_timeout": ctx.args.save_timeout, "overlap": mode == "overlap"}
        if self.local is not None:
            kw.update(local=self.local + "/{node}", local_keep_last=1, persist_every=1)
        self.mgr = ckptlib.CheckpointManager(self.root, **kw)
        self.state = {"model": sd, "opt": opt} if mode == "overlap" else sd  # overlap defers optimizer params
        self.handle: Any = None
        self.w0 = 0.0
        self.first_arena: weakref.ref[torch.Tensor] | None = None

    def _begin(self) -> None:
        self.stats0 = host_stats()
        self.w0 = self.mgr.snapshot_wait_seconds
        self.handle = self.mgr.save(self.n, self.state)
        self.stats1 = host_stats()

    def waited(self) -> float:
        return self.mgr.snapshot_wait_seconds - self.w0  # overlap: the optimizer step's pre-hook

    def done(self) -> bool:
        return bool(self.handle.done())

    def finish(self, timeout: float) -> dict[str, float]:
        self.handle.wait(timeout)
        out = {"durable_s": (getattr(self.handle, "_durable_at", None) or time.monotonic()) - self.t_call}
        if self.local is not None:
            self.handle.wait_persisted(timeout)
            out["persisted_s"] = time.monotonic() - self.t_call
        return out

    def cleanup(self) -> None:
        shutil.rmtree(os.path.join(self.root, step_dir(self.n)), ignore_errors=True)
        if self.local is not None:  # drained: at most one step on tmpfs at a time
            for node in glob.glob(os.path.join(self.local, "*", step_dir(self.n))):
                shutil.rmtree(node, ignore_errors=True)

    def pinned(self) -> dict[str, Any]:
        """Staging after this save: new pinned host memory, and whether the arena is the first
        save's (the same object, held weakly: an address alone can be handed out again)."""
        arena = getattr(self.mgr._stager, "_arena", None)
        if self.first_arena is None and arena is not None:
            self.first_arena = weakref.ref(arena)
        return {**pinned_delta(self.stats0, self.stats1), "arena_bytes": self.mgr._stager.nbytes,
                "arena_ptr": None if arena is None else arena.data_ptr(),
                "arena_same": None if arena is None or self.first_arena is None else self.first_arena() is arena,
                "arena_pinned": None if arena is None else bool(arena.is_pinned())}

    def floor(self) -> float | None:
        """The copy floor: the state copied into views of this manager's own (pinned) arena with
        one ``_foreach_copy_``, no save in flight; the faster of two tries."""
        arena = getattr(self.mgr._stager, "_arena", None)
        if arena is None or self.state is not self.sd:
            return None
        dsts, off = [], 0
        for t in self.sd.values():
            dsts.append(arena[off : off + t.nbytes].view(t.dtype).view(t.shape))
            off += (t.nbytes + 63) // 64 * 64
        times = []
        for _ in range(2):
            self.ctx.sync()
            t0 = time.perf_counter()
            torch._foreach_copy_(dsts, list(self.sd.values()), non_blocking=True)
            self.ctx.sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    def close(self) -> None:
        self.mgr.close()
        self.handle = None


def dcp_kwargs() -> dict[str, Any]:
    """DCP without a process group: ``no_dist=True`` where async_save takes it, else a one-rank
    gloo group on 127.0.0.1."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if "no_dist" in inspect.signature(dcp.async_save).parameters:
        return {"no_dist": True}
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=timedelta(seconds=120))
    return {}


def make_saver(ctx: Ctx, name: str, sd: dict[str, torch.Tensor], trainer: Trainer) -> Saver:
    if name == "torch.save":
        return TorchSave(ctx, sd)
    if name in ("dcp", "dcp+stager"):
        return Dcp(ctx, sd, stager=name == "dcp+stager")
    mode = {"ckptlib": "default", "ckptlib+tier": "tier", "ckptlib.overlap": "overlap"}[name]
    return Ckptlib(ctx, sd, mode, trainer.opt)


