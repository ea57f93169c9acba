"""The command line the scenario workers share (st, v2, scale, every_step, dist workers):

    python tests/workers/<worker>.py SCENARIO RANK WORLD PORT ROOT [ARGS_JSON]

:func:`run` is each worker's ``main``: it joins the gloo group on 127.0.0.1:PORT, calls the
worker's ``sc_<SCENARIO>(rank, world, root, args)`` on the main thread, and writes what it
returned (or the traceback, as ``{"crash": ...}``) to ``ROOT/result-<SCENARIO>-<RANK>.json``,
which the test reads. Then it leaves the group, or (``exit_at_once``) ends the process at once
with ``os._exit(0)``, as a job that exits the instant its work returned does.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def run(scenarios: dict[str, Any], *, timeout_s: float, exit_at_once: bool = False,
        keep_group_for: Collection[str] = ()) -> int:
    """Run the scenario named on the command line from ``scenarios`` (a worker's ``globals()``);
    ``keep_group_for``: scenarios after which the group is not destroyed (a peer is gone)."""
    scenario, rank, world, port, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    args = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung job's stacks (tests/launcher.py)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    fn: Callable[[int, int, str, dict], dict] = scenarios[f"sc_{scenario}"]
    out: dict
    try:
        out = fn(rank, world, root, args)
    except Exception:
        out = {"crash": traceback.format_exc()}
    with open(os.path.join(root, f"result-{scenario}-{rank}.json"), "w") as f:
        json.dump(out, f)
    if exit_at_once:
        os._exit(0)
    if scenario not in keep_group_for:
        dist.destroy_process_group()
    return 0
