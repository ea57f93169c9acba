"""dist_worker.py plus the ``restore`` scenario: a save, then a restore during which the
coordinator's listing of the run root is slow (an injected ``slow`` fault) or frozen (rank 0
SIGSTOPs itself inside it).

usage: restore_worker.py restore RANK WORLD PORT ROOT JSON-ARGS
(started by tests/distributed/test_restore_liveness.py through the common launcher).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import dist_worker  # same folder: this file's folder is sys.path[0]
import torch

import ckptlib
from ckptlib.backends.base import Entry
from ckptlib.testing.faults import Fault, FaultyStorage

ROWS = 24


def state(world: int, rank: int, zero: bool = False) -> dict:
    full = torch.zeros(ROWS, 5) if zero else torch.arange(ROWS * 5, dtype=torch.float32).reshape(ROWS, 5)
    start, n = dist_worker.split(ROWS, world, rank)
    return {
        "w": ckptlib.Shard(full[start : start + n].clone(), full.shape, (start, 0)),
        "plain": torch.zeros(7) if zero else torch.full((7,), 3.5),
        "rng": ckptlib.PerRank(torch.full((2,), -1 if zero else rank, dtype=torch.int64)),
    }


class StopInListing(FaultyStorage):
    """Rank 0's storage in the ``stop`` mode: its first listing of the root logs the time and
    SIGSTOPs the process (heartbeat thread included): a coordinator frozen mid-listing."""

    def __init__(self, inner, log: str) -> None:
        super().__init__(inner, [])
        self.log = log

    def listdir(self, path: str = "") -> list[Entry]:
        if path == "":
            with open(self.log, "a") as f:
                f.write(json.dumps({"phase": "listing", "rank": 0, "time": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().listdir(path)


def sc_restore(rank: int, world: int, root: str, args: dict) -> dict:
    """Step 1 saved by every rank, then ``CheckpointManager.restore`` with rank 0's first
    listing of the root ``slow`` (``args["delay"]`` seconds) or ``stop`` (SIGSTOP)."""
    mgr = ckptlib.CheckpointManager(args["url"], async_save=False)
    mgr.save(1, state(world, rank)).wait()
    if rank == 0 and args["mode"] == "slow":
        mgr.storage = FaultyStorage(mgr.storage, [Fault("listdir", "", kind="slow", delay=args["delay"])])
    elif rank == 0 and args["mode"] == "stop":
        mgr.storage = StopInListing(mgr.storage, os.environ["CKPTLIB_TEST_KILL_LOG"])
    target = state(world, rank, zero=True)
    t0 = time.monotonic()
    try:
        got = mgr.restore(target)
    except ckptlib.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0, "time": time.time(),
                "notes": list(getattr(e, "__notes__", []))}
    if rank == 0 and args["mode"] == "slow":
        mgr.storage.injector.verify()  # the slow listing really happened
    want = state(world, rank)
    exact = torch.equal(target["w"].local, want["w"].local) and torch.equal(target["plain"], want["plain"]) and (
        target["rng"].value.tolist() == [rank, rank])
    mgr.close()
    return {"error": None, "step": got, "exact": exact, "elapsed": time.monotonic() - t0, "time": time.time()}


dist_worker.sc_restore = sc_restore  # type: ignore[attr-defined]  # dist_worker.main looks it up

if __name__ == "__main__":
    sys.exit(dist_worker.main())
