"""The coordinator conformance suite: one list of cases (:data:`CASES`), each a body every rank
runs inside one session and a check of what the ranks concluded, run two ways:

- on simulated ranks (:func:`run_sim`: virtual time, :mod:`ckptlib.testing.simulation`);
- on real processes over a real TCPStore hosted by rank 0's process
  (tests/workers/coord_worker.py, driven by tests/coord/test_conformance.py), where a rank that
  dies calls ``os._exit``, a frozen one stops itself with SIGSTOP, and the store is the one the
  coordinator's process hosts (so it freezes and dies with it).

A case's body gets the session and a :class:`Control` (die, freeze, sleep, exit after the
session). Every rank's outcome is a JSON-typed :class:`Outcome`; :meth:`Case.check` returns the
problems (empty: conforms). Timings are checked in units of the coordination timeout ``T``,
with slack for a busy machine on real processes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptlib.coord.session import Session
from ckptlib.errors import CommitError, CommitTimeoutError


class Control(Protocol):
    rank: int

    def die(self) -> None: ...

    def freeze(self, seconds: float) -> None: ...

    def sleep(self, seconds: float) -> None: ...


@dataclass
class Outcome:
    rank: int
    result: Any = None
    error: str | None = None
    """The exception's type name, or None."""
    message: str = ""
    failures: list[int] = field(default_factory=list)
    t: float = 0.0
    """Seconds from the start of the body to its end (virtual on simulated ranks)."""

    @classmethod
    def of(cls, rank: int, t: float, result: Any = None, error: BaseException | None = None) -> Outcome:
        if error is None:
            return cls(rank, result, t=t)
        return cls(rank, None, type(error).__name__, str(error)[:500], sorted(getattr(error, "failures", {}) or {}), t)


@dataclass
class Case:
    name: str
    world: int
    body: Callable[[Session, Control], Any]
    check: Callable[[list[Outcome], float], list[str]]
    """``check(outcomes, T)``: the problems (rank order; a rank that died has none)."""
    exit_after: bool = False
    """Every process exits the instant its session closes (rank 0's takes the store with it)."""


def _meetings(s: Session, ctl: Control) -> Any:
    long = s.share("y" * 5000 if s.is_coordinator else None)
    short = s.share({"n": 3} if s.is_coordinator else None)
    got = s.report(s.rank * 10)
    mine = s.answer_each([f"to {r}" for r in range(s.world)] if s.is_coordinator else None)
    every = s.exchange([s.rank])
    plan = s.consult(s.rank, lambda vs: [sum(vs) + r for r in range(len(vs))])
    last = s.share("bye" if s.is_coordinator else None, receipts=True)
    return [len(long), short, got, mine, every, plan, last]


def _check_meetings(out: list[Outcome], T: float) -> list[str]:
    problems = []
    world = len(out)
    total = sum(range(world))
    for o in out:
        want = [5000, {"n": 3}, [10 * r for r in range(world)] if o.rank == 0 else None, f"to {o.rank}",
                [[r] for r in range(world)], total + o.rank, "bye"]
        if o.error is not None or o.result != want:
            problems.append(f"rank {o.rank}: {o.error or o.result!r} {o.message}")
    return problems


def _fails_naming(rank: int, within: float, timeout_ok: bool = False) -> Callable[[list[Outcome], float], list[str]]:
    def check(out: list[Outcome], T: float) -> list[str]:
        problems = []
        for o in out:
            if o.rank == rank or o.error == "Died":
                continue
            if o.error is None:
                problems.append(f"rank {o.rank} returned {o.result!r}: rank {rank} was not noticed")
            elif o.error == "CommitTimeoutError" and not timeout_ok:
                problems.append(f"rank {o.rank} waited until its deadline instead of judging rank {rank}")
            elif f"rank {rank}" not in o.message and rank not in o.failures:
                problems.append(f"rank {o.rank}'s error does not name rank {rank}: {o.message}")
            elif o.t > within * T:
                problems.append(f"rank {o.rank} failed after {o.t:.1f}s, over {within:g} x T = {within * T:.1f}s")
        return problems

    return check


def _all_succeed(out: list[Outcome], T: float) -> list[str]:
    return [f"rank {o.rank}: {o.error}: {o.message}" for o in out if o.error is not None]


def _dead_before(s: Session, ctl: Control) -> Any:
    if s.rank == 1:
        ctl.die()
    return s.exchange(s.rank)


def _frozen_before(s: Session, ctl: Control) -> Any:
    if s.rank == 1:
        ctl.freeze(12.0)
    return s.exchange(s.rank)


def _coordinator_frozen(s: Session, ctl: Control) -> Any:
    s.exchange(s.rank)  # everyone is here before the coordinator (and its store) stops
    if s.is_coordinator:
        ctl.freeze(12.0)
    return s.exchange(s.rank)


def _slow_alive(s: Session, ctl: Control) -> Any:
    if s.rank == 1:
        ctl.sleep(3 * s.dead_after)
    return s.exchange(s.rank)


def _left_on_error(s: Session, ctl: Control) -> Any:
    if s.rank == 1:
        raise OSError("disk full while staging")
    return s.exchange(s.rank)


def _last_answer(s: Session, ctl: Control) -> Any:
    s.report(s.rank)
    return s.share(["committed", 42] if s.is_coordinator else None)


def _check_last(out: list[Outcome], T: float) -> list[str]:
    return [f"rank {o.rank}: {o.error or o.result} {o.message}" for o in out if o.result != ["committed", 42]]


CASES = [
    Case("meetings", 3, _meetings, _check_meetings),
    Case("dead_rank_is_named", 3, _dead_before, _fails_naming(1, within=2.5)),
    Case("frozen_rank_is_named", 3, _frozen_before, _fails_naming(1, within=2.5)),
    Case("frozen_coordinator_is_named", 3, _coordinator_frozen, _fails_naming(0, within=3.0)),
    Case("slow_rank_is_waited_for", 3, _slow_alive, _all_succeed),
    Case("rank_leaving_on_error_is_named", 3, _left_on_error, _fails_naming(1, within=1.0)),
    Case("coordinator_exit_loses_no_answer", 4, _last_answer, _check_last, exit_after=True),
]


def case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


# -- simulated ranks
class _SimControl:
    def __init__(self, world: Any, rank: int) -> None:
        self.world, self.rank = world, rank

    def die(self) -> None:
        self.world.kill(self.rank)
        self.world.step()  # raises Killed: the process is gone

    def freeze(self, seconds: float) -> None:
        self.world.freeze(self.rank, seconds)
        self.world.step()

    def sleep(self, seconds: float) -> None:
        self.world.sleep(seconds)


def run_sim(c: Case, *, seed: int = 1, dead_after: float = 5.0) -> list[Outcome]:
    """``c`` on simulated ranks; the outcomes of the ranks that did not die."""
    from ckptlib.testing.simulation import SimCoordinator, World

    w = World(c.world, seed=seed, dead_after=dead_after)
    coords = [SimCoordinator(w, r) for r in range(c.world)]
    outs: dict[int, Outcome] = {}

    def flow(r: int) -> None:
        ctl = _SimControl(w, r)
        try:
            with coords[r].session(c.name, 60.0) as s:
                result = c.body(s, ctl)
            outs[r] = Outcome.of(r, w.t, result)
        except (CommitError, CommitTimeoutError, OSError) as e:
            outs[r] = Outcome.of(r, w.t, error=e)
        if c.exit_after:
            w.kill(r)

    for r in range(c.world):
        w.spawn(r, functools.partial(flow, r))
    w.run(until=400)
    return [outs.get(r) or Outcome(r, error="Died") for r in range(c.world)]
