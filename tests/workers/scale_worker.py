"""One rank of a scale job (tests/distributed/test_scale.py): many ranks on this 2-core machine.

usage: scale_worker.py SCENARIO RANK WORLD PORT ROOT JSON-ARGS
Writes ROOT/result-<scenario>-<rank>.json. Every tensor is a pure function of (name, step), so
any rank can compute the bytes any step must restore.

- ``saves``: three async saves (steps 1-3) with ``keep_last=2`` (and, with ``local``, a local
  tier on this rank's node, ``CKPTLIB_NODE``); records each save's outcome on this rank; with
  ``exit`` the process exits the instant its last save's wait returns (rank 0 takes the
  job's store with it);
- ``restore``: a fresh state, ``restore``; records the step and whether every byte matches.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

import torch

import ckptlib

ROWS, COLS = 96, 64


def full(name: str, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}@{step}".encode()))
    return torch.randn(shape, generator=g)


def state(rank: int, world: int, step: int) -> dict:
    rows = ROWS * world
    emb = full("emb", step, (rows, COLS))[rank * ROWS:(rank + 1) * ROWS].clone()
    return {"emb": ckptlib.Shard(emb, (rows, COLS), (rank * ROWS, 0)), "head": full("head", step, (COLS,)),
            "cursor": ckptlib.PerRank({"rank": rank, "step": step}), "step": step}


def manager(root: str, args: dict) -> ckptlib.CheckpointManager:
    kw = {"local": os.path.join(root, "node{node}"), "replicas": 1, "persist_every": 2} if args.get("local") else {}
    return ckptlib.CheckpointManager(os.path.join(root, "ckpt"), keep_last=2, **kw)


def sc_saves(rank: int, world: int, root: str, args: dict) -> dict:
    mgr = manager(root, args)
    outcomes = {}
    handles = []
    for step in (1, 2, 3):
        handles.append((step, mgr.save(step, state(rank, world, step))))
    for step, h in handles:
        try:
            h.wait(timeout=600)
            outcomes[step] = "ok"
        except ckptlib.CheckpointError as e:
            outcomes[step] = f"{type(e).__name__}: {e}"
    out = {"outcomes": outcomes}
    if args.get("exit"):
        with open(os.path.join(root, f"result-saves-{rank}.json"), "w") as f:
            json.dump(out, f)
        os._exit(0)  # the instant the wait returned: no close, no barrier
    mgr.close(timeout=600)
    return out


def sc_restore(rank: int, world: int, root: str, args: dict) -> dict:
    mgr = manager(root, args)
    target = {"emb": ckptlib.Shard(torch.zeros(ROWS, COLS), (ROWS * world, COLS), (rank * ROWS, 0)),
              "head": torch.zeros(COLS), "cursor": ckptlib.PerRank(None), "step": 0}
    step = mgr.restore(target)
    mgr.close(timeout=600)
    if step is None:
        return {"step": None}
    want = state(rank, world, step)
    same = (torch.equal(target["emb"].local, want["emb"].local) and torch.equal(target["head"], want["head"])
            and target["cursor"].value == {"rank": rank, "step": step} and target["step"] == step)
    return {"step": step, "bitwise": same}


if __name__ == "__main__":
    from scenario_main import run  # the shared command line (tests import this module too)

    sys.exit(run(globals(), timeout_s=300, exit_at_once=True))
