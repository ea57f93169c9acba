"""The session protocol (ckptlib/coord/session.py), meeting by meeting, on simulated ranks
(ckptlib/testing/simulation.py: threads run one at a time on virtual time, so every case is
deterministic and a 'frozen for 50 s' case takes milliseconds). The same protocol on the job's
real store: test_conformance.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from ckptlib.coord.session import Session
from ckptlib.errors import CommitError, CommitTimeoutError
from ckptlib.testing.simulation import SimCoordinator, SimThread, World

DEAD_AFTER = 5.0


def _run(world: int, body: Callable[[Session], Any], *, seed: int = 1, before: Callable[[World], None] | None = None,
         deadline: float = 120.0) -> tuple[World, list[SimThread]]:
    w = World(world, seed=seed, dead_after=DEAD_AFTER)
    coords = [SimCoordinator(w, r) for r in range(world)]

    def flow(r: int) -> Any:
        with coords[r].session("test", deadline) as s:
            return body(s)

    threads = [w.spawn(r, lambda r=r: flow(r)) for r in range(world)]
    if before is not None:
        before(w)
    w.run(until=1000)
    return w, threads


def test_every_meeting_shape_gives_each_rank_its_value():
    def body(s: Session) -> Any:
        long = s.share("y" * 5000 if s.is_coordinator else None)  # stored once, read by pointer
        short = s.share({"n": 3} if s.is_coordinator else None)  # in every rank's own key
        got = s.report(s.rank * 10)
        mine = s.answer_each([f"to {r}" for r in range(s.world)] if s.is_coordinator else None)
        every = s.exchange([s.rank])
        plan = s.consult(s.rank, lambda vs: [sum(vs) + r for r in range(len(vs))])
        return len(long), short, got, mine, every, plan

    _w, threads = _run(3, body)
    for r, t in enumerate(threads):
        assert t.error is None, t.error
        size, short, got, mine, every, plan = t.result
        assert (size, short, mine, every, plan) == (5000, {"n": 3}, f"to {r}", [[0], [1], [2]], 3 + r)
        assert got == ([0, 10, 20] if r == 0 else None)


def test_a_non_coordinator_posts_and_reads_a_constant_number_of_keys():
    """Store calls per non-coordinator for the same meetings at 2 and at 12 ranks: equal."""
    def body(s: Session) -> Any:
        s.share(1 if s.is_coordinator else None)
        s.report(s.rank)
        return s.exchange(s.rank)

    most = []
    for world in (2, 12):
        w, threads = _run(world, body)
        assert all(t.error is None for t in threads)
        most.append(max(sum(n for (r, op), n in w.calls.items() if r == q and op != "beat")
                        for q in range(1, world)))
    # At 2 ranks rank 1 is always the last to report (it also sets the coordinator's wake key):
    # the most any rank does. At 12 ranks, no rank does more. 15 at most: 11 posts and reads,
    # and the deletes of the keys it is done with (coord/session.py, "Store memory").
    assert most[1] <= most[0] <= 15, most


def test_a_rank_that_left_on_an_error_is_named_at_once_with_its_failure():
    def body(s: Session) -> Any:
        if s.rank == 2:
            raise OSError("disk full while staging")
        return s.exchange(s.rank)

    w, threads = _run(3, body)
    assert isinstance(threads[2].error, OSError)
    for t in threads[:2]:
        assert isinstance(t.error, CommitError) and "disk full while staging" in str(t.error), t.error
        assert 2 in t.error.failures
        assert t.ended_at is not None and t.ended_at < 2 * w.every + 0.5  # at the next heartbeat, not after 5 s


def test_a_dead_rank_fails_the_others_within_the_liveness_timeout():
    def before(w: World) -> None:
        w.kill(1)  # before it reaches the meeting

    w, threads = _run(3, lambda s: s.exchange(s.rank), before=before)
    for r in (0, 2):
        e = threads[r].error
        assert isinstance(e, CommitError) and not isinstance(e, CommitTimeoutError), e
        assert "rank 1" in str(e) and "no heartbeat" in str(e)
        assert DEAD_AFTER < threads[r].ended_at < DEAD_AFTER + 4 * w.every


def test_a_slow_rank_that_is_alive_is_waited_for_and_named_in_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="ckptlib")

    def body(s: Session) -> Any:
        if s.rank == 1:
            s.clock.sleep(4 * DEAD_AFTER)  # training, slow; heartbeat moving
        return s.exchange(s.rank)

    _w, threads = _run(3, body)
    assert [t.result for t in threads] == [[0, 1, 2]] * 3
    warned = [r.getMessage() for r in caplog.records if "alive but not at this meeting" in r.getMessage()]
    assert len(warned) == 1 and "[1]" in warned[0]


def test_a_rank_at_another_sessions_meeting_is_named():
    w = World(2, seed=3, dead_after=DEAD_AFTER)
    coords = [SimCoordinator(w, r) for r in range(2)]

    def flow(r: int, label: str) -> Any:
        with coords[r].session(label, 100.0) as s:
            return s.exchange(r)

    threads = [w.spawn(0, lambda: flow(0, "save")), w.spawn(1, lambda: flow(1, "restore"))]
    w.run(until=200)
    for t in threads:
        assert isinstance(t.error, CommitError) and "'restore'" in str(t.error) and "'save'" in str(t.error), t.error


def test_a_late_coordinator_ends_the_others_wait_at_the_deadline():
    def body(s: Session) -> Any:
        if s.is_coordinator:
            s.clock.sleep(50.0)
        return s.share(7 if s.is_coordinator else None, deadline=10.0)

    _w, threads = _run(2, body)
    assert isinstance(threads[1].error, CommitTimeoutError), threads[1].error
    assert 10.0 <= threads[1].ended_at < 10.5


def test_the_coordinator_leaves_last_so_its_exit_loses_no_answer():
    """The coordinator's process (the store's host) exits the instant its session closes; with
    receipts nowhere, every rank still has the last answer."""
    seen = []
    for seed in range(20):
        w = World(4, seed=seed, dead_after=DEAD_AFTER)
        coords = [SimCoordinator(w, r) for r in range(4)]

        def flow(r: int, w: World = w, coords: list[SimCoordinator] = coords) -> Any:
            with coords[r].session("t", 100.0) as s:
                out = s.exchange(r * 2)
            if r == 0:
                w.kill(0)  # exit: the store goes with the process
            return out

        threads = [w.spawn(r, lambda r=r, flow=flow: flow(r)) for r in range(4)]
        w.run(until=200)
        seen += [t.result for t in threads]
        assert all(t.error is None for t in threads), [t.error for t in threads]
    assert seen == [[0, 2, 4, 6]] * 80


@pytest.mark.parametrize("receipts", [False, True])
def test_a_frozen_store_host_is_reported_unreachable(receipts):
    """The coordinator (hosting the store) is frozen mid-session: the others' waits end within
    about the call limit, naming rank 0, instead of at the deadline."""
    def before(w: World) -> None:
        w.at(0.0005, lambda: w.freeze(0, 100.0))

    _w, threads = _run(3, lambda s: s.share(1 if s.is_coordinator else None, receipts=receipts), before=before,
                      deadline=60.0)
    for t in threads[1:]:
        if t.error is None:  # it read the value before the freeze
            continue
        assert isinstance(t.error, CommitError) and "rank 0" in str(t.error), t.error
        assert t.ended_at < 2 * DEAD_AFTER + 1
