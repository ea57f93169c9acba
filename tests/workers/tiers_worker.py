"""One rank of a tiers test job (gloo on 127.0.0.1). Started by tests/distributed/test_tiers.py
and tests/chaos/test_tier_kills.py through tests/launcher.py.

usage: tiers_worker.py RANK WORLD PORT OUT JSON-ARGS
The node comes from CKPTLIB_NODE (set per rank by the test). args: ``mode`` (``save``: save
``steps`` with ``persist_every``/``persist``; ``resume``: restore into zeros and report),
``url`` (persistent tier), ``local`` (template with ``{node}``), ``storage_options``,
``drain`` (close(drain=...)), ``save_timeout`` (also the restore's), ``slow_verify``/``slow_list``/
``slow_write_back``/``slow_stage``/``slow_rank`` (:data:`SLOW_AT`, either mode).
Writes OUT/result-<rank>.json. Every tensor's content is a pure function of (name, step), so
any rank of any world size can check restored bytes exactly. A saving rank also appends each
step to OUT/attempted-<rank>.txt just before ``mgr.save`` and to OUT/committed-<rank>.txt once
its ``wait()`` returned (what the chaos tier-kill test counts).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

import ckptlib
from ckptlib.format.layout import MARKER

SHAPES = {"w": (24, 8), "b": (13,), "e": (10, 6)}
BIG = (4096, 512)
"""``"big": true`` adds a sharded tensor ``m`` of this shape (8 MiB): payload files large enough
for a memory tier's retention to recycle (backends/posix.py ``SPARE_MIN``)."""


def full(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * step)
    return torch.randn(SHAPES[name], generator=g)


def piece(name: str, world: int, rank: int, step: int | None) -> ckptlib.Shard:
    t = full(name, step or 0)
    base, extra = divmod(t.shape[0], world)
    start = rank * base + min(rank, extra)
    n = base + (1 if rank < extra else 0)
    local = t.narrow(0, start, n).clone() if step is not None else torch.zeros(n, *t.shape[1:])
    return ckptlib.Shard(local, t.shape, [start] + [0] * (t.dim() - 1))


def state(world: int, rank: int, step: int | None) -> dict:
    """The state of ``step`` (None: zeros, a restore target)."""
    return {
        "w": piece("w", world, rank, step),
        "e": piece("e", world, rank, step),
        "b": full("b", step) if step is not None else torch.zeros(SHAPES["b"]),
        "step": step if step is not None else -1,
        **({"m": piece("m", world, rank, step)} if "m" in SHAPES else {}),
    }


def matches(st: dict, world: int, rank: int, step: int) -> bool:
    want = state(world, rank, step)
    return all(torch.equal(st[k].local, want[k].local) for k in SHAPES if k != "b") and torch.equal(st["b"], want["b"]) \
        and st["step"] == step


SLOW_AT = {"slow_verify": ("open_read", "step-*/*/r*.bin"), "slow_list": ("listdir", ""),
           "slow_write_back": ("open_write", "step-*.partial"), "slow_stage": ("open_write", f"step-*.tmp-*/{MARKER}")}
"""Where a ``slow_*`` argument slows the rank's node folder: the first read of a payload file
(the restore verifying its local copies), the first listing of the folder (the restore's start,
listing the local steps), the first file the write-back writes (its temporary name), the marker
of the first staging folder (a save: a node leader that is not the coordinator creating its
node's staging folder, ``save_local``)."""


def slow_local(mgr: ckptlib.CheckpointManager, delay: float, out: str, rank: int, op: str, where: str) -> None:
    """This rank's node folder, seen through fault-injecting storage: the first ``op`` call on
    a path matching ``where`` sleeps ``delay`` seconds; a negative ``delay`` SIGSTOPs the
    process there instead (the time goes to OUT/stopped-<rank>.txt)."""
    from ckptlib.testing.faults import Fault, FaultyStorage

    tier = mgr._tier
    assert tier is not None

    def freeze() -> BaseException:
        with open(os.path.join(out, f"stopped-{rank}.txt"), "w") as f:
            f.write(f"{time.time()}\n")
        os.kill(os.getpid(), signal.SIGSTOP)
        return OSError("resumed after SIGSTOP")

    fault = Fault(op, where, kind="slow", delay=delay) if delay >= 0 else Fault(op, where, kind="error",
                                                                                 error=freeze)
    tier.storage = FaultyStorage(tier.storage, [fault])


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung job's stacks (tests/launcher.py)
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    args = json.loads(sys.argv[5])
    if args.get("big"):
        SHAPES["m"] = BIG
    result: dict = {"rank": rank, "node": os.environ.get("CKPTLIB_NODE")}
    path = os.path.join(out, f"result-{rank}.json")
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60))
        mgr = ckptlib.CheckpointManager(
            args["url"], local=args["local"], persist_every=args.get("persist_every", 1),
            replicas=args.get("replicas", 1), storage_options=args.get("storage_options"),
            local_keep_last=args.get("local_keep_last", 2), save_timeout=args.get("save_timeout", 60.0),
        )
        for key, (op, where) in SLOW_AT.items():
            if args.get(key) is not None and rank == args.get("slow_rank", 1):
                slow_local(mgr, float(args[key]), out, rank, op, where)
        started = time.monotonic()
        if args["mode"] == "save":
            persist = args.get("persist", {})
            for step in args["steps"]:
                with open(os.path.join(out, f"attempted-{rank}.txt"), "a") as log:  # chaos: saves started
                    log.write(f"{step}\n")
                h = mgr.save(step, state(world, rank, step), persist=persist.get(str(step)))
                h.wait()
                with open(os.path.join(out, f"committed-{rank}.txt"), "a") as log:  # chaos: saves seen committed
                    log.write(f"{step}\n")
            result["elapsed"] = time.monotonic() - started
            mgr.close(drain=args.get("drain", True))
            result["steps"] = [[i.step, i.status, i.tiers] for i in mgr.steps()]
        else:
            st = state(world, rank, None)
            got = mgr.restore(st)
            result["elapsed"] = time.monotonic() - started
            result["restored"] = got
            result["bitwise"] = got is not None and matches(st, world, rank, got)
            mgr.close()
        result["ok"] = True
    except BaseException as e:  # reported to the test, which fails with it
        result["crash"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        result.update(error=type(e).__name__, message=str(e), time=time.time())
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    if "crash" in result:  # a peer may be dead (chaos): tearing the group down could wait on it
        sys.stdout.flush()
        os._exit(0)
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
