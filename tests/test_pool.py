"""The I/O pool used by the writer and reader: one deadline, first failure raised."""

from __future__ import annotations

import threading
import time

import pytest

from ckptlib.engine.pool import run_all
from ckptlib.errors import StorageTimeoutError


def test_results_in_order():
    assert run_all([lambda i=i: i * i for i in range(5)], threads=2, name="t") == [0, 1, 4, 9, 16]


def test_first_failure_is_raised():
    def boom():
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output"):
        run_all([lambda: time.sleep(0.05), boom], threads=2, name="t", timeout=10)


def test_stuck_task_hits_the_deadline():
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="still running"):
        run_all([lambda: release.wait(30), lambda: None], threads=2, name="t", timeout=0.3)
    assert time.monotonic() - t0 < 10
    release.set()


def test_failure_is_raised_only_after_running_tasks_finish():
    """The caller frees buffers and closes files as soon as run_all returns: a task that had
    started must have finished by then, and one that had not started must never start."""
    started = threading.Event()
    finished = []
    ran_late = []

    def slow():
        started.set()
        time.sleep(0.3)
        finished.append(True)

    def boom():
        started.wait(10)
        raise OSError(5, "Input/output error")

    def late():
        ran_late.append(True)

    with pytest.raises(OSError, match="Input/output"):
        run_all([slow, boom, late, late, late], threads=2, name="t", timeout=30)
    assert finished == [True]
    time.sleep(0.2)
    assert ran_late == []


def test_failed_load_leaves_no_reader_running(tmp_path, monkeypatch):
    """A damaged chunk fails fast while a pack is still being copied into the destination
    tensors: load must not raise (and drop those tensors) before the copy is done."""
    import torch

    import ckptlib
    from ckptlib.engine import reader

    state = {"big": torch.arange(1 << 20, dtype=torch.float32), **{f"s{i}": torch.full((8,), float(i)) for i in range(4)}}
    ckptlib.save(state, tmp_path / "ck")
    active = []
    real_pack, real_check = reader.Reader._run_pack, reader.Reader._check

    def slow_pack(self, task):
        active.append(1)
        time.sleep(0.3)
        real_pack(self, task)
        active.pop()

    def failing_check(self, t, stored):
        if t.name == "/big":
            time.sleep(0.05)
            raise ckptlib.CorruptCheckpointError("injected", "big")
        real_check(self, t, stored)

    monkeypatch.setattr(reader.Reader, "_run_pack", slow_pack)
    monkeypatch.setattr(reader.Reader, "_check", failing_check)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="injected"):
        ckptlib.load(tmp_path / "ck")
    assert active == []


def test_a_failure_with_tasks_still_queued_returns_without_waiting_out_the_deadline():
    """After a failure the pool cancels the queued tasks it picks up; a future cancelled but not
    marked as notified never counted as done, so run_all waited out its whole deadline (600 s
    by default) before raising: a restore falling back over a damaged step hung that long."""
    def boom():
        raise OSError(5, "Input/output error")

    t0 = time.monotonic()
    with pytest.raises(OSError, match="Input/output"):
        run_all([boom, *[lambda: time.sleep(0.01)] * 40], threads=2, name="t", timeout=120)
    assert time.monotonic() - t0 < 60  # the deadline is 120 s: a hang detector, not a timing
    assert not [t for t in threading.enumerate() if t.name.startswith("t_")]
