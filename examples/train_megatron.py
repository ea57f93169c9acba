#!/usr/bin/env python3
"""Train a tiny tensor-parallel MLP with Megatron-Core dist_checkpointing, stored by ckptlib.

Copy this file as a starting point. It runs on CPU (gloo) with the real ``megatron-core``:

    python examples/train_megatron.py --save-dir /tmp/mcore-run                  # one process
    torchrun --nproc-per-node 2 examples/train_megatron.py --save-dir /tmp/mcore-run --tp 2
    torchrun --nproc-per-node 2 examples/train_megatron.py --save-dir /tmp/mcore-run --async-save

Kill it at any moment (Ctrl-C, ``kill -9``) and start it again: it resumes from the newest
*consistent* ``iter_NNNNNNN`` folder, found by ckptlib's resume planner
(:func:`ckptlib.integrations.megatron.load_latest`), not from
``latest_checkpointed_iteration.txt``. A checkpoint whose payload has a flipped bit is
detected by checksum and the previous one is used instead. Changing ``--tp`` (or the number
of processes) between runs works: tensors are resharded by their global offsets.

What maps to what: each parameter of a Megatron layer is described by a ``ShardedTensor``
(key, local data, global shape, global offset, replica id), exactly as Megatron's own
``sharded_state_dict()`` methods do; ``replica_id != 0`` pieces (here: the output bias,
identical on every TP rank) are not written. Per-rank RNG state is a ``ShardedObject``
(values: JSON-typed data and tensors only — ckptlib never pickles).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor  # noqa: E402

from ckptlib.integrations import megatron as ck  # noqa: E402

D_IN, D_HID, D_OUT, BATCH = 32, 64, 8, 16


def init_distributed() -> None:
    if "RANK" not in os.environ:  # plain `python`: a one-process group
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))


class TinyTPModel:
    """Column-parallel ``w1``/``b1`` (rows split over TP), row-parallel ``w2`` (columns split,
    partial outputs summed over the TP group), replicated ``b2``; Adam on the local pieces."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        assert world % tp == 0 and D_HID % tp == 0, "world size must be a multiple of --tp"
        self.tp, self.tp_rank, self.dp_rank = tp, rank % tp, rank // tp
        self.tp_group = None
        for start in range(0, world, tp):  # every rank creates every group, same order
            g = dist.new_group(list(range(start, start + tp)), backend="gloo")
            if start <= rank < start + tp:
                self.tp_group = g
        gen = torch.Generator().manual_seed(0)  # same full init everywhere, then slice
        w1, b1 = torch.randn(D_HID, D_IN, generator=gen) * 0.2, torch.zeros(D_HID)
        w2, b2 = torch.randn(D_OUT, D_HID, generator=gen) * 0.2, torch.zeros(D_OUT)
        rows = slice(self.tp_rank * D_HID // tp, (self.tp_rank + 1) * D_HID // tp)
        self.p = {
            "w1": w1[rows].clone().requires_grad_(),
            "b1": b1[rows].clone().requires_grad_(),
            "w2": w2[:, rows].clone().requires_grad_(),
            "b2": b2.clone().requires_grad_(),
        }
        self.opt = torch.optim.Adam(self.p.values(), lr=1e-2)
        for t in self.p.values():  # materialize Adam's state so it can be loaded into
            self.opt.state[t].update(
                step=torch.tensor(0.0), exp_avg=torch.zeros_like(t), exp_avg_sq=torch.zeros_like(t)
            )

    def train_step(self, iteration: int) -> float:
        gen = torch.Generator().manual_seed(iteration)  # data depends on the iteration only
        x, y = torch.randn(BATCH, D_IN, generator=gen), torch.randn(BATCH, D_OUT, generator=gen)
        x = x + 0.01 * torch.randn_like(x)  # "dropout-like" noise from the checkpointed RNG
        h = torch.relu(x @ self.p["w1"].T + self.p["b1"])
        partial = h @ self.p["w2"].T
        total = partial.detach().clone()
        dist.all_reduce(total, group=self.tp_group)
        out = partial + (total - partial.detach()) + self.p["b2"]
        loss = ((out - y) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def sharded_state_dict(self, iteration: int, with_rng: bool = True) -> dict:
        tp, r, dp = self.tp, self.tp_rank, self.dp_rank
        layout = {"w1": [(0, r, tp)], "b1": [(0, r, tp)], "w2": [(1, r, tp)], "b2": []}
        sd: dict = {"model": {}, "optimizer": {}, "iteration": iteration}
        for name, t in self.p.items():
            # Replicas: over data parallelism always; b2 also over tensor parallelism.
            replica = (r, dp) if name == "b2" else (0, dp)
            st = self.opt.state[t]
            for where, key, data in (
                (sd["model"], f"model.{name}", t.detach()),
                (sd["optimizer"], f"optimizer.exp_avg.{name}", st["exp_avg"]),
                (sd["optimizer"], f"optimizer.exp_avg_sq.{name}", st["exp_avg_sq"]),
            ):
                where[key] = ShardedTensor.from_rank_offsets(
                    key, data, *layout[name], replica_id=replica
                )
        sd["optimizer"]["step"] = int(self.opt.state[self.p["w1"]]["step"].item())
        if with_rng:
            rank, world = dist.get_rank(), dist.get_world_size()
            sd["rng"] = ShardedObject("rng", {"torch": torch.get_rng_state()}, (world,), (rank,))
        return sd

    def restore_extras(self, loaded: dict) -> None:
        for t in self.p.values():
            self.opt.state[t]["step"] = torch.tensor(float(loaded["optimizer"]["step"]))
        if "rng" in loaded:
            torch.set_rng_state(loaded["rng"]["torch"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (divides world size)")
    ap.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to try kill -9)")
    args = ap.parse_args()

    init_distributed()
    rank = dist.get_rank()
    model = TinyTPModel(args.tp)
    torch.manual_seed(1234)

    # Resume: newest consistent iteration, checksums verified, corrupt ones skipped. The RNG
    # object is only loaded when the world size is unchanged (it is keyed by rank).
    start = 0
    world_before = _saved_world(args.save_dir)
    it, loaded = ck.load_latest(
        model.sharded_state_dict(0, with_rng=world_before == dist.get_world_size()), args.save_dir
    )
    if it is not None:
        model.restore_extras(loaded)
        start = it
        if rank == 0:
            print(f"resumed from iteration {it}")

    strategy = ck.SaveStrategy()
    pending = None  # the async save in flight, if any
    for iteration in range(start + 1, args.iters + 1):
        loss = model.train_step(iteration)
        time.sleep(args.sleep)
        if iteration % args.save_every == 0:
            if pending is not None:
                pending.finalize()  # every rank: wait, then Megatron writes metadata.json
            ckpt_dir = ck.iteration_dir(args.save_dir, iteration)
            os.makedirs(ckpt_dir, exist_ok=True)
            dist.barrier()
            sd = model.sharded_state_dict(iteration)
            if args.async_save:
                req = dist_checkpointing.save(
                    sd, ckpt_dir, sharded_strategy=strategy, async_sharded_save=True
                )
                pending = ck.schedule(req)  # training continues while it writes
            else:
                dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=strategy)
            if rank == 0:
                print(f"iteration {iteration}: loss {loss:.4f}, checkpoint {ckpt_dir}")
    if pending is not None:
        pending.finalize()
    dist.destroy_process_group()


def _saved_world(save_dir: str) -> int | None:
    """World size of the newest consistent checkpoint (from its manifest), or None."""
    for info in ck.iterations(save_dir):
        if info.status == "committed":
            return info.world_size
    return None


if __name__ == "__main__":
    main()
