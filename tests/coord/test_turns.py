"""Turns (ckptlib/coord/turns.py): the flows of one process meet in the order they were
started, whatever order their threads reach the store in. Real threads, no store; the real
job's case: tests/distributed/test_turns.py."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from ckptlib.coord.turns import Line, check_waiter, in_turn
from ckptlib.errors import CheckpointError, CommitTimeoutError


def _far() -> float:
    return time.monotonic() + 60


def test_flows_meet_in_the_order_they_were_started_not_the_order_their_threads_arrive():
    line = Line(time.monotonic)
    turns = [line.reserve(f"flow {i}") for i in range(4)]
    met: list[str] = []
    ready = threading.Barrier(4)

    def flow(i: int) -> None:
        with turns[i] as t:
            ready.wait(10)  # every thread is waiting before any may meet
            line.wait(t, _far(), t.label)
            met.append(t.label)

    threads = [threading.Thread(target=flow, args=(i,)) for i in (3, 1, 2, 0)]  # started last first
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert met == ["flow 0", "flow 1", "flow 2", "flow 3"]
    assert line.pending() == 0


def test_a_flow_waiting_past_its_deadline_names_the_one_ahead_of_it():
    line = Line(time.monotonic)
    first = line.reserve("save of step 7")
    second = line.reserve("restore")
    with pytest.raises(CommitTimeoutError, match=r"restore: .*'save of step 7', started before it") as e:
        line.wait(second, time.monotonic() + 0.2, "restore")
    assert "1 ahead" in str(e.value)
    assert line.pending() == 2  # the failed wait gives nothing up: its caller ends its turn
    first.end()
    line.wait(second, time.monotonic() + 0.2, "restore")  # now at the front
    second.end()
    second.end()  # idempotent
    assert line.pending() == 0


def test_a_turn_nobody_runs_is_ended_when_it_is_dropped():
    # A Megatron AsyncRequest that is never run, a save job never submitted: its turn must not
    # hold up every later flow until their deadlines.
    line = Line(time.monotonic)
    line.reserve("never run")  # dropped at once
    gc.collect()
    later = line.reserve("load")
    line.wait(later, time.monotonic() + 0.5, "load")
    assert line.pending() == 1


def test_in_turn_ends_the_turn_even_when_the_flow_raises_and_claims_it_only_on_its_thread():
    line = Line(time.monotonic)
    turn = line.reserve("save")
    seen: dict[str, object] = {}

    def job() -> None:
        seen["held"] = line.held() is turn
        raise ValueError("disk full")

    assert line.held() is None  # reserved on this thread, run on another
    errors: list[BaseException] = []

    def thread() -> None:
        try:
            in_turn(turn, job)()
        except ValueError as e:
            errors.append(e)
        seen["after"] = line.held()

    th = threading.Thread(target=thread)
    th.start()
    th.join(10)
    assert seen == {"held": True, "after": None}
    assert [str(e) for e in errors] == ["disk full"]
    assert line.pending() == 0


def test_a_wait_for_a_later_flow_on_the_thread_inside_an_earlier_one_is_refused():
    # The thread that holds turn 1 (inside its session) waits for turn 2's flow: it would wait
    # for itself. Any other thread may wait; so may this one once its turn ended.
    line = Line(time.monotonic)
    first = line.reserve("load")
    second = line.reserve("save of step 5")
    others: list[object] = []
    with first:
        with pytest.raises(CheckpointError, match=r"wait\(\) for the save of step 5 .* inside 'load'"):
            check_waiter([first, second], "wait()")
        check_waiter([first], "wait()")  # its own turn: not ahead of itself
        th = threading.Thread(target=lambda: others.append(line.ahead_here(second)))
        th.start()
        th.join(10)
    assert others == [None]
    check_waiter([second], "wait()")  # "load" ended
    check_waiter([None], "wait()")
    second.end()
    assert line.pending() == 0
