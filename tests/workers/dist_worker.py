"""One rank of a multi-process test job (gloo on 127.0.0.1). Started by tests/distributed/*.

usage: dist_worker.py SCENARIO RANK WORLD PORT ROOT [JSON-ARGS]
Writes ROOT/result-<scenario>-<rank>.json with what it observed; exits 0 unless it crashed.
Every tensor's content is a pure function of its name, so any rank of any job can compute
the expected bytes of any piece.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import zlib

import torch
import torch.distributed as dist

import ckptlib

SHAPES = {"plain": (64, 32), "bias": (7,), "emb": (41, 16), "col": (8, 30), "dt": (12, 6),
          "half": (10, 10)}
DTYPES = {"half": torch.bfloat16}


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(SHAPES[name], generator=g)
    return t.to(DTYPES.get(name, torch.float32))


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """Uneven split of n into world parts (the first parts one larger)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def shard(name: str, dim: int, world: int, rank: int) -> ckptlib.Shard:
    t = full(name)
    start, length = split(t.shape[dim], world, rank)
    offset = [0] * t.dim()
    offset[dim] = start
    return ckptlib.Shard(t.narrow(dim, start, length).clone(), t.shape, offset)


def empty_shard(name: str, dim: int, world: int, rank: int) -> ckptlib.Shard:
    s = shard(name, dim, world, rank)
    return ckptlib.Shard(torch.zeros_like(s.local), s.global_shape, s.global_offset)


def dtensor(name: str, dim: int, world: int, zero: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    src = torch.zeros(SHAPES[name]) if zero else full(name)
    return distribute_tensor(src, mesh, [Shard(dim)])


def make_state(world: int, rank: int, dims: dict[str, int]) -> dict:
    return {
        "plain": full("plain"),
        "nested": {"bias": full("bias"), "half": full("half"), "lr": 0.5, "name": "run"},
        "emb": shard("emb", dims.get("emb", 0), world, rank),
        "col": shard("col", dims.get("col", 1), world, rank),
        "dt": dtensor("dt", dims.get("dt", 0), world),
        "rng": ckptlib.PerRank(torch.full((4,), rank, dtype=torch.int64)),
        "cursor": ckptlib.PerRank({"rank": rank, "pos": 100 + rank}),
    }


def sc_save(rank: int, world: int, root: str, args: dict) -> dict:
    state = make_state(world, rank, args.get("dims", {}))
    t0 = time.monotonic()
    ckptlib.save(state, os.path.join(root, args.get("name", "ck")))
    return {"elapsed": time.monotonic() - t0}


def sc_store_keys(rank: int, world: int, root: str, args: dict) -> dict:
    """Saves of a manager; rank 0 (the store's host) counts the job store's keys after the first
    ``args["first"]`` saves and again after all ``args["saves"]`` (tests/distributed/test_store_keys.py)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    state = make_state(world, rank, {})
    counts = []
    with ckptlib.CheckpointManager(os.path.join(root, "ck"), keep_last=2) as mgr:
        for step in range(1, args["saves"] + 1):
            mgr.save(step, state).wait(timeout=60)
            if step in (args["first"], args["saves"]):
                dist.barrier()
                time.sleep(2.5)  # spent keys are deleted at each process's next heartbeat (every 2 s)
                counts.append(_get_default_store().num_keys() if rank == 0 else 0)
                dist.barrier()
    return {"keys": counts}


def sc_failed_saves(rank: int, world: int, root: str, args: dict) -> dict:
    """Saves that fail (the last rank holds a value no save can store: a set) between good ones;
    rank 0 counts the job store's keys after the first good save, after ``args["failures"]``
    failed saves and after a good save again (tests/distributed/test_store_keys.py)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    state = make_state(world, rank, {})
    counts, failed = [], 0

    def count() -> None:
        dist.barrier()
        time.sleep(2.5)  # spent keys are deleted at each process's next heartbeat (every 2 s)
        counts.append(_get_default_store().num_keys() if rank == 0 else 0)
        dist.barrier()

    with ckptlib.CheckpointManager(os.path.join(root, "ck"), keep_last=2, save_timeout=60) as mgr:
        mgr.save(1, state).wait(timeout=60)
        count()
        for step in range(2, 2 + args["failures"]):
            bad = dict(state, bad={1, 2}) if rank == world - 1 else state
            try:
                mgr.save(step, bad).wait(timeout=60)
            except ckptlib.CheckpointError:
                failed += 1
            if step == 3:
                count()
        mgr.save(100, state).wait(timeout=60)
        count()
    return {"keys": counts, "failed": failed}


def sc_tier_managers(rank: int, world: int, root: str, args: dict) -> dict:
    """Managers with a local tier made, used (a drained save, a restore) and closed one after
    another in one process, as a sweep or a notebook does; each rank counts its threads and
    open descriptors, and rank 0 the job store's keys, after ``args["first"]`` managers and
    again after ``args["managers"]`` (tests/distributed/test_store_keys.py). Every closed
    manager is kept referenced, as a notebook's variables keep them."""
    import gc
    import threading

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    os.environ["CKPTLIB_NODE"] = str(rank)  # one node per rank, each with its local folder
    kept, counts = [], []
    for m in range(1, args["managers"] + 1):
        mgr = ckptlib.CheckpointManager(os.path.join(root, "ck"), local=os.path.join(root, "local-{node}"),
                                        replicas=0, keep_last=2, save_timeout=60)
        state = {"w": full("plain").clone(), "step": 0}
        mgr.restore(state)
        state["step"] = m
        mgr.save(m, state).wait_persisted(timeout=60)
        mgr.close()
        kept.append(mgr)
        if m in (args["first"], args["managers"]):
            dist.barrier()
            time.sleep(2.5)  # discarded keys are deleted at each process's next heartbeat (every 2 s)
            gc.collect()
            counts.append({"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
                           "keys": _get_default_store().num_keys() if rank == 0 else 0})
            dist.barrier()
    return {"counts": counts}


def sc_load(rank: int, world: int, root: str, args: dict) -> dict:
    dims = args.get("dims", {})
    policy = args.get("per_rank", "error")
    target = {
        "plain": torch.zeros(SHAPES["plain"]),
        "nested": {"bias": torch.zeros(7), "half": torch.zeros(10, 10, dtype=torch.bfloat16),
                   "lr": 0.0, "name": ""},
        "emb": empty_shard("emb", dims.get("emb", 1), world, rank),
        "col": empty_shard("col", dims.get("col", 0), world, rank),
        "dt": dtensor("dt", dims.get("dt", 1), world, zero=True),
        "rng": ckptlib.PerRank(torch.zeros(4, dtype=torch.int64)),
        "cursor": ckptlib.PerRank(None),
    }
    from ckptlib.backends import open_storage
    from ckptlib.engine.load import load_checkpoint

    stats: dict[str, int] = {}
    try:
        load_checkpoint(open_storage(root), args.get("name", "ck"), target, rank=rank, world_size=world,
                        per_rank=policy, stats=stats)
    except ckptlib.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}
    bad = []
    if not torch.equal(target["plain"], full("plain")):
        bad.append("plain")
    for k in ("bias", "half"):
        if not torch.equal(target["nested"][k], full(k)):
            bad.append(k)
    for k in ("emb", "col"):
        s = target[k]
        want = full(k)
        for d, (o, n) in enumerate(zip(s.global_offset, s.local.shape, strict=True)):
            want = want.narrow(d, o, n)
        if not torch.equal(s.local, want):
            bad.append(k)
    if not torch.equal(target["dt"].full_tensor(), full("dt")):
        bad.append("dt")
    return {
        "stats": stats,
        "bad": bad,
        "lr": target["nested"]["lr"],
        "rng": target["rng"].value.tolist() if isinstance(target["rng"], ckptlib.PerRank) else None,
        "cursor": target["cursor"].value if isinstance(target["cursor"], ckptlib.PerRank) else None,
    }


def sc_fail(rank: int, world: int, root: str, args: dict) -> dict:
    """Save once cleanly, then again with a rank told (by env) to die or freeze mid-write."""
    state = make_state(world, rank, {})
    ckptlib.save(state, os.path.join(root, "good"))
    dist.barrier()
    if rank == args["victim"]:
        os.environ["CKPTLIB_TEST_KILL_AT"] = f"{args['phase']}:{rank}:{args['signal']}"
        from ckptlib import crashpoints

        crashpoints.configure()
    t0 = time.monotonic()
    try:
        ckptlib.save(state, os.path.join(root, "bad"))
    except ckptlib.CommitError as e:
        return {"error": type(e).__name__, "message": str(e), "failures": {str(k): v for k, v in e.failures.items()},
                "elapsed": time.monotonic() - t0}
    return {"error": None, "elapsed": time.monotonic() - t0}


def sc_unsaveable(rank: int, world: int, root: str, args: dict) -> dict:
    """Rank ``args["victim"]``'s state holds a value ckptlib cannot save (a set), in a manager's
    save (``args["async"]``) and in a one-shot save; then every rank saves a good state. Records
    what each save raised, and the step a fresh restore finds."""
    out: dict = {}

    def attempt(key: str, fn) -> None:
        try:
            fn()
            out[key] = None
        except ckptlib.CheckpointError as e:
            out[key] = [type(e).__name__, str(e)]

    state = make_state(world, rank, {})
    bad = dict(state, extra=ckptlib.PerRank({1, 2} if rank == args["victim"] else [1, 2]))
    with ckptlib.CheckpointManager(os.path.join(root, "ck"), async_save=args["async"], save_timeout=60) as mgr:
        mgr.save(1, state).wait(timeout=60)
        attempt("manager", lambda: mgr.save(2, bad).wait(timeout=60))
        attempt("next", lambda: mgr.save(3, state).wait(timeout=60))
    attempt("one_shot", lambda: ckptlib.save(bad, os.path.join(root, "one")))
    attempt("one_shot_next", lambda: ckptlib.save(state, os.path.join(root, "two")))
    out["one_exists"] = os.path.exists(os.path.join(root, "one"))
    with ckptlib.CheckpointManager(os.path.join(root, "ck")) as mgr:
        out["restored"] = mgr.restore(make_state(world, rank, {}))
    return out


def dp_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, step: int) -> None:
    """One data-parallel step of ``sc_train``'s job (also chaos_worker.py's ``ctrain``).

    A fixed global batch of 8 samples seeded by ``step``; each rank computes the per-sample
    gradients of its samples, all are gathered and summed in sample order, so the result is
    bitwise the same for any world size. Collective: every rank calls it, main thread.
    """
    batch = 8
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch, 16, generator=g)
    y = torch.randn(batch, 4, generator=g)
    mine = {}
    for i in range(rank, batch, world):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[i : i + 1]), y[i : i + 1]).backward()
        mine[i] = [p.grad.clone() for p in model.parameters()]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    merged = {}
    for part in everyone:
        merged.update(part)
    for j, p in enumerate(model.parameters()):
        total = merged[0][j].clone()
        for i in range(1, batch):
            total = total + merged[i][j]
        p.grad = total / batch
    opt.step()


def sc_train(rank: int, world: int, root: str, args: dict) -> dict:
    """Data-parallel training with a fixed global batch whose result does not depend on the
    number of ranks: per-sample gradients are gathered and summed in sample order."""
    import hashlib
    import signal

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt, "step": 0}
    mgr = ckptlib.CheckpointManager(os.path.join(root, "ckpt"), keep_last=2) if args.get("save_every") else None
    start = 0
    if mgr is not None:
        start = mgr.restore(state) or 0
    for step in range(start + 1, args["steps"] + 1):
        dp_step(model, opt, rank, world, step)
        state["step"] = step
        if mgr is not None and step % args["save_every"] == 0:
            mgr.save(step, state)
        if step == args.get("die_at") and rank == args.get("victim", 1):
            mgr.wait()  # so the newest committed step is known: the one before the kill
            os.kill(os.getpid(), signal.SIGKILL)
    if mgr is not None:
        mgr.close()
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    return {"digest": h.hexdigest(), "start": start}


def fsdp_setup(fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model (sharded with FSDP2 over every rank when ``fsdp``) and a fresh Adam on it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def fsdp_train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """The same batch on every rank: FSDP's gradient average over 1, 2 or 4 ranks is exact."""
    for i in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + i))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def fsdp_full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and Adam moments as whole tensors, by parameter name."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if type(t).__name__ == "DTensor" else t).detach().clone()

    out = {}
    for name, p in model.named_parameters():
        out[name] = whole(p)
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{k}"] = whole(opt.state[p][k])
    return out


def sc_fsdp_save(rank: int, world: int, root: str, args: dict) -> dict:
    model, opt = fsdp_setup(args["fsdp"])
    fsdp_train(model, opt, range(2))
    ckptlib.save({"model": model, "optim": opt}, os.path.join(root, "ck"))
    return {}


def sc_fsdp_resume(rank: int, world: int, root: str, args: dict) -> dict:
    """A fresh model and a fresh Adam (empty state), restored, then one step: compared bit for
    bit with an uninterrupted run of the plain model in this process."""
    model, opt = fsdp_setup(args["fsdp"])
    ckptlib.load(os.path.join(root, "ck"), into={"model": model, "optim": opt})
    fsdp_train(model, opt, range(2, 3))
    got = fsdp_full(model, opt)
    ref_model, ref_opt = fsdp_setup(False)
    fsdp_train(ref_model, ref_opt, range(3))
    want = fsdp_full(ref_model, ref_opt)
    return {"bad": [k for k in want if not torch.equal(got[k], want[k])]}


def sc_plain_differs(rank: int, world: int, root: str, args: dict) -> dict:
    """Plain (replicated) tensors that differ between ranks (a caller's bug): rank 1's ``b`` has
    another shape, rank 2 holds an ``extra`` tensor, rank 3 (if any) the same ones in another
    order. What each rank's save raises, in format v1 and v2."""
    out: dict = {}
    for fmt in (1, 2):
        plain = {"a": torch.zeros(3), "b": torch.zeros(2, 2 + (rank == 1)), "c": torch.ones(1)}
        if rank == 2:
            plain["extra"] = torch.zeros(5, dtype=torch.int64)
        if rank == 3:
            plain = dict(reversed(plain.items()))
        state = {"w": shard("emb", 0, world, rank), "plain": plain}
        os.environ["CKPTLIB_FORMAT_VERSION"] = str(fmt)  # read by each save
        with ckptlib.CheckpointManager(os.path.join(root, f"v{fmt}"), save_timeout=30) as mgr:
            try:
                mgr.save(1, state).wait(timeout=60)
                out[f"v{fmt}"] = None
            except ckptlib.CheckpointError as e:
                out[f"v{fmt}"] = [type(e).__name__, str(e)]
    return out


def sc_step_mismatch(rank: int, world: int, root: str, args: dict) -> dict:
    """Every rank saves a different step at once (a bug in the caller): what each save raises,
    then a save of one step by all, and what is on disk."""
    state = {"w": shard("emb", 0, world, rank), "step": ckptlib.PerRank(rank)}
    out: dict = {}
    with ckptlib.CheckpointManager(os.path.join(root, "ck"), save_timeout=30) as mgr:
        try:
            mgr.save(1 + rank, state).wait(timeout=60)
            out["mismatch"] = None
        except ckptlib.CheckpointError as e:
            out["mismatch"] = [type(e).__name__, str(e)]
        mgr.save(5, state).wait(timeout=60)
    out["steps"] = sorted(os.listdir(os.path.join(root, "ck")))
    return out


def sc_preempt_skew(rank: int, world: int, root: str, args: dict) -> dict:
    """save_on_signal in flag mode; each rank gets its SIGTERM at another step (rank r at step
    20 + 3r; saves every 10 steps). Returns the exit code of the final checkpoint and its step."""
    w = torch.zeros(1000)

    def state(step: int) -> dict:
        return {"w": ckptlib.Shard(w, (world * 1000,), (rank * 1000,)), "step": step}

    mgr = ckptlib.CheckpointManager(os.path.join(root, "ck"), save_timeout=30)
    mgr.save_on_signal(deadline=60)
    for step in range(1, 100):
        w.fill_(step)
        if step % 10 == 0:
            mgr.save(step, state(step))
        if step == 20 + 3 * rank:
            os.kill(os.getpid(), signal.SIGTERM)
        try:
            mgr.maybe_save_on_preemption(step, state(step))
        except SystemExit as e:
            return {"exit": e.code, "step": step}
    return {"exit": None}


def sc_hsdp_replicas(rank: int, world: int, root: str, args: dict) -> dict:
    """HSDP: a 2 x (world/2) mesh, each weight ``Shard(0)`` over the second dimension and
    ``Replicate()`` over the first (ranks r and r + world/2 hold the same rows), saved with
    ``check_replicas=True``: step 1 as is, step 2 with one bit of rank ``flip``'s rows flipped,
    step 3 as is. Returns each save's outcome and the committed steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2))
    mgr = ckptlib.CheckpointManager(os.path.join(root, "ck"), check_replicas=True, keep_last=2)
    out = {}
    for step in (1, 2, 3):
        w = distribute_tensor(full("plain"), mesh, [Replicate(), Shard(0)])
        if step == 2 and rank == args["flip"]:
            w.to_local().view(torch.int32)[3, 5] ^= 1 << 7
        try:
            mgr.save(step, {"w": w, "bias": full("bias")}).wait(timeout=60)
            out[step] = "ok"
        except ckptlib.CheckpointError as e:
            out[step] = f"{type(e).__name__}: {e}; failures={sorted(e.failures or {})}"
    mgr.close()
    return {"outcomes": out, "steps": [(i.step, i.status) for i in mgr.steps()]}


def sc_streamed_replicas(rank: int, world: int, root: str, args: dict) -> dict:
    """Async saves streamed through a staging budget far smaller than the state (the snapshot
    is copied and written in row slabs, engine/snapshot.py), ``check_replicas=True``: step 2
    with one bit flipped in the first rows of rank ``flip``'s copy of a 1 MiB plain tensor."""
    mgr = ckptlib.CheckpointManager(os.path.join(root, "ck"), check_replicas=True, keep_last=2,
                                    staging_budget=64 << 10)
    out = {}
    for step in (1, 2, 3):
        rep = torch.arange(1 << 18, dtype=torch.float32) + step
        if step == 2 and rank == args["flip"]:
            rep.view(torch.int32)[17] ^= 1 << 4
        try:
            mgr.save(step, {"rep": rep, "w": shard("plain", 0, world, rank)}).wait(timeout=60)
            out[step] = "ok"
        except ckptlib.CheckpointError as e:
            out[step] = f"{type(e).__name__}: {e}; failures={sorted(e.failures or {})}"
    mgr.close()
    return {"outcomes": out, "steps": [(i.step, i.status) for i in mgr.steps()]}


def sc_lazy_fallback(rank: int, world: int, root: str, args: dict) -> dict:
    """Saves steps 1..``args["steps"]`` (values differ per step); rank 0 flips one payload
    byte of the newest step (its size kept, so only the load's checksum finds it); then every
    rank restores with a fresh manager (tests/distributed/test_lazy_resume.py). Reports the
    step restored, whether every tensor is bitwise that step's, and how many step folders the
    restore judged on this rank."""
    from ckptlib.engine import scan
    from ckptlib.format import layout

    def state(step: int) -> dict:
        return {"w": shard("emb", 0, world, rank), "step": torch.full((3,), float(step)),
                "x": full("plain") * step}

    path = os.path.join(root, "ck")
    last = args["steps"]
    with ckptlib.CheckpointManager(path) as mgr:
        for step in range(1, last + 1):
            s = state(step)
            s["w"].local.mul_(step)
            mgr.save(step, s).wait(timeout=60)
    dist.barrier()
    if rank == 0:
        folder = os.path.join(path, layout.step_dir(last))
        payload = sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.startswith("r00001"))[0]
        with open(payload, "r+b") as f:
            at = os.path.getsize(payload) // 2
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    judged: list[str] = []
    inner = scan.check_step

    def counting(storage, folder, step=None, **kw):  # type: ignore[no-untyped-def]
        judged.append(folder)
        return inner(storage, folder, step, **kw)

    scan.check_step = counting  # type: ignore[assignment]
    got, same = _restore_scaled(path, state, ("step", "x"))
    return {"restored": got, "bitwise": same, "judged": judged}


def _restore_scaled(path: str, state, plain: tuple[str, ...]) -> tuple[int | None, bool]:  # type: ignore[no-untyped-def]
    """A fresh manager restores into ``state(0)`` (its shard ``w`` zeroed). Returns the step
    restored and whether every tensor is bitwise that step's as the scenarios save it:
    ``state(step)`` with the shard multiplied by the step; ``plain``: the other tensors compared."""
    target = state(0)
    target["w"].local.zero_()
    with ckptlib.CheckpointManager(path) as mgr:
        got = mgr.restore(target)
    want = state(got or 0)
    want["w"].local.mul_(got or 0)
    return got, all(torch.equal(target[k], want[k]) for k in plain) and torch.equal(target["w"].local, want["w"].local)


def sc_restore_sizes(rank: int, world: int, root: str, args: dict) -> dict:
    """Saves steps 1 and 2 (values differ per step), then every rank restores with a fresh
    manager, counting the payload size requests (``Storage.size``) this rank's restore makes
    (tests/distributed/test_lazy_resume.py). ``args["cut"]``: right after the coordinator has
    judged step 2 (sizes good), rank 1's payload file of it loses its last byte, so only rank 1's
    reader can find it. Reports the step restored, whether every tensor is bitwise that step's,
    the payload files of a step and the size requests."""
    from ckptlib.backends.posix import PosixStorage
    from ckptlib.engine import scan
    from ckptlib.format import layout

    def state(step: int) -> dict:
        return {"w": shard("emb", 0, world, rank), "step": torch.full((3,), float(step))}

    path = os.path.join(root, "ck")
    with ckptlib.CheckpointManager(path) as mgr:
        for step in (1, 2):
            s = state(step)
            s["w"].local.mul_(step)
            mgr.save(step, s).wait(timeout=60)
    folder = os.path.join(path, layout.step_dir(2))
    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs
                   if f.endswith(".bin"))
    dist.barrier()
    sizes: list[str] = []  # relative to the step folder
    inner_size, inner_check = PosixStorage.size, scan.check_step

    def counting(self, p):  # type: ignore[no-untyped-def]
        if p.endswith(".bin"):
            sizes.append(p.split("/", 1)[1])
        return inner_size(self, p)

    def judge_then_cut(storage, name, step=None, **kw):  # type: ignore[no-untyped-def]
        info = inner_check(storage, name, step, **kw)
        if step == 2 and args.get("cut"):
            victim = os.path.join(folder, next(f for f in files if "r00001" in f))
            os.truncate(victim, os.path.getsize(victim) - 1)
        return info

    PosixStorage.size = counting  # type: ignore[method-assign]
    scan.check_step = judge_then_cut  # type: ignore[assignment]
    got, same = _restore_scaled(path, state, ("step",))
    return {"restored": got, "bitwise": same, "files": files, "sizes": sizes}


def _pair(world: int, rank: int, step: int) -> tuple[dict, dict]:
    """``sc_two_managers``' states at ``step`` (all zeros at step 0, the restore templates)."""
    s = shard("emb", 0, world, rank)
    model = {"emb": ckptlib.Shard(s.local * step, s.global_shape, s.global_offset), "plain": full("plain") * step,
             "step": torch.tensor(step)}
    ema = {"col": full("col") * (step / 2), "rng": ckptlib.PerRank(torch.full((3,), rank * step, dtype=torch.int64))}
    return model, ema


def _same(a: dict, b: dict) -> bool:
    def flat(d: dict) -> dict:
        return {k: (v.local if isinstance(v, ckptlib.Shard) else v.value if isinstance(v, ckptlib.PerRank) else v)
                for k, v in d.items()}

    fa, fb = flat(a), flat(b)
    return fa.keys() == fb.keys() and all(fa[k].dtype == fb[k].dtype and torch.equal(fa[k], fb[k]) for k in fa)


def sc_two_managers(rank: int, world: int, root: str, args: dict) -> dict:
    """Two managers in one process (a model's and an EMA's, two roots), both saving asynchronously
    every step through the job's one coordinator, each rank reaching each save after its own
    random pause. Every ``args["every"]``-th step, right after both saves were handed to their
    threads, a fresh manager on the EMA's root restores on the training thread. Then fresh
    managers restore both roots. Reports every restore's step and whether it is bitwise."""
    import random

    from ckptlib import CheckpointManager

    pause = random.Random(1000 + rank)
    a_root, b_root = os.path.join(root, "model"), os.path.join(root, "ema")
    restores = []
    with CheckpointManager(a_root, keep_last=2, save_timeout=60) as ma, \
            CheckpointManager(b_root, keep_last=2, save_timeout=60) as mb:
        for step in range(1, args["steps"] + 1):
            model, ema = _pair(world, rank, step)
            time.sleep(pause.random() * 0.02)
            ma.save(step, model)
            time.sleep(pause.random() * 0.02)
            mb.save(step, ema)
            if step % args["every"] == 0:
                into = _pair(world, rank, 0)[1]
                with CheckpointManager(b_root, save_timeout=60) as mc:
                    got = mc.restore(into)
                restores.append([got, got == step and _same(into, ema)])
        ma.wait(timeout=60)
        mb.wait(timeout=60)
    last = []
    for path, i in ((a_root, 0), (b_root, 1)):
        into = _pair(world, rank, 0)[i]
        with CheckpointManager(path, save_timeout=60) as m:
            got = m.restore(into)
        last.append([got, _same(into, _pair(world, rank, args["steps"])[i])])
    return {"restores": restores, "last": last}


def sc_wait_inside_session(rank: int, world: int, root: str, args: dict) -> dict:
    """A signal handler on the training thread saves asynchronously and waits, while the thread
    it interrupted is inside another flow's session on the job's coordinator (opened directly
    here, as a Megatron or DeepSpeed load opens one). That save meets only after the session
    ends, so the waits (the handle's, the manager's, its ``close()``) must be refused at once
    instead of waiting for themselves until the save's deadline. The session then meets as
    usual; once it closes the save commits, and the manager, still open, saves the next step.
    Reports the refusals, how long they took, and both steps' restores."""
    from ckptlib import CheckpointManager
    from ckptlib.coord.coordinator import default_coordinator

    coord = default_coordinator()
    step, seen = 5, {}
    with CheckpointManager(root, save_timeout=40) as mgr:
        def handler(signum: int, frame: object) -> None:
            start = time.monotonic()
            handle = mgr.save(step, _pair(world, rank, step)[0])
            for name, wait in (("handle", handle.wait), ("manager", mgr.wait), ("close", mgr.close)):
                try:
                    wait()
                    seen[name] = "returned"
                except ckptlib.CheckpointError as e:
                    seen[name] = str(e)
            seen["refused_s"] = time.monotonic() - start
            seen["done_in_handler"] = handle.done()

        old = signal.signal(signal.SIGUSR1, handler)
        try:
            with coord.session("load", coord.deadline(60)) as s:
                os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs here, on this thread
                met = s.exchange(rank)
        finally:
            signal.signal(signal.SIGUSR1, old)
        mgr.wait(timeout=60)
        mgr.save(step + 1, _pair(world, rank, step + 1)[0]).wait(60)  # the refused close() left it open
    got = []
    for s_ in (step, step + 1):
        into = _pair(world, rank, 0)[0]
        with CheckpointManager(root, save_timeout=60) as m:
            got.append([m.restore(into, step=s_), _same(into, _pair(world, rank, s_)[0])])
    return {**seen, "met": met, "restored": got}


def main() -> int:
    """The shared command line over this module's scenarios; publish/overwrite/restore/savewait
    workers add theirs to this module and call it."""
    # This file's folder is sys.path[0] here (imported by a test, this module needs no scenario_main).
    from scenario_main import run

    return run(globals(), timeout_s=60, keep_group_for=("fail", "train"))


if __name__ == "__main__":
    sys.exit(main())
