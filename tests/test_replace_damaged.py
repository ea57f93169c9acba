"""A step that ``restore()`` found damaged is replaced by the manager's next save of that step
(manager.py ``_replace``: that save commits with ``overwrite``), so a job that resumed from an
older step retrains through the damaged one and saves it again instead of failing with
``StepExistsError``. Only steps the restore found damaged are replaced: an intact committed
step is still refused. On POSIX and on a real S3 server (SeaweedFS): the damage is a flipped
bit in a payload file, the replacement is read back byte for byte, and no debris is left.
"""

from __future__ import annotations

import logging

import pytest
import torch
from backends.conftest import make_storage

import ckptlib
from ckptlib.backends import Storage, join
from ckptlib.format import layout


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "step": step}


def damage(storage: Storage, step: int) -> None:
    """Flip one bit in the middle of a payload file of ``step``."""
    folder = layout.step_dir(step)
    ids = [e.name for e in storage.listdir(folder) if e.is_dir]
    path = next(join(folder, i, e.name) for i in ids for e in storage.listdir(join(folder, i))
                if layout.is_payload_name(e.name))
    data = bytearray(storage.read(path))
    data[len(data) // 2] ^= 0x10
    storage.delete(path)  # writes are create-only
    w = storage.open_write(path)
    w.write(bytes(data))
    w.close()


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_step_found_damaged_by_restore_is_replaced_by_its_next_save(kind, request, tmp_path, caplog):
    url, opts, storage = make_storage(kind, request, tmp_path)
    with ckptlib.CheckpointManager(url, storage_options=opts, keep_last=3) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state(step))
    damage(storage, 30)

    target = state(0)
    with caplog.at_level(logging.INFO, logger="ckptlib"), \
            ckptlib.CheckpointManager(url, storage_options=opts, keep_last=3) as mgr:
        assert mgr.restore(target) == 20
        assert torch.equal(target["w"], state(20)["w"])
        with pytest.raises(ckptlib.StepExistsError):  # an intact step is never replaced
            mgr.save(20, state(21)).wait()
        new = state(30)
        new["w"] += 1.0  # retrained: not the bytes the damaged step held
        mgr.save(30, new).wait()
        assert mgr.save(40, state(40)).wait() is None
    assert "step 30 was found damaged by restore(); this save replaces it" in caplog.text

    got = state(0)
    assert ckptlib.CheckpointManager(url, storage_options=opts).restore(got, step=30) == 30
    assert torch.equal(got["w"], new["w"]) and got["step"] == 30
    assert ckptlib.CheckpointManager(url, storage_options=opts).restore(state(0), step=20) == 20  # kept
    names = sorted(e.name for e in storage.listdir(""))
    assert names == [layout.step_dir(s) for s in (20, 30, 40)], names  # no .del-, .corrupt- or .tmp- left
    # On an object store the replaced step's old payload prefix is gone too: one save id per step.
    assert len([e for e in storage.listdir(layout.step_dir(30)) if e.is_dir]) == 1


def test_a_restore_that_found_nothing_damaged_replaces_nothing(tmp_path):
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state(1))
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.restore(state(0)) == 1
        with pytest.raises(ckptlib.StepExistsError):
            mgr.save(1, state(2))


def test_a_step_deleted_during_restore_is_passed_over_not_replaced(tmp_path, monkeypatch, caplog):
    """A step deleted (by an outside ``ckptlib prune``, a person) between the restore's listing
    and its reads is "vanished": the restore falls back to the older step, as for damage, but
    the step is not counted damaged, so the next save of that number is no overwrite (it used
    to be a ``CheckpointNotFoundError`` that ended the restore, once the reads learned to tell
    a deleted step from a damaged one)."""
    import shutil

    from ckptlib.engine import load as load_flow

    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
    real = load_flow.run_plan

    def run_plan(plan, storage, folder, m, **kw):  # the first step read, step 2, is deleted meanwhile
        if m.step == 2:  # its manifest read, its files not yet
            shutil.rmtree(tmp_path / layout.step_dir(2))
        return real(plan, storage, folder, m, **kw)

    monkeypatch.setattr(load_flow, "run_plan", run_plan)
    target = state(0)
    with caplog.at_level(logging.WARNING, logger="ckptlib"), ckptlib.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(target) == 1
        assert torch.equal(target["w"], state(1)["w"])
        mgr.save(2, state(2)).wait()
    assert "step 2 vanished while it was read, trying an older one" in caplog.text
    assert "was deleted while it was being read" in caplog.text
    assert "found damaged by restore()" not in caplog.text  # not saved with overwrite
