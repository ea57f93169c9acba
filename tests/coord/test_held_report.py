"""A report held back (``Session.report(hold=True)``, docs/distributed.md "One hand-off per
wait") reaches the coordinator exactly once: with the rank's wait for the next answer, or with
its leave when the rank fails first; never again after a wait that failed. On simulated ranks
(ckptlib/testing/simulation.py), where every store call is counted by rank."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from ckptlib.errors import CommitError
from ckptlib.testing.simulation import SimCoordinator, SimKV, World

Flow = Callable[[SimCoordinator, World], Any]


def run(flows: list[Flow], monkeypatch: pytest.MonkeyPatch) -> tuple[dict[int, Any], World, list[str]]:
    """Each rank's flow on its own simulated rank: what each returned (or raised), the world, and
    the store calls rank 1 handed over on their own (``batch``: one hand-off each)."""
    batches: list[str] = []
    real = SimKV.batch

    def counted(self: SimKV, calls: Any) -> Any:
        if self.rank == 1:
            batches.append("batch")
        return real(self, calls)

    monkeypatch.setattr(SimKV, "batch", counted)
    w = World(len(flows), seed=11, dead_after=5.0)
    coords = [SimCoordinator(w, r) for r in range(len(flows))]
    out: dict[int, Any] = {}

    def body(r: int) -> None:
        try:
            out[r] = flows[r](coords[r], w)
        except CommitError as e:
            out[r] = e

    threads = [w.spawn(r, functools.partial(body, r)) for r in range(len(flows))]
    w.run(until=300)
    assert all(t.finished for t in threads), "a flow did not end"
    assert all(t.error is None for t in threads), [t.error for t in threads]
    return out, w, batches


def test_a_held_report_goes_with_the_wait_for_the_answer(monkeypatch):
    def coordinator(c: SimCoordinator, w: World) -> Any:
        with c.session("t", w.now() + 60) as s:
            got = s.report(0)
            assert got is not None
            return got, s.answer_each([v * 2 for v in got])

    def other(c: SimCoordinator, w: World) -> Any:
        with c.session("t", w.now() + 60) as s:
            assert s.report(11, hold=True) is None
            return s.answer_each(None)

    out, _w, batches = run([coordinator, other], monkeypatch)
    assert out == {0: ([0, 11], 0), 1: 22}
    assert batches == []  # the report was not handed over on its own

    # the same flow with the report posted at once hands it over once more
    def other_at_once(c: SimCoordinator, w: World) -> Any:
        with c.session("t", w.now() + 60) as s:
            s.report(11)
            return s.answer_each(None)

    out, _w, batches = run([coordinator, other_at_once], monkeypatch)
    assert out == {0: ([0, 11], 0), 1: 22}
    assert batches == ["batch"]


def test_a_rank_that_fails_before_its_next_meeting_posts_its_held_report_with_its_leave(monkeypatch):
    def coordinator(c: SimCoordinator, w: World) -> Any:
        with c.session("t", w.now() + 60) as s:
            return s.report(0)

    def other(c: SimCoordinator, w: World) -> Any:
        try:
            with c.session("t", w.now() + 60) as s:
                s.report(11, hold=True)
                raise RuntimeError("the rank's own work failed")
        except RuntimeError:
            return "raised"

    out, _w, _b = run([coordinator, other], monkeypatch)
    assert out == {0: [0, 11], 1: "raised"}


def test_a_held_report_is_not_posted_again_after_its_wait_failed(monkeypatch):
    """The coordinator reads the report, then fails the session instead of answering: the rank's
    wait ends with the failure, and its leave must not post the report a second time (its
    counter would count the rank in twice)."""

    def coordinator(c: SimCoordinator, w: World) -> Any:
        try:
            with c.session("t", w.now() + 60) as s:
                assert s.report(0) == [0, 11]
                raise RuntimeError("the coordinator's plan failed")
        except RuntimeError:
            return "raised"

    def other(c: SimCoordinator, w: World) -> Any:
        with c.session("t", w.now() + 60) as s:
            s.report(11, hold=True)
            return s.answer_each(None)

    out, w, _b = run([coordinator, other], monkeypatch)
    assert out[0] == "raised"
    assert isinstance(out[1], CommitError), out[1]
    posts = [k for k in w.data if k.endswith("/m1/r/1")]
    assert len(posts) == 1, posts  # posted, kept (a failed session leaves a few keys)
    assert not [k for k in w.data if k.endswith("/m1/n")], "the report was counted in again"
    assert w.calls[(1, "add")] == 2  # one count for the report, one for the leave
