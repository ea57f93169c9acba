"""dist_worker.py plus the ``publish`` scenario: the coordinator's manifest publish is slow
(an injected ``slow`` fault on its ``put_atomic``) or frozen (crash point ``manifest:0:STOP``).

usage: publish_worker.py publish RANK WORLD PORT ROOT JSON-ARGS
(started by tests/distributed/test_failures.py through the common launcher).
"""

from __future__ import annotations

import os
import sys
import time

import dist_worker  # same folder: this file's folder is sys.path[0]

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import default_coordinator
from ckptlib.engine import save as save_flow
from ckptlib.testing.faults import Fault, FaultyStorage


def sc_publish(rank: int, world: int, root: str, args: dict) -> dict:
    """One save; ``args["delay"]``: seconds rank 0's manifest put sleeps; ``args["signal"]``
    (``STOP`` or ``KILL``): rank 0 sends it to itself right after writing the manifest."""
    if args.get("signal") and rank == 0:
        os.environ["CKPTLIB_TEST_KILL_AT"] = f"manifest:0:{args['signal']}"
        from ckptlib import crashpoints

        crashpoints.configure()
    faults = [Fault("put_atomic", "*manifest*", kind="slow", delay=args.get("delay", 0.0))]
    storage = FaultyStorage(open_storage(root), faults if rank == 0 else [])
    coord = default_coordinator()
    flat = save_flow.prepare(dist_worker.make_state(world, rank, {}), rank)
    t0 = time.monotonic()
    try:
        save_flow.persist(storage, "ck", flat, step=None, coordinator=coord)
    except ckptlib.CommitError as e:
        return {
            "error": type(e).__name__,
            "message": str(e),
            "elapsed": time.monotonic() - t0,
            "time": time.time(),
        }
    storage.injector.verify()
    return {"error": None, "elapsed": time.monotonic() - t0, "time": time.time()}


dist_worker.sc_publish = sc_publish  # type: ignore[attr-defined]  # dist_worker.main looks it up

if __name__ == "__main__":
    sys.exit(dist_worker.main())
