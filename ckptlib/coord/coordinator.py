"""Coordination between ranks: who meets whom, through what.

A :class:`Coordinator` belongs to one thread of every rank (the save's, the drain's); created
collectively. Flows open a :class:`~ckptlib.coord.session.Session` with
``with coord.session(label, deadline) as s:`` (every rank, same order) and pass ``s`` to
everything that meets inside it: the save (:mod:`ckptlib.engine.save`), the resume loop
(:mod:`ckptlib.engine.resume`), the tier save, drain and restore (:mod:`ckptlib.tiers`), the
adapters' checks. Deadlines are absolute times on ``coord.clock`` (``clock.now() + timeout``).
Bulk bytes (a tier save's replicas, a tier restore's peer copies) move with
:meth:`Coordinator.transfer`, point to point, never through the store.

:class:`LocalCoordinator` is the single-process one (its sessions meet nobody);
:class:`ckptlib.coord.torch_coordinator.TorchCoordinator` the torch.distributed one (the job's
store for meetings and liveness, a gloo group for bulk bytes).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence

from ckptlib.coord.kv import REAL_CLOCK, Clock
from ckptlib.coord.session import Session
from ckptlib.coord.turns import Line, Turn
from ckptlib.errors import CheckpointError


class Coordinator(ABC):
    rank: int
    world_size: int
    clock: Clock = REAL_CLOCK
    dead_after: float = 30.0
    """The coordination timeout: how long a silent rank is waited for."""

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def session(self, label: str, deadline: float) -> Session:
        """Every rank, in the same order: the next session (a context manager; module
        docstring of :mod:`ckptlib.coord.session`). ``deadline``: on :attr:`clock`."""

    def turn(self, label: str) -> Turn:
        """Reserve the next turn for a flow that another thread will run (``with turn:`` there):
        on the thread that starts it, in program order (:mod:`ckptlib.coord.turns`). Sessions
        opened without one take their own."""
        line: Line | None = getattr(self, "_line", None)
        if line is None:
            line = self._line = Line(self.clock.now)
        return line.reserve(label)

    def deadline(self, timeout: float) -> float:
        """``timeout`` seconds from now, on :attr:`clock`."""
        return self.clock.now() + timeout

    def close(self) -> None:  # noqa: B027 - optional hook: a local coordinator holds nothing
        """Done with this coordinator (a manager's drain coordinator, once its drain thread
        ended): release what it holds. No meeting; idempotent; never raises."""

    def transfer(self, sends: Sequence[tuple[int, bytes | bytearray]], recvs: list[tuple[int, int]],
                 timeout: float) -> list[bytes]:
        """Send each ``(rank, data)`` and receive each ``(rank, size)``, in list order (a pair of
        ranks lists its messages in the same order); the received bytes. Raises
        :class:`~ckptlib.errors.CommitTimeoutError` when a peer does not answer in ``timeout``."""
        if not any(d for _r, d in sends) and not any(n for _r, n in recvs):
            return [b""] * len(recvs)
        raise CheckpointError("peer transfers need torch.distributed (no process group)")


class LocalCoordinator(Coordinator):
    """One process: every meeting returns at once."""

    rank = 0
    world_size = 1

    def session(self, label: str, deadline: float) -> Session:
        return Session(None, "", 0, 1, deadline=deadline, dead_after=self.dead_after, label=label, coord=self)


_shared: dict[str, Coordinator] = {}


def default_coordinator(dead_after: float | None = None) -> Coordinator:
    """The torch.distributed coordinator when a default process group of several ranks exists,
    else a local one. The distributed one is created once per process (creating it is
    collective); ``dead_after`` defaults to env ``CKPTLIB_COORD_TIMEOUT``, else 30 s."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            coord = _shared.get("torch")
            if coord is None:
                from ckptlib.coord.torch_coordinator import DEFAULT_DEAD_AFTER, TorchCoordinator

                env = os.environ.get("CKPTLIB_COORD_TIMEOUT")
                timeout = dead_after or (float(env) if env else DEFAULT_DEAD_AFTER)
                coord = _shared["torch"] = TorchCoordinator(timeout)
            return coord
    except ImportError:
        pass
    return LocalCoordinator()
