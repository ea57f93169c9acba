"""One rank of a DCP-through-ckptlib training job (gloo on 127.0.0.1). Started by
tests/integrations/test_dcp.py.

usage: dcp_worker.py SCENARIO RANK WORLD PORT ROOT JSON-ARGS

Scenarios:
- ``train``: a small MLP sharded with FSDP2 (``fully_shard``; DTensor ``Shard(0)`` parameters
  and optimizer state; one output, so rank 1 holds an empty piece of the last layer), AdamW, deterministic data (a pure function of step and rank). After
  every optimizer step it saves ``{"model", "optim", "step"}`` (``get_state_dict``) with
  ``dcp.save`` -- or ``dcp.async_save`` on a dedicated gloo group when ``async`` -- through
  ``CkptlibWriter(ROOT/ckpt, step=step)``. ``resume``: start from ``load_latest``.
  ``kill_at``: SIGKILL rank ``victim`` while it writes the payload of that step's save (a
  real kill, from ckptlib's named crash point ``write``). At the end rank 0 writes the full
  (unsharded) model and optimizer state to ``ROOT/final-<tag>.npz``. ``manager``: a
  ``CheckpointManager`` on ``ROOT/side`` also saves a small state asynchronously right after each
  DCP save (at once on rank 1, whose upload thread plans 0.2 s late; 0.2 s later on rank 0),
  and restores it at the end.
- ``load``: every rank calls ``load_latest`` on ``ROOT/ckpt`` (a checkpoint of ``{"w", "step"}``
  made by the test) and records the step and values, or the error it raised with the wall
  time (``t_error``); the test freezes a rank with ``CKPTLIB_TEST_KILL_AT=restore:<rank>:STOP``.
  The process then exits at once (a peer may be frozen: no barrier, no teardown).
- ``sizes``: every rank saves steps 1 and 2 of ``{"w<rank>", "step"}`` (a tensor only it holds,
  so each rank's load reads only its own payload file) under ``ROOT/ck-sizes``, then counts the
  payload size requests (``Storage.size`` of a ``.bin``) of its ``load_latest`` and of a plain
  ``dcp.load`` of step 2. Then rank 1's payload file of step 2 is cut by a byte right after the
  coordinator's judge passed it, and every rank calls ``load_latest`` again.
With world size 1 the model is not sharded. The test process imports :func:`reference` (an
uninterrupted single-process run) and :func:`reshard` (load into a plain model, any saved
world size) from this module.

Writes ``ROOT/result-<scenario>-<tag>-<rank>.json``; on an exception it records ``crash``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ckptlib import crashpoints as hooks
from ckptlib.errors import CheckpointError
from ckptlib.integrations.dcp import CkptlibWriter, load_latest

IN, HID, OUT = 24, 40, 1
"""``OUT`` = 1: with 2 ranks, FSDP2 gives rank 1 an empty ``(0, HID)`` piece of the last weight
(a model dim smaller than the world size), which the writer once failed to commit."""


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(16, IN, generator=g), torch.randn(16, OUT, generator=g)


def flat(prefix: str, x, out: dict[str, np.ndarray]) -> None:
    if isinstance(x, dict):
        for k, v in x.items():
            flat(f"{prefix}.{k}", v, out)
    elif isinstance(x, list | tuple):
        for i, v in enumerate(x):
            flat(f"{prefix}.{i}", v, out)
    elif isinstance(x, torch.Tensor):
        out[prefix] = x.detach().cpu().contiguous().numpy()
    else:
        out[prefix] = np.array(repr(x))


def dump(model, opt, path: Path) -> None:
    """Full model + optimizer state (collective when distributed); rank 0 writes it."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=opts)
    if not dist.is_initialized() or dist.get_rank() == 0:
        out: dict[str, np.ndarray] = {}
        flat("model", msd, out)
        flat("optim", osd, out)
        np.savez(path, **out)


def step_once(model, opt, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def reference(steps: int, path: Path) -> None:
    """The uninterrupted single-process run (no saves), for comparison with world size 1."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, steps + 1):
        step_once(model, opt, step, 0)
    dump(model, opt, path)


def train(rank: int, world: int, root: Path, args: dict) -> dict:
    ckpt = root / "ckpt"
    model = make_model()
    if world > 1:  # FSDP2: parameters and optimizer state become DTensor shards
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    if args.get("resume"):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": -1}
        loaded = load_latest(state, ckpt)
        if loaded is not None:
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            assert state["step"] == loaded, (state["step"], loaded)
            start = loaded
    upload_pg = dist.new_group(backend="gloo") if args.get("async") else None
    pending = None
    mgr = None
    if args.get("manager"):  # a second ckptlib flow on the same coordinator (docs/distributed.md, turns)
        import ckptlib

        mgr = ckptlib.CheckpointManager(root / "side", keep_last=2, save_timeout=60)
        if rank == 1:  # a slow planner here: this rank's upload thread opens its session 0.2 s late
            plan = CkptlibWriter.prepare_local_plan

            def slow_plan(self, p):  # type: ignore[no-untyped-def]
                time.sleep(0.2)
                return plan(self, p)

            CkptlibWriter.prepare_local_plan = slow_plan  # type: ignore[method-assign]
    for step in range(start + 1, args["steps"] + 1):
        step_once(model, opt, step, rank)
        if pending is not None:
            pending.result()  # the previous save is committed: one save in flight at a time
        if step == args.get("kill_at") and rank == args.get("victim", world - 1):
            hooks._target = ("write", rank, signal.SIGKILL)  # die mid-write of this save
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": step}
        writer = CkptlibWriter(ckpt, step=step)
        if args.get("async"):
            pending = dcp.async_save(state, storage_writer=writer, process_group=upload_pg)
        else:
            dcp.save(state, storage_writer=writer)
        if mgr is not None:
            # Rank 0 lets DCP's upload thread reach its session first; rank 1 saves at once, and
            # its upload thread plans slowly: the threads reach the store in opposite orders.
            time.sleep(0.2 if rank == 0 else 0.0)
            mgr.save(step, side_state(rank, step))
    if pending is not None:
        pending.result()
    out: dict = {}
    if mgr is not None:
        mgr.close()
        import ckptlib

        into = side_state(rank, 0)
        with ckptlib.CheckpointManager(root / "side") as m:
            out["side"] = [m.restore(into), all(torch.equal(into[k], v) for k, v in side_state(rank, args["steps"]).items())]
    dump(model, opt, root / f"final-{args['tag']}.npz")
    return {"start": start, "debris": sorted(p.name for p in ckpt.iterdir() if ".tmp-" in p.name), **out}


def side_state(rank: int, step: int) -> dict:
    """The ``manager`` option's state at ``step`` (zeros at 0: the restore's template)."""
    return {"w": torch.arange(6, dtype=torch.float32) * step, "step": torch.tensor(step)}


def reshard(root: Path, out: Path) -> int | None:
    """Load the newest step under ``root/ckpt`` into a plain (unsharded) model and optimizer in
    this process -- DCP reshards whatever was saved -- and dump it to ``out``."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)  # also creates the optimizer state to load into
    state = {"model": msd, "optim": osd, "step": -1}
    loaded = load_latest(state, root / "ckpt")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    dump(model, opt, out)
    assert state["step"] == loaded
    return loaded


def load_once(root: Path) -> dict:
    """Scenario ``load``: one ``load_latest``; the outcome, or the error and when it came."""
    state = {"w": torch.zeros(8), "step": -1}
    try:
        step = load_latest(state, root / "ckpt")
    except Exception as e:
        return {"error_type": type(e).__name__, "ckptlib": isinstance(e, CheckpointError),
                "error": str(e)[:2000], "t_error": time.time()}
    return {"step": step, "state_step": state["step"], "w": state["w"].tolist()}


def sizes(rank: int, root: Path) -> dict:
    """Scenario ``sizes`` (module docstring): per phase, the step loaded, whether this rank's
    tensor is bitwise that step's, and the payload size requests this rank made."""
    from ckptlib.backends.posix import PosixStorage
    from ckptlib.integrations.dcp import CkptlibReader
    from ckptlib.integrations.dcp import resume as dresume

    ck = root / "ck-sizes"

    def want(step: int) -> torch.Tensor:
        return torch.arange(64.0) * step + 1000 * rank

    for step in (1, 2):
        dcp.save({f"w{rank}": want(step), "step": step}, storage_writer=CkptlibWriter(ck, step=step))
    dist.barrier()
    files = sorted(str(p.relative_to(ck / "step-000000000002")) for p in (ck / "step-000000000002").rglob("*.bin"))
    asked: list[str] = []
    inner_size, inner_judge = PosixStorage.size, dresume._judge

    def counting(self, p):  # type: ignore[no-untyped-def]
        if p.endswith(".bin"):
            asked.append(p)
        return inner_size(self, p)

    PosixStorage.size = counting  # type: ignore[method-assign]
    out: dict = {"files": files}

    def phase(name: str, load) -> None:  # type: ignore[no-untyped-def]
        asked.clear()
        st = {f"w{rank}": torch.zeros(64), "step": -1}
        got = load(st)
        out[name] = {"step": got, "state_step": st["step"], "asked": list(asked),
                     "bitwise": got is not None and torch.equal(st[f"w{rank}"], want(got))}

    phase("resume", lambda st: load_latest(st, ck))
    phase("plain", lambda st: dcp.load(st, storage_reader=CkptlibReader(ck, step=2)) or 2)

    def judge_then_cut(info):  # type: ignore[no-untyped-def]
        verdict = inner_judge(info)
        if info.step == 2:
            victim = next(p for p in (ck / "step-000000000002").rglob("*.bin") if "r00001" in p.name)
            os.truncate(victim, victim.stat().st_size - 1)
        return verdict

    dresume._judge = judge_then_cut
    phase("cut", lambda st: load_latest(st, ck))
    return out


def main() -> None:
    scenario, rank, world, port, root, args = sys.argv[1:7]
    rank, world, root, args = int(rank), int(world), Path(root), json.loads(args)
    out = root / f"result-{scenario}-{args['tag']}-{rank}.json"
    try:
        if scenario not in ("train", "load", "sizes"):
            raise ValueError(f"unknown scenario {scenario!r}")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))
        if scenario == "load":
            out.write_text(json.dumps(load_once(root)))
            sys.stdout.flush()
            os._exit(0)
        res = sizes(rank, root) if scenario == "sizes" else train(rank, world, root, args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        out.write_text(json.dumps({"crash": traceback.format_exc()}))
        sys.stdout.flush()
        os._exit(3)  # a collective peer may be dead: do not wait in atexit handlers
    out.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
