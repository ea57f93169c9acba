"""One rank of a Megatron-Core dist_checkpointing job on CPU (gloo on 127.0.0.1).

Started by tests/integrations/test_megatron.py. usage:
    mcore_worker.py SCENARIO RANK WORLD PORT ROOT JSON-ARGS
Writes ROOT/result-<scenario>-<rank>.json; exits 0 unless it crashed.

The model is a tiny tensor-parallel MLP whose pieces are described to Megatron as
ShardedTensors the way Megatron's layers do it: ``w1``/``b1`` split by rows (column parallel),
``w2`` split by columns (row parallel, outputs summed over the TP group), ``b2`` replicated
(``replica_id`` = TP rank), plus a stacked buffer saved as two pieces of one key with
``prepend_axis_num=1``. Adam's moments are sharded like their parameters. Training is
deterministic: data comes from a generator seeded by the iteration, the noise from the
global torch RNG, whose state is checkpointed as a ShardedObject.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

D, H, OUT, B = 8, 16, 4, 5  # input, hidden, output, batch
LR = 0.05


class Model:
    """This rank's parameters of the global MLP for tensor-parallel size ``tp``."""

    def __init__(self, tp: int, tp_rank: int, dp_rank: int) -> None:
        self.tp, self.tp_rank, self.dp_rank = tp, tp_rank, dp_rank
        g = torch.Generator().manual_seed(0)
        full = {
            "w1": torch.randn(H, D, generator=g) * 0.3,
            "b1": torch.randn(H, generator=g) * 0.1,
            "w2": torch.randn(OUT, H, generator=g) * 0.3,
            "b2": torch.randn(OUT, generator=g) * 0.1,
        }
        h = H // tp
        self.rows = slice(tp_rank * h, (tp_rank + 1) * h)
        self.params = {
            "w1": full["w1"][self.rows].clone().requires_grad_(),
            "b1": full["b1"][self.rows].clone().requires_grad_(),
            "w2": full["w2"][:, self.rows].clone().requires_grad_(),
            "b2": full["b2"].clone().requires_grad_(),
        }
        self.stacked = torch.zeros(2, 6)
        self.opt = torch.optim.Adam(list(self.params.values()), lr=LR)

    def step(self, it: int) -> float:
        g = torch.Generator().manual_seed(1000 + it)
        x = torch.randn(B, D, generator=g) + 0.01 * torch.randn(B, D)  # global RNG: checkpointed
        target = torch.randn(B, OUT, generator=g)
        p = self.params
        hid = torch.relu(x @ p["w1"].T + p["b1"])
        part = hid @ p["w2"].T
        total = part.detach().clone()
        if self.tp > 1:
            dist.all_reduce(total, group=TP_GROUP)
        y = part + (total - part.detach()) + p["b2"]
        loss = ((y - target) ** 2).sum()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.stacked += torch.arange(12, dtype=torch.float32).view(2, 6) * 0.5
        return float(loss)

    def ensure_opt_state(self) -> None:
        for t in self.params.values():
            st = self.opt.state[t]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(t)
                st["exp_avg_sq"] = torch.zeros_like(t)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every checkpointed tensor of this rank by name (params, moments, buffer)."""
        self.ensure_opt_state()
        out = {}
        for n, t in self.params.items():
            out[n] = t.detach()
            out[f"exp_avg.{n}"] = self.opt.state[t]["exp_avg"]
            out[f"exp_avg_sq.{n}"] = self.opt.state[t]["exp_avg_sq"]
        out["stacked"] = self.stacked
        return out

    def sharded_state_dict(self, it: int, world: int, rank: int, with_rng: bool = True) -> dict:
        from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

        tp, r, dp = self.tp, self.tp_rank, self.dp_rank
        sd: dict = {"model": {}, "optimizer": {}}
        ts = self.tensors()
        for n in self.params:
            for prefix, where in (
                ("", sd["model"]),
                ("exp_avg.", sd["optimizer"]),
                ("exp_avg_sq.", sd["optimizer"]),
            ):
                t = ts[prefix + n]
                key = f"{'optimizer.' if prefix else 'model.'}{prefix}{n}"
                if n in ("w1", "b1"):
                    st = ShardedTensor.from_rank_offsets(key, t, (0, r, tp), replica_id=(0, dp))
                elif n == "w2":
                    st = ShardedTensor.from_rank_offsets(key, t, (1, r, tp), replica_id=(0, dp))
                else:
                    st = ShardedTensor.from_rank_offsets(key, t, replica_id=(r, dp))
                where[prefix + n] = st
        sd["model"]["stacked"] = [
            ShardedTensor.from_rank_offsets(
                "model.stacked", self.stacked[i], (0, i, 2), replica_id=(r, dp), prepend_axis_num=1
            )
            for i in range(2)
        ]
        step = int(self.opt.state[self.params["w1"]]["step"].item())
        sd["iteration"] = it
        sd["opt_step"] = step
        if with_rng:
            sd["rng"] = ShardedObject(
                "rng_state",
                {"torch": torch.get_rng_state(), "iteration": it, "tag": f"rank{rank}"},
                (world,),
                (rank,),
                replica_id=0,
            )
        return sd

    def apply_loaded(self, loaded: dict) -> None:
        step = torch.tensor(float(loaded["opt_step"]))
        for t in self.params.values():
            self.opt.state[t]["step"] = step.clone()
        if "rng" in loaded:
            torch.set_rng_state(loaded["rng"]["torch"])


TP_GROUP = None


def setup(rank: int, world: int, port: int, tp: int) -> Model:
    global TP_GROUP
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    # Groups of consecutive ranks form one TP group (Megatron's default order: TP fastest).
    for start in range(0, world, tp):
        grp = dist.new_group(list(range(start, start + tp)), backend="gloo")
        if start <= rank < start + tp:
            TP_GROUP = grp
    torch.manual_seed(42)
    return Model(tp, rank % tp, rank // tp)


def digests(m: Model) -> dict[str, str]:
    import hashlib

    return {
        k: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
        for k, t in m.tensors().items()
    }


def dump(m: Model, folder: Path, rank: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for k, t in m.tensors().items():
        np.save(folder / f"{k}.rank{rank}.npy", t.contiguous().numpy())


def _save(m: Model, it: int, world: int, rank: int, save_dir: Path, strategy, use_async: bool):
    from megatron.core import dist_checkpointing as mdc

    from ckptlib.integrations import megatron as ck

    ckdir = Path(ck.iteration_dir(save_dir, it))
    ckdir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if strategy == "ckptlib":
        strat = ck.SaveStrategy()
    else:
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        strat = TorchDistSaveShardedStrategy("torch_dist", 1)
    sd = m.sharded_state_dict(it, world, rank)
    if use_async:
        req = mdc.save(sd, str(ckdir), sharded_strategy=strat, async_sharded_save=True)
        return ck.schedule(req)
    mdc.save(sd, str(ckdir), sharded_strategy=strat)
    return None


def arm_kill() -> None:
    """SIGKILL this process inside the next save: after its payload files are written, before
    it reports them (the async save thread is mid-save, the training thread mid-step)."""
    from ckptlib.engine import save as save_flow

    def then_die(original):
        def write_then_die(*a, **k):
            original(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)

        return write_then_die

    # A plain save's rank writes with write_files_indexed (its index at its payload file's end).
    save_flow.write_files = then_die(save_flow.write_files)
    save_flow.write_files_indexed = then_die(save_flow.write_files_indexed)


def sc_train(rank: int, world: int, root: str, args: dict) -> dict:
    """Train to ``iters``, saving every ``every`` iterations; resume first via load_latest."""
    from ckptlib.integrations import megatron as ck

    m = setup(rank, world, int(args["port"]), int(args.get("tp", world)))
    save_dir = Path(args["save_dir"])
    start = 0
    resumed = None
    if args.get("resume"):
        it, loaded = ck.load_latest(m.sharded_state_dict(0, world, rank), save_dir)
        if it is not None:
            m.apply_loaded(loaded)
            start, resumed = it, it
    out: dict = {
        "resumed": resumed,
        "loaded": digests(m) if resumed is not None else None,
        "saved": {},
    }
    pending = None
    kill_iter = args.get("kill_iter")
    for it in range(start + 1, int(args["iters"]) + 1):
        m.step(it)
        time.sleep(float(args.get("sleep", 0)))
        if it % int(args["every"]) == 0:
            if pending is not None:
                pending.finalize()
                pending = None
            if kill_iter == it and rank == int(args.get("kill_rank", 0)):
                arm_kill()
            if args.get("dump"):
                dump(m, Path(args["dump"]) / f"iter_{it}", rank)
            out["saved"][it] = digests(m)
            pending = _save(m, it, world, rank, save_dir, "ckptlib", bool(args.get("async")))
    if pending is not None:
        pending.finalize()
    out["final"] = digests(m)
    dist.destroy_process_group()
    return out


def sc_load(rank: int, world: int, root: str, args: dict) -> dict:
    """Resume on this layout (maybe different from the saving one) and dump what was loaded."""
    from ckptlib.integrations import megatron as ck

    m = setup(rank, world, int(args["port"]), int(args.get("tp", world)))
    sd = m.sharded_state_dict(0, world, rank, with_rng=bool(args.get("rng", False)))
    it, loaded = ck.load_latest(sd, args["save_dir"])
    m.apply_loaded(loaded)
    dump(m, Path(args["dump"]), rank)
    infos = [[i.iteration, i.status, i.reason] for i in ck.iterations(args["save_dir"])]
    dist.destroy_process_group()
    return {
        "iteration": it,
        "iterations": infos,
        "latest_quick": ck.latest_iteration(args["save_dir"]),
        "latest_deep": ck.latest_iteration(args["save_dir"], deep=True),
    }


def cuda_shim() -> None:
    """Megatron's torch_dist strategy calls CUDA helpers even for CPU tensors."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def sc_torch_dist(rank: int, world: int, root: str, args: dict) -> dict:
    """Megatron's default torch_dist path on a payload with one flipped bit: what loads?"""
    from megatron.core import dist_checkpointing as mdc

    cuda_shim()
    m = setup(rank, world, int(args["port"]), 1)
    m.step(1)
    save_dir = Path(args["save_dir"])
    _save(m, 2, world, rank, save_dir, "torch_dist", False)
    before = {k: t.clone() for k, t in m.tensors().items()}
    ckdir = Path(save_dir) / "iter_0000002"
    needle = before["w1"].contiguous().numpy().tobytes()
    out: dict = {}
    for target in sorted(p for p in ckdir.iterdir() if p.suffix == ".distcp"):
        data = bytearray(target.read_bytes())
        pos = data.find(needle)
        if pos >= 0:
            data[pos + len(needle) // 2] ^= 0x10  # one bit inside w1's bytes
            target.write_bytes(bytes(data))
            out.update(payload=target.name, flipped=pos + len(needle) // 2)
            break
    assert "payload" in out, "w1's bytes not found in any torch_dist payload"
    fresh = Model(1, 0, 0)
    try:
        loaded = mdc.load(fresh.sharded_state_dict(0, world, rank, with_rng=False), str(ckdir))
        after = {
            "w1": loaded["model"]["w1"],
            "b1": loaded["model"]["b1"],
            "w2": loaded["model"]["w2"],
        }
        out["outcome"] = "loaded"
        out["differs"] = sorted(k for k in after if not torch.equal(before[k], after[k]))
    except Exception as e:
        out["outcome"] = "error"
        out["error"] = f"{type(e).__name__}: {e}"[:500]
    dist.destroy_process_group()
    return out


def sc_freeze(rank: int, world: int, root: str, args: dict) -> dict:
    """Rank 1 stops itself (SIGSTOP, crash point ``restore``) inside ``load_latest``; rank 0
    returns the error it raised and when (``time.time()``). The test SIGKILLs rank 1."""
    from ckptlib import crashpoints
    from ckptlib.errors import CheckpointError
    from ckptlib.integrations import megatron as ck

    os.environ["CKPTLIB_COORD_TIMEOUT"] = str(args["deadline"])  # read when load_latest creates it
    m = setup(rank, world, int(args["port"]), int(args.get("tp", world)))
    sd = m.sharded_state_dict(0, world, rank, with_rng=False)
    os.environ["CKPTLIB_TEST_KILL_AT"] = "restore:1:STOP"
    os.environ["CKPTLIB_TEST_KILL_LOG"] = str(Path(root) / "freeze-signal.jsonl")
    crashpoints.configure()
    try:
        it, _ = ck.load_latest(sd, args["save_dir"])
        return {"error": None, "iteration": it, "at": time.time()}
    except CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}", "at": time.time()}


def sc_sizes(rank: int, world: int, root: str, args: dict) -> dict:
    """Saves iterations 1 and 2 (TP = world), then counts the payload size requests
    (``Storage.size`` of a ``.bin``) this rank's ``load_latest`` makes, and the payload files it
    opens (for data, or for the piece index at a file's end). Then, right after rank 0's
    judge passed iteration 2, rank 1's payload file of it is cut by a byte, and every rank calls
    ``load_latest`` again. Reports, per load, the iteration and whether this rank's tensors are
    bitwise those it saved at that iteration. Then two plain ``dist_checkpointing.load`` calls
    with ``LoadStrategy()``: iteration 1 (``plain``: the size requests, bitwise) and the cut
    iteration 2 (``plain_cut``: the size requests and the error each rank raised)."""
    from ckptlib.backends.posix import PosixStorage
    from ckptlib.integrations import megatron as ck
    from ckptlib.integrations.megatron import resume as mresume

    m = setup(rank, world, int(args["port"]), world)
    save_dir = Path(root) / "ckpt"
    saved = {}
    for it in (1, 2):
        m.step(it)
        saved[it] = digests(m)
        _save(m, it, world, rank, save_dir, "ckptlib", False)
    dist.barrier()
    it2 = Path(ck.iteration_dir(save_dir, 2))
    files = sorted(str(p.relative_to(it2)) for p in it2.rglob("*.bin"))
    asked: list[str] = []
    opened: set[str] = set()
    inner_size, inner_open, inner_judge = PosixStorage.size, PosixStorage.open_read, mresume._judge

    def counting(self, p):  # type: ignore[no-untyped-def]
        if p.endswith(".bin"):
            asked.append(p)
        return inner_size(self, p)

    def opening(self, p):  # type: ignore[no-untyped-def]
        if p.endswith(".bin"):
            opened.add(p)
        return inner_open(self, p)

    def judge_then_cut(path, it, deep):  # type: ignore[no-untyped-def]
        info = inner_judge(path, it, deep)
        if it == 2:
            victim = next(p for p in it2.rglob("*.bin") if "r00001" in p.name)
            os.truncate(victim, victim.stat().st_size - 1)
        return info

    PosixStorage.size = counting  # type: ignore[method-assign]
    PosixStorage.open_read = opening  # type: ignore[method-assign]
    out: dict = {"files": files}
    for phase in ("resume", "cut"):
        if phase == "cut":
            mresume._judge = judge_then_cut
        asked.clear()
        opened.clear()
        it, _ = ck.load_latest(lambda: m.sharded_state_dict(0, world, rank, with_rng=False), save_dir)
        out[phase] = {"iteration": it, "asked": list(asked), "opened": sorted(opened),
                      "bitwise": it in saved and digests(m) == saved[it]}
    # A plain dist_checkpointing.load with LoadStrategy() (no resume loop, no judge): iteration
    # 1 after a step moved the tensors on, then iteration 2 with rank 1's file still cut.
    from megatron.core import dist_checkpointing as mdc

    from ckptlib.errors import CheckpointError

    m.step(3)
    it1 = Path(ck.iteration_dir(save_dir, 1))
    out["files1"] = sorted(str(p.relative_to(it1)) for p in it1.rglob("*.bin"))
    for phase, it in (("plain", 1), ("plain_cut", 2)):
        asked.clear()
        try:
            mdc.load(m.sharded_state_dict(0, world, rank, with_rng=False), ck.iteration_dir(save_dir, it),
                     sharded_strategy=ck.LoadStrategy(), common_strategy=ck.LoadCommonStrategy())
            out[phase] = {"asked": list(asked), "bitwise": digests(m) == saved[it]}
        except CheckpointError as e:
            out[phase] = {"asked": list(asked), "error": type(e).__name__, "message": str(e)}
    # A plain load of iteration 1 while an async save of iteration 3 (``schedule``) is writing,
    # slowly, on its thread, inside its session on the same coordinator.
    writes_end = [0.0]
    inner_write = PosixStorage.open_write_in

    def slow_write(self, p):  # type: ignore[no-untyped-def]
        if p.endswith(".bin"):
            time.sleep(1.0)
            writes_end[0] = time.monotonic()
        return inner_write(self, p)

    PosixStorage.open_write_in = slow_write  # type: ignore[method-assign]
    mresume._judge = inner_judge  # no more cuts
    m.step(4)
    saved[3] = digests(m)
    pending = _save(m, 3, world, rank, save_dir, "ckptlib", True)
    time.sleep(0.5)  # the save's thread is in its session, writing
    try:
        mdc.load(m.sharded_state_dict(0, world, rank, with_rng=False), ck.iteration_dir(save_dir, 1),
                 sharded_strategy=ck.LoadStrategy(timeout=30), common_strategy=ck.LoadCommonStrategy())
        load = {"bitwise": digests(m) == saved[1], "after_write": time.monotonic() >= writes_end[0] > 0}
    except Exception as e:
        load = {"error": f"{type(e).__name__}: {e}"}
    try:
        pending.finalize()
        load["saved"] = mresume.iterations(save_dir)[0].iteration == 3
    except Exception as e:
        load["save_error"] = f"{type(e).__name__}: {e}"
    out["during_save"] = load
    dist.destroy_process_group()
    return out


SCENARIOS = {"train": sc_train, "load": sc_load, "torch_dist": sc_torch_dist, "freeze": sc_freeze, "sizes": sc_sizes}


def main() -> None:
    scenario, rank, world, port, root = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    args = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    args["port"] = port
    out_path = Path(root) / f"result-{scenario}-{rank}.json"
    try:
        res = SCENARIOS[scenario](rank, world, root, args)
    except BaseException:
        res = {"crash": traceback.format_exc()}
        out_path.write_text(json.dumps(res))
        sys.exit(1)
    out_path.write_text(json.dumps(res))
    if scenario == "freeze":
        os._exit(0)  # a peer is frozen: leave without gloo teardown


if __name__ == "__main__":
    main()
