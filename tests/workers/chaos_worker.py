"""One rank of a chaos-test job: ``dist_worker.py``'s scenarios with a clean shutdown.

usage: chaos_worker.py SCENARIO RANK WORLD PORT ROOT [JSON-ARGS] (as dist_worker.py)

``dist_worker.py`` leaves the gloo group to interpreter exit for ``train``; a rank that exits
while its peer's gloo threads still run sometimes aborts in teardown ("terminate called without
an active exception", exit -6). Here a rank that finished its scenario meets the others at a
barrier and destroys the group, so a clean job exits 0. A rank whose scenario raised (the
survivor of a killed peer) writes its result and leaves at once with ``os._exit(0)``: its
group is broken, and the result file says what happened.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path


def _dist_worker():
    path = Path(__file__).resolve().parent / "dist_worker.py"
    spec = importlib.util.spec_from_file_location("ckptlib_test_dist_worker", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    import torch
    import torch.distributed as dist

    worker = _dist_worker()
    scenario, rank, world, port, root = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    args = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        out = getattr(worker, f"sc_{scenario}")(rank, world, root, args)
    except Exception:
        out = {"crash": traceback.format_exc()}
    with open(os.path.join(root, f"result-{scenario}-{rank}.json"), "w") as f:
        json.dump(out, f)
    if "crash" in out:
        sys.stdout.flush()
        os._exit(0)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
