"""Saving every step: what it adds to a training step, side by side in one run.

One process, a GPT-like state of ``--gib`` GiB (float32 tensors), a training step of about
``--step-s`` seconds on the training thread (matmuls, then every tensor of the state updated in
place, as an optimizer step does). Each contender runs ``--steps`` steps with a save after every
step; rounds alternate the order of the contenders (``--rounds``):

* ``none``           -- no checkpoint: the step time itself;
* ``copy``           -- one plain copy of the state into preallocated buffers per step (the
  floor of any snapshot: the reference the overheads are divided by);
* ``ckptlib.memory`` -- ``CheckpointManager(url, local="/dev/shm/.../{node}")``: every step to
  the memory tier (tmpfs, no fsync), ``persist_every`` large (drains are not measured here);
* ``ckptlib.disk``   -- ``CheckpointManager(url)`` on the disk folder (fsync), every step;
* ``dcp.async``      -- ``torch.distributed.checkpoint.async_save(no_dist=True)`` to /dev/shm;
* ``torch.save``     -- ``torch.save`` to /dev/shm (synchronous).

Every contender first runs ``WARMUP`` (3) untimed steps with its saves (steady state: buffers
allocated; the memory tier's retention recycles the pages of the step it deletes). Per-step
overhead = (the loop's time with the saves - the same loop with ``none``) / steps, and
its ratio to the time of one plain copy (``copy``). The local commit of a memory-tier save is
compared with the raw write of its bytes to the same file system (one file, no fsync on tmpfs).

``--recovery``: 2 ranks as 2 simulated nodes (gloo on 127.0.0.1), every step to the memory tier
with a replica on the peer, the persistent tier on disk: the restore time after losing node 1
(from the peer) against after losing both (from the persistent tier), in fresh processes; then
one save of a data-parallel state (half of the bytes sharded, half replicated on both ranks): the
replica bytes each rank sends, receives and rebuilds from its own memory (the tier's counts).

    python bench/bench_every_step.py [--gib 0.5] [--step-s 0.12] [--steps 8] [--rounds 2] [--recovery]
                                     [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30
MIB = 1 << 20
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import ckptlib  # noqa: E402


def make_state(gib: float) -> dict[str, torch.Tensor]:
    """Layers of a GPT-like model: 4 matrices each, plus embeddings; about ``gib`` GiB."""
    n = int(gib * GIB / 4)
    d = 1024
    layers = max(1, n // (12 * d * d + 8 * d))
    state: dict[str, torch.Tensor] = {}
    for i in range(layers):
        state[f"layers.{i}.attn.qkv"] = torch.randn(3 * d, d)
        state[f"layers.{i}.attn.out"] = torch.randn(d, d)
        state[f"layers.{i}.mlp.up"] = torch.randn(4 * d, d)
        state[f"layers.{i}.mlp.down"] = torch.randn(d, 4 * d)
        state[f"layers.{i}.ln"] = torch.randn(8 * d)
    left = n - sum(t.numel() for t in state.values())
    if left > d:
        state["embed"] = torch.randn(left // d, d)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class Trainer:
    """A training step of about ``step_s`` seconds on this thread: matmuls sized once, then the
    state updated in place."""

    def __init__(self, state: dict[str, torch.Tensor], step_s: float) -> None:
        self.state = state
        self.a = torch.randn(512, 512)
        self.reps = 1
        t0 = time.perf_counter()
        self._compute(20)
        per = (time.perf_counter() - t0) / 20
        update = self._timed_update()
        self.reps = max(1, int((step_s - update) / per))

    def _compute(self, reps: int) -> None:
        x = self.a
        for _ in range(reps):
            x = torch.tanh(x @ self.a)

    def _timed_update(self) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for t in self.state.values():
                t.mul_(0.9999)
        return time.perf_counter() - t0

    def step(self) -> None:
        self._compute(self.reps)
        self._timed_update()


WARMUP = 3
"""Steps each contender runs (and saves) before its clock starts: a run saving every step for
hours is in its steady state (buffers allocated, retention recycling), not in its first saves."""


def _loop(trainer: Trainer, steps: int, save: Any, finish: Any = None) -> float:
    """The seconds of ``steps`` steps after :data:`WARMUP` untimed ones, ``finish`` included."""
    t0 = time.perf_counter()
    for step in range(1, WARMUP + steps + 1):
        if step == WARMUP + 1:
            t0 = time.perf_counter()
        trainer.step()
        if save is not None:
            save(step)
    if finish is not None:
        finish()
    return time.perf_counter() - t0


def contenders(state: dict[str, torch.Tensor], work: Path, shm: Path) -> dict[str, Any]:
    """name -> a function(steps, trainer) returning the loop's seconds (fresh folders each run)."""
    bufs = {k: torch.empty_like(t) for k, t in state.items()}

    def none(trainer: Trainer, steps: int) -> float:
        return _loop(trainer, steps, None)

    def copy(trainer: Trainer, steps: int) -> float:
        def save(step: int) -> None:
            for k, t in state.items():
                bufs[k].copy_(t)

        return _loop(trainer, steps, save)

    def manager(trainer: Trainer, steps: int, memory: bool) -> float:
        root = work / f"ck-{uuid.uuid4().hex[:8]}"
        local = shm / f"tier-{uuid.uuid4().hex[:8]}"
        kw: dict[str, Any] = {"local": str(local / "{node}"), "replicas": 0, "persist_every": 10**9,
                              "local_keep_last": 2} if memory else {"keep_last": 2}
        mgr = ckptlib.CheckpointManager(root, **kw)
        try:
            return _loop(trainer, steps, lambda step: mgr.save(step, state), lambda: mgr.close(drain=False))
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)

    def dcp_async(trainer: Trainer, steps: int) -> float:
        import torch.distributed.checkpoint as dcp

        folder = shm / f"dcp-{uuid.uuid4().hex[:8]}"
        pending: list[Any] = []

        def save(step: int) -> None:
            if pending:
                pending.pop().result()  # one save in flight, as the others
            pending.append(dcp.async_save(dict(state), checkpoint_id=str(folder / f"step{step}"), no_dist=True))
            old = folder / f"step{step - 2}"
            if old.exists():
                shutil.rmtree(old)  # keep the last two, as the managers do

        try:
            return _loop(trainer, steps, save, lambda: [p.result() for p in pending])
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def torch_save(trainer: Trainer, steps: int) -> float:
        folder = shm / f"ts-{uuid.uuid4().hex[:8]}"
        folder.mkdir()

        def save(step: int) -> None:
            torch.save(state, folder / f"step{step % 2}.pt")

        try:
            return _loop(trainer, steps, save)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    return {"none": none, "copy": copy, "ckptlib.memory": lambda t, s: manager(t, s, True),
            "ckptlib.disk": lambda t, s: manager(t, s, False), "dcp.async": dcp_async, "torch.save": torch_save}


def local_commit_vs_raw(state: dict[str, torch.Tensor], shm: Path, rounds: int) -> dict[str, float]:
    """A synchronous memory-tier save (plan, write, checksum, commit) against writing the same
    bytes into one file on the same tmpfs; medians of per-round ratios."""
    ratios, tier_s, raw_s = [], [], []
    for r in range(rounds):
        local = shm / f"commit-{uuid.uuid4().hex[:8]}"
        root = shm / f"persist-{uuid.uuid4().hex[:8]}"

        def tier(root: Path = root, local: Path = local) -> float:
            mgr = ckptlib.CheckpointManager(root, local=str(local / "{node}"), replicas=0, persist_every=10**9,
                                            async_save=False)
            mgr.save(1, state).wait()  # warm
            t0 = time.perf_counter()
            mgr.save(2, state).wait()
            t = time.perf_counter() - t0
            mgr.close(drain=False)
            return t

        def raw() -> float:
            path = shm / f"raw-{uuid.uuid4().hex[:8]}.bin"
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                for t in state.values():
                    f.write(memoryview(t.numpy()).cast("B"))
            t = time.perf_counter() - t0
            path.unlink()
            return t

        try:
            pair = (tier(), raw()) if r % 2 == 0 else tuple(reversed((raw(), tier())))
        finally:
            shutil.rmtree(local, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
        tier_s.append(pair[0])
        raw_s.append(pair[1])
        ratios.append(pair[0] / pair[1])
    return {"tier_s": statistics.median(tier_s), "raw_s": statistics.median(raw_s),
            "ratio": statistics.median(ratios)}


# ----------------------------------------------------------------------------- node loss
def _rank(rank: int, port: int, root: str, shm: str, mode: str, out: str, gib: float, steps: int) -> None:
    import torch.distributed as dist

    os.environ["CKPTLIB_NODE"] = str(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    torch.manual_seed(rank)
    full = make_state(gib)
    half = {k: ckptlib.Shard(t.chunk(2)[rank].clone(), tuple(t.shape), (rank * t.chunk(2)[0].shape[0],) +
                             (0,) * (t.dim() - 1)) for k, t in full.items() if t.shape[0] % 2 == 0}
    mgr = ckptlib.CheckpointManager(root, local=os.path.join(shm, "node{node}"), replicas=1, persist_every=steps - 1,
                                    local_keep_last=2)
    t0 = time.perf_counter()
    if mode == "traffic":  # data parallel: half of the bytes sharded, half replicated on both ranks
        torch.manual_seed(0)  # the replicated half: the same bytes on both ranks (check_replicas compares them)
        same = make_state(gib)
        rep = {f"rep.{k}": same[k] for k in list(full)[: len(full) // 2]}
        dp = {**{k: v for k, v in half.items() if k not in {f[4:] for f in rep}}, **rep}
        mgr.save(1, dp).wait()
        st = mgr._tier.stats  # type: ignore[union-attr]  # the tier's own counts of the save
        assert st is not None
        Path(f"{out}.{rank}.json").write_text(json.dumps({"sent": st.sent, "received": st.received,
                                                          "rebuilt": st.rebuilt}))
        mgr.close(drain=False)
    elif mode == "train":
        for step in range(1, steps + 1):
            mgr.save(step, half)
        mgr.close()
    else:
        got = mgr.restore(half)
        mgr.close()
        dist.barrier()
        Path(f"{out}.{rank}.json").write_text(json.dumps({"step": got, "seconds": time.perf_counter() - t0}))
    dist.destroy_process_group()


def _job(mode: str, root: str, shm: str, out: str, gib: float, steps: int) -> list[dict[str, Any]]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "_rank", str(r), str(port), root, shm, mode, out, str(gib),
                               str(steps)], env=env) for r in range(2)]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"the {mode} job failed")
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)] if mode != "train" else []


def recovery(gib: float, steps: int, work: Path, shm: Path) -> dict[str, Any]:
    root, tiers, out = str(work / "rec"), str(shm / "rec"), str(work / "rec-out")
    try:
        _job("train", root, tiers, out, gib, steps + 1)  # persist_every=steps: the last step is local only
        shutil.rmtree(Path(tiers) / "node1")
        peer = _job("restore", root, tiers, out, gib, steps + 1)
        shutil.rmtree(tiers, ignore_errors=True)
        persistent = _job("restore", root, tiers, out, gib, steps + 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tiers, ignore_errors=True)
    try:
        traffic = _job("traffic", root, tiers, out, gib, steps + 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tiers, ignore_errors=True)
    return {"from_peer": {"step": peer[0]["step"], "seconds": max(r["seconds"] for r in peer)},
            "from_persistent": {"step": persistent[0]["step"], "seconds": max(r["seconds"] for r in persistent)},
            "traffic": traffic}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        a = sys.argv[2:]
        _rank(int(a[0]), int(a[1]), a[2], a[3], a[4], a[5], float(a[6]), int(a[7]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--step-s", type=float, default=0.12)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None, help="contenders to run (default: all)")
    p.add_argument("--recovery", action="store_true")
    p.add_argument("--dir", default=None, help="disk folder (default: a temp folder)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="every-step-"))
    shm = Path("/dev/shm") / f"ckptlib-bench-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    try:
        state = make_state(args.gib)
        size = nbytes(state)
        trainer = Trainer(state, args.step_s)
        runs = contenders(state, work, shm)
        names = [n for n in runs if args.only is None or n in args.only or n in ("none", "copy")]
        runs["ckptlib.memory"](trainer, 2)  # warm: imports, pools
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                times[name].append(runs[name](trainer, args.steps) / args.steps)
        base = statistics.median(times["none"])
        copy = statistics.median(times["copy"]) - base
        rows = {}
        print(f"state {size / GIB:.2f} GiB, step {base:.3f} s, one plain copy {copy:.3f} s, {args.steps} steps x "
              f"{args.rounds} rounds")
        for name in names:
            extra = statistics.median(times[name]) - base
            rows[name] = {"step_s": statistics.median(times[name]), "overhead_s": extra,
                          "x_copy": extra / copy if copy > 0 else None}
            print(f"  {name:15s} step {rows[name]['step_s']:.3f} s  overhead {extra:+.3f} s  "
                  f"= {rows[name]['x_copy']:.1f} x one copy")
        commit = local_commit_vs_raw(state, shm, max(3, args.rounds))
        print(f"memory-tier local commit {commit['tier_s']:.3f} s vs raw write {commit['raw_s']:.3f} s: "
              f"{commit['ratio']:.2f} x")
        result: dict[str, Any] = {"machine": platform.node(), "cpus": os.cpu_count(), "gib": size / GIB,
                                  "when": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "rows": rows,
                                  "copy_s": copy, "step_s": base, "local_commit": commit}
        if args.recovery:
            result["recovery"] = rec = recovery(args.gib, args.steps, work, shm)
            print(f"node loss: restore from the peer {rec['from_peer']['seconds']:.2f} s (step "
                  f"{rec['from_peer']['step']}), all nodes lost: from the persistent tier "
                  f"{rec['from_persistent']['seconds']:.2f} s (step {rec['from_persistent']['step']})")
            for r, t in enumerate(rec["traffic"]):
                print(f"data parallel, rank {r}: replica bytes sent {t['sent'] / MIB:.1f} MiB, rebuilt from its own "
                      f"memory {t['rebuilt'] / MIB:.1f} MiB, received {t['received'] / MIB:.1f} MiB")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
