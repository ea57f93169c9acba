"""Resharding jobs of tests/integrations/test_deepspeed.py, run by tests/workers/ds_worker.py.

A job (``args["reshard"]`` of a ds_worker scenario, run before the scenario's own work, on its
process group) is one of:

- ``{"do": "save", "key", "stage", "bf16", "dir"}``: a fresh engine with ckptlib installed, 2
  steps -> save (global_step2) -> 2 steps -> save (global_step4); per-parameter digests (fp32
  weights and Adam's moments read with DeepSpeed's ``safe_get_full_*``, the model's own
  weights) at each save. An optional ``"zero"`` dict adds to ``zero_optimization``.
- ``{"do": "load", "key", "stage", "bf16", "dir", "how"}``: a fresh engine at this job's size
  loads ``dir`` with ``ckds.resume`` (``how="resume"``) or DeepSpeed's own
  ``engine.load_checkpoint(dir)`` (``how="load_checkpoint"``, the tag ``latest`` names);
  digests after the load, then one more training step (Adam's ``step`` must go on from the
  saved one) and a save. A ckptlib error is recorded as ``{"error": ...}``.

:func:`run` returns the job's record (with its wall time in ``seconds``).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any


def make_engine(deepspeed: Any, stage: int, bf16: bool, zero: dict[str, Any] | None = None) -> Any:
    import torch

    torch.manual_seed(1234)
    # 6 parameters, 845 elements (odd sizes): partition edges fall inside parameters at 2 ranks.
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 31), torch.nn.LayerNorm(31), torch.nn.ReLU(), torch.nn.Linear(31, 8)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, **(zero or {})},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01}},
        "steps_per_print": 10**9,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
        if stage == 1:  # fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def train(engine: Any, n: int, bf16: bool) -> None:
    import torch
    import torch.distributed as dist

    for _ in range(n):
        g = torch.Generator().manual_seed(engine.global_steps * 100 + dist.get_rank())
        x = torch.randn(4, 16, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
        y = torch.randn(4, 8, generator=g)
        loss = ((engine(x).float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()


def _sha(t: Any) -> str:
    import torch

    t = t.detach().cpu().contiguous().view(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def digests(engine: Any) -> dict[str, Any]:
    """Per parameter: fp32 weights and Adam's moments assembled by DeepSpeed, and the model's
    own (bf16 or fp32) weights; collective."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    lazy = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if lazy is not None:  # fragments are linked to the optimizer state at the first step()
        lazy()
    out: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            lp = _sha(p.data)
        out[name] = {
            "lp": lp,
            "fp32": _sha(safe_get_full_fp32_param(p)),
            "exp_avg": _sha(safe_get_full_optimizer_state(p, "exp_avg")),
            "exp_avg_sq": _sha(safe_get_full_optimizer_state(p, "exp_avg_sq")),
        }
    return {
        "optimizer": type(engine.optimizer).__name__,
        "dtype": str(next(engine.module.parameters()).dtype),
        "params": out,
        "adam_step": adam_steps(engine),
        "global_steps": engine.global_steps,
        "lr": engine.lr_scheduler.state_dict(),
    }


def adam_steps(engine: Any) -> list[float]:
    """The distinct ``step`` values of the wrapped torch Adam's state."""
    opt = engine.optimizer.optimizer
    return sorted({float(s["step"]) for s in opt.state.values() if "step" in s})


def do_save(ds: Any, job: dict[str, Any]) -> dict[str, Any]:
    from ckptlib.integrations import deepspeed as ckds

    engine = make_engine(ds, job["stage"], job["bf16"], job.get("zero"))
    ckds.install(engine)
    rec: dict[str, Any] = {}
    for step in (2, 4):
        train(engine, 2, job["bf16"])
        engine.save_checkpoint(job["dir"], client_state={"data_pos": engine.global_steps * 4})
        rec[str(step)] = digests(engine)
    return rec


def do_load(ds: Any, job: dict[str, Any]) -> dict[str, Any]:
    from ckptlib.errors import CheckpointError
    from ckptlib.integrations import deepspeed as ckds

    engine = make_engine(ds, job["stage"], job["bf16"], job.get("zero"))
    ce = ckds.install(engine)
    rec: dict[str, Any] = {"error": None}
    try:
        if job["how"] == "resume":
            res = ckds.resume(engine, job["dir"])
            rec.update(tag=res.tag, skipped=res.skipped, client=res.client_state)
        else:
            path, client = engine.load_checkpoint(job["dir"])
            with open(os.path.join(job["dir"], "latest")) as f:  # the tag DeepSpeed loaded
                rec.update(tag=f.read().strip() if path else None, client=client)
    except CheckpointError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    rec["client"] = {"data_pos": (rec["client"] or {}).get("data_pos")}
    rec["reshard"] = ce.last_reshard
    rec["digest"] = digests(engine)
    train(engine, 1, job["bf16"])
    rec["after"] = {"adam_step": adam_steps(engine), "global_steps": engine.global_steps}
    engine.save_checkpoint(job["dir"] + "-again")
    return rec


def run(ds: Any, root: str, job: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    job = {**job, "dir": os.path.join(root, job["dir"])}
    rec = (do_save if job["do"] == "save" else do_load)(ds, job)
    return {**rec, "seconds": round(time.perf_counter() - t0, 2)}
