"""Crash-test worker: save a deterministic training state step after step, forever.

Run by ``tests/test_crash_kill.py``, which SIGKILLs it at random moments. The state saved for
a step is a pure function of ``(seed, step)`` (see :func:`build_state`), so the parent can
recompute the exact bytes of any step without a log.

Two modes:

``save_loop.py ROOT --seed S --start-step K [--async-save] [--keep-last N] [--wait-every W]``
    One process that saves steps K, K+1, ... until it is killed. Prints one line per event
    (see below). Handy to reproduce a run by hand.

``save_loop.py ROOT --seed S --fork-server [--async-save] ...``
    Imports torch and ckptlib once, then reads commands on stdin. ``fork K ERRFILE`` forks a
    child that starts a new session (so ``killpg`` reaches it and nothing else), sends its
    stderr to ERRFILE and runs the save loop from step K; the server answers ``forked PID``.
    ``reap PID`` waits for that child and answers ``reaped PID CODE`` (CODE as in
    ``subprocess``: ``-9`` for SIGKILL); every line the child wrote comes before it.
    The children are real processes killed by a real SIGKILL: the fork server only saves the
    ~1.5 s of ``import torch`` per kill that a 2-core CI machine cannot spare.

Events on stdout, one flushed line each (prefixed with ``PID `` in fork-server mode; lines
are shorter than PIPE_BUF, so lines from different writers never interleave):

``started K``       about to open the manager and save step K, K+1, ...
``saving N``        about to call ``mgr.save(N, ...)`` (the save is attempted from here on)
``saved N``         ``mgr.save(N, ...)`` returned
``committed N``     step N is known to be committed: a synchronous ``save`` returned, or (async)
                    ``handle.wait()`` returned for it -- for every W-th step, and for any earlier
                    save whose handle is done when a later ``save()`` returns (so that a save
                    retention may delete later was seen committed first)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import traceback
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


def _emit(line: str, prefix: str = "") -> None:
    os.write(1, f"{prefix}{line}\n".encode())  # one write(2) per line: atomic on a pipe


def save_forever(args: argparse.Namespace, start: int, prefix: str = "") -> None:
    import ckptlib

    torch.set_num_threads(1)
    _emit(f"started {start}", prefix)
    mgr = ckptlib.CheckpointManager(args.root, keep_last=args.keep_last, async_save=args.async_save)
    step = start
    unsettled: list[tuple[int, Any]] = []  # async saves whose outcome was not printed yet
    while True:
        state = build_state(args.seed, step)
        _emit(f"saving {step}", prefix)
        handle = mgr.save(step, state)
        _emit(f"saved {step}", prefix)
        if not args.async_save:
            if not handle.done():
                raise AssertionError(f"synchronous save({step}) returned an unfinished handle")
            handle.wait(timeout=60)
            _emit(f"committed {step}", prefix)
        else:
            for earlier, h in list(unsettled):
                if h.done():
                    h.wait(timeout=60)  # raises if that save failed: the loop ends
                    _emit(f"committed {earlier}", prefix)
                    unsettled.remove((earlier, h))
            if args.wait_every and step % args.wait_every == 0:
                handle.wait(timeout=60)
                _emit(f"committed {step}", prefix)
            else:
                unsettled.append((step, handle))
        step += 1


def _child(args: argparse.Namespace, start: int, err_path: str) -> None:
    """In a forked child: never returns into the server's loop."""
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(err, 2)
        save_forever(args, start, prefix=f"{os.getpid()} ")
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(1)  # the loop only ends by an error (or a SIGKILL)


def fork_server(args: argparse.Namespace) -> int:
    import ckptlib  # noqa: F401  (imported once, before any fork)

    # Forking is only safe while this process has no other threads.
    assert threading.active_count() == 1, threading.enumerate()
    _emit("ready")
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "fork":
            start, err_path = int(rest[0]), rest[1]
            pid = os.fork()
            if pid == 0:
                _child(args, start, err_path)
            _emit(f"forked {pid}")
        elif cmd == "reap":
            pid = int(rest[0])
            _, status = os.waitpid(pid, 0)
            _emit(f"reaped {pid} {os.waitstatus_to_exitcode(status)}")
        else:
            print(f"unknown command {line!r}", file=sys.stderr)
            return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--seed", type=int, required=True)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--start-step", type=int)
    mode.add_argument("--fork-server", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument(
        "--wait-every",
        type=int,
        default=3,
        help="async only: wait for the handle of every W-th step (0: never wait)",
    )
    args = parser.parse_args(argv)
    if args.fork_server:
        return fork_server(args)
    save_forever(args, args.start_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
