"""``Coordinator.consult`` (coord/coordinator.py, coord/torch_coordinator.py): every rank's value
to the coordinator, each rank its own answer. The store protocol (:class:`_Session`) runs with
ranks as threads of this process over one real in-memory store (torch's ``HashStore``), each
with its own heartbeat thread; the multi-process use is the tier restore
(tests/distributed/test_tiers.py, test_tier_liveness.py). No timed assertions: a frozen rank's
case asserts who is blamed and why, with a deadline far past the liveness timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from typing import Any

import pytest
import torch.distributed as dist

from ckptlib.coord.coordinator import LocalCoordinator
from ckptlib.coord.torch_coordinator import _Session
from ckptlib.errors import CommitError

DEAD_AFTER = 1.0
LONG = 120.0  # the deadline: a wait not judged by heartbeats would end here, as a timeout


def _ranks(world: int, call: Any, skip: Collection[int] = ()) -> dict[Any, Any]:
    """Run ``call(session)`` on a thread per rank (not the ``skip`` ranks: present in the world,
    never arriving, heartbeat still); rank -> what it returned or raised."""
    store = dist.HashStore()
    out: dict[int, Any] = {}

    def run(rank: int) -> None:
        s = _Session(store, "t", rank, world, DEAD_AFTER, 0.05)
        s.start()
        try:
            out[rank] = call(s)
        except BaseException as e:  # the test inspects it
            out[rank] = e
        finally:
            s.stop()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world) if r not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LONG + 30)
    for t in threading.enumerate():  # store waits left on daemon threads (at most DEAD_AFTER): a
        if t.name in ("ckptlib-store-wake", "ckptlib-store-call"):  # thread blocked in the store
            t.join(LONG)  # at interpreter exit aborts the process
    out["keys"] = {name: store.check([f"ckptlib/t/x1/{name}"]) for name in ("all", "to/0", "to/1", "to/2")}
    return out


def test_each_rank_gets_its_own_answer() -> None:
    seen: list[Any] = []

    def decide(values: list[Any]) -> list[Any]:
        seen.append(values)
        return [{"rank": r, "sum": sum(v["x"] for v in values)} for r in range(len(values))]

    out = _ranks(3, lambda s: s.consult({"x": 10 * s.rank}, decide, time.monotonic() + LONG))
    assert seen == [[{"x": 0}, {"x": 10}, {"x": 20}]]  # once, on the coordinator, in rank order
    assert [out[r] for r in range(3)] == [{"rank": r, "sum": 30} for r in range(3)]
    assert out["keys"] == {"all": False, "to/0": True, "to/1": True, "to/2": True}  # no list for everyone


def test_consult_and_exchange_share_the_meeting_count() -> None:
    """Meetings of either kind number alike on every rank: an exchange after a consult works."""
    def both(s: _Session) -> Any:
        mine = s.consult(s.rank, lambda vs: [v * 2 for v in vs], time.monotonic() + LONG)
        return mine, s.exchange(s.rank, time.monotonic() + LONG)

    out = _ranks(2, both)
    assert [out[0], out[1]] == [(0, [0, 1]), (2, [0, 1])]


def test_a_rank_that_never_arrives_fails_the_others_by_its_heartbeat() -> None:
    """Rank 2 never posts and its heartbeat never moves (dead or frozen): ranks 0 and 1 raise a
    CommitError naming it for its silent heartbeat, not a timeout at the (far) deadline."""
    out = _ranks(3, lambda s: s.consult(s.rank, lambda vs: vs, time.monotonic() + LONG), skip={2})
    for r in (0, 1):
        assert isinstance(out[r], CommitError), out[r]
        assert set(out[r].failures) == {2} and "no heartbeat" in out[r].failures[2], out[r].failures


def test_a_failing_decision_fails_every_rank() -> None:
    def decide(values: list[Any]) -> list[Any]:
        raise ValueError("bad plan")

    out = _ranks(2, lambda s: s.consult(s.rank, decide, time.monotonic() + LONG))
    assert isinstance(out[0], ValueError)  # the coordinator raises its own error
    assert isinstance(out[1], CommitError) and "ValueError: bad plan" in str(out[1]), out[1]


def test_single_process_default() -> None:
    """Without a session (here: one process) consult is gather, decide, scatter."""
    got = LocalCoordinator().consult(5, lambda vs: [vs[0] + 1], time.monotonic() + 1)
    assert got == 6


@pytest.mark.parametrize("world", [1, 4])
def test_answers_are_json_values(world: int) -> None:
    """What a rank gets went through JSON: tuples come back as lists, int keys as strings."""
    out = _ranks(world, lambda s: s.consult(None, lambda vs: [{1: (s.rank, r)} for r in range(len(vs))],
                                            time.monotonic() + LONG))
    assert [out[r] for r in range(world)] == [{"1": [0, r]} for r in range(world)]


def test_a_rank_at_another_kind_of_meeting_fails_every_rank() -> None:
    """Rank 1 skipped a consult (a local failure) and came to the next meeting, an exchange,
    while ranks 0 and 2 consult: every rank raises a CommitError naming rank 1 at once, none
    waits for an answer under a key that is never written (until the deadline)."""
    def call(s: _Session) -> Any:
        if s.rank == 1:
            return s.exchange("verdict", time.monotonic() + 60)
        return s.consult("needs", lambda vs: vs, time.monotonic() + 60)

    out = _ranks(3, call)
    for r in range(3):
        assert type(out[r]) is CommitError and set(out[r].failures) == {1}, out[r]
        assert "another meeting" in out[r].failures[1], out[r].failures


def test_gather_and_scatter_over_the_store() -> None:
    """Inside a session, gather brings every rank's JSON value to the coordinator only, scatter
    each rank its own part; the two number their meetings like the others."""
    def flow(s: _Session) -> Any:
        got = s.gather({"r": s.rank, "t": [1, 2]}, time.monotonic() + LONG)
        part = s.scatter(None if got is None else [[v["r"], len(got)] for v in got], time.monotonic() + LONG)
        return got, part, s.exchange(s.rank, time.monotonic() + LONG)

    out = _ranks(3, flow)
    assert out[0] == ([{"r": r, "t": [1, 2]} for r in range(3)], [0, 3], [0, 1, 2])
    assert [out[r] for r in (1, 2)] == [(None, [1, 3], [0, 1, 2]), (None, [2, 3], [0, 1, 2])]


def test_a_rank_that_left_the_session_is_known_at_once() -> None:
    """Rank 2 leaves the session (it failed on its own) instead of coming to the gather: the
    coordinator fails the gather naming it as gone, not by its heartbeat, and rank 1, waiting for
    the coordinator's next value, learns why from the coordinator's own leaving."""
    def flow(s: _Session) -> Any:
        if s.rank == 2:
            return "left"
        got = s.gather(s.rank, time.monotonic() + LONG)
        return s.scatter(got, time.monotonic() + LONG)

    out = _ranks(3, flow)
    assert out[2] == "left"
    assert isinstance(out[0], CommitError) and set(out[0].failures) == {2}, out[0]
    assert "left the save or restore" in out[0].failures[2], out[0].failures
    assert isinstance(out[1], CommitError), out[1]
    assert "left the session" in str(out[1]) and "rank 2" in str(out[1]), out[1]


def test_a_late_live_rank_is_waited_for_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 reaches the gather 2.5x the liveness timeout late, heartbeat moving: the gather
    completes, and the coordinator's log says whom it waited for and why (the usual cause when
    a rank never comes: save called on some ranks only)."""
    def flow(s: _Session) -> Any:
        if s.rank == 1:
            time.sleep(2.5 * DEAD_AFTER)
        return s.gather(s.rank, time.monotonic() + LONG)

    with caplog.at_level("WARNING", logger="ckptlib"):
        out = _ranks(2, flow)
    assert out[0] == [0, 1] and out[1] is None, out
    said = [r.getMessage() for r in caplog.records if "alive but not at this meeting" in r.getMessage()]
    assert len(said) == 1 and "ranks [1]" in said[0], said
