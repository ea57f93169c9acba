"""Coordination between ranks during a save or load.

The save flow (:mod:`ckptlib.engine.save`) calls on every rank, in order: :meth:`begin_session`
(unless its caller opened one: :func:`liveness_session`); :meth:`agree` (save id),
:meth:`agree` (staging prefix), :meth:`gather` + :meth:`scatter` or :meth:`consult` (who writes
what); writes, :meth:`report_done`, then :meth:`wait_all_done` + :meth:`release` on the
coordinator and :meth:`wait_release` elsewhere; :meth:`gather` of results, publish,
:meth:`share_outcome`; :meth:`end_session`. Every rank returns or raises the same
:class:`CommitError`. The resume loop (:mod:`ckptlib.engine.resume`): :meth:`begin_session`,
:meth:`share` (the candidates), then per candidate :meth:`exchange` (meet, then the verdicts),
:meth:`end_session`; a tier restore (:mod:`ckptlib.tiers.restore`) also :meth:`consult` (the
coordinator plans from every rank's report, each rank reads its own plan). Inside a session
every meeting waits on liveness, not on a fixed collective timeout.
:class:`LocalCoordinator` is the single-process implementation;
:class:`ckptlib.coord.torch_coordinator.TorchCoordinator` the torch.distributed one.
"""

from __future__ import annotations

import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class Coordinator(ABC):
    rank: int
    world_size: int

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def agree(self, value: Any, timeout: float) -> Any:
        """Return the coordinator's ``value`` on every rank (JSON-typed values only)."""

    @abstractmethod
    def gather(self, value: Any, timeout: float) -> list[Any] | None:
        """Coordinator: every rank's ``value`` in rank order; other ranks: ``None``."""

    @abstractmethod
    def scatter(self, values: list[Any] | None, timeout: float) -> Any:
        """Every rank gets its entry of the coordinator's ``values``."""

    # -- liveness during a save or restore (no-ops for a single process)
    def begin_session(self, label: str) -> None:  # noqa: B027 - optional hook
        """Every rank, in the same order (collective, but no meeting): open a liveness session
        for one save or restore (``label``: what it is for). Inside, :meth:`agree`,
        :meth:`gather`, :meth:`scatter` and the other meetings take JSON-typed values and wait
        on a rank while it is alive (its heartbeat moves), up to their deadline; a rank that
        died, froze or left the session fails the others within the liveness timeout."""

    def end_session(self) -> None:  # noqa: B027 - optional hook
        """Close the session on this rank (whoever still waits for it there stops waiting)."""

    def report_done(self, error: str | None) -> None:  # noqa: B027 - optional hook
        """This rank finished writing (``error`` is None on success)."""

    def wait_all_done(self, deadline: float) -> dict[int, str]:
        """Coordinator: wait for every rank; rank -> error for ranks that failed or died."""
        return {}

    def release(self, failures: dict[int, str]) -> None:  # noqa: B027 - optional hook
        """Coordinator: let the other ranks proceed (no failures) or fail with ``failures``."""

    def wait_release(self, deadline: float) -> dict[int, str]:
        """Other ranks: wait for :meth:`release`; returns the failures (empty: proceed)."""
        return {}

    def share_outcome(self, outcome: Any, deadline: float) -> Any:
        """After the coordinator tried to publish: every rank gets its ``outcome`` (JSON-typed;
        other ranks pass None). Bounded by ``deadline`` (``time.monotonic()``). A rank that
        gets no verdict returns ``{"failures": ..., "gave_up": True}`` or raises
        :class:`CommitError`; the save flow then fences the save (``engine.commit.fence``)."""
        return self.agree(outcome, max(0.1, deadline - time.monotonic()))


    # -- waits on ranks that may be slow but alive (a restore: listing a big root, loading)
    def share(self, value: Any, deadline: float) -> Any:
        """The coordinator's ``value`` on every rank (others pass None), for a value it may
        take long to produce (the resume loop's listing): with a session open
        (:meth:`begin_session`), the others wait while its heartbeat moves, until ``deadline``
        (``time.monotonic()``); a dead or frozen coordinator fails them within the session's
        liveness timeout. Default: :meth:`agree`."""
        return self.agree(value, max(0.1, deadline - time.monotonic()))

    def exchange(self, value: Any, deadline: float) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank, where ranks may arrive far
        apart (each after loading a step): with a session open, a wait on a rank is bounded by
        its heartbeat and ``deadline``, not by a fixed collective timeout. Raises
        :class:`~ckptlib.errors.CommitError` on every live rank when one died or froze.
        Default: :meth:`gather`, then :meth:`agree`."""
        timeout = max(0.1, deadline - time.monotonic())
        gathered = self.gather(value, timeout)
        return list(self.agree(gathered, timeout))

    def consult(self, value: Any, decide: Callable[[list[Any]], list[Any]], deadline: float) -> Any:
        """Every rank's ``value`` goes to the coordinator, which computes ``decide(values)`` (every
        rank's value in rank order -> one JSON-typed answer per rank); each rank gets its own
        answer and reads no other (a tier restore's plans: every rank's report in, one plan out,
        no rank reading all the reports). Waits as :meth:`exchange` does; ``decide`` runs on the
        coordinator only and should not raise (put errors in the answers): with a session open,
        its exception fails every rank with a CommitError. Default: :meth:`gather`, then
        :meth:`scatter`."""
        timeout = max(0.1, deadline - time.monotonic())
        gathered = self.gather(value, timeout)
        return self.scatter(decide(gathered) if gathered is not None else None, timeout)


@contextmanager
def liveness_session(coord: Coordinator, label: str) -> Iterator[None]:
    """Several ranks, every rank (collective, no meeting): a liveness session around a whole
    flow (a restore; a tier save, its meetings before and after the save's own; a drain),
    opened by the caller's thread. Inside an open one it opens nothing and yields at once, so
    the flows inside (the resume loop, :meth:`ckptlib.engine.save.SaveSession.begin`) use the
    caller's."""
    if coord.world_size <= 1 or coord in _FLOWS:
        yield
        return
    coord.begin_session(label)
    _FLOWS.add(coord)
    try:
        yield
    finally:
        _FLOWS.discard(coord)
        coord.end_session()


def in_flow(coord: Coordinator) -> bool:
    """Inside a :func:`liveness_session` (a flow's, which a save inside it uses as is; a session
    some save left open on a failure path does not count: the next one replaces it)."""
    return coord in _FLOWS


_FLOWS: weakref.WeakSet[Coordinator] = weakref.WeakSet()
"""Coordinators inside a :func:`liveness_session` (one flow at a time per coordinator: flows are
collective, driven by one thread)."""


class LocalCoordinator(Coordinator):
    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self._error: str | None = None

    def agree(self, value: Any, timeout: float) -> Any:
        return value

    def gather(self, value: Any, timeout: float) -> list[Any] | None:
        return [value]

    def scatter(self, values: list[Any] | None, timeout: float) -> Any:
        assert values is not None
        return values[0]

    def report_done(self, error: str | None) -> None:
        self._error = error

    def wait_all_done(self, deadline: float) -> dict[int, str]:
        return {0: self._error} if self._error else {}


_shared: dict[str, Coordinator] = {}


def default_coordinator(dead_after: float | None = None) -> Coordinator:
    """The torch.distributed coordinator when a default process group exists, else local.

    The distributed one is created once per process (creating it is collective).
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            coord = _shared.get("torch")
            if coord is None:
                import os

                from ckptlib.coord.torch_coordinator import DEFAULT_DEAD_AFTER, TorchCoordinator

                env = os.environ.get("CKPTLIB_COORD_TIMEOUT")
                timeout = dead_after or (float(env) if env else DEFAULT_DEAD_AFTER)
                coord = _shared["torch"] = TorchCoordinator(timeout)
            return coord
    except ImportError:
        pass
    return LocalCoordinator()
