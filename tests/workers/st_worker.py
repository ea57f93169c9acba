"""One rank of a safetensors-folder load job (gloo on 127.0.0.1). Started by
tests/distributed/test_safetensors_ranks.py.

usage: st_worker.py SCENARIO RANK WORLD PORT ROOT [JSON-ARGS]
Writes ROOT/result-<scenario>-<rank>.json; exits 0 unless it crashed.

``load``: the Hugging Face folder ``args["folder"]`` (written by the test from :func:`make_model`,
two shard files + index) is loaded on every rank with ``ckptlib.load`` into (1) an FSDP2 model
(DTensor ``Shard(0)`` parameters) and (2) ``ckptlib.Shard`` row targets of uneven sizes plus one
replicated tensor, with ``select="model"``. Around each load the rank records what it read from
the kernel's own count (``rchar`` of /proc/self/io: every byte its read calls returned), and for
(2) also the reader's count (``stats["bytes_read"]``). The loaded pieces are then compared
bitwise with the file's tensors read by the safetensors package.
"""

from __future__ import annotations

import os
import sys

import torch

import ckptlib


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4096, 256)  # 4 MiB
        self.proj = torch.nn.Linear(256, 1024)  # 1 MiB + 4 KiB
        self.norm = torch.nn.LayerNorm(1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(self.emb(x)))


def make_model(seed: int = 0) -> Model:
    torch.manual_seed(seed)
    model = Model()
    with torch.no_grad():
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    return model


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def rows(n: int, world: int, rank: int, skew: int = 0) -> tuple[int, int]:
    """Rank ``rank``'s rows of ``n``: even parts, each inner edge moved ``skew`` rows later."""
    def edge(r: int) -> int:
        return n if r == world else r * n // world + (skew if r else 0)
    return edge(rank), edge(rank + 1)


def sc_load(rank: int, world: int, root: str, args: dict) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard

    from ckptlib.backends import open_storage
    from ckptlib.engine import safetensors_folder
    from ckptlib.engine.load import load_checkpoint
    from ckptlib.plan.flatten import dtensor_piece

    folder = args["folder"]
    full: dict[str, torch.Tensor] = {}

    def shard_targets() -> dict:
        emb_lo, emb_hi = rows(4096, world, rank, skew=52)  # uneven: 2100 / 1996 rows on 2 ranks
        w_lo, w_hi = rows(1024, world, rank)
        return {"model": {
            "emb.weight": ckptlib.Shard(torch.zeros(emb_hi - emb_lo, 256), (4096, 256), (emb_lo, 0)),
            "proj.weight": ckptlib.Shard(torch.zeros(w_hi - w_lo, 256), (1024, 256), (w_lo, 0)),
            "norm.weight": torch.zeros(1024),  # replicated: every rank reads it whole
        }}

    def fsdp_model(seed: int) -> Model:
        model = make_model(seed)
        fully_shard(model)
        return model

    # Warm-up, not measured: the first loads import modules (DTensor helpers, ...) and read
    # their files, which /proc/self/io counts too.
    ckptlib.load(folder, into=shard_targets(), select="model", strict=False)
    ckptlib.load(folder, into=fsdp_model(2))

    model = fsdp_model(1)
    before = rchar()
    ckptlib.load(folder, into=model)
    fsdp_read = rchar() - before
    fsdp_own = sum(p.to_local().numel() * p.element_size() for p in model.state_dict().values())

    target = shard_targets()
    before = rchar()
    ckptlib.load(folder, into=target, select="model", strict=False)
    shard_read = rchar() - before
    pieces = target["model"]
    shard_own = sum((v.local if isinstance(v, ckptlib.Shard) else v).nbytes for v in pieces.values())

    again = shard_targets()
    found = safetensors_folder.describe(open_storage(os.path.dirname(folder)), os.path.basename(folder), "folder",
                                        select="model")
    stats: dict[str, int] = {}
    load_checkpoint(found.storage, found.folder, again, manifest=found.manifest, stats=stats, strict=False,
                    where=found.where)

    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            full.update(load_file(os.path.join(folder, name)))
    bad = []
    for k, p in model.state_dict().items():
        local, _, off = dtensor_piece(p, k)
        want = full[k].narrow(0, off[0], local.shape[0])
        if not torch.equal(local.view(torch.uint8), want.contiguous().view(torch.uint8)):
            bad.append(f"fsdp {k}")
    for res in (pieces, again["model"]):
        for k, v in res.items():
            if isinstance(v, ckptlib.Shard):
                want = full[k].narrow(0, v.global_offset[0], v.local.shape[0])
                got = v.local
            else:
                want, got = full[k], v
            if not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
                bad.append(f"shard {k}")
    return {"bad": bad, "fsdp_read": fsdp_read, "fsdp_own": fsdp_own, "shard_read": shard_read,
            "shard_own": shard_own, "reader_read": stats["bytes_read"], "reader_needed": stats["bytes_needed"]}


class TiedLM(torch.nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2, Llama 3.2 1B, Gemma)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.lm_head = torch.nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.embed.weight


def sc_tied(rank: int, world: int, root: str, args: dict) -> dict:
    """``tied``: the folder holds ``embed.weight`` only, as Hugging Face writes a tied model;
    an FSDP2 :class:`TiedLM` loads it with the default ``strict=True``; both names must then
    hold the file's tensor."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(rank + 1)
    model = TiedLM()
    fully_shard(model)
    try:
        ckptlib.load(args["folder"], into=model)
    except ckptlib.CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    want = load_file(os.path.join(args["folder"], "model.safetensors"))["embed.weight"]
    return {"error": None, "embed": torch.equal(model.embed.weight.full_tensor(), want),
            "lm_head": torch.equal(model.lm_head.weight.full_tensor(), want)}


if __name__ == "__main__":
    from scenario_main import run  # the shared command line (tests import this module too)

    sys.exit(run(globals(), timeout_s=60))
