"""dist_worker.py plus the ``savewait`` scenario: one save (CheckpointManager, sync) whose
opening meetings (SaveSession.begin, the plan) wait on a rank that is slow but alive, or on a
frozen one (SIGSTOP), then a restore of what was saved.

usage: savewait_worker.py savewait RANK WORLD PORT ROOT JSON-ARGS
(started by tests/distributed/test_save_liveness.py through the common launcher).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import dist_worker  # same folder: this file's folder is sys.path[0]
import restore_worker
import torch
import torch.distributed

import ckptlib
from ckptlib import crashpoints
from ckptlib.coord import kv
from ckptlib.engine import save_plan
from ckptlib.format import layout
from ckptlib.testing.faults import Fault, FaultyStorage

STEP = 3
STAGING_MARKER = f"step-*.tmp-*/{layout.MARKER}"
"""The marker commit.begin writes first into a save's new staging folder (the rename commit
mode: POSIX): slowing or freezing its ``open_write`` is slowing or freezing the staging creation."""


def freeze(log: str, phase: str) -> BaseException:
    """Log ``{"phase", "time"}`` to ``log`` and SIGSTOP this process (heartbeat thread
    included); after a SIGCONT the storage call fails."""
    with open(log, "a") as f:
        f.write(json.dumps({"phase": phase, "rank": 0, "time": time.time()}) + "\n")
    os.kill(os.getpid(), signal.SIGSTOP)
    return OSError("resumed after SIGSTOP")


def slow_connect(delay: float) -> None:
    """This rank's coordinator connects to the job's store ``delay`` seconds late (the
    connection of its :class:`ckptlib.coord.kv.TorchKV`; the pulse's is left alone)."""
    real = kv.own_connection

    def own_connection(store: Any) -> Any:
        time.sleep(delay)
        return real(store)

    kv.own_connection = own_connection  # type: ignore[assignment]


def slow_assign(delay: float) -> None:
    """The coordinator's write plan (``assign``, between the plan's gather and its scatter)
    takes ``delay`` seconds more: the others wait in the plan's last meeting."""
    real = save_plan.assign

    def assign(*a: Any, **kw: Any) -> Any:
        time.sleep(delay)
        return real(*a, **kw)

    save_plan.assign = assign  # type: ignore[assignment]


def sc_savewait(rank: int, world: int, root: str, args: dict) -> dict:
    """Save step :data:`STEP` at ``args["url"]`` (``save_timeout`` ``args["save_timeout"]``) with:
    ``slow_stage``: rank 0's staging creation ``args["delay"]`` seconds slow; ``late``: rank 1
    calls ``save`` ``args["delay"]`` seconds after rank 0; ``slow_plan``: rank 0's write plan
    ``args["delay"]`` seconds slow; ``stop_snapshot``: rank 1 SIGSTOPs at the ``snapshot`` crash
    point (the start of ``save``); ``stop_stage``: rank 0 SIGSTOPs in its staging creation;
    ``stop_init``: rank 0 SIGSTOPs once its manager is made, while rank 1's coordinator still
    connects to the job's store (2 s late: :func:`slow_connect`); ``stop_before``: rank 0
    SIGSTOPs before making its manager (rank 1's result: ``"in": "CheckpointManager"`` when
    making its own failed).
    A save that commits is restored into zeros on every rank (``exact``: bytes as saved)."""
    mode, delay = args["mode"], float(args.get("delay", 0.0))
    if mode == "stop_snapshot" and rank == 1:
        os.environ["CKPTLIB_TEST_KILL_AT"] = "snapshot:1:STOP"
        crashpoints.configure()
    if mode == "stop_init" and rank == 1:
        slow_connect(2.0)
    if mode == "stop_before":
        # Every rank first finishes init_process_group: rank 0's can return before rank 1's gloo
        # group has read its peers' addresses from the store (rank 0's process), and a freeze
        # then leaves rank 1 in torch's own wait (its group timeout), not in ckptlib's (seen
        # once on a busy machine). Past the barrier both groups are made; rank 1 says so in a
        # file, so rank 0 cannot freeze while rank 1 still waits in the barrier either.
        torch.distributed.barrier()
        ready = os.path.join(root, "stop-before-ready")
        if rank == 1:
            open(ready, "w").close()
        else:
            end = time.monotonic() + 60
            while not os.path.exists(ready) and time.monotonic() < end:
                time.sleep(0.01)
            freeze(os.environ["CKPTLIB_TEST_KILL_LOG"], "before_init")
    try:
        mgr = ckptlib.CheckpointManager(args["url"], async_save=False, save_timeout=args.get("save_timeout", 120.0))
    except ckptlib.CheckpointError as e:  # its coordinator could not be made
        return {"error": type(e).__name__, "message": str(e), "in": "CheckpointManager", "time": time.time()}
    if mode == "stop_init" and rank == 0:
        freeze(os.environ["CKPTLIB_TEST_KILL_LOG"], "init")
    if rank == 0 and mode == "slow_stage":
        mgr.storage = FaultyStorage(mgr.storage, [Fault("open_write", STAGING_MARKER, kind="slow", delay=delay)])
    elif rank == 0 and mode == "stop_stage":
        log = os.environ["CKPTLIB_TEST_KILL_LOG"]
        mgr.storage = FaultyStorage(mgr.storage, [Fault("open_write", STAGING_MARKER, kind="error",
                                                        error=lambda: freeze(log, "staging"))])
    elif rank == 0 and mode == "slow_plan":
        slow_assign(delay)
    if rank == 1 and mode == "late":
        time.sleep(delay)
    called, t0 = time.time(), time.monotonic()
    try:
        mgr.save(STEP, restore_worker.state(world, rank)).wait()
    except ckptlib.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0,
                "called": called, "time": time.time(), "notes": list(getattr(e, "__notes__", []))}
    out: dict[str, Any] = {"error": None, "elapsed": time.monotonic() - t0, "called": called, "time": time.time()}
    if isinstance(mgr.storage, FaultyStorage):
        mgr.storage.injector.verify()  # the slow staging creation really happened
    target = restore_worker.state(world, rank, zero=True)
    out["restored"] = mgr.restore(target)
    want = restore_worker.state(world, rank)
    out["exact"] = torch.equal(target["w"].local, want["w"].local) and torch.equal(target["plain"], want["plain"]) \
        and target["rng"].value.tolist() == [rank, rank]
    mgr.close()
    return out


dist_worker.sc_savewait = sc_savewait  # type: ignore[attr-defined]  # dist_worker.main looks it up

if __name__ == "__main__":
    sys.exit(dist_worker.main())
