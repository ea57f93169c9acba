"""The coordinator's store waits wake as soon as the keys they wait for exist
(``coord.torch_coordinator._Wake``), on the job's real store: a ``PrefixStore`` over a
``TCPStore``, as ``init_process_group`` makes it. Timing-free: every wait here has a generous
deadline and checks what happened, never how fast."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckptlib.coord.torch_coordinator import _Session, _Wake

pytestmark = pytest.mark.skipif(not hasattr(dist.Store, "clone"), reason="Store.clone: torch 2.6 and later")


@pytest.fixture
def store() -> dist.Store:
    return dist.PrefixStore("default_pg", dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60)))


def _threads_done() -> None:
    for t in threading.enumerate():
        if t.name == "ckptlib-store-wake":
            t.join(60)


def test_wakes_once_every_key_exists(store: dist.Store) -> None:
    s = _Session(store, "save1", 0, 2, 60.0, 0.5)
    wake = _Wake(s, [s.k("done/0"), s.k("done/1")], time.monotonic() + 60)
    s.set("done/0", "ok")
    s.set("done/1", "ok")  # through the session's own connection and prefix
    assert wake._event.wait(60)


def test_a_key_that_never_comes_leaves_the_polls_to_it(store: dist.Store) -> None:
    s = _Session(store, "save2", 0, 2, 0.2, 0.5)  # the wake thread waits at most dead_after
    wake = _Wake(s, [s.k("release")], time.monotonic() + 60)
    _threads_done()
    assert not wake._event.is_set()
    s.set("release", "{}")  # too late for the thread: the caller's next poll sees it
    assert s.read_release(0.0) == {}
    wake.sleep(0.01)  # a plain sleep now, and the store still answers on both connections
    assert store.check([s.k("release")])


def test_a_store_that_cannot_clone_itself_only_polls(store: dist.Store) -> None:
    class NoClone:
        """The job's real store, as an older torch has it: no ``clone``."""

        def __init__(self, inner: dist.Store) -> None:
            self.inner, self.clones = inner, 0

        def clone(self) -> None:
            self.clones += 1
            raise RuntimeError("not supported")

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    nc = NoClone(store)
    s = _Session(nc, "save3", 0, 2, 60.0, 0.5)
    wake = _Wake(s, [s.k("release")], time.monotonic() + 60)
    _threads_done()
    assert nc.clones == 1  # one try at a connection of its own, then the thread is gone
    assert not [t for t in threading.enumerate() if t.name == "ckptlib-store-wake"]
    s.set("release", "{}")  # the key arrives: nothing waits for it on the store...
    assert not wake._event.is_set()
    assert s.read_release(0.0) == {}  # ...and the caller's poll, on the same store, sees it
    wake.sleep(0.0)
