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
    with ckptlib.CheckpointManager(str(root), keep_last=2, keep_every=100, async_save=False) as mgr:
        for s in (100, 150, 200, 250):
            mgr.save(s, {"w": torch.full((16,), float(s))})
    assert _steps(root) == [100, 200, 250]

    caplog.set_level(logging.WARNING, logger="ckptlib")
    with ckptlib.CheckpointManager(str(root), keep_last=2, keep_every=100, async_save=False) as mgr:
        state = {"w": torch.zeros(16)}
        assert mgr.restore(state, step=100) == 100  # kept by keep_every; two newer steps
        assert torch.equal(state["w"], torch.full((16,), 100.0))
        assert "restoring step 100" in caplog.text and "resumes from step 250" in caplog.text, caplog.text
        caplog.clear()
        mgr.save(110, {"w": torch.full((16,), 110.0)})
        assert _steps(root) == [100, 110, 200, 250], "the save just reported done was deleted by its own retention"
        assert "step 110 was saved" in caplog.text and "newer committed step 250" in caplog.text, caplog.text
        mgr.save(120, {"w": torch.full((16,), 120.0)})
        assert _steps(root) == [100, 120, 200, 250]  # the policy still retires the run's older saves
    assert torch.equal(ckptlib.load(str(root / layout.step_dir(120)))["w"], torch.full((16,), 120.0))
    with ckptlib.CheckpointManager(str(root), keep_last=2, async_save=False) as mgr:
        assert mgr.restore({"w": torch.zeros(16)}) == 250  # by step number, as the warnings said


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


def test_a_tiered_run_keeps_the_step_just_saved_on_both_tiers(tmp_path: Path) -> None:
    """The same rollback through a node-local tier: local retention (``local_keep_last``) and the
    persistent tier's retention after each drain both keep the step just saved."""
    persistent, local = tmp_path / "ck", tmp_path / "local-0"

    def manager(**kw: int) -> ckptlib.CheckpointManager:
        return ckptlib.CheckpointManager(persistent, local=str(tmp_path / "local-{node}"), keep_last=2,
                                         keep_every=100, local_keep_last=2, async_save=False, **kw)

    with manager() as mgr:
        for s in (100, 150, 200, 250):
            mgr.save(s, {"w": torch.full((16,), float(s))})
        mgr.wait()
    assert _steps(persistent) == [100, 200, 250] and _steps(local) == [200, 250]
    with manager() as mgr:
        state = {"w": torch.zeros(16)}
        assert mgr.restore(state, step=100) == 100  # from the persistent tier
        assert torch.equal(state["w"], torch.full((16,), 100.0))
        mgr.save(110, {"w": torch.full((16,), 110.0)})
        mgr.wait()
        assert 110 in _steps(local), _steps(local)
    assert _steps(persistent) == [100, 110, 200, 250], _steps(persistent)
    with manager(persist_every=100) as mgr:  # a save kept only locally, not drained
        assert mgr.restore({"w": torch.zeros(16)}, step=100) == 100
        mgr.save(120, {"w": torch.full((16,), 120.0)})
        mgr.wait()
        assert 120 in _steps(local), _steps(local)
        assert 120 not in _steps(persistent)
    assert torch.equal(ckptlib.load(str(persistent / layout.step_dir(110)))["w"], torch.full((16,), 110.0))
