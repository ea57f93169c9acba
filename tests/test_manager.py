"""CheckpointManager: save/restore, retention, the resume planner's fallbacks, errors."""

from __future__ import annotations

import logging
import os
import sys
import time

import pytest
import torch
from helpers import disk_full, flip_bit, patch_creates, payload_files

import ckptlib
from ckptlib.format import layout


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 8, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model, "optim": opt, "step": seed, "note": f"seed {seed}"}


def weights(state: dict) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state["model"].parameters()]




@pytest.mark.parametrize("async_save", [False, True])
def test_save_restore_roundtrip(tmp_path, async_save):
    state = make_state(1)
    with ckptlib.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(10, state).wait(timeout=60)
        assert mgr.latest_step() == 10
    fresh = make_state(2)
    mgr = ckptlib.CheckpointManager(tmp_path)
    assert mgr.restore(fresh) == 10
    for a, b in zip(weights(state), weights(fresh), strict=True):
        assert torch.equal(a, b)
    assert fresh["step"] == 1 and fresh["note"] == "seed 1"
    exp = state["optim"].state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh["optim"].state_dict()["state"][0]["exp_avg"], exp)


def test_restore_empty_root_returns_none(tmp_path):
    assert ckptlib.CheckpointManager(tmp_path / "never").restore(make_state()) is None
    assert ckptlib.CheckpointManager(tmp_path / "never").steps() == []


@pytest.mark.parametrize("under", [False, True])
def test_root_that_is_a_file_fails_save_saying_so(tmp_path, under):
    (tmp_path / "f").write_text("not a folder")
    root = tmp_path / "f" / "run" if under else tmp_path / "f"
    mgr = ckptlib.CheckpointManager(root)
    with pytest.raises(ckptlib.StorageError, match="is a file, not a folder"):
        mgr.save(1, {"w": torch.ones(3)})
    mgr.close()
    assert (tmp_path / "f").read_text() == "not a folder"


def test_retention_keep_last_and_every(tmp_path):
    state = make_state()
    with ckptlib.CheckpointManager(tmp_path, keep_last=2, keep_every=20, async_save=False) as mgr:
        for step in range(0, 70, 10):
            mgr.save(step, state)
        kept = [i.step for i in mgr.steps()]
    assert kept == [0, 20, 40, 50, 60]
    assert sorted(os.listdir(tmp_path)) == [layout.step_dir(s) for s in kept]


def test_restore_falls_back_when_newest_is_corrupt(tmp_path, caplog):
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
    victim = payload_files(tmp_path / layout.step_dir(2))[0]
    flip_bit(victim, os.path.getsize(victim) // 2, 4)  # one bit in the middle of the payload
    target = make_state(3)
    with caplog.at_level(logging.WARNING, logger="ckptlib"):
        assert ckptlib.CheckpointManager(tmp_path).restore(target) == 1
    assert "step 2 is corrupt" in caplog.text and "checksum mismatch" in caplog.text
    for a, b in zip(weights(make_state(1)), weights(target), strict=True):
        assert torch.equal(a, b)


def test_truncated_payload_is_reported_and_skipped(tmp_path):
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
    victim = payload_files(tmp_path / layout.step_dir(2))[0]
    os.truncate(victim, os.path.getsize(victim) - 7)
    mgr = ckptlib.CheckpointManager(tmp_path)
    infos = {i.step: i for i in mgr.steps()}
    assert infos[2].status == "corrupt" and "bytes, manifest records" in infos[2].reason
    assert infos[1].status == "committed"
    assert mgr.latest_step() == 1
    assert mgr.restore(make_state(5)) == 1


def test_all_steps_corrupt_raises(tmp_path):
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, make_state(1))
    with open(tmp_path / layout.step_dir(1) / "manifest.json", "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(ckptlib.CorruptCheckpointError, match="no usable checkpoint"):
        ckptlib.CheckpointManager(tmp_path).restore(make_state())


def test_crash_debris_cleaned_only_if_ours(tmp_path):
    ours = tmp_path / f"{layout.step_dir(5)}.tmp-{'ab' * 16}"
    (ours / ("ab" * 16)).mkdir(parents=True)
    (ours / layout.MARKER).write_text("{}")
    (ours / ("ab" * 16) / "r00000-0.bin").write_bytes(b"partial")
    foreign = tmp_path / f"{layout.step_dir(6)}.tmp-{'cd' * 16}"
    foreign.mkdir()
    (foreign / "data.bin").write_bytes(b"not ours: no marker")
    (tmp_path / "notes.txt").write_text("user file")
    mgr = ckptlib.CheckpointManager(tmp_path, async_save=False)
    assert [(i.step, i.status) for i in mgr.steps()] == [(5, "incomplete"), (6, "incomplete")]
    mgr.save(7, make_state())
    assert not ours.exists()
    assert foreign.exists() and (tmp_path / "notes.txt").exists()


def test_step_exists_and_corrupt_step_is_set_aside(tmp_path):
    mgr = ckptlib.CheckpointManager(tmp_path, async_save=False)
    mgr.save(3, make_state(3))
    # The manager takes no overwrite=: its message says what to do instead (it said "pass overwrite=True").
    with pytest.raises(ckptlib.StepExistsError, match=r"CheckpointManager\.save never replaces a committed step"):
        mgr.save(3, make_state(4))
    (tmp_path / layout.step_dir(3) / "manifest.json").write_bytes(b"{}")  # damage it
    mgr.save(3, make_state(4))
    target = make_state(9)
    assert mgr.restore(target) == 3 and target["step"] == 4
    aside = [n for n in os.listdir(tmp_path) if ".corrupt-" in n]
    assert len(aside) == 1  # kept for inspection, never deleted


def test_background_failure_raised_once(tmp_path, monkeypatch):
    mgr = ckptlib.CheckpointManager(tmp_path)
    patch_creates(monkeypatch, disk_full)
    h = mgr.save(1, make_state())
    with pytest.raises(ckptlib.CommitError, match="No space left") as first:
        h.wait(timeout=60)
    assert h.done() and h.error is first.value
    # Asked again, the handle never reads as committed; the failure itself is not raised again.
    with pytest.raises(ckptlib.CheckpointError, match=r"step 1 was not committed: CommitError: .*No space left") as again:
        h.wait(timeout=60)
    assert again.value is not first.value and again.value.__cause__ is first.value
    mgr.wait()
    monkeypatch.undo()
    assert mgr.latest_step() is None
    # The next failure surfaces on the next save() instead.
    patch_creates(monkeypatch, disk_full)
    mgr.save(2, make_state())
    mgr._worker.join(60)
    monkeypatch.undo()
    with pytest.raises(ckptlib.CommitError):
        mgr.save(3, make_state())
    h4 = mgr.save(4, make_state())
    h4.wait(timeout=60)
    h4.wait(timeout=60)  # committed: waiting again raises nothing
    assert h4.done() and h4.error is None
    mgr.close()
    assert [i.step for i in mgr.steps() if i.status == "committed"] == [4]
    assert os.listdir(tmp_path) == [layout.step_dir(4)]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_lost_rank_failure_says_to_relaunch(tmp_path, monkeypatch):
    """A save that failed because a rank is gone (a liveness verdict) carries a note: relaunch
    the whole job, and the newest step this process saw commit; a storage failure does not
    (a relaunch does not mend a full disk)."""
    from ckptlib.coord.liveness import Judge
    from ckptlib.engine import save as save_flow

    mgr = ckptlib.CheckpointManager(tmp_path)
    gone = ckptlib.CommitError("coordination failed during save", {1: Judge(5.0).why()})
    for step in (1, 2):
        mgr.save(step, make_state()).wait(timeout=60)
    real = save_flow.persist

    def lost(*args, **kwargs):
        raise gone

    monkeypatch.setattr(save_flow, "persist", lost)
    with pytest.raises(ckptlib.CommitError) as e:
        mgr.save(3, make_state()).wait(timeout=60)
    assert e.value is gone and str(e.value) == "coordination failed during save"  # the message is unchanged
    assert e.value.__notes__ == ["ckptlib: step 3 was not saved. A rank that died or froze ends the job's process "
                                 "group: relaunch the whole job; restore() then resumes from step 2, the newest "
                                 "step this process saw committed."]
    monkeypatch.setattr(save_flow, "persist", real)
    patch_creates(monkeypatch, disk_full)
    with pytest.raises(ckptlib.CommitError, match="No space left") as full:
        mgr.save(4, make_state()).wait(timeout=60)
    assert full.value.failures and not getattr(full.value, "__notes__", None)
    monkeypatch.undo()
    mgr.close()
    fresh = ckptlib.CheckpointManager(tmp_path / "fresh")
    monkeypatch.setattr(save_flow, "persist", lost)
    gone.__notes__.clear()
    with pytest.raises(ckptlib.CommitError) as e:
        fresh.save(1, make_state()).wait(timeout=60)
    assert e.value.__notes__ == ["ckptlib: step 1 was not saved. A rank that died or froze ends the job's process "
                                 "group: relaunch the whole job; restore() then resumes from the newest committed "
                                 "step (this process committed none)."]
    monkeypatch.undo()
    fresh.close()


def test_fsync_failure_fails_the_checkpoint(tmp_path, monkeypatch):
    mgr = ckptlib.CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, make_state(1))
    real = os.fsync
    calls = {"n": 0}

    def flaky(fd):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(5, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", flaky)
    with pytest.raises(ckptlib.CommitError, match="fsync"):
        mgr.save(2, make_state(2))
    monkeypatch.undo()
    assert mgr.latest_step() == 1
    assert sorted(os.listdir(tmp_path)) == [layout.step_dir(1)]


def test_in_flight_skip_policy(tmp_path, monkeypatch):
    def slow(real):
        def create(self, path):
            time.sleep(0.5)
            return real(self, path)
        return create

    patch_creates(monkeypatch, slow)
    mgr = ckptlib.CheckpointManager(tmp_path, in_flight="skip")
    h1 = mgr.save(1, make_state())
    with pytest.warns(RuntimeWarning, match="skipping save of step 2"):
        h2 = mgr.save(2, make_state())
    assert h2.skipped and h2.done()
    h1.wait(timeout=60)
    mgr.close()
    assert [i.step for i in mgr.steps()] == [1]


def test_async_snapshot_isolated_from_mutation(tmp_path):
    state = make_state(1)
    before = weights(state)
    mgr = ckptlib.CheckpointManager(tmp_path)
    h = mgr.save(1, state)
    with torch.no_grad():  # mutate right after save() returns
        for p in state["model"].parameters():
            p.add_(1000.0)
    h.wait(timeout=60)
    target = make_state(2)
    assert mgr.restore(target) == 1
    for a, b in zip(before, weights(target), strict=True):
        assert torch.equal(a, b)
    mgr.close()


def test_memory_backend_manager(memory_url):
    with ckptlib.CheckpointManager(memory_url, keep_last=1) as mgr:
        mgr.save(1, make_state(1)).wait(timeout=60)
        mgr.save(2, make_state(2)).wait(timeout=60)
        assert [i.step for i in mgr.steps()] == [2]
        target = make_state(0)
        assert mgr.restore(target) == 2 and target["step"] == 2
        with pytest.raises(ckptlib.StepExistsError):
            mgr.save(2, make_state(3)).wait(timeout=60)


def test_closed_manager_refuses_saves(tmp_path):
    mgr = ckptlib.CheckpointManager(tmp_path)
    mgr.close()
    with pytest.raises(ckptlib.CheckpointError, match="closed"):
        mgr.save(1, make_state())


def test_restore_pinned_step_absent_incomplete_or_not_a_step_says_what_to_do(tmp_path):
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        for step in (1, 2, 4):
            mgr.save(step, {"w": torch.full((8,), float(step))})
    (tmp_path / layout.step_dir(3)).mkdir()  # a save that never committed
    mgr = ckptlib.CheckpointManager(tmp_path)
    state = {"w": torch.zeros(8)}
    with pytest.raises(ckptlib.CheckpointNotFoundError, match=r"no step 7 under .*newest committed step \(step 4\)"):
        mgr.restore(state, step=7)
    with pytest.raises(ckptlib.CheckpointNotFoundError, match=r"step 3 under .* is incomplete: .*ckptlib ls"):
        mgr.restore(state, step=3)
    with pytest.raises(TypeError, match="step must be an int, got True"):
        mgr.restore(state, step=True)  # not step 1
    with pytest.raises(TypeError, match="step must be an int, got '4'"):
        mgr.restore(state, step="4")
    with pytest.raises(ValueError, match="step must be from 0"):
        mgr.restore(state, step=-1)
    assert torch.equal(state["w"], torch.zeros(8))  # nothing was loaded
    assert mgr.restore(state, step=2) == 2 and torch.equal(state["w"], torch.full((8,), 2.0))


def test_retention_with_keep_every_judges_the_newest_steps_only(tmp_path, monkeypatch):
    """With ``keep_every`` a run keeps a step every N for good, and retention judged every one of
    them after each save (a manifest read and a size check per payload file each). Now it judges
    newest first and passes over the ``keep_every`` multiples once ``keep_last`` committed steps
    are found: they are kept whatever they hold."""
    from ckptlib.engine import scan

    judged: list[str] = []
    inner = scan.check_step

    def counting(storage, folder, step=None, **kw):  # type: ignore[no-untyped-def]
        judged.append(folder)
        return inner(storage, folder, step, **kw)

    with ckptlib.CheckpointManager(tmp_path, keep_last=2, keep_every=5, async_save=False) as mgr:
        for step in range(1, 21):
            mgr.save(step, make_state())
        monkeypatch.setattr(scan, "check_step", counting)
        mgr.save(21, make_state())
        monkeypatch.undo()
        assert [i.step for i in mgr.steps()] == [5, 10, 15, 20, 21]
    # 21 and 20 kept (the newest 2), 19 judged and deleted; 15, 10 and 5 not judged (before: all six)
    assert [f for f in judged if f.startswith("step-")] == [layout.step_dir(s) for s in (21, 20, 19)], judged


@pytest.mark.parametrize("seed", range(40))
def test_retention_decides_as_a_full_scan_would(tmp_path, seed):
    """Random roots (committed, damaged and crashed steps) and policies: the steps retention
    deletes are those :func:`ckptlib.plan.retention.decide` deletes over a full scan."""
    import random

    from ckptlib.engine import retire, scan
    from ckptlib.plan import retention

    rng = random.Random(seed)
    root = tmp_path / "run"
    steps = sorted(rng.sample(range(1, 60), rng.randint(1, 14)))
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for step in steps:
            mgr.save(step, make_state())
    storage = mgr.storage
    for step in steps:
        folder = root / layout.step_dir(step)
        fate = rng.random()
        if fate < 0.15:  # damaged: a payload file cut short
            victim = payload_files(folder)[0]
            os.truncate(victim, os.path.getsize(victim) - 1)
        elif fate < 0.25:  # crashed before its commit
            (folder / "manifest.json").unlink()
    keep_last, keep_every = rng.randint(1, 4), rng.choice([None, 2, 3, 5, 10])
    just_saved = rng.choice([None, *steps])
    full = [i for i in scan.scan(storage) if i.status == "committed"]
    want = [d.step for d in retention.decide([i.step for i in full], keep_last, keep_every, just_saved=just_saved)
            if not d.keep]
    got = retire.apply_retention(storage, keep_last, keep_every, just_saved=just_saved)
    assert got == want, (steps, keep_last, keep_every, just_saved)
    left = {i.step for i in scan.scan(storage) if i.status == "committed"}
    assert left == {i.step for i in full} - set(want)
