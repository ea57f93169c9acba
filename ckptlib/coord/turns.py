"""Turns: the order in which the flows of one process meet through one coordinator.

One :class:`~ckptlib.coord.torch_coordinator.TorchCoordinator` serves every flow of a process
that uses it (``default_coordinator()``: several managers' saves, Megatron's async saves and
loads, DeepSpeed's loads), and those flows run on different threads: a manager's persist
thread, a Megatron save's thread, the training thread. Their sessions must meet in the same
order on every rank, and that order cannot be the order in which the threads happen to reach
the store. So each flow holds a :class:`Turn`, numbered when the flow is *started*, on the
thread that starts it, in program order (the same on every rank):

- an async flow reserves its turn with ``coord.turn(label)`` on the training thread, when it is
  handed to its thread (``CheckpointManager.save``, Megatron's ``async_save``), and its thread
  runs the flow inside ``with turn:``;
- any other session takes a turn of its own when it is opened (``coord.session``), on the
  thread that opens it, and ends it when it closes.

A session opened inside a turn waits (until the session's deadline) for every turn numbered
before it to end, then meets under keys named by its turn, ``s<turn>.<k>/`` for the turn's k-th
session. So one flow that fails before it opens a session, on some rank, never shifts the keys
of the flows after it, and two flows never share a session. A turn that nobody runs is ended
when it is dropped (garbage collected), so it holds nobody up for long.

A thread that waits for a flow (``SaveHandle.wait``, ``CheckpointManager.wait``/``close``) while
it holds an earlier turn itself would wait for itself until the flow's deadline: that is what a
signal handler does when it saves and waits while the thread it interrupted is inside another
flow's session (a Megatron load, say). Such a wait asks :meth:`Line.ahead_here` and is refused
at once; the flow goes on and meets once the earlier session ends.

Threads: :meth:`Line.reserve` on the thread that starts a flow; ``with turn:`` and
:meth:`Line.wait` on the thread that runs it; :meth:`Line.ahead_here` on a thread about to wait
for a flow; :meth:`Line.end` on any thread (idempotent).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType

from ckptlib.errors import CheckpointError, CommitTimeoutError


class Turn:
    """One flow's place in its coordinator's :class:`Line` (module docstring)."""

    def __init__(self, line: Line, number: int, label: str) -> None:
        self.line, self.number, self.label = line, number, label
        self.sessions = 0
        """Sessions opened in this turn so far (their keys: ``s<number>.<k>``)."""
        self.owner: int | None = None  # the thread that runs the flow (``with turn:``)
        self._finalizer = weakref.finalize(self, line.end_number, number)

    def end(self) -> None:
        """The flow is over (or will never run): the turns after it may meet. Idempotent."""
        self.owner = None
        self._finalizer()

    def __enter__(self) -> Turn:
        self.line.claim(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None,
                 ) -> None:
        self.end()


class Line:
    """The turns of one coordinator, in the order they were reserved."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self._cond = threading.Condition()
        self._next = 0
        self._pending: dict[int, str] = {}  # number -> label, of every turn not ended
        self._held = threading.local()  # the turn this thread claimed

    def reserve(self, label: str) -> Turn:
        """The next turn (the thread that starts the flow, in program order)."""
        with self._cond:
            self._next += 1
            self._pending[self._next] = label
            return Turn(self, self._next, label)

    def claim(self, turn: Turn) -> None:
        """``turn``'s sessions are those this thread opens until it ends (``with turn:``)."""
        turn.owner = threading.get_ident()
        self._held.turn = turn

    def held(self) -> Turn | None:
        """The turn this thread claimed and has not ended, if any."""
        turn: Turn | None = getattr(self._held, "turn", None)
        if turn is None or turn.owner != threading.get_ident():
            return None
        return turn

    def ahead_here(self, turn: Turn) -> Turn | None:
        """The turn this thread holds, if it comes before ``turn`` and ``turn`` has not ended: a
        wait on this thread for ``turn``'s flow would wait for itself (a signal handler that
        waits for a save while the thread it interrupted is inside another flow's session)."""
        held = self.held()
        with self._cond:
            if held is None or held.number >= turn.number or turn.number not in self._pending:
                return None
        return held

    def wait(self, turn: Turn, deadline: float, label: str) -> None:
        """Block until every turn reserved before ``turn`` has ended. Raises
        :class:`CommitTimeoutError` naming the flow still ahead at ``deadline`` (``now``'s clock)."""
        with self._cond:
            while True:
                ahead = [n for n in self._pending if n < turn.number]
                if not ahead:
                    return
                left = deadline - self.now()
                if left <= 0:
                    first = min(ahead)
                    raise CommitTimeoutError(
                        f"{label}: another flow of this process that uses the same checkpoint coordinator, "
                        f"{self._pending[first]!r}, started before it and was still running at this one's "
                        f"deadline ({len(ahead)} ahead). Flows that share a coordinator meet one at a time, in the "
                        f"order they were started; wait for the earlier one (its handle's wait()) or give this one "
                        f"a longer timeout")
                self._cond.wait(min(left, 1.0))

    def end_number(self, number: int) -> None:
        with self._cond:
            if self._pending.pop(number, None) is not None:
                self._cond.notify_all()

    def pending(self) -> int:
        """Turns reserved and not ended (tests, diagnostics)."""
        with self._cond:
            return len(self._pending)


def in_turn(turn: Turn, fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` to run inside ``turn`` on whichever thread calls it (an async flow's job)."""

    def run(*args: object) -> None:
        with turn:
            fn(*args)

    return run


def check_waiter(turns: Iterable[Turn | None], what: str) -> None:
    """Before a thread waits for the flows of ``turns`` (``what``: the call, e.g. ``"wait()"``):
    raise :class:`CheckpointError` at once if this thread holds a turn before one of them
    (:meth:`Line.ahead_here`), where the wait would wait for itself until that flow's deadline.
    The flows go on. Nothing is raised for a ``None`` (a flow done, or with no turn)."""
    for turn in filter(None, turns):
        held = turn.line.ahead_here(turn)
        if held is None:
            continue
        raise CheckpointError(
            f"{what} for the {turn.label} was called on a thread that is inside {held.label!r}, a session on "
            f"the same checkpoint coordinator started before it (a signal handler?): the {turn.label} meets "
            f"only after that session ends, so this wait would wait for itself. It goes on and runs once that "
            f"session returns: wait for it then (on SIGTERM: save_on_signal() and poll for it, docs/async.md)")
