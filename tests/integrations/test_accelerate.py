"""Accelerate through ckptlib: a real Accelerator's whole state (models, optimizer, scheduler,
sampler, custom registered object, RNG) saved by save_state through an async manager; the
process is SIGKILLed inside the third save and resumed with load_state: the final weights and
custom state are bitwise those of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import ckptlib

WORKER = Path(__file__).resolve().parents[1] / "workers" / "accelerate_worker.py"
EPOCHS = 5


def train(root: Path, sampler: str, kill_at: str | None = None) -> dict | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(ckptlib.__file__).parents[1]), *sys.path])}
    env.pop("CKPTLIB_TEST_KILL_AT", None)
    if kill_at:
        env["CKPTLIB_TEST_KILL_AT"] = kill_at
    p = subprocess.run([sys.executable, str(WORKER), str(root), str(EPOCHS), sampler], env=env,
                       capture_output=True, timeout=300)
    if kill_at:
        assert p.returncode == -9, f"expected a SIGKILL at {kill_at}, got exit {p.returncode}:\n{p.stdout[-3000:]!r}"
        return None
    assert p.returncode == 0, p.stdout.decode(errors="replace")[-5000:] + p.stderr.decode(errors="replace")[-5000:]
    return json.loads((root / "result.json").read_text())


@pytest.mark.parametrize("sampler, kill_at", [
    ("plain", "write:0::3"),  # killed while the 3rd save's payload is written (persist thread)
    ("seedable", "manifest:0::4"),  # the 4th save's manifest written, never published
])
def test_kill_during_save_then_resume_is_bitwise(tmp_path, sampler, kill_at):
    ref = train(tmp_path / "ref", sampler)
    assert ref is not None and ref["resumed"] == 0
    train(tmp_path / "run", sampler, kill_at)
    steps = {i.step: i.status for i in ckptlib.CheckpointManager(tmp_path / "run" / "ckpt").steps()}
    killed = int(kill_at.rsplit(":", 1)[1])
    assert steps.get(killed) == "incomplete" and steps.get(killed - 1) == "committed", steps
    out = train(tmp_path / "run", sampler)
    assert out is not None and out["resumed"] == killed - 1
    for key in ("weights", "seen", "history", "lr"):
        assert out[key] == ref[key], f"{key}: resumed run diverged from the uninterrupted one"


def test_load_state_fresh_root_and_url_target(tmp_path):
    from accelerate import Accelerator

    from ckptlib.integrations.accelerate import load_state, save_state

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(3, 2))
    assert load_state(acc, tmp_path / "none") is None
    save_state(acc, tmp_path / "c", 4, metrics={"loss": 1.5})  # a URL: a synchronous save
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert load_state(acc, tmp_path / "c") == 4
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert ckptlib.CheckpointManager(tmp_path / "c").steps()[0].metrics == {"loss": 1.5}
