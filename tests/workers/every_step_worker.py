"""One rank of an every-step job (tests/distributed/test_every_step.py): 2 ranks as 2 simulated
nodes, a memory tier (local root under /dev/shm) with replicas on the peer, a persistent tier
on disk.

usage: every_step_worker.py SCENARIO RANK WORLD PORT ROOT JSON-ARGS  (ROOT/result-<scenario>-<rank>.json)

- ``train``: steps 1..N, a save every step (``persist_every`` drains some to disk); optionally
  at step ``flip`` this rank (``flip_rank``) flips one bit of its copy of a replicated tensor,
  at step ``nan`` rank ``nan_rank`` puts a NaN in its shard; records each save's outcome and,
  after every save, the steps its node's memory tier holds;
- ``restore``: a fresh state restored; records the step and whether every byte is the step's.
Every tensor is a pure function of (name, step, rank), so the expected bytes are known.
"""

from __future__ import annotations

import math
import os
import sys
import zlib

import torch

import ckptlib

ROWS, COLS = 64, 32
BIG_REP = {f"rep.{c}": (6 << 20,) for c in "abcdef"}
"""``"big_rep": true``: six plain (replicated) tensors of 24 MiB, the same on every rank. Each of
2 ranks writes three of them (72 MiB): the writer spreads them over two files, balanced by size
(equal sizes keep the order they came in: what a peer rebuilding the files must reproduce)."""


def tensor(name: str, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}@{step}".encode()))
    return torch.randn(shape, generator=g)


def state(rank: int, world: int, step: int, big_rep: bool = False) -> dict:
    shard = tensor("w", step, (ROWS * world, COLS))[rank * ROWS:(rank + 1) * ROWS].clone()
    return {"w": ckptlib.Shard(shard, (ROWS * world, COLS), (rank * ROWS, 0)), "emb": tensor("emb", step, (128, 16)),
            "step": step, "rng": ckptlib.PerRank([rank, step]),
            **({k: tensor(k, step, shape) for k, shape in BIG_REP.items()} if big_rep else {})}


def manager(root: str, args: dict) -> ckptlib.CheckpointManager:
    return ckptlib.CheckpointManager(
        os.path.join(root, "persist"), local=os.path.join(args["shm"], "node{node}"), replicas=1,
        local_keep_last=args.get("local_keep_last", 2), keep_last=args.get("keep_last", 2),
        persist_every=args.get("persist_every", 3), check_replicas=args.get("check_replicas", "auto"),
        nonfinite=args.get("nonfinite", "allow"), async_save=True)


def local_steps(args: dict, node: int) -> list[int]:
    folder = os.path.join(args["shm"], f"node{node}")
    return sorted(int(n[5:]) for n in os.listdir(folder) if n.startswith("step-") and n[5:].isdigit()) \
        if os.path.isdir(folder) else []


def replica_traffic(mgr: ckptlib.CheckpointManager, rank: int, args: dict, step: int) -> dict:
    """What this rank's replica stream moved in the save of ``step`` (the tier's own counts),
    beside the sizes of this rank's files in its node's step folder: ``single`` (its shards,
    per-rank values and index: on this node only) and ``replicated`` (``r<rank>rep-*``: the
    plain tensors every data-parallel rank holds)."""
    stats = mgr._tier.stats  # type: ignore[union-attr]  # the tier's own counts
    folder = os.path.join(args["shm"], f"node{os.environ.get('CKPTLIB_NODE', '0')}", f"step-{step:012d}")
    single = replicated = 0
    for d, _, names in os.walk(folder):
        if "replicas" not in os.path.relpath(d, folder).split(os.sep):  # this rank's own files only
            for n in names:
                if n.startswith(f"r{rank:05d}"):
                    size = os.path.getsize(os.path.join(d, n))
                    if n.startswith(f"r{rank:05d}rep"):
                        replicated += size
                    else:
                        single += size
    return {"sent": stats.sent, "received": stats.received, "rebuilt": stats.rebuilt, "single": single,
            "replicated": replicated}


def sc_train(rank: int, world: int, root: str, args: dict) -> dict:
    mgr = manager(root, args)
    outcomes, held, traffic = {}, {}, {}
    for step in range(1, args["steps"] + 1):
        st = state(rank, world, step, args.get("big_rep", False))
        if step == args.get("flip") and rank == args.get("flip_rank"):
            st["emb"].view(torch.int32)[5, 3] ^= 1 << 7  # a silent fault in this rank's replica
        if step == args.get("nan") and rank == args.get("nan_rank"):
            st["w"].local[3, 4] = math.nan
        try:
            mgr.save(step, st).wait(timeout=300)
            outcomes[step] = "ok"
        except ckptlib.CheckpointError as e:
            outcomes[step] = f"{type(e).__name__}: {e}"
        held[step] = local_steps(args, int(os.environ.get("CKPTLIB_NODE", "0")))
        if outcomes[step] == "ok":
            traffic[step] = replica_traffic(mgr, rank, args, step)
    try:
        mgr.close(timeout=300)
    except ckptlib.CheckpointError as e:  # a failure already reported above is raised once more here
        outcomes["close"] = f"{type(e).__name__}: {e}"
    return {"outcomes": outcomes, "held": held, "traffic": traffic}


def sc_restore(rank: int, world: int, root: str, args: dict) -> dict:
    mgr = manager(root, args)
    target = {"w": ckptlib.Shard(torch.zeros(ROWS, COLS), (ROWS * world, COLS), (rank * ROWS, 0)),
              "emb": torch.zeros(128, 16), "step": 0, "rng": ckptlib.PerRank(None),
              **({k: torch.zeros(shape) for k, shape in BIG_REP.items()} if args.get("big_rep") else {})}
    step = mgr.restore(target)
    mgr.close(timeout=300)
    if step is None:
        return {"step": None}
    want = state(rank, world, step, args.get("big_rep", False))
    same = (torch.equal(target["w"].local, want["w"].local) and torch.equal(target["emb"], want["emb"])
            and target["step"] == step and target["rng"].value == [rank, step]
            and all(torch.equal(target[k], want[k]) for k in BIG_REP if args.get("big_rep")))
    return {"step": step, "bitwise": same}


if __name__ == "__main__":
    from scenario_main import run  # the shared command line (tests import this module too)

    sys.exit(run(globals(), timeout_s=300, exit_at_once=True))
