"""Async snapshot races: the state is mutated right after ``save()`` returns, at seeded random
moments while the snapshot (overlap mode) and the write are still running.

Each case trains a small model (Linear -> BatchNorm -> Tanh -> Linear, AdamW, a plain "ema"
tensor and a Python counter, ~4 MB) and saves it 5 times with an async
``CheckpointManager`` in one of four modes: plain async, ``overlap=True`` (parameters and
optimizer state are copied in the background until the next optimizer step), a small
``staging_budget`` (the state streams through two reused halves), and both. The hash of every
leaf is taken just before each ``save()``; right after it returns the state is mutated:

* ``add_`` / ``zero_``: every tensor in place (parameters, optimizer moments, BN buffers, ema);
* ``opt_step``: forward, backward and ``optimizer.step()`` (in overlap mode the step pre-hook
  must hold the step until the copy is done);
* ``buffers``: a forward pass in train mode (BN running stats) and the ema, which overlap
  mode copies before ``save()`` returns -- legal to touch at once;
* ``mixed``: a seeded choice of the above per save.

When: ``inline`` (immediately), ``delay`` (after a seeded 0-3 ms pause on the training
thread) or ``thread`` (a background thread after a seeded 0-3 ms pause; plain and streaming
modes only -- in overlap mode the contract lets only the training thread, through the
optimizer hook or ``wait_for_snapshot()``, touch parameters). In overlap mode ``add_`` and
``zero_`` call ``mgr.wait_for_snapshot()`` first, as the contract requires of code that edits
parameters outside an optimizer step.

Invariant: every committed step loads to exactly the hashes taken before its ``save()`` --
never the mutated values, never a torn mix.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlib
from ckptlib.format import layout

from .conftest import SEED, rng, sampled, worker_module
from .record import recording

pytestmark = pytest.mark.chaos

SAVES = 5
MODES: dict[str, dict[str, Any]] = {
    "async": {},
    "overlap": {"overlap": True},
    "stream": {"staging_budget": 512 << 10},
    "overlap+stream": {"overlap": True, "staging_budget": 512 << 10},
}
KINDS = ("add_", "zero_", "opt_step", "buffers", "mixed")
WHENS = ("inline", "delay", "thread")
CASES = [
    (m, k, w, s)
    for m in MODES
    for k in KINDS
    for w in WHENS
    if not (w == "thread" and "overlap" in m)
    for s in range(2)
]
IDS = [f"{m}-{k}-{w}-s{s}" for m, k, w, s in CASES]


class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024),
            torch.nn.BatchNorm1d(1024),
            torch.nn.Tanh(),
            torch.nn.Linear(1024, 256),
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.state: dict[str, Any] = {
            "model": self.model,
            "optim": self.opt,
            "ema": torch.zeros(1 << 18),
            "counter": 0,
        }
        self.n = 0

    def step(self) -> None:
        self.n += 1
        g = torch.Generator().manual_seed(self.n)
        x, y = torch.randn(32, 256, generator=g), torch.randn(32, 256, generator=g)
        self.model.train()
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        with torch.no_grad():
            self.state["ema"].mul_(0.9).add_(float(self.n))
        self.state["counter"] = self.n

    def tensors(self) -> list[torch.Tensor]:
        out = (
            [p.data for p in self.model.parameters()]
            + list(self.model.buffers())
            + [self.state["ema"]]
        )
        for st in self.opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def buffers_forward(self) -> None:
        with torch.no_grad():
            self.model.train()
            self.model(torch.randn(32, 256))
            self.state["ema"].add_(1.0)
        self.state["counter"] = -1

    def hashes(self) -> dict[str, str]:
        return leaf_hashes(self.state)


def leaf_hashes(state: dict[str, Any]) -> dict[str, str]:
    """sha256 (with dtype and shape) of every leaf: the same function the storage jobs log."""
    return worker_module().leaf_hashes(state)


def mutate(
    t: Trainer, mgr: ckptlib.CheckpointManager, kind: str, overlap: bool, on_thread: bool
) -> None:
    if kind in ("add_", "zero_"):
        if overlap and not on_thread:
            mgr.wait_for_snapshot()  # the contract for edits outside an optimizer step
        with torch.no_grad():
            for x in t.tensors():
                if kind == "zero_":
                    x.zero_()
                elif x.is_floating_point():
                    x.add_(1.0)
                else:
                    x.add_(1)
        t.state["counter"] = -2
    elif kind == "opt_step":
        t.step()
    elif kind == "buffers":
        t.buffers_forward()
    else:
        raise ValueError(kind)


HOW_ATTEMPTED = "the `save()` calls the test made"
HOW_COMMITTED = "each handle's `wait()` returned"
HOW_LOST = ("every step loaded back (`ckptlib.load`, checksums verified) and its leaf hashes compared with those "
            "taken just before its `save()`: a step with any other leaf counts")


@pytest.mark.parametrize("mode,kind,when,seed", sampled(CASES, IDS, 6, "async_race"))
def test_async_mutation_never_reaches_the_checkpoint(
    tmp_path: Path, mode: str, kind: str, when: str, seed: int
) -> None:
    r: random.Random = rng("async_race", mode, kind, when, seed)
    overlap = bool(MODES[mode].get("overlap"))
    t = Trainer()
    expected: dict[int, dict[str, str]] = {}
    threads = torch.get_num_threads()
    with recording("async_race", f"{mode}-{kind}-{when}-s{seed}", SEED) as rec:
        mgr = ckptlib.CheckpointManager(tmp_path / "ckpt", keep_last=None, **MODES[mode])
        try:
            handles = []
            for i in range(1, SAVES + 1):
                t.step()
                expected[i] = t.hashes()
                this = r.choice(KINDS[:-1]) if kind == "mixed" else kind
                delay = 0.0 if when == "inline" else r.uniform(0.0, 0.003)
                rec.saves_attempted += 1
                handles.append(mgr.save(i, t.state))
                if when == "thread":
                    th = threading.Thread(
                        target=lambda d=delay, k=this: (
                            time.sleep(d),
                            mutate(t, mgr, k, overlap, True),
                        ),
                        name="chaos-mutator",
                    )
                    th.start()
                    th.join(60)
                    assert not th.is_alive(), "the mutating thread hung"
                else:
                    if delay:
                        time.sleep(delay)
                    mutate(t, mgr, this, overlap, False)
            for h in handles:
                h.wait(timeout=120)
                rec.saves_committed += 1
        finally:
            rec.checked(HOW_ATTEMPTED, "saves_attempted")
            rec.checked(HOW_COMMITTED, "saves_committed")
            mgr.close()
            torch.set_num_threads(threads)
        for i in range(1, SAVES + 1):
            fresh = Trainer()
            fresh.step()  # creates the optimizer state the checkpoint fills
            ckptlib.load(str(tmp_path / "ckpt" / layout.step_dir(i)), into=fresh.state)
            got = fresh.hashes()
            torn = sorted(k for k in expected[i] if got.get(k) != expected[i][k])
            if torn:
                rec.saves_lost += 1
            rec.checked(HOW_LOST, "saves_lost")
            assert not torn, f"step {i}: leaves differ from the state at save(): {torn}"
