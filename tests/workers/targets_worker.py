"""One rank of a save-target job (gloo on 127.0.0.1). Started by tests/test_targets.py through
tests/launcher.py.

usage: targets_worker.py RANK WORLD PORT ROOT JSON-ARGS
For each ``args["targets"]`` entry ``[path, overwrite]``, every rank calls ``ckptlib.save`` of
its shard and records the error type it got (or "ok") and the payload files this process
opened for writing. Writes ROOT/result-targets-<rank>.json; exits 0 unless it crashed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import ckptlib
from ckptlib.backends.posix import PosixStorage
from ckptlib.format import layout


def main() -> int:
    rank, world, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    args = json.loads(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    opened: list[str] = []

    def spy(real):
        def create(self: PosixStorage, path: str):  # record every payload file this rank starts
            if layout.is_payload_name(path.rsplit("/", 1)[-1]):
                opened.append(path)
            return real(self, path)
        return create

    for name in ("open_write", "open_write_in"):  # as tests/helpers.py patch_creates, without pytest
        setattr(PosixStorage, name, spy(getattr(PosixStorage, name)))
    out: dict = {"rank": rank, "saves": []}
    try:
        for path, overwrite in args["targets"]:
            opened.clear()
            state = {"w": ckptlib.Shard(torch.full((4,), float(rank + 1)), (4 * world,), (4 * rank,)),
                     "step": 7}
            try:
                ckptlib.save(state, path, overwrite=overwrite)
                got = "ok"
            except ckptlib.CheckpointError as e:
                got = type(e).__name__
            out["saves"].append({"path": path, "got": got, "payloads_opened": list(opened)})
    except Exception:
        out = {"crash": traceback.format_exc()}
    with open(os.path.join(root, f"result-targets-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
