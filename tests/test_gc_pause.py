"""The cyclic GC is paused while save/load build per-tensor objects, and restored after."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.engine import gc_pause
from ckptlib.engine.gc_pause import paused_gc
from ckptlib.engine.save import prepare


@pytest.fixture(autouse=True)
def _gc_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_nested_pauses_restore_collection_once() -> None:
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause is still running
    assert gc.isenabled()
    assert gc_pause._depth == 0


def test_a_pause_never_enables_a_collector_the_user_disabled() -> None:
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_restored_after_an_exception() -> None:
    with pytest.raises(ckptlib.UnsupportedValueError), paused_gc():
        prepare({"x": object()})
    assert gc.isenabled()


def test_overlapping_pauses_on_two_threads() -> None:
    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with paused_gc():
            inside.set()
            leave.wait(10)

    th = threading.Thread(target=other)
    th.start()
    assert inside.wait(10)
    with paused_gc():
        pass
    assert not gc.isenabled()  # the other thread's pause has not ended yet
    leave.set()
    th.join(10)
    assert gc.isenabled()


def test_save_and_load_leave_the_collector_as_they_found_it(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(50)}
    ckptlib.save(state, tmp_path / "a")
    assert gc.isenabled()
    out = ckptlib.load(tmp_path / "a")
    assert gc.isenabled()
    assert all(torch.equal(out[k], v) for k, v in state.items())
    gc.disable()
    ckptlib.save(state, tmp_path / "b")
    ckptlib.load(tmp_path / "b")
    assert not gc.isenabled()
    with pytest.raises(ckptlib.CheckpointError):
        ckptlib.load(tmp_path / "missing")
    assert not gc.isenabled()
