"""Train with DeepSpeed, checkpoint through ckptlib, resume from the newest consistent tag.

Copy this file and replace the model/data. On a CPU-only machine (gloo)::

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/train_deepspeed.py --dir /tmp/ds-run
    # kill it at any point (even mid-save), run the same command again: it resumes

With the ``deepspeed`` launcher or on GPUs the script is unchanged (drop ``DS_ACCELERATOR``).
Only two lines differ from a plain DeepSpeed script: ``ckds.install(engine)`` after
``deepspeed.initialize`` and ``ckds.resume(engine, dir)`` instead of ``engine.load_checkpoint``.
"""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch

from ckptlib.integrations import deepspeed as ckds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--dir", required=True, help="checkpoint folder (or pass --url for any ckptlib backend)"
    )
    ap.add_argument(
        "--url", default=None, help="ckptlib root, e.g. s3://bucket/run (default: --dir)"
    )
    ap.add_argument("--stage", type=int, default=2, help="ZeRO stage 0-3")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--keep-last", type=int, default=3)
    args = ap.parse_args()

    if os.environ.get("DS_ACCELERATOR") == "cpu":
        import deepspeed.ops as ds_ops

        ds_ops.__compatible_ops__ = {}  # CPU: skip op probing and the shm comm op build
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 20, "warmup_max_lr": 1e-3},
        },
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    # Every rank: route engine.save_checkpoint / load_checkpoint through ckptlib.
    ckds.install(engine, args.url, keep_last=args.keep_last)

    # Every rank: the newest tag whose every byte verifies (DeepSpeed's `latest` is ignored).
    res = ckds.resume(engine, args.dir)
    data_pos = 0
    if res.tag is not None:
        data_pos = res.client_state["data_pos"]
        print(f"rank {engine.global_rank}: resumed {res.tag} (skipped: {res.skipped or 'none'})")

    while engine.global_steps < args.steps:
        g = torch.Generator().manual_seed(
            data_pos * 1000 + engine.global_rank
        )  # your data loader here
        x = torch.randn(8, 64, generator=g)
        loss = ((engine(x) - x) ** 2).mean()
        engine.backward(loss)
        engine.step()
        data_pos += 1
        if engine.global_steps % args.save_every == 0:
            # Unchanged DeepSpeed call; returns once every rank's files are committed.
            engine.save_checkpoint(args.dir, client_state={"data_pos": data_pos})
            if engine.global_rank == 0:
                print(f"step {engine.global_steps}: loss {loss.item():.4f}, saved")


if __name__ == "__main__":
    main()
