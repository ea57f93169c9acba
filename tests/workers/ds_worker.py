"""One rank of a DeepSpeed (CPU, gloo) job for tests/integrations/test_deepspeed.py.

usage: ds_worker.py SCENARIO RANK WORLD PORT ROOT [JSON-ARGS]

Scenarios (each writes ROOT/result-<scenario>-<rank>.json, rewritten as it progresses so a
killed job still leaves what it got to; the jobs of ``args["reshard"]`` run first, see
tests/workers/ds_reshard.py, their records under ``reshard/<key>``):

- ``train``: for each ZeRO stage in ``args["stages"]``: a fresh engine with ckptlib installed,
  2 steps -> save (tag global_step2) -> 2 steps -> save (global_step4); digests of parameters
  and optimizer state at each save. Stage 0 also saves global_step4 with DeepSpeed's default
  engine to ROOT/torch_z0. The last stage then trains 2 more steps and saves again with rank 1
  SIGKILLed in the middle of writing (ckptlib's crash point ``write``).
- ``resume``: for each stage, a fresh engine resumes with ``ckds.resume`` and records the tag,
  the skipped steps, digests and client state; then trains one step and saves again.
- ``single`` (1 rank, stage 0 and 2 checkpoints written by 2 ranks): DeepSpeed's own load of a
  bit-flipped torch checkpoint; ckptlib's ``engine.load_checkpoint`` of a bit-flipped step via
  DeepSpeed's ``latest``; the resume helper on a different data-parallel size (stage 2 with and
  without optimizer state; the bitwise optimizer-state checks of resharding are
  ds_reshard_worker.py's).
- ``freeze`` (2 ranks, after ``train``): rank 1 stops itself (SIGSTOP, crash point ``restore``)
  inside ``ckds.resume`` of the stage 0 checkpoints; rank 0 records the error it raised and
  when (``time.time()``). The test SIGKILLs the frozen rank.

Nothing may compile: every DeepSpeed op build is made to raise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT_DIR = Path(__file__).resolve().parents[2]
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

import ds_reshard  # noqa: E402  (this directory: the resharding jobs)


def setup(rank: int, world: int, port: str) -> Any:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    deepspeed.ops.__compatible_ops__ = {}  # no op probing, no shm comm op build

    def no_build(self: Any, *a: Any, **k: Any) -> Any:
        raise RuntimeError(f"test forbids building DeepSpeed op {getattr(self, 'name', self)}")

    OpBuilder.jit_load = no_build
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    return deepspeed


def make_engine(deepspeed: Any, stage: int) -> Any:
    import torch

    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01},
        },
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def train(engine: Any, n: int) -> None:
    import torch
    import torch.distributed as dist

    for _ in range(n):
        g = torch.Generator().manual_seed(engine.global_steps * 100 + dist.get_rank())
        x = torch.randn(4, 16, generator=g)
        y = torch.randn(4, 8, generator=g)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()


def _hash_tree(h: Any, x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{list(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return 1
    if isinstance(x, dict):
        n = 0
        for k in sorted(x, key=str):
            h.update(f"K{k!r}".encode())
            n += _hash_tree(h, x[k])
        return n
    if isinstance(x, list | tuple):
        return sum(_hash_tree(h, v) for v in x)
    if x is None or isinstance(x, bool | int | float | str):
        h.update(f"V{x!r}".encode())
    else:
        h.update(f"O{type(x).__name__}".encode())
    return 0


def digests(engine: Any) -> dict[str, Any]:
    """Parameters (this rank's partition under ZeRO-3) and the optimizer's state dict."""
    hp = hashlib.sha256()
    n = 0
    for name, p in engine.module.named_parameters():
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        hp.update(name.encode())
        n += _hash_tree(hp, t)
    ho = hashlib.sha256()
    m = _hash_tree(ho, engine.optimizer.state_dict())
    return {
        "params": hp.hexdigest(),
        "n_params": n,
        "optim": ho.hexdigest(),
        "n_optim": m,
        "global_steps": engine.global_steps,
        "lr": engine.lr_scheduler.state_dict(),
    }


def client_state(engine: Any) -> dict[str, Any]:
    return {
        "data_pos": engine.global_steps * 4,
        "args": argparse.Namespace(lr=0.01, name="run"),
        "seen": {1, 2, 3},
    }


def describe_client(cs: dict[str, Any] | None) -> Any:
    if cs is None:
        return None
    return {
        "data_pos": cs.get("data_pos"),
        "args": repr(cs.get("args")),
        "seen": sorted(cs.get("seen", [])),
    }


class Results:
    def __init__(self, root: str, scenario: str, rank: int) -> None:
        self.path = os.path.join(root, f"result-{scenario}-{rank}.json")
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def sc_train(ds: Any, rank: int, world: int, root: str, args: dict[str, Any], out: Results) -> None:
    from ckptlib import crashpoints
    from ckptlib.integrations import deepspeed as ckds

    stages = args["stages"]
    for i, stage in enumerate(stages):
        engine = make_engine(ds, stage)
        ce = ckds.install(engine)
        save_dir = os.path.join(root, f"z{stage}")
        rec: dict[str, Any] = {}
        for step in (2, 4):
            train(engine, 2)
            engine.save_checkpoint(save_dir, client_state=client_state(engine))
            rec[str(step)] = digests(engine)
            rec[f"save_seconds_{step}"] = ce.last_save_seconds
            out.put(f"z{stage}", rec)
        if stage == 0:
            engine.checkpoint_engine = ce.previous  # DeepSpeed's default TorchCheckpointEngine
            engine.save_checkpoint(
                os.path.join(root, "torch_z0"), client_state=client_state(engine)
            )
            engine.checkpoint_engine = ce
            w = engine.module.state_dict()["0.weight"]
            rec["torch_probe"] = w.contiguous().view(-1)[:4].numpy().tobytes().hex()
            out.put(f"z{stage}", rec)
        if i == len(stages) - 1:
            train(engine, 2)
            # Rank 1 dies mid-write of global_step6: arm ckptlib's crash point through its
            # public environment variable (read when the module loads).
            os.environ["CKPTLIB_TEST_KILL_AT"] = "write:1:KILL"
            crashpoints.configure()
            try:
                engine.save_checkpoint(save_dir, client_state=client_state(engine))
                out.put("killed_save", {"error": None})
            except Exception as e:
                out.put("killed_save", {"error": f"{type(e).__name__}: {e}"})
                return


def sc_resume(
    ds: Any, rank: int, world: int, root: str, args: dict[str, Any], out: Results
) -> None:
    from ckptlib.integrations import deepspeed as ckds

    for stage in args["stages"]:
        engine = make_engine(ds, stage)
        ckds.install(engine)
        save_dir = os.path.join(root, f"z{stage}")
        with asking_sizes() as asked:  # the resume's load_checkpoint included
            res = ckds.resume(engine, save_dir)
        rec = {
            "tag": res.tag,
            "step": res.step,
            "skipped": res.skipped,
            "client": describe_client(res.client_state),
            "digest": digests(engine),
            "asked": len(asked),
        }
        train(engine, 1)
        engine.save_checkpoint(save_dir, client_state=client_state(engine))
        rec["after"] = engine.global_steps
        rec["plain"], rec["plain_cut"] = plain_loads(engine, rank, save_dir)
        out.put(f"z{stage}", rec)


def asking_sizes() -> Any:
    """A context counting this process's payload size requests (``Storage.size`` of a
    ``.bin``): the list of paths asked while it is open."""
    import contextlib

    from ckptlib.backends.posix import PosixStorage

    @contextlib.contextmanager
    def counting() -> Any:
        asked: list[str] = []
        inner = PosixStorage.size

        def size(self: Any, p: str) -> Any:
            if p.endswith(".bin"):
                asked.append(p)
            return inner(self, p)

        PosixStorage.size = size  # type: ignore[method-assign]
        try:
            yield asked
        finally:
            PosixStorage.size = inner  # type: ignore[method-assign]

    return counting()


def plain_loads(engine: Any, rank: int, save_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSpeed's own ``load_checkpoint`` (its ``latest``: the tag just saved), twice: after a
    training step moved the state on (the payload size requests, whether the state is back
    bitwise), then with rank 1's payload file of that tag cut by a byte (the error each rank
    raises, the size requests); rank 0 puts the byte back."""
    import torch.distributed as dist

    from ckptlib.errors import CheckpointError

    saved = digests(engine)
    train(engine, 1)
    with asking_sizes() as asked:
        engine.load_checkpoint(save_dir)
    plain = {"asked": len(asked), "bitwise": digests(engine) == saved}
    victim = next(Path(save_dir).glob(f"step-{int(saved['global_steps']):012d}/*/r00001-*.bin"))
    data = victim.read_bytes()
    dist.barrier()
    if rank == 0:
        os.truncate(victim, len(data) - 1)
    dist.barrier()
    cut: dict[str, Any] = {"error": None}
    with asking_sizes() as asked:
        try:
            engine.load_checkpoint(save_dir)
        except CheckpointError as e:
            cut = {"error": type(e).__name__, "message": str(e)}
    cut["asked"] = len(asked)
    dist.barrier()
    if rank == 0:
        victim.write_bytes(data)
    dist.barrier()
    return plain, cut


def sc_single(
    ds: Any, rank: int, world: int, root: str, args: dict[str, Any], out: Results
) -> None:
    from ckptlib.errors import CheckpointError
    from ckptlib.integrations import deepspeed as ckds

    engine = make_engine(ds, 0)
    # DeepSpeed's own path: `latest` -> global_step4, a torch file with one flipped bit.
    try:
        engine.load_checkpoint(os.path.join(root, "torch_z0"))
        out.put("torch_flip", {"error": None, "digest": digests(engine)})
    except Exception as e:
        out.put("torch_flip", {"error": f"{type(e).__name__}: {e}"})
    ckds.install(engine)
    # ckptlib's engine behind the unchanged load_checkpoint: the same `latest`, a flipped bit.
    try:
        engine.load_checkpoint(os.path.join(root, "z0"))
        out.put("ckptlib_flip", {"error": None})
    except CheckpointError as e:
        out.put("ckptlib_flip", {"error": f"{type(e).__name__}: {e}"})
    res = ckds.resume(engine, os.path.join(root, "z0"))
    out.put(
        "z0",
        {
            "tag": res.tag,
            "skipped": res.skipped,
            "digest": digests(engine),
            "client": describe_client(res.client_state),
        },
    )
    # A value ckptlib cannot store without pickle: a typed error before anything is written.
    try:
        engine.save_checkpoint(os.path.join(root, "bad"), client_state={"cfg": object()})
        out.put("bad_value", {"error": None})
    except CheckpointError as e:
        out.put(
            "bad_value",
            {
                "error": f"{type(e).__name__}: {e}",
                "left": sorted(os.listdir(os.path.join(root, "bad"))),
            },
        )

    engine = make_engine(ds, 2)
    ckds.install(engine)
    try:
        res = ckds.resume(engine, os.path.join(root, "z2"))
        out.put("z2_optim", {"error": None, "tag": res.tag, "digest": digests(engine)})
    except Exception as e:
        out.put("z2_optim", {"error": f"{type(e).__name__}: {e}"})
    res = ckds.resume(engine, os.path.join(root, "z2"), load_optimizer_states=False)
    out.put("z2", {"tag": res.tag, "digest": digests(engine)})


def sc_freeze(
    ds: Any, rank: int, world: int, root: str, args: dict[str, Any], out: Results
) -> None:
    import time

    from ckptlib import crashpoints
    from ckptlib.errors import CheckpointError
    from ckptlib.integrations import deepspeed as ckds

    engine = make_engine(ds, 0)
    ckds.install(engine)  # creates the coordinator (deadline: CKPTLIB_COORD_TIMEOUT)
    os.environ["CKPTLIB_TEST_KILL_AT"] = "restore:1:STOP"
    os.environ["CKPTLIB_TEST_KILL_LOG"] = os.path.join(root, "freeze-signal.jsonl")
    crashpoints.configure()
    try:
        res = ckds.resume(engine, os.path.join(root, "z0"))
        out.put("freeze", {"error": None, "tag": res.tag, "at": time.time()})
    except CheckpointError as e:
        out.put("freeze", {"error": f"{type(e).__name__}: {e}", "at": time.time()})


def main() -> int:
    scenario, rank, world, port, root = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    args = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    os.environ.setdefault("CKPTLIB_COORD_TIMEOUT", "6")
    out = Results(root, scenario, rank)
    ds = setup(rank, world, port)
    import torch.distributed as dist

    try:
        for job in args.get("reshard", []):
            out.put(f"reshard/{job['key']}", ds_reshard.run(ds, root, job))
        globals()[f"sc_{scenario}"](ds, rank, world, root, args, out)
    except Exception:
        out.put("crash", traceback.format_exc())
    sys.stdout.flush()
    if "crash" in out.data or "killed_save" in out.data or scenario == "freeze":
        os._exit(0)  # the group is broken (a peer died); leave without gloo teardown
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
