"""One rank of a chaos-test job: ``dist_worker.py``'s scenarios with a clean shutdown, plus
``ctrain``, the logged training job the chaos harness (tests/chaos/) kills.

usage: chaos_worker.py SCENARIO RANK WORLD PORT ROOT [JSON-ARGS] (as dist_worker.py)
       chaos_worker.py --warm   (pre-started: reads argv and environment from stdin; see warm())

``dist_worker.py`` leaves the gloo group to interpreter exit for ``train``; a rank that exits
while its peer's gloo threads still run sometimes aborts in teardown ("terminate called without
an active exception", exit -6). Here a rank that finished its scenario meets the others at a
barrier and destroys the group, so a clean job exits 0. A rank whose scenario raised (the
survivor of a killed peer) writes its result, with ``error_time`` (``time.time()`` when the
error reached the scenario), and leaves at once with ``os._exit(0)``: its group is broken,
and the result file says what happened.

``ctrain`` (:func:`sc_ctrain`) appends to ``ROOT/savelog-<rank>.jsonl`` one JSON line per
event (``job``, ``rank``, ``event``, ``t`` = ``time.time()``, ...), each with one ``write`` on
an ``O_APPEND`` file so a SIGKILL leaves at most a torn last line (readers skip it):

* ``init``: the process group is up, restore is about to start;
* ``restored``: ``step`` resumed from (0: nothing) and ``sha256`` of the restored state;
* ``ready``: training starts (after restore);
* ``attempt``: ``step`` and ``sha256`` of the state just before ``mgr.save(step, state)``;
* ``committed`` / ``failed``: what that save's handle reported (checked before the next save
  and before ``close``; a failure is re-raised, so the job fails as it would without logging);
* ``done``: training finished (``train_s``).
"""

from __future__ import annotations

import faulthandler
import hashlib
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any


def _dist_worker():
    path = Path(__file__).resolve().parent / "dist_worker.py"
    spec = importlib.util.spec_from_file_location("ckptlib_test_dist_worker", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SaveLog:
    """Appends events of one rank of one job to ``ROOT/savelog-<rank>.jsonl``."""

    def __init__(self, root: str, rank: int, job: int) -> None:
        self.path = os.path.join(root, f"savelog-{rank}.jsonl")
        self.rank = rank
        self.job = job

    def event(self, event: str, **fields: Any) -> None:
        rec = {"job": self.job, "rank": self.rank, "event": event, "t": time.time(), **fields}
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)


def ballast(mb: float, zero: bool = False):
    """A deterministic replicated float32 tensor of ``mb`` MiB (zeros: a restore target)."""
    import torch

    n = int(mb * (1 << 20)) // 4
    if zero:
        return torch.zeros(n)
    return torch.arange(n, dtype=torch.float32).mul_(0.001).sin_()


def digest(model, opt) -> str:
    """SHA-256 of the weights and optimizer state (the final result of a job)."""
    import torch

    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


def state_hash(state: dict) -> str:
    """SHA-256 of everything ``ctrain`` saves: weights, optimizer state, step, ballast."""
    h = hashlib.sha256(digest(state["model"], state["optim"]).encode())
    h.update(repr(state["step"]).encode())
    if "ballast" in state:
        h.update(state["ballast"].numpy().tobytes())
    return h.hexdigest()


def sc_ctrain(rank: int, world: int, root: str, args: dict) -> dict:
    """``dist_worker.sc_train``'s model and data (same result for any world size), with
    ``CheckpointManager`` restore + async saves every ``save_every`` steps, logged events,
    an optional ``ballast_mb`` tensor (a bigger state to restore), ``step_sleep`` seconds
    per step (stretches training so random-moment kills spread over it) and
    ``startup_skew`` seconds the last rank sleeps before creating the manager. Main thread."""
    import torch

    import ckptlib

    log = SaveLog(root, rank, int(args.get("job", 0)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optim": opt, "step": 0}
    if args.get("ballast_mb"):
        state["ballast"] = ballast(args["ballast_mb"], zero=True)
    if rank == world - 1 and args.get("startup_skew"):
        time.sleep(args["startup_skew"])  # this rank reaches the (collective) manager late
    mgr = ckptlib.CheckpointManager(os.path.join(root, "ckpt"), keep_last=args.get("keep_last", 2))
    log.event("init")
    t0 = time.monotonic()
    start = mgr.restore(state) or 0
    log.event(
        "restored",
        step=start,
        sha256=state_hash(state) if start else None,
        restore_s=round(time.monotonic() - t0, 4),
    )
    if not start and "ballast" in state:
        state["ballast"] = ballast(args["ballast_mb"])
    log.event("ready", start=start)
    t0 = time.monotonic()
    pending: ckptlib.SaveHandle | None = None

    def settle() -> None:
        nonlocal pending
        if pending is None:
            return
        h, pending = pending, None
        try:
            h.wait()
        except Exception as e:
            log.event("failed", step=h.step, error=f"{type(e).__name__}: {e}"[:300])
            raise
        log.event("committed", step=h.step)

    dp_step = _dist_worker().dp_step  # the same model step as dist_worker.py's ``train``
    for step in range(start + 1, args["steps"] + 1):
        dp_step(model, opt, rank, world, step)
        state["step"] = step
        if step % args["save_every"] == 0:
            settle()
            log.event("attempt", step=step, sha256=state_hash(state))
            pending = mgr.save(step, state)
        if args.get("step_sleep"):
            time.sleep(args["step_sleep"])
    settle()
    mgr.close()
    train_s = round(time.monotonic() - t0, 4)
    log.event("done", train_s=train_s)
    return {"digest": digest(model, opt), "start": start, "train_s": train_s}


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    # The harness sends SIGUSR1 to a process that missed its deadline: every thread's stack.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    worker = _dist_worker()
    scenario, rank, world, port, root = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4]
    args = json.loads(argv[5]) if len(argv) > 5 else {}
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=float(args.get("pg_timeout", 60))),
    )
    fn = globals().get(f"sc_{scenario}") or getattr(worker, f"sc_{scenario}")
    try:
        out = fn(rank, world, root, args)
    except Exception:
        out = {"crash": traceback.format_exc(), "error_time": time.time()}
    with open(os.path.join(root, f"result-{scenario}-{rank}.json"), "w") as f:
        json.dump(out, f)
    if "crash" in out:
        sys.stdout.flush()
        os._exit(0)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def warm() -> int:
    """``chaos_worker.py --warm``: import torch and ckptlib first, then read one JSON line
    ``{"argv": [...], "env": {...}}`` from stdin and run that rank with that environment.

    The harness (tests/chaos/launch.py) starts these ahead of time so a job does not wait for
    the imports; each process still runs exactly one rank of one job. EOF on stdin (the
    harness went away or no longer needs it): exit 0 without doing anything.
    """
    import torch
    import torch.distributed  # noqa: F401

    import ckptlib  # noqa: F401
    from ckptlib import crashpoints as hooks

    line = sys.stdin.readline()
    if not line.strip():
        return 0
    req = json.loads(line)
    os.environ.clear()
    os.environ.update(req["env"])
    hooks.configure()  # the kill spec and trace path of this job
    return main(req["argv"])


if __name__ == "__main__":
    if sys.argv[1:] == ["--warm"]:
        sys.exit(warm())
    sys.exit(main(sys.argv[1:]))
