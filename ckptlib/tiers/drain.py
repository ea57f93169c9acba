"""Drain: copy a locally committed step to the persistent tier and commit it there.

The manager owns one :class:`Drainer` (thread ``ckptlib-drain``, lowered priority) when it has a
local tier. Its persist thread calls :meth:`Drainer.submit` after each local commit that is to
be persisted (``persist_every``, ``persist=True``, preemption saves); every rank submits the same
steps in the same order, so the drain threads of all ranks meet in the same collectives (on a
coordinator of their own: :func:`drain_coordinator`, never the save's).

:func:`drain_step`, every rank, on the drain thread, in one coordination session (``"drain"``;
its meetings wait on liveness, as a save's do): the coordinator checks whether the step is
already there and shares the answer -> :meth:`SaveSession.begin` on the persistent
storage (a fresh save id, that backend's staging) -> each rank checks the checksums of the files
it wrote in its node's local copy (payloads and, format v2, its piece index file:
:func:`step_files`) and copies them into the session's payload prefix (throttled
to ``rate`` bytes/s) -> :meth:`SaveSession.finish` with the local manifest rewritten for the new
save id (``extra["tiers"]["local_save_id"]`` links the two): that backend's commit (rename on
POSIX, conditional put on S3), so a drain is never half-visible. A failure fails the drain on
every rank; the ticket carries it to the training thread (raised once) and the step stays local.
The session's coordinator leaves last, so a drain that ends at its first meeting (the step was
there) never loses its answer with the coordinator's process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from ckptlib import crashpoints
from ckptlib.backends import Storage, join
from ckptlib.coord.coordinator import Coordinator, LocalCoordinator
from ckptlib.coord.session import Session
from ckptlib.engine import commit
from ckptlib.engine.save import SaveOptions, SaveSession
from ckptlib.engine.scan import check_step, read_manifest
from ckptlib.errors import CheckpointError, CommitError, CommitTimeoutError
from ckptlib.format import layout
from ckptlib.format.build import rebased
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.format.schema import Manifest
from ckptlib.tiers.inventory import (
    file_name,
    local_save_id,
    step_files,
    verify_files,
    writer_rank,
)
from ckptlib.tiers.local import LocalTier, retain_after_drains

log = logging.getLogger("ckptlib")

COPY_PIECE = 8 << 20


def drain_coordinator(coord: Coordinator) -> Coordinator:
    """A coordinator for the drain thread, with sessions of its own and no group (drains move
    no bytes between ranks): every rank, training thread, when the manager is made (creating
    one is collective)."""
    if coord.world_size <= 1:
        return LocalCoordinator()
    from ckptlib.coord.torch_coordinator import TorchCoordinator

    return TorchCoordinator(coord.dead_after, bulk=False)


def writer_of(path: str) -> int | None:
    """The rank that wrote payload ``path`` (``<save id>/r<rank>...bin``), or None."""
    return writer_rank(file_name(path))


def persisted_manifest(data: bytes, m: Manifest, save_id: str, mode: str) -> bytes:
    """The local manifest ``data`` (decoded: ``m``) rewritten for the persistent copy: save id
    ``save_id``, payload and index paths under it, commit mode ``mode``, the local save id in
    ``extra["tiers"]``."""
    return rebased(data, save_id, mode, {**(m.extra or {}), "tiers": {"local_save_id": m.save_id}})


def _copy(src: Storage, src_path: str, dst: Storage, dst_path: str, rate: float | None, rank: int,
          first: bool) -> int:
    w = dst.open_write(dst_path)
    try:
        with src.open_read(src_path) as h:
            start, t0 = 0, time.monotonic()
            while start < h.size:
                n = min(COPY_PIECE, h.size - start)
                w.write(h.read(start, n))
                start += n
                if first:
                    crashpoints.point("drain_upload", rank)
                    first = False
                if rate:
                    ahead = start / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        w.close()
    except BaseException:
        w.abort()
        raise
    return start


def drain_step(tier: LocalTier, persistent: Storage, coord: Coordinator, step: int, *, timeout: float,
               rate: float | None = None) -> bool:
    """Every rank (collective), drain thread: copy ``step`` from the local tier and commit it on
    ``persistent`` (module docstring). False when it was already there (nothing done)."""
    with coord.session("drain", coord.deadline(timeout)) as s:
        return _drain_step(tier, persistent, s, step, timeout=timeout, rate=rate)


def _drain_step(tier: LocalTier, persistent: Storage, s: Session, step: int, *, timeout: float,
                rate: float | None = None) -> bool:
    """:func:`drain_step`, inside its session."""
    final = layout.step_dir(step)
    m: Manifest | None = None
    error: BaseException | None = None
    try:
        m = read_manifest(tier.storage, final, pieces=False)  # v2: only this rank's index files are read
        if m.world_size != s.world:
            raise CheckpointError(f"step {step} was saved by {m.world_size} ranks, draining on {s.world}")
    except CheckpointError as e:
        error = e
    done = None
    if s.is_coordinator and m is not None:
        try:
            there = check_step(persistent, final, step)
            done = there.status == "committed" and there.manifest is not None and (
                local_save_id(there.manifest) == m.save_id)
        except (CheckpointError, OSError):
            done = False
    if s.share(done, what="check the persistent tier"):
        return False
    session = SaveSession.begin(persistent, final, step=step, options=SaveOptions(timeout=timeout), session=s)
    try:
        if m is not None and error is None:
            try:
                mine = [f for f in step_files(m) if f.rank == s.rank]
                verify_files(tier.storage, final, m, mine)  # never spread a bad copy
                first = True
                with session.bounded():
                    for f in mine:
                        _copy(tier.storage, join(final, f.path), persistent, join(session.prefix, f.name),
                              rate, s.rank, first)
                        first = False
            except Exception as e:
                error = e
        data = None
        if s.is_coordinator and m is not None and error is None:
            try:
                data = persisted_manifest(tier.storage.read(join(final, MANIFEST_NAME)), m, session.save_id,
                                          commit.commit_mode(persistent))
            except (CheckpointError, OSError) as e:
                error = e
            crashpoints.point("drain_commit", s.rank)
        if s.is_coordinator and data is None and error is None:
            error = CommitError("no local manifest to drain")
        session.finish(error=error, manifest=data)
        return True
    except BaseException as e:
        session.abort(e)  # a no-op after finish
        raise


class DrainTicket:
    """One step's drain: set by the drain thread, waited for on any thread."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.status = "pending"
        """``pending``, ``persisted`` or ``failed``."""
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._raised = False

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self.status = "failed" if error is not None else "persisted"
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def cancel(self, error: BaseException) -> None:
        """Never drained because its save failed (that failure is raised by the save)."""
        self._raised = True
        self.finish(error)

    def take_error(self) -> BaseException | None:
        """The failure, the first time it is asked for (raised once)."""
        with self._lock:
            if self.error is not None and not self._raised:
                self._raised = True
                return self.error
            return None

    def wait(self, timeout: float) -> None:
        if not self._event.wait(timeout):
            raise CommitTimeoutError(f"drain of step {self.step} still running after {timeout:.0f}s")


class Drainer:
    """The drain thread and its queue (module docstring). Made by the manager."""

    def __init__(self, tier: LocalTier, persistent: Storage, coord: Coordinator, *, timeout: float,
                 rate: float | None = None, on_start: Callable[[], None] | None = None) -> None:
        self.tier, self.persistent, self.coord = tier, persistent, coord
        self.timeout, self.rate, self._on_start = timeout, rate, on_start
        self._queue: queue.Queue[DrainTicket | None] = queue.Queue()
        self.tickets: list[DrainTicket] = []
        """Drains whose outcome was not yet taken by the training thread."""
        self.history: dict[int, DrainTicket] = {}
        """The latest drain of each step that ``steps()`` may show: pending ones, and failed
        ones of steps the local tier still keeps (:meth:`committed_locally` forgets the rest)."""
        self._recent: list[int] = []
        """The newest ``local_keep_last`` steps committed locally (ascending)."""
        self._failing = 0
        """Drains failed in a row (their warnings are spaced out: :meth:`_run`)."""
        self.after: Callable[[int], None] | None = None
        """Called on the drain thread after each successful drain, with its step (the manager's retention)."""
        self._thread: threading.Thread | None = None
        self._warn_at = self._first_warning = tier.keep_last + 1
        """Steps waiting to be drained that draw the next backlog warning (:meth:`submit`)."""

    def pending_steps(self) -> set[int]:
        return {t.step for t in self.tickets if not t.done()}

    def committed_locally(self, step: int, ticket: DrainTicket | None) -> None:
        """The persist thread, every rank, after each local commit: :meth:`submit` its drain
        (``ticket``; None: not drained), then forget the drains that ``steps()`` no longer
        shows, so that :attr:`history` stays bounded however many steps a job drains: a
        persisted drain (the persistent tier shows that step itself) and a failed one of a
        step older than the newest ``local_keep_last`` (local retention deletes it). Pending
        drains stay."""
        if ticket is not None:
            self.submit(ticket)
        recent = self._recent
        if step not in recent:
            recent.append(step)
            recent.sort()
            del recent[:-self.tier.keep_last]
        oldest = recent[0]
        for s, t in list(self.history.items()):
            if t.done() and (t.status == "persisted" or s < oldest):
                del self.history[s]

    def submit(self, ticket: DrainTicket) -> None:
        """The persist thread, after the local commit of ``ticket.step``. Local retention keeps
        every step whose drain is pending, so drains slower than saves grow the local tier (on a
        memory tier, the node's RAM) without bound: rank 0 warns when more than
        ``local_keep_last`` steps wait, and again each time that backlog doubles; once it is back
        under ``local_keep_last + 1``, the next backlog is warned about afresh."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ckptlib-drain", daemon=True)
            self._thread.start()
        self.tickets.append(ticket)
        self.history[ticket.step] = ticket
        self._queue.put(ticket)
        backlog = len(self.pending_steps())
        if backlog < self._first_warning:
            self._warn_at = self._first_warning
        if backlog >= self._warn_at:
            self._warn_at = 2 * backlog
            if self.coord.rank == 0:
                log.warning("ckptlib: drains fall behind saves: %d steps wait to be drained to %s, and the local "
                            "tier keeps each one until it is (beyond local_keep_last=%d; on a memory tier, in "
                            "RAM). Drain less often (a larger persist_every), or give the drain more bandwidth "
                            "(drain_rate, the persistent tier)", backlog, self.persistent.url, self.tier.keep_last)

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            ticket = self._queue.get()
            if ticket is None:
                self._close_coord()  # the drain coordinator's only user was this thread
                return
            try:
                drain_step(self.tier, self.persistent, self.coord, ticket.step, timeout=self.timeout, rate=self.rate)
                if self.after is not None:
                    self.after(ticket.step)
                ticket.finish(None)
                if self._failing:
                    log.warning("ckptlib: drains to %s work again: step %d drained after %d failed drain(s)",
                                self.persistent.url, ticket.step, self._failing)
                    self._failing = 0
            except Exception as e:
                self._failing += 1
                self._log_failure(ticket.step, e)
                ticket.finish(e)

    def _log_failure(self, step: int, error: Exception) -> None:
        """One warning for the first failed drain, then one each time the run of failures
        doubles (2, 4, 8, ...): a persistent tier down for a day fails thousands of drains, and
        each failure is raised on the training thread anyway; the rest go to DEBUG."""
        n = self._failing
        if n & (n - 1):
            log.debug("ckptlib: drain of step %d to %s failed (%d in a row); it stays local: %s",
                      step, self.persistent.url, n, error)
            return
        again = "" if n == 1 else f" ({n} drains in a row have failed; the next warning at {2 * n})"
        log.warning("ckptlib: drain of step %d to %s failed; it stays local%s: %s",
                    step, self.persistent.url, again, error)

    def _close_coord(self) -> None:
        """Release the drain coordinator (its store connection and thread, its spent keys):
        by the drain thread as it ends, or by :meth:`stop`/:meth:`abandon` if none ever ran.
        Idempotent (:meth:`Coordinator.close`)."""
        try:
            self.coord.close()
        except Exception as e:  # costs a connection until exit, never the close
            log.debug("ckptlib: releasing the drain coordinator failed: %s", e)

    def abandon(self) -> None:
        """``close`` (``drain=False``, or a close that raised): drop the drains not started
        (their tickets fail; the steps stay local) and let the thread end after the one in
        progress, if any. Never waits. No-op once :meth:`stop` ended the thread."""
        while True:
            try:
                ticket = self._queue.get_nowait()
            except queue.Empty:
                break
            if ticket is not None:
                ticket.finish(CommitError(f"drain of step {ticket.step} abandoned: the manager was closed "
                                          "before it started; the step stays local"))
        if self._thread is not None:
            self._queue.put(None)  # the thread releases the coordinator as it ends
            self._thread = None
        else:
            self._close_coord()

    def stop(self, timeout: float) -> None:
        """``close`` (training thread, no save in flight), after the last submit: let the
        thread finish the queue, then end it (bounded); the drain coordinator is released once
        no thread uses it. Once the drains ended, a node leader applies local retention again:
        the steps it kept only while their drain was pending go now, not at a next save that
        never comes (on a memory tier they would hold the node's RAM after the job)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
            self._thread = None
        else:
            self._close_coord()
        topo, rank = self.tier.topology, self.coord.rank
        if topo is not None and topo.is_leader(rank):
            retain_after_drains(self.tier, self.pending_steps(), rank)
