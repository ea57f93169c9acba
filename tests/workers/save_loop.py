"""Crash-test worker: save a deterministic training state step after step, forever.

Run by ``tests/test_crash_kill.py`` as a real subprocess that the test SIGKILLs at random
moments. The state saved for a step is a pure function of ``(seed, step)`` (see
:func:`build_state`), so the parent can recompute the exact bytes of any step without a log.

Usage::

    python tests/workers/save_loop.py ROOT --seed S [--start-step K] [--async-save]
                                             [--keep-last N] [--wait-every W]

Without ``--start-step`` the worker imports everything, prints ``idle`` and then reads one line
``go K`` from stdin. The parent uses this to start the next worker (and pay for ``import torch``)
while the previous one is still saving; the worker does not touch ``ROOT`` before ``go``.

Protocol on stdout (one line each, flushed):

``idle``            imports done, waiting for ``go K`` on stdin
``started K``       about to open the manager and save step K, K+1, ...
``saved N``         ``mgr.save(N, ...)`` returned
``committed N``     step N is known to be committed: a synchronous ``save`` returned, or (async)
                    ``handle.wait()`` returned for it
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import torch

# Sizes: ~4 MiB float32 + 1 MiB bfloat16 + 1 MiB int64 + 0.5 MiB optimizer + ~250 small tensors,
# so a save takes tens of milliseconds and kills often land in the middle of one.
N_LAYERS = 48


def _generator(seed: int, step: int) -> torch.Generator:
    # A fixed mix of (seed, step) into one 63-bit seed; distinct for every pair we use.
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (2**63)
    return torch.Generator().manual_seed(mixed)


def build_state(seed: int, step: int) -> dict[str, Any]:
    """The state saved at ``step``: same structure, shapes and dtypes for every step."""
    g = _generator(seed, step)
    weight = torch.randn(1024, 1024, generator=g)
    # Bit patterns that a value comparison would miss or mangle.
    weight[0, :5] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-45])
    embedding = torch.randn(512, 1024, generator=g).to(torch.bfloat16)
    token_ids = torch.randint(-(2**62), 2**62, (128 * 1024,), dtype=torch.int64, generator=g)
    layers = []
    for i in range(N_LAYERS):
        layers.append(
            {
                "bias": torch.randn(17 + 13 * i, generator=g),
                "scale": torch.randn(3, 7, generator=g).to(torch.float16),
                "mask": torch.rand(5 + i, generator=g) > 0.5,
                "codes": torch.randint(-128, 128, (2, i + 1), dtype=torch.int8, generator=g),
                "running": torch.randn(4, generator=g, dtype=torch.float64),
            }
        )
    exp_avg = torch.randn(256, 256, generator=g)
    exp_avg_sq = torch.rand(256, 256, generator=g)
    return {
        "model": {
            "weight": weight,
            "embedding": embedding,
            "layers": layers,
            "empty": torch.zeros(0, 3, dtype=torch.float32),
        },
        "data": {"token_ids": token_ids, "position": step * 4096 + seed},
        # Shaped like torch.optim.Adam.state_dict(): int keys, 0-dim step tensors, tuples.
        "optim": {
            "state": {
                0: {
                    "step": torch.tensor(float(step)),
                    "exp_avg": exp_avg,
                    "exp_avg_sq": exp_avg_sq,
                }
            },
            "param_groups": [
                {
                    "lr": 3e-4 / (1 + step),
                    "betas": (0.9, 0.999),
                    "weight_decay": 0.0,
                    "amsgrad": False,
                    "params": [0],
                }
            ],
        },
        "step": step,
        "big_int": 2**62 + step,
        "name": f"run-{seed}/step-{step}-\u00fcn\u00efc\u00f6d\u00e9-\u2713",
        "blob": bytes((seed + step + i) % 256 for i in range(64)),
        "big_blob": bytes((seed * 7 + step + i) % 251 for i in range(10_000)),
        "flags": [True, False, None, step % 2 == 0],
        "history": [float(step - i) / 3 for i in range(5)],
    }


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--start-step", type=int, default=None)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument(
        "--wait-every",
        type=int,
        default=3,
        help="async only: wait for the handle of every W-th step (0: never wait)",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    import ckptlib  # imported before `idle`: the parent overlaps this with the previous worker

    start = args.start_step
    if start is None:
        _emit("idle")
        line = sys.stdin.readline()
        if not line:  # the parent went away
            return 0
        cmd, _, value = line.strip().partition(" ")
        if cmd != "go":
            print(f"unexpected command {line!r}", file=sys.stderr)
            return 2
        start = int(value)

    _emit(f"started {start}")
    mgr = ckptlib.CheckpointManager(args.root, keep_last=args.keep_last, async_save=args.async_save)
    step = start
    while True:
        state = build_state(args.seed, step)
        handle = mgr.save(step, state)
        _emit(f"saved {step}")
        if not args.async_save:
            if not handle.done():
                print(f"synchronous save({step}) returned an unfinished handle", file=sys.stderr)
                return 3
            handle.wait(timeout=60)
            _emit(f"committed {step}")
        elif args.wait_every and step % args.wait_every == 0:
            handle.wait(timeout=60)
            _emit(f"committed {step}")
        step += 1


if __name__ == "__main__":
    sys.exit(main())
