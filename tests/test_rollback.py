"""A run that goes back to an older step (``restore(step=N)`` with newer steps committed, e.g.
after a loss spike) and goes on saving. Retention counts by step number, so the save it had just
reported done was deleted at once by its own retention (``keep_last``), and nothing said that a
later ``restore()`` resumes from the newer step. Now the step just saved is always kept, and both
the restore and each such save log a warning that says what a resume will do, and what to do."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.format import layout
from ckptlib.plan import retention


def _steps(root: Path) -> list[int]:
    return sorted(s for p in root.iterdir() if (s := layout.parse_step(p.name)) is not None)


def test_saves_after_a_rollback_survive_retention_and_say_what_a_resume_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(str(root), keep_last=2, async_save=False) as mgr:
        for s in (100, 200, 300):
            mgr.save(s, {"w": torch.full((16,), float(s))})
    assert _steps(root) == [200, 300]

    caplog.set_level(logging.WARNING, logger="ckptlib")
    with ckptlib.CheckpointManager(str(root), keep_last=2, async_save=False) as mgr:
        state = {"w": torch.zeros(16)}
        assert mgr.restore(state, step=200) == 200
        assert torch.equal(state["w"], torch.full((16,), 200.0))
        assert "restoring step 200" in caplog.text and "resumes from step 300" in caplog.text, caplog.text
        caplog.clear()
        mgr.save(210, {"w": torch.full((16,), 210.0)})
        assert _steps(root) == [210, 300], "the save just reported done was deleted by its own retention"
        assert "step 210 was saved" in caplog.text and "newer committed step 300" in caplog.text, caplog.text
        mgr.save(220, {"w": torch.full((16,), 220.0)})
        assert _steps(root) == [220, 300]  # the policy still bounds what the rollback's saves keep
    assert torch.equal(ckptlib.load(str(root / layout.step_dir(220)))["w"], torch.full((16,), 220.0))
    with ckptlib.CheckpointManager(str(root), keep_last=2, async_save=False) as mgr:
        assert mgr.restore({"w": torch.zeros(16)}) == 300  # by step number, as the warnings said


def test_no_warning_on_an_ordinary_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ckptlib")
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(str(root), keep_last=2, async_save=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": torch.ones(4)})
        assert mgr.restore({"w": torch.zeros(4)}, step=3) == 3
    assert _steps(root) == [2, 3]
    assert "rollback" not in caplog.text and "newer committed" not in caplog.text, caplog.text


def test_decide_keeps_the_step_just_saved() -> None:
    kept = {d.step for d in retention.decide([300, 210, 200], 2, None, just_saved=210) if d.keep}
    assert kept == {300, 210}
    kept = {d.step for d in retention.decide([300, 210, 200], 2, None) if d.keep}
    assert kept == {300, 210}  # among the newest 2 anyway
    kept = {d.step for d in retention.decide([300, 250, 210], 2, None, just_saved=210) if d.keep}
    assert kept == {300, 250, 210}
    assert {d.step for d in retention.decide([300, 250, 210], 2, None) if d.keep} == {300, 250}
