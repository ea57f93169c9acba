"""Coordination over torch.distributed: the job's store for sessions and liveness, a gloo group
for bulk bytes.

A :class:`TorchCoordinator` is created collectively, once per process and thread that drives
flows (``default_coordinator()``: the saves' and restores'; ``drain_coordinator``: the drain
thread's, without a group). What it holds, all made once (docs/scale.md, the per-process budget):

- a :class:`~ckptlib.coord.kv.TorchKV`: one store connection and one worker thread, for every
  store call of its sessions;
- the process's :class:`~ckptlib.coord.liveness.Pulse` (shared with the other coordinators on
  the same store): one connection and one thread, for heartbeats and the watches of waits;
- the gloo group (``bulk=True``) that :meth:`TorchCoordinator.transfer` sends bytes over.

Making one waits on the job's store (connecting, the first heartbeat, the ranks' meeting) at
most the coordination timeout per step: the connections are made on the threads that use them,
the meeting's calls go through the worker, and a frozen store host fails the creation with
:class:`~ckptlib.errors.CommitError` (docs/distributed.md, "Connecting is bounded too").

Sessions (:meth:`TorchCoordinator.session`) meet one at a time, in the order of their flows'
turns (:mod:`ckptlib.coord.turns`: numbered in program order, the same on every rank), so the
k-th session of turn n has the same keys on every rank, ``ckptlib/c<coordinator>/s<n>.<k>/``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptlib.coord.coordinator import Coordinator
from ckptlib.coord.kv import StoreUnreachable, TorchKV
from ckptlib.coord.liveness import Pulse, heartbeat_period
from ckptlib.coord.session import UNREACHABLE, Session
from ckptlib.coord.turns import Line
from ckptlib.errors import CheckpointError, CommitError, CommitTimeoutError

DEFAULT_DEAD_AFTER = 30.0


def _default_store() -> Any:
    """The default process group's store (a patch point: shared/tools counts store calls)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


ALIGN_TIMEOUT = 120.0
"""How long ranks wait for each other before creating a coordinator."""
_generation = [0]


def _init_key(n: int) -> str:
    return f"ckptlib/coordinator-init/{n}"


def _meet(kv: TorchKV, world: int, timeout: float, rank: int = 0) -> int:
    """Store barrier before a :class:`TorchCoordinator` is made (collective, in the same order on
    every rank, so the n-th call on each rank uses the same key). Returns that number: the
    coordinator's name in the store, the same on every rank. Its calls go through ``kv``: a
    frozen store host fails them within the coordination timeout
    (:class:`ckptlib.coord.kv.StoreUnreachable`). Rank 0 then deletes the previous meeting's
    key: every rank counted itself into this one, so every rank is past that one (a process
    that makes a manager with a local tier many times must not fill the store)."""
    _generation[0] += 1
    n = _generation[0]
    key = _init_key(n)
    kv.add(key, 1)
    end = time.monotonic() + timeout
    pause = 0.005
    while kv.add(key, 0) < world:
        if time.monotonic() > end:
            raise CommitTimeoutError(f"ranks did not all create the checkpoint coordinator within {timeout:.0f}s")
        time.sleep(pause)
        pause = min(0.1, pause * 2)
    if rank == 0 and n > 1:
        kv.discard([_init_key(n - 1)])
    return n


class TorchCoordinator(Coordinator):
    """Created collectively (every rank, same order) the first time a save or load needs it
    (module docstring). ``bulk``: make the gloo group for :meth:`transfer`."""

    def __init__(self, dead_after: float = DEFAULT_DEAD_AFTER, *, bulk: bool = True) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dead_after = dead_after
        store = _default_store()
        self.every = heartbeat_period(dead_after)
        try:
            self.pulse = Pulse.of(store, self.rank, self.every, dead_after)  # beats before the meeting below
        except StoreUnreachable as e:
            raise _creation_failed(e) from None
        # Rank 0 hosts the job's store (init_process_group without an agent store): its calls
        # need no worker to bound them.
        self.kv = TorchKV(store, dead_after, self.pulse, name="ckptlib-store", host=_hosts(store))
        try:
            # Ranks reach this point seconds apart (whatever each did since init_process_group);
            # gloo's connect timeout is the group timeout (dead_after), so meet first.
            self.generation = _meet(self.kv, self.world_size, max(ALIGN_TIMEOUT, dead_after), self.rank)
            self.name = f"c{self.generation}"
            self.kv.rename(f"ckptlib-store-{self.name}")
            self.group = _bulk_group(self.pulse, dead_after) if bulk else None
        except BaseException as e:  # this coordinator's threads end
            _drop(self.pulse, self.kv)
            if isinstance(e, StoreUnreachable):
                raise _creation_failed(e) from None
            raise
        self._line = Line(self.clock.now)
        self._open: Session | None = None
        self._spent: list[str] = []  # keys this rank posted, deleted with its next take (coord/session.py)
        self._closed = False
        self._finalizer = weakref.finalize(self, _drop, self.pulse, self.kv)

    def close(self) -> None:
        """See :meth:`Coordinator.close`: the keys its last session left in the store are
        deleted (by rank 0, those the others posted, once every rank left that session normally,
        and the coordinator's meeting key; by every other rank, its last answer key: nobody
        reads it again), then its store worker and connection end, and the pulse if no other
        coordinator uses it. Without this a manager with a local tier, made and closed many
        times in one process, left a connection, a thread and a few keys behind each time."""
        if self._closed:
            return
        self._closed = True
        last = self._open
        try:
            if self.rank == 0:
                spent = last.spent_keys() if last is not None else None
                if spent is not None:  # every rank got past the meeting that made this coordinator
                    self.kv.discard([*spent, _init_key(self.generation)])
            else:
                answer = f"/w/{self.rank}"
                self.kv.discard([k for k in self._spent if k.endswith(answer)])
        finally:
            self._finalizer()  # _drop: the worker ends after the calls queued (a posted leave)
            self.kv.close()

    def session(self, label: str, deadline: float) -> Session:
        """See :meth:`Coordinator.session`. Any thread: in the turn this thread holds (``with
        turn:``), else in a turn of its own, which ends when the session closes. Waits until
        ``deadline`` for the turns before it to end (:meth:`ckptlib.coord.turns.Line.wait`)."""
        if self._closed:
            raise CheckpointError("this coordinator was closed")
        turn = self._line.held()
        own = turn is None
        if turn is None:
            turn = self._line.reserve(label)
            self._line.claim(turn)
        try:
            self._line.wait(turn, deadline, label)
            if self._open is not None and not self._open.closed:  # this thread's own, still open
                raise RuntimeError(f"a {self._open.label} session is still open on this coordinator: pass it to "
                                   f"the {label} instead of opening another")
        except BaseException:
            if own:
                turn.end()
            raise
        turn.sessions += 1
        self._open = Session(self.kv, f"ckptlib/{self.name}/s{turn.number}.{turn.sessions}/", self.rank,
                             self.world_size, deadline=deadline, dead_after=self.dead_after, label=label, coord=self,
                             spent=self._spent, after_close=turn.end if own else None)
        return self._open

    def transfer(self, sends: Sequence[tuple[int, bytes | bytearray]], recvs: list[tuple[int, int]],
                 timeout: float) -> list[bytes]:
        """See :meth:`Coordinator.transfer`; a ``bytearray`` is sent as it is (no copy)."""
        sends = [(r, d) for r, d in sends if d]
        wanted = [(i, r, n) for i, (r, n) in enumerate(recvs) if n > 0]
        out: list[bytes] = [b""] * len(recvs)
        if not sends and not wanted:
            return out
        if self.group is None:
            raise CheckpointError("this coordinator has no group for peer transfers")
        import torch

        works = []
        for r, data in sends:
            t = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
            works.append((r, dist.isend(t, dist.get_global_rank(self.group, r), group=self.group)))
        bufs = []
        for i, r, n in wanted:
            t = torch.empty(n, dtype=torch.uint8)
            works.append((r, dist.irecv(t, dist.get_global_rank(self.group, r), group=self.group)))
            bufs.append((i, t))
        end = time.monotonic() + max(0.1, timeout)
        for peer, w in works:
            assert w is not None  # a rank of the group always gets a Work
            try:
                w.wait(timeout=timedelta(seconds=max(0.1, end - time.monotonic())))
            except RuntimeError as e:
                raise CommitTimeoutError(f"peer transfer with rank {peer} failed or timed out after {timeout:.0f}s: "
                                         f"{e}", {peer: "no answer to a peer transfer"}) from e
        for i, t in bufs:
            out[i] = t.numpy().tobytes()
        return out


def _bulk_group(pulse: Pulse, timeout: float) -> Any:
    """The gloo group for :meth:`TorchCoordinator.transfer` (``dist.new_group``, collective),
    made on a helper thread while the caller watches this process's heartbeat: torch's group
    creation waits on the job's store with the store's own timeout (often 30 minutes), so a
    store host frozen meanwhile would hold the caller that long. The caller gives up once no
    heartbeat reached the store for the coordination timeout (:class:`StoreUnreachable`), or
    at :data:`ALIGN_TIMEOUT`; a slow but live job waits (gloo's own connect timeout is
    ``timeout``). A helper given up on ends when torch's wait does."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def make() -> None:
        try:
            box["group"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        except BaseException as e:  # raised on the caller's thread
            box["error"] = e
        done.set()

    threading.Thread(target=make, name="ckptlib-group", daemon=True).start()
    limit = max(ALIGN_TIMEOUT, timeout)
    end = time.monotonic() + limit
    while not done.wait(pulse.every):
        if pulse.stalled():
            raise StoreUnreachable(f"the job's store took no heartbeat for {pulse.limit:.0f}s while the "
                                   f"coordinator's group was made")
        if time.monotonic() > end:
            raise CommitTimeoutError(f"the coordinator's gloo group was not made within {limit:.0f}s")
    if "error" in box:
        raise CommitError(f"making the coordinator's gloo group failed: {box['error']}") from box["error"]
    return box["group"]


def _creation_failed(e: StoreUnreachable) -> CommitError:
    """The error a rank raises when the store stopped answering while its coordinator was made."""
    return CommitError(f"creating the checkpoint coordinator failed: {UNREACHABLE} ({e}); every rank's save and "
                       f"restore needs it: restart the job", {0: UNREACHABLE})


def _drop(pulse: Pulse, kv: TorchKV) -> None:
    """A coordinator was dropped (a manager's drain coordinator): its worker ends, and the pulse
    if nobody else uses it."""
    kv.stop()
    pulse.release()


def _hosts(store: Any) -> bool:
    """Whether this process hosts ``store``'s server (a TCPStore made with ``is_master``, under
    any PrefixStore): torch does not say, so: rank 0 of a job whose store is not torchrun's
    agent store (``TORCHELASTIC_USE_AGENT_STORE``)."""
    import os

    return dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() not in ("true", "1")
