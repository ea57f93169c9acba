"""Connecting to the job's store never blocks a caller past the coordination timeout
(ckptlib/coord/kv.py ``TorchKV``, ckptlib/coord/liveness.py ``Pulse``): connecting to a frozen
store host blocks for the store's own timeout (minutes), so the connection is made on the thread
that owns it, and the caller waits its limit at most. In-process stores whose ``clone`` or
calls block until the test lets them go; the real frozen host (SIGSTOP, real processes) is
tests/distributed/test_save_liveness.py's ``stop_init`` case."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from ckptlib.coord.kv import StoreUnreachable, TorchKV
from ckptlib.coord.liveness import Pulse, hb_key

LIMIT = 0.5


class Store:
    """A dict store; ``clone`` and every call wait for ``gate`` (set: they go through)."""

    def __init__(self, open_clone: bool = True, open_calls: bool = True) -> None:
        self.data: dict[str, int] = {}
        self.clone_gate, self.call_gate = threading.Event(), threading.Event()
        if open_clone:
            self.clone_gate.set()
        if open_calls:
            self.call_gate.set()
        self.clones = 0

    def clone(self) -> Store:
        assert self.clone_gate.wait(30), "the test never let the clone through"
        self.clones += 1
        return self

    def add(self, key: str, amount: int) -> int:
        assert self.call_gate.wait(30), "the test never let the call through"
        self.data[key] = self.data.get(key, 0) + amount
        return self.data[key]


def _live(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_a_blocked_connection_fails_the_call_within_the_limit_not_the_constructor():
    store = Store(open_clone=False)
    t0 = time.monotonic()
    kv = TorchKV(store, LIMIT, SimpleNamespace(every=0.05), name="test-kv-blocked")
    assert time.monotonic() - t0 < LIMIT  # made without connecting
    assert store.clones == 0
    with pytest.raises(StoreUnreachable, match="unanswered"):
        kv.add("k", 1)
    assert LIMIT - 0.05 < time.monotonic() - t0 < LIMIT + 5
    store.clone_gate.set()  # the store answers again: the queued call runs, later ones too
    assert kv.add("k", 1) == 2
    assert store.clones == 1
    kv.stop(wait=5)
    assert not _live("test-kv-blocked")


def test_a_host_connects_at_once_and_calls_on_the_callers_thread():
    store = Store()
    kv = TorchKV(store, LIMIT, SimpleNamespace(every=0.05), name="test-kv-host", host=True)
    assert store.clones == 1
    assert kv.add("k", 3) == 3
    assert not _live("test-kv-host")  # no worker


def test_the_first_heartbeat_is_bounded_and_the_pulse_ends_once_the_store_answers():
    store = Store(open_calls=False)
    before = len(_live("ckptlib-pulse"))
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match="first heartbeat"):
        Pulse(store, 3, every=0.05, limit=LIMIT)
    assert LIMIT - 0.05 < time.monotonic() - t0 < LIMIT + 5
    store.call_gate.set()  # its first call returns: the thread sees it was given up and ends
    end = time.monotonic() + 10
    while len(_live("ckptlib-pulse")) > before and time.monotonic() < end:
        time.sleep(0.01)
    assert len(_live("ckptlib-pulse")) == before
    assert store.data == {hb_key(3): 1}  # that one beat, no more


def test_a_pulse_beats_before_its_constructor_returns_and_then_every_period():
    store = Store()
    pulse = Pulse(store, 5, every=0.05, limit=LIMIT)
    try:
        assert store.data[hb_key(5)] >= 1  # the key exists before anyone reads it
        end = time.monotonic() + 10
        while store.data[hb_key(5)] < 4 and time.monotonic() < end:
            time.sleep(0.01)
        assert store.data[hb_key(5)] >= 4
        assert not pulse.stalled()
    finally:
        pulse.stop()


def test_a_refused_first_heartbeat_fails_at_once():
    class Refusing(Store):
        def add(self, key: str, amount: int) -> int:
            raise RuntimeError("Connection refused")

    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match="refused"):
        Pulse(Refusing(), 1, every=0.05, limit=30.0)
    assert time.monotonic() - t0 < 10  # not the 30 s limit


def test_the_bulk_group_is_given_up_once_the_heartbeat_stalls(monkeypatch):
    """torch's group creation blocked on a frozen store (here: until the test lets it go): the
    caller gives up once its pulse says no heartbeat reached the store, not at torch's timeout;
    with the heartbeat moving it waits, and gets the group."""
    from ckptlib.coord import torch_coordinator as tc

    gate = threading.Event()
    monkeypatch.setattr(tc.dist, "new_group", lambda **kw: "group" if gate.wait(30) else None)
    stalled = threading.Event()
    pulse = SimpleNamespace(every=0.02, limit=LIMIT, stalled=stalled.is_set)
    threading.Timer(0.3, stalled.set).start()
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match="no heartbeat"):
        tc._bulk_group(pulse, 4.0)  # type: ignore[arg-type]
    assert 0.3 <= time.monotonic() - t0 < 5
    gate.set()  # the abandoned helper ends with torch's wait
    end = time.monotonic() + 10
    while _live("ckptlib-group") and time.monotonic() < end:
        time.sleep(0.01)
    assert not _live("ckptlib-group")

    stalled.clear()
    gate.clear()
    threading.Timer(0.3, gate.set).start()
    assert tc._bulk_group(pulse, 4.0) == "group"  # type: ignore[arg-type]


def test_a_failed_bulk_group_is_a_commit_error(monkeypatch):
    from ckptlib.coord import torch_coordinator as tc
    from ckptlib.errors import CommitError

    def fail(**kw):
        raise RuntimeError("Gloo connectFullMesh failed")

    monkeypatch.setattr(tc.dist, "new_group", fail)
    with pytest.raises(CommitError, match="connectFullMesh"):
        tc._bulk_group(SimpleNamespace(every=0.02, limit=LIMIT, stalled=lambda: False), 4.0)  # type: ignore[arg-type]
