"""Save every step to a memory tier, lose a node, lose at most one step.

Two ranks as two simulated nodes (gloo on 127.0.0.1, ``CKPTLIB_NODE``), data-parallel training of
a small MLP. Every step is saved to the memory tier (``local="/dev/shm/.../{node}"``, no fsync)
with a replica of each rank's files on the other node; every 10th step is drained to the
persistent tier on disk in the background.

1. A reference run trains ``--steps`` steps without interruption.
2. A run is killed: rank 1's process dies (SIGKILL) in the middle of step ``--kill-at``, and its
   node's memory is lost (its ``/dev/shm`` folder removed, as a node reboot would).
3. A fresh job resumes: it restores the newest step every piece of which has a verified copy
   (node 1's pieces from the replicas on node 0), trains to the end, and the weights are compared
   bit for bit with the reference.

    python examples/every_step.py [--steps 30] [--kill-at 17] [--out runs/every-step]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import ckptlib


def make_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "step": 0}


def train_step(state: dict, step: int, rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    mine = slice(rank * 16 // world, (rank + 1) * 16 // world)  # this rank's half of the batch
    loss = torch.nn.functional.mse_loss(state["model"](x[mine]), y[mine])
    loss.backward()
    for p in state["model"].parameters():  # data parallel: the mean of both halves' gradients
        dist.all_reduce(p.grad)
        p.grad /= world
    state["optim"].step()
    state["optim"].zero_grad()
    state["step"] = step


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for t in state["model"].state_dict().values():
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def worker(rank: int, port: int, args: argparse.Namespace, kill_at: int | None) -> None:
    os.environ["CKPTLIB_NODE"] = str(rank)  # one rank per simulated node
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    state = make_state()
    mgr = ckptlib.CheckpointManager(
        args.out / "persistent", local=f"{args.shm}/{{node}}", local_keep_last=2, replicas=1, persist_every=10,
        keep_last=2, check_replicas="auto", nonfinite="refuse")
    start = mgr.restore(state) or 0
    if rank == 0:
        print(f"rank 0: {'restored step ' + str(start) if start else 'no checkpoint: training from scratch'}",
              flush=True)
    for step in range(start + 1, args.steps + 1):
        if step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash in the middle of a step
        train_step(state, step, rank, 2)
        mgr.save(step, state)  # every step: returns once the state is copied
    mgr.close()
    if rank == 0:
        (args.out / "result.json").write_text(json.dumps({"resumed_from": start, "digest": digest(state)}))
    dist.destroy_process_group()


def job(args: argparse.Namespace, kill_at: int | None) -> dict | None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CKPTLIB_COORD_TIMEOUT": "10"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--out", str(args.out),
                               "--shm", args.shm, "--steps", str(args.steps)]
                              + (["--die-at", str(kill_at)] if kill_at else []), env=env) for r in range(2)]
    codes = [p.wait(timeout=600) for p in procs]
    result = args.out / "result.json"
    if kill_at is None and codes != [0, 0]:
        raise SystemExit(f"a rank failed: exit codes {codes}")
    return json.loads(result.read_text()) if result.exists() and codes == [0, 0] else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-at", type=int, default=17)
    p.add_argument("--out", type=Path, default=Path("runs/every-step"))
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--shm", help=argparse.SUPPRESS)
    p.add_argument("--die-at", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.rank is not None:
        worker(args.rank, args.port, args, args.die_at)
        return 0
    args.out = args.out.resolve()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    reference_dir, shm_root = args.out / "reference", Path("/dev/shm") / f"ckptlib-every-step-{uuid.uuid4().hex[:8]}"
    try:
        out = args.out
        args.out, args.shm = reference_dir, str(shm_root / "reference")
        reference_dir.mkdir()
        ref = job(args, None)
        assert ref is not None
        print(f"reference: {args.steps} steps, weights {ref['digest'][:16]}")
        args.out, args.shm = out / "run", str(shm_root / "run")
        args.out.mkdir()
        job(args, args.kill_at)
        print(f"killed: rank 1 died in step {args.kill_at}; node 1's memory tier is lost")
        shutil.rmtree(Path(args.shm) / "1", ignore_errors=True)
        resumed = job(args, None)
        assert resumed is not None
        lost = args.kill_at - 1 - resumed["resumed_from"]
        same = resumed["digest"] == ref["digest"]
        print(f"resumed from step {resumed['resumed_from']} (steps lost: {lost}), trained to {args.steps}: weights "
              f"{'bitwise equal to' if same else 'DIFFERENT from'} the reference")
        return 0 if same and lost <= 1 else 1
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
