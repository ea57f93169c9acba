"""One rank of the RNG-leaf job (tests/test_rng.py), gloo on 127.0.0.1 through tests/launcher.py.

usage: rng_worker.py PHASE RANK WORLD PORT ROOT
PHASE ``save``: seed this rank's generators differently per rank, save a step holding
``ckptlib.RNGState()``, then draw. PHASE ``restore`` (fresh processes): seed with other
values, restore the step, then draw. Each rank writes ROOT/result-PHASE-RANK.json with its
draws; the test compares them.
"""

from __future__ import annotations

import json
import random
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import ckptlib


def draws() -> dict:
    return {
        "python": [random.random() for _ in range(4)],
        "numpy": [*np.random.rand(4).tolist(), float(np.random.randn())],
        "torch": torch.rand(4).tolist() + torch.randn(3).tolist(),
    }


def main() -> None:
    phase, rank, world, port, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    out: dict = {}
    try:
        seed = (100 if phase == "save" else 7) + rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        draws()  # move every generator away from its seed
        state = {"w": torch.zeros(3), "rng": ckptlib.RNGState()}
        with ckptlib.CheckpointManager(root / "ckpt") as mgr:
            if phase == "save":
                mgr.save(1, state).wait(timeout=60)
            else:
                out["restored"] = mgr.restore(state)
        out["draws"] = draws()
    except Exception:
        out["crash"] = traceback.format_exc()
    finally:
        (root / f"result-{phase}-{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
