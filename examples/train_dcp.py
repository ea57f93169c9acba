"""Train with torch.distributed.checkpoint, stored through ckptlib (atomic commits, checksums,
any backend), resuming from the newest consistent checkpoint after a crash.

    # one process (DCP runs single-process without a process group)
    python examples/train_dcp.py /tmp/dcp-run --steps 20
    # two gloo ranks, FSDP2-sharded model, asynchronous saves (torchtitan style)
    torchrun --nproc-per-node 2 examples/train_dcp.py /tmp/dcp-run --steps 20 --async-save

Kill it at any point and run the same command again: it resumes from the newest step whose
every byte is present and checks out, skipping a crashed (incomplete) or damaged one.
The root can be any ckptlib URL: a local path, ``s3://bucket/run``, ``memory://...``.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckptlib.integrations.dcp import CkptlibWriter, load_latest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--async-save", action="store_true")
    args = ap.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    else:
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if distributed:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # Resume: the newest consistent step (collective; every rank gets the same answer).
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    start = load_latest(state, args.root) or 0
    if start:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from step {start}")

    upload_group = dist.new_group(backend="gloo") if distributed and args.async_save else None
    pending = None
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(64, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.save_every == 0:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "step": step}
            writer = CkptlibWriter(args.root, step=step)
            if pending is not None:
                pending.result()  # one save in flight at a time
            if args.async_save:
                pending = dcp.async_save(state, storage_writer=writer, process_group=upload_group)
            else:
                dcp.save(state, storage_writer=writer)
            if rank == 0:
                print(
                    f"step {step}: loss {loss.item():.4f}, checkpoint {'started' if args.async_save else 'committed'}"
                )
    if pending is not None:
        pending.result()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
