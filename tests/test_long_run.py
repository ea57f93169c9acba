"""What a long job does many times in one process must not grow with the count: open files,
the drain history, the local tier after close, warnings per failed drain."""

from __future__ import annotations

import gc
import logging
import os

import pytest
import torch

import ckptlib


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_view_dropped_without_close_gives_its_file_descriptors_back(tmp_path):
    # Before: each view read and dropped unclosed kept its payload file open for good (a raw
    # descriptor with no finalizer): a job that peeks at its checkpoints ran out of them.
    root = tmp_path / "ck"
    with ckptlib.CheckpointManager(root) as mgr:
        mgr.save(1, {"a": torch.arange(1000.0)})
    ckptlib.open(root).read("/a")  # the first open imports what it needs
    gc.collect()
    before = _fds()
    for _ in range(30):
        view = ckptlib.open(root)
        assert torch.equal(view.read("/a"), torch.arange(1000.0))
        del view
    gc.collect()
    assert _fds() == before


def _tiered(tmp_path, **kw) -> ckptlib.CheckpointManager:
    return ckptlib.CheckpointManager(tmp_path / "ck", local=str(tmp_path / "local-{node}"), keep_last=2,
                                     local_keep_last=2, **kw)


def test_the_drain_history_stays_bounded_however_many_steps_are_drained(tmp_path):
    # Before: the manager kept every drained step's ticket for steps(): one more per drain,
    # for the whole job (tens of thousands over weeks of frequent saves).
    state = {"w": torch.zeros(256)}
    sizes = []
    with _tiered(tmp_path) as mgr:
        for step in range(1, 41):
            state["w"].fill_(step)
            mgr.save(step, state).wait_persisted(timeout=60)
            if step in (10, 40):
                sizes.append(len(mgr._drainer.history))
        assert [(i.step, i.tiers) for i in mgr.steps()] == [
            (39, {"local": "committed", "persistent": "committed"}),
            (40, {"local": "committed", "persistent": "committed"})]
    assert sizes[1] == sizes[0] <= 2, sizes


def test_close_retires_the_local_steps_kept_only_while_their_drain_was_pending(tmp_path):
    # Drains slower than saves: local retention keeps every step whose drain is pending. Before,
    # close() waited for those drains but left their steps on the local tier (on a memory tier:
    # in the node's RAM after the job) until some later job's first save.
    state = {"w": torch.zeros(16 << 10)}  # 64 KiB a step, drained at 256 KiB/s
    with _tiered(tmp_path, drain_rate=256 << 10) as mgr:
        for step in range(1, 9):
            state["w"].fill_(step)
            mgr.save(step, state).wait()
        backlog = len([p for p in os.listdir(tmp_path / "local-0") if p.startswith("step-")])
    assert backlog > 2  # the test made a backlog
    assert sorted(p for p in os.listdir(tmp_path / "local-0") if p.startswith("step-")) == [
        "step-000000000007", "step-000000000008"]
    got = {"w": torch.zeros(16 << 10)}
    with _tiered(tmp_path) as mgr:
        assert mgr.restore(got) == 8
    assert torch.equal(got["w"], torch.full((16 << 10,), 8.0))


def test_failed_drains_warn_once_then_at_doubling_counts_and_recovery_is_said(tmp_path, caplog):
    # The persistent tier unusable for a while (here its root is a file): every drain fails,
    # and each failure is raised on the training thread. Before, each one also logged a
    # warning, on every rank: thousands over an outage. Now: the first, then 2, 4, 8, ... and
    # one line when drains work again.
    (tmp_path / "ck").write_bytes(b"not a folder")
    state = {"w": torch.zeros(64)}
    raised = 0
    caplog.set_level(logging.DEBUG, logger="ckptlib")
    mgr = _tiered(tmp_path)
    for step in range(1, 21):
        if step == 18:
            (tmp_path / "ck").unlink()  # the tier is back
        try:
            mgr.save(step, state).wait_persisted(timeout=60)
        except ckptlib.CheckpointError:
            raised += 1
    mgr.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "drain" in r.getMessage()]
    failed = [m for m in warned if "stays local" in m]
    assert raised == 17
    assert len(failed) == 5, failed  # drains 1, 2, 4, 8, 16 of 17 failures
    assert "16 drains in a row have failed" in failed[-1]
    assert any("work again: step 18 drained after 17 failed drain(s)" in m for m in warned), warned
    with _tiered(tmp_path) as again:
        assert again.latest_step() == 20
