"""dist_worker.py plus the ``overwrite`` scenario of tests/distributed/test_overwrite_fence.py:
step ``args["step"]`` is saved, then saved again with ``overwrite=True`` while rank 0 is frozen
in its publish (crash point ``manifest:0:STOP:2``).

usage: overwrite_worker.py overwrite RANK WORLD PORT ROOT JSON-ARGS (through the common launcher).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import dist_worker  # same folder: this file's folder is sys.path[0]
import torch

import ckptlib
from ckptlib import crashpoints
from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import default_coordinator
from ckptlib.engine import save as save_flow
from ckptlib.format import layout


def state(gen: int) -> dict[str, Any]:
    """What every rank saves as generation ``gen`` (replicated; the test loads it back)."""
    return {"w": torch.arange(5000, dtype=torch.float32) * gen, "gen": gen}


def sc_overwrite(rank: int, world: int, root: str, args: dict) -> dict:
    if rank == 0:  # frozen at the second reach of "manifest": the overwrite's publish, before its claim
        os.environ["CKPTLIB_TEST_KILL_AT"] = "manifest:0:STOP:2"
        crashpoints.configure()
    storage = open_storage(args["url"], args.get("options"))
    coord = default_coordinator()
    step = args["step"]
    first = save_flow.persist(storage, layout.step_dir(step), save_flow.prepare(state(1), rank), step=step,
                              coordinator=coord)
    t0 = time.monotonic()
    try:
        save_flow.persist(storage, layout.step_dir(step), save_flow.prepare(state(2), rank), step=step,
                          coordinator=coord, options=save_flow.SaveOptions(overwrite=True))
    except ckptlib.CommitError as e:
        return {"first": first.save_id, "error": type(e).__name__, "message": str(e),
                "elapsed": time.monotonic() - t0, "time": time.time()}
    return {"first": first.save_id, "error": None, "elapsed": time.monotonic() - t0, "time": time.time()}


dist_worker.sc_overwrite = sc_overwrite  # type: ignore[attr-defined]  # dist_worker.main looks it up

if __name__ == "__main__":
    sys.exit(dist_worker.main())
