"""Ranks that save different steps at once: a typed error on every rank, never one rank's bytes
committed under another rank's step (the preemption signal reaching ranks at different steps)."""

from __future__ import annotations

import torch

import ckptlib
from ckptlib.format import layout

from .launch import results, start, wait


def test_ranks_saving_different_steps_fail_on_every_rank(tmp_path):
    res = [o.result for o in wait("step_mismatch", start("step_mismatch", 2, tmp_path), tmp_path, 120)]
    for r in res:
        assert r is not None and "crash" not in r, r
        kind, msg = r["mismatch"]
        assert kind == "CommitError" and "StepMismatch" in msg and "same step" in msg, r
        assert r["steps"] == [layout.step_dir(5)], r  # neither step 1 nor 2 committed


def test_sigterm_at_different_steps_never_reports_an_uncommitted_step(tmp_path):
    procs = start("preempt_skew", 2, tmp_path)
    wait("preempt_skew", procs, tmp_path, 120)
    res = results("preempt_skew", 2, tmp_path)
    root = tmp_path / "ck"
    committed = [i.step for i in ckptlib.CheckpointManager(root).steps() if i.status == "committed"]
    assert committed == [10, 20], committed
    assert res[0] == {"exit": 0, "step": 20}, res  # step 20 was committed (by the periodic save)
    assert res[1] == {"exit": 1, "step": 23}, res  # rank 1's step 23 was never committed: failure code
    out = ckptlib.load(root / layout.step_dir(20))
    assert out["step"] == 20 and torch.equal(out["w"], torch.full((2000,), 20.0))
