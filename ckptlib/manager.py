"""CheckpointManager: the scheduling façade. It orders saves, restores and retention; the
work is in the engine (save, resume, overlap, preemption, retire). Threads (docs/async.md):

- ``save()`` runs on the training thread: flatten, plan staging (:class:`Stager`), start the
  manager's persist thread (:mod:`ckptlib.engine.persist_worker`; ``ckptlib-save-<step>`` while
  it writes, commits and applies retention), copy the state into the
  staging arena, return a :class:`SaveHandle`. In overlap mode parameters and optimizer state
  are copied by ``ckptlib-snapshot-<step>`` and the next optimizer step waits for it.
- One save is in flight at a time: a new ``save()`` waits for the previous one or skips
  itself (``in_flight``), so the arena is never overwritten while a writer reads it.

Errors: a background failure is raised exactly once, on the caller's thread, by the first of
``handle.wait()``, the next ``save()``, ``wait()`` or ``close()`` to see it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, overload

from ckptlib import crashpoints
from ckptlib.backends import Storage, open_storage
from ckptlib.backends.posix import PosixStorage
from ckptlib.coord.coordinator import Coordinator, default_coordinator
from ckptlib.coord.liveness import note_relaunch
from ckptlib.coord.turns import Turn, check_waiter, in_turn
from ckptlib.engine import options as argcheck
from ckptlib.engine import persist_worker, resume, retire
from ckptlib.engine import save as save_flow
from ckptlib.engine.load import LoadResult
from ckptlib.engine.mapped_arena import Ring
from ckptlib.engine.overlap import SnapshotGate, deferred_mask
from ckptlib.engine.persist_worker import PersistWorker, lower_priority
from ckptlib.engine.preemption import FinalCheckpoint, PreemptionWatcher
from ckptlib.engine.scan import StepInfo, newest_committed, refuse_run_inside_checkpoint, scan
from ckptlib.engine.snapshot import Snapshot, SnapshotAborted, Stager, failed_rounds
from ckptlib.errors import CheckpointError, CheckpointNotFoundError, CommitTimeoutError
from ckptlib.format import layout
from ckptlib.format.schema import check_metrics
from ckptlib.plan import retention
from ckptlib.plan.flatten import FlatState, TensorItem
from ckptlib.schedule import HOUR, IntervalEstimator, SaveSchedule, check_bounds, check_positive
from ckptlib.tiers import local as tier_local
from ckptlib.tiers import restore as tier_restore
from ckptlib.tiers.drain import Drainer, DrainTicket, drain_coordinator
from ckptlib.tiers.node import local_root, node_index

log = logging.getLogger("ckptlib")

FAILURE_EXIT_CODE = 1
"""Exit code of a preempted process whose final checkpoint did not commit in time."""


class SaveHandle:
    """The result of ``CheckpointManager.save``: poll with :meth:`done`, block with :meth:`wait`
    (any thread). Created on the training thread; finished by the manager's persist thread."""

    def __init__(self, step: int, timeout: float) -> None:
        self.step = step
        self.skipped = False
        self._timeout = timeout
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._raised = False
        self._snapshot: Snapshot | None = None
        self._durable_at: float | None = None  # time.monotonic() when committed
        self._drain: DrainTicket | None = None
        self._tiered = False
        self._pid = os.getpid()  # its save runs in this process only
        self._turn: Callable[[], Turn | None] = lambda: None  # its place among its coordinator's flows

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        if error is None and not self.skipped:
            self._durable_at = time.monotonic()
        self._event.set()

    def done(self) -> bool:
        """True once the save committed or failed (or was skipped)."""
        return self._event.is_set()

    def snapshot_done(self) -> bool:
        """True once the state was copied (the training loop may mutate it freely)."""
        return self._snapshot is None or self._snapshot.staged_done()

    def _take_error(self) -> BaseException | None:
        with self._lock:
            if self._error is not None and not self._raised:
                self._raised = True
                return self._error
            return None

    @property
    def error(self) -> BaseException | None:
        """The save's failure once :meth:`done`, whoever raised it; None while it runs, and when
        it committed or was skipped. Reading it raises nothing (for threads that only check)."""
        return self._error if self._event.is_set() else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed. A failure is raised here if this is the first to see it;
        if the next ``save()``, ``wait()`` or ``close()`` raised it before, this raises a
        :class:`CheckpointError` that says the step did not commit (the original chained), so
        a handle never reads as committed for a save that failed.

        ``timeout=None`` waits up to the save's own deadline (plus a margin).
        """
        if os.getpid() != self._pid and not self._event.is_set():  # a forked child: it would wait out the limit
            raise CheckpointError(f"step {self.step}: its save runs in process {self._pid}, which this one was "
                                  "forked from, and is never done here; wait for it there")
        if not self._event.is_set():  # inside an earlier flow's session, it would wait for itself
            check_waiter([self._turn()], "wait()")
        limit = self._timeout + 30.0 if timeout is None else timeout
        if not self._event.wait(limit):
            raise CommitTimeoutError(f"save of step {self.step} still running after {limit:g}s of waiting; it goes "
                                     "on and may still commit: wait() again to learn its outcome")
        err = self._take_error()
        if err is not None:
            raise err
        if self._error is not None:  # raised before, elsewhere: say so again, as a fact
            raise CheckpointError(f"step {self.step} was not committed: {type(self._error).__name__}: "
                                  f"{self._error} (raised earlier by the save, wait or close that saw it first)"
                                  ) from self._error

    def wait_persisted(self, timeout: float | None = None) -> None:
        """Block until this step is committed on the persistent tier (tiers: its drain; without
        a local tier this is :meth:`wait`). Raises the save's or the drain's failure if this is
        the first to see it, and :class:`CheckpointError` if the step is not to be drained."""
        if self._drain is None and self._tiered:
            raise CheckpointError(f"step {self.step} is not drained to the persistent tier (persist=False "
                                  "or persist_every); save it with persist=True")
        self.wait(timeout)
        ticket = self._drain
        if ticket is None:
            return
        ticket.wait(self._timeout + 30.0 if timeout is None else timeout)
        err = ticket.take_error()
        if err is not None:
            raise err
        if ticket.status != "persisted":  # its failure was raised before: say so again, as a fact
            raise CheckpointError(f"step {self.step} is not on the persistent tier: its drain failed ({ticket.error})")


@dataclass(frozen=True)
class ManagerOptions:
    """The manager's scheduling options, validated once (documented on :class:`CheckpointManager`)."""

    keep_last: int | None = None
    keep_every: int | None = None
    async_save: bool = True
    compression: str | None = None
    in_flight: str = "wait"
    save_timeout: float = 600.0
    snapshot_timeout: float = 300.0
    overlap: bool = False
    persist_nice: int | None = 10
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    save_interval_steps: int | None = None
    save_interval: str | None = None
    mtbf_hours: float | None = None
    save_interval_min_steps: int = 1
    save_interval_max_steps: int | None = None
    nonfinite: str = "allow"
    check_replicas: bool | str = "auto"

    def __post_init__(self) -> None:
        """Every argument checked when given, naming it (:mod:`ckptlib.engine.options`)."""
        argcheck.positive_int("keep_last", self.keep_last, optional=True)
        argcheck.positive_int("keep_every", self.keep_every, optional=True)
        argcheck.flag("async_save", self.async_save)
        argcheck.compression(self.compression)
        argcheck.one_of("in_flight", self.in_flight, ("wait", "skip"))
        argcheck.positive_number("save_timeout", self.save_timeout)
        argcheck.positive_number("snapshot_timeout", self.snapshot_timeout)
        argcheck.flag("overlap", self.overlap)
        argcheck.optional_int("persist_nice", self.persist_nice)
        retention.decide([], self.keep_last, self.keep_every)  # validates the policy
        retention.check_best(self.keep_best, self.best_metric, self.best_mode)
        self.schedule()  # validates the saving decisions
        argcheck.one_of("nonfinite", self.nonfinite, ("allow", "refuse"))
        argcheck.one_of("check_replicas", self.check_replicas, (True, False, "auto"))

    def schedule(self) -> SaveSchedule | None:
        """The ``should_save`` policy these options ask for (None: should_save not enabled)."""
        n, auto = self.save_interval_steps, self.save_interval
        if n is not None and (type(n) is not int or n < 1):
            raise ValueError(f"save_interval_steps must be an int >= 1, got {n!r}")
        if auto is not None and auto != "auto":
            raise ValueError(f"save_interval must be None or 'auto', got {auto!r}")
        if n is not None and auto is not None:
            raise ValueError("pass save_interval_steps=N or save_interval='auto', not both")
        if auto is None:
            if self.mtbf_hours is not None:
                raise ValueError("mtbf_hours is used only with save_interval='auto'")
            check_bounds(self.save_interval_min_steps, self.save_interval_max_steps)
            return None if n is None else SaveSchedule(every=n)
        if self.mtbf_hours is None:
            raise ValueError("save_interval='auto' needs mtbf_hours= (the job's mean time "
                             "between failures, in hours)")
        return SaveSchedule(estimator=IntervalEstimator(
            check_positive("mtbf_hours", self.mtbf_hours) * HOUR, min_steps=self.save_interval_min_steps,
            max_steps=self.save_interval_max_steps,
        ))


class CheckpointManager:
    """Save steps under one root folder and resume from the newest consistent one.

    The async options (``in_flight``, ``staging_budget``, ``overlap``, ``save_timeout``,
    ``snapshot_timeout``, ``persist_nice``) are described in docs/async.md.
    ``keep_best=k`` also keeps the k best committed steps by ``metrics[best_metric]`` given to
    :meth:`save` (``best_mode`` "min" or "max"; a step without the metric ranks worst); the
    newest committed step is always kept (docs/training.md).

    Saving decisions (:meth:`should_save`, docs/scale.md): ``save_interval_steps=N`` saves at
    multiples of N; ``save_interval="auto"`` with ``mtbf_hours=`` (the job's mean time between
    failures) applies Young/Daly to the measured stall and time to durable of recent saves and
    the measured step time, re-evaluated at every save and clamped to
    ``[save_interval_min_steps, save_interval_max_steps]``; the first two saves come
    ``save_interval_min_steps`` apart (they measure the cost).
    The tier options (``local``, ``local_keep_last``, ``replicas``, ``replica_jump``,
    ``persist_every``, ``drain_rate``) are described in docs/tiers.md. Checked before trusted
    (docs/tiers.md, :mod:`ckptlib.engine.checks`): ``nonfinite="refuse"`` fails a save whose
    floating-point tensors hold NaN or Inf (:class:`NonFiniteError`); ``check_replicas`` (True,
    "auto", False) compares the copies of replicated tensors (:class:`ReplicaMismatchError`).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = True,
        compression: str | None = None,
        storage_options: dict[str, Any] | None = None,
        in_flight: str = "wait",
        save_timeout: float = 600.0,
        coordinator: Coordinator | None = None,
        overlap: bool = False,
        staging_budget: int | None = None,
        snapshot_timeout: float = 300.0,
        persist_nice: int | None = 10,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        save_interval_steps: int | None = None,
        save_interval: str | None = None,
        mtbf_hours: float | None = None,
        save_interval_min_steps: int = 1,
        save_interval_max_steps: int | None = None,
        local: str | os.PathLike[str] | None = None,
        local_keep_last: int = 2,
        replicas: int = 1,
        persist_every: int = 1,
        replica_jump: int = 1,
        drain_rate: float | None = None,
        nonfinite: str = "allow",
        check_replicas: bool | str = "auto",
    ) -> None:
        self.options = ManagerOptions(
            keep_last=keep_last, keep_every=keep_every, async_save=async_save, compression=compression,
            in_flight=in_flight, save_timeout=save_timeout, snapshot_timeout=snapshot_timeout,
            overlap=overlap, persist_nice=persist_nice,
            keep_best=keep_best, best_metric=best_metric, best_mode=best_mode,
            save_interval_steps=save_interval_steps,
            save_interval=save_interval, mtbf_hours=mtbf_hours,
            save_interval_min_steps=save_interval_min_steps,
            save_interval_max_steps=save_interval_max_steps, nonfinite=nonfinite, check_replicas=check_replicas,
        )
        self._schedule = self.options.schedule()
        self._last_handle: SaveHandle | None = None
        self._last_saved: int | None = None  # the newest step this process saw commit (persist thread)
        # Steps this manager's restore found damaged (every rank alike): their next save replaces them.
        self._replace: set[int] = set()
        self._agreed_interval, self._overlap_seen = 0, 0.0
        self._queued_s = 0.0  # how long the current save() waited for the previous one
        self.url = os.fspath(url)
        self.storage: Storage = open_storage(self.url, storage_options)
        self.coordinator = coordinator or default_coordinator()
        self._stager = Stager(staging_budget)
        self._handles: list[SaveHandle] = []
        self._worker = PersistWorker(self.options.persist_nice)  # runs async saves; started by the first
        self._overlap = SnapshotGate(snapshot_timeout)
        self._active_ids: set[str] = set()
        self._settled: dict[str, str] = {}  # object stores: clean committed steps (retire.find_debris)
        self._closed = False
        self._root_ready = False
        self._final: FinalCheckpoint | None = None
        self._pid = os.getpid()  # a forked child's copy leaves the saves, drains and files to this process
        self._finalizer = weakref.finalize(self, persist_worker.drain, self._handles, self._pid)
        # At interpreter exit an in-flight save must end (commit, or fail on a verdict) while the
        # write's thread pools take work and the coordination threads still run: drained from
        # threading's exit hooks, before concurrent.futures' and every atexit handler
        # (ckptlib.engine.persist_worker.drain_at_exit).
        self._finalizer.atexit = False
        persist_worker.drain_at_exit(self._finalizer)
        self._init_tiers(local, local_keep_last, replicas, persist_every, replica_jump, drain_rate)

    def _init_tiers(self, local: str | os.PathLike[str] | None, keep_last: int, replicas: int, persist_every: int,
                    jump: int, rate: float | None) -> None:
        """The local tier and its drain (docs/tiers.md); nothing without ``local``. Training
        thread, every rank (the drain's coordinator is made collectively)."""
        self._tier: tier_local.LocalTier | None = None
        self._drainer: Drainer | None = None
        self._saves = 0
        self._persist_next = False
        if local is None:
            given = {name: value for name, value, default in (
                ("local_keep_last", keep_last, 2), ("replicas", replicas, 1), ("persist_every", persist_every, 1),
                ("replica_jump", jump, 1), ("drain_rate", rate, None)) if value != default}
            if given:  # a tier setting with no tier would be silently ignored
                named = ", ".join(f"{k}={v!r}" for k, v in given.items())
                raise ValueError(f"{named}: these set the node-local tier, and there is none; pass local= "
                                 "(a node-local folder, docs/tiers.md) or leave them out")
            return
        for name, value, low in (("local_keep_last", keep_last, 1), ("replicas", replicas, 0),
                                 ("replica_jump", jump, 1), ("persist_every", persist_every, 1)):
            argcheck.int_at_least(name, value, low)  # before the local tier's folder is opened
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf):
            raise ValueError(f"drain_rate must be None (no limit) or a finite number of bytes/s > 0, got {rate!r}")
        self._persist_every = persist_every
        node = node_index()
        self._tier = tier_local.LocalTier(open_storage(local_root(os.fspath(local), node)), node, replicas, jump,
                                          keep_last)
        self._tier.check_apart(self.storage)
        if isinstance(self._tier.storage, PosixStorage) and self._tier.storage.memory:  # one copy per save
            self._stager.ring = Ring(self._tier.storage.root, self.coordinator.rank, keep_last + 2)
        nice = self.options.persist_nice
        self._drainer = Drainer(self._tier, self.storage, drain_coordinator(self.coordinator),
                                timeout=self.options.save_timeout, rate=rate,
                                on_start=lambda: lower_priority(nice))
        if self.coordinator.is_coordinator:
            self._drainer.after = self._after_drain

    # ------------------------------------------------------------------ saving
    def save(
        self, step: int, state: Any, *, metadata: Any = None, metrics: dict[str, float] | None = None,
        persist: bool | None = None,
    ) -> SaveHandle:
        """Save ``state`` as ``step``. Training thread. Async (default): returns once the
        snapshot is safe; persist and commit run on a background thread, reported by the handle.
        ``metrics``: a flat dict of str -> finite float stored in the manifest (``keep_best``).
        With a local tier, ``persist`` forces (True) or skips (False) the drain of this step to
        ``url``; None follows ``persist_every`` (preemption saves are always drained)."""
        self._check_process(f"save({step})")
        if self._closed:
            raise CheckpointError(f"save({step}): this CheckpointManager is closed (close() ran, or its with block "
                                  "ended); nothing was saved. Save before closing, or open a new manager")
        if type(step) is not int or not 0 <= step <= layout.MAX_STEP:
            raise ValueError(f"step must be an int from 0 to {layout.MAX_STEP}, got {step!r}")
        metrics = check_metrics(metrics)
        final = self._final
        self._persist_next = self._wants_drain(persist)
        if final is not None:
            final.busy = True  # a save_in_handler signal now waits until this call returns
        outer, self._stager.saver = self._stager.saver, threading.get_ident()  # a handler's close()/wait() refuse
        try:
            handle = self._scheduled(step, time.monotonic(), self._save(step, state, metadata, metrics))
        finally:
            self._stager.saver = outer
            if final is not None:
                final.busy = False
        if final is not None:
            final.after_save(self)
        return handle

    def _check_process(self, what: str) -> None:
        """Caller's thread, first in each method using this manager's threads, tier, staging or
        coordinator: refuse in a process forked from its builder's (docs/async.md, Fork)."""
        if os.getpid() != self._pid:
            raise CheckpointError(f"{what}: this CheckpointManager was built by process {self._pid}, which this one "
                                  "was forked from: its threads, drains, staging and coordinator are that process's. "
                                  "Build a new CheckpointManager in this process (close() here is harmless)")

    def should_save(self, step: int) -> bool:
        """True when ``step`` is due for a save (``save_interval_steps`` or ``"auto"``). Training
        thread, once per step on every rank; in auto mode the time between calls is the
        measured step time. Every rank gets the same answer for the same steps."""
        if self._schedule is None:
            raise ValueError("should_save needs CheckpointManager(save_interval_steps=N) or "
                             "save_interval='auto' with mtbf_hours=")
        layout.step_dir(step)  # an int from 0 up, as save() takes (TypeError/ValueError naming it)
        waited = self._overlap.wait_seconds
        self._schedule.add_stall(waited - self._overlap_seen)
        self._overlap_seen = waited
        return self._schedule.should_save(step)

    def _scheduled(self, step: int, start: float, handle: SaveHandle) -> SaveHandle:
        if self._schedule is not None and not handle.skipped:
            self._last_handle = handle
            began = start + self._queued_s  # when the save itself started
            self._schedule.saved(step, self._agreed_interval, began, max(0.0, time.monotonic() - began),
                                 queued_s=self._queued_s)
        self._queued_s = 0.0
        return handle

    def _agree_interval(self) -> None:
        """Auto interval: before a save, with no save in flight (the previous one finished),
        so this collective never runs beside the persist thread's. Every rank adopts the
        coordinator's proposal, made from its measurements."""
        if self._schedule is None or self._schedule.estimator is None:
            return
        prev = self._last_handle
        proposal = self._schedule.begin_save(None if prev is None else prev._durable_at)
        coord = self.coordinator
        with coord.session("interval", coord.deadline(self.options.save_timeout)) as s:  # a late rank is waited for
            agreed = s.share({"save_interval_steps": proposal})
        self._agreed_interval = int(agreed["save_interval_steps"])

    def _save(self, step: int, state: Any, metadata: Any, metrics: dict[str, float] | None = None) -> SaveHandle:
        self._overlap.finish()
        self._raise_pending()
        handle = SaveHandle(step, self.options.save_timeout)
        if self._tier is not None:
            handle._tiered = True
            if self._persist_next:
                handle._drain = DrainTicket(step)
        if self._worker.busy():
            if self.options.in_flight == "skip":
                warnings.warn(
                    f"ckptlib: skipping save of step {step}: the previous save is still persisting",
                    RuntimeWarning,
                    stacklevel=3,
                )
                handle.skipped = True
                if handle._drain is not None:
                    handle._drain.cancel(CheckpointError(f"step {step} was skipped, so not drained"))
                handle._finish()
                return handle
            waited = time.monotonic()
            self._join_thread()
            self._queued_s = time.monotonic() - waited  # not the save's own stall (docs/scale.md)
            self._raise_pending()
        self._agree_interval()
        coord = self.coordinator
        flat = save_flow.prepare(state, coord.rank, metadata=metadata, collective=coord.world_size > 1)
        crashpoints.point("snapshot", self.coordinator.rank)
        self._ensure_root()
        save_id = save_flow.new_save_id()
        created = time.time()
        if not self.options.async_save or flat.error is not None:
            # A state this rank cannot save fails the save on every rank now, and raises here.
            self._handles.append(handle)
            self._persist(handle, flat, step, metadata, save_id, created, metrics)
            self._raise_pending()
            return handle

        deadline = time.monotonic() + self.options.snapshot_timeout
        deferred = deferred_mask(state, flat) if self.options.overlap else None
        direct = self._tier is not None and (self.coordinator.world_size == 1 or
                                             not any(it.replicated for it in flat.items))  # all written here
        snap = self._stager.begin(flat, deferred, direct)
        handle._snapshot = snap
        self._handles.append(handle)
        self._active_ids.add(save_id)
        # Its sessions meet in this save's place among the flows on its coordinator (coord/turns.py).
        turn = self.coordinator.turn(f"save of step {step}")  # a weak ref: a job never run ends it when dropped
        handle._turn = weakref.ref(turn)
        self._worker.submit(in_turn(turn, self._persist),
                            (handle, snap, step, metadata, save_id, created, metrics), f"ckptlib-save-{step}")
        sync_upto = snap.sync_rounds if self.options.overlap else snap.nrounds
        try:
            snap.stage(sync_upto, deadline)
        except SnapshotAborted:
            pass  # the persist thread failed first; its error reaches the handle
        except BaseException as e:
            # Raised here, on the caller's thread: the handle must not raise it again.
            snap.fail(e)
            self._join_thread()
            handle._take_error()
            self._handles.remove(handle)
            raise
        if not snap.staged_done():
            self._overlap.start(snap, deadline, step)
        return handle

    def _ensure_root(self) -> None:
        if not self._root_ready:  # every rank, first save: never a run inside another run's step
            # With tiers the drain makes the persistent root: a persistent tier that is down is not waited for.
            refuse_run_inside_checkpoint(self.storage, patient=self._tier is None)
            if self._tier is None:
                self.storage.makedirs("")
            self._root_ready = True

    def _persist(
        self, handle: SaveHandle, source: FlatState | Snapshot, step: int, metadata: Any, save_id: str, created: float,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Persist and commit: the live state (``FlatState``, synchronous save, caller's thread)
        or, on the persist thread, a :class:`Snapshot`'s staged copies as they become ready.

        A failed snapshot still goes through ``persist`` (its rounds raise), so every rank
        learns of the failure through the commit protocol and nothing is committed.
        """
        error: BaseException | None = None
        snap = source if isinstance(source, Snapshot) else None
        flat = source.staged if isinstance(source, Snapshot) else source
        rounds: Iterable[list[TensorItem]] | None = None
        try:
            if snap is not None:
                deadline = time.monotonic() + self.options.save_timeout
                if snap.streaming:
                    rounds = snap.rounds(deadline)
                else:
                    snap.wait_staged(deadline)
                    rounds = None if snap.error is None else failed_rounds(snap.error)
            replace = step in self._replace  # a step restore() found damaged is not a step to keep
            if replace:
                log.info("ckptlib: step %d was found damaged by restore(); this save replaces it", step)
            opts = save_flow.SaveOptions(self.options.compression, timeout=self.options.save_timeout,
                                         nonfinite=self.options.nonfinite, check_replicas=self.options.check_replicas,
                                         overwrite=replace)
            if self._tier is not None:
                tier_local.save_local(
                    self._tier, layout.step_dir(step), flat, step=step, metadata=metadata, options=opts,
                    coordinator=self.coordinator, save_id=save_id, created=created, rounds=rounds, metrics=metrics,
                    arena=None if snap is None else snap.arena,
                )
                self._after_local_commit(handle, save_id)
            else:
                save_flow.persist(
                    self.storage, layout.step_dir(step), flat, step=step, metadata=metadata, options=opts,
                    coordinator=self.coordinator, save_id=save_id, created=created, rounds=rounds, metrics=metrics,
                )
                if self.coordinator.is_coordinator:
                    self._after_commit(save_id, step)
            self._last_saved = step
            self._replace.discard(step)
        except Exception as e:
            error = e
            note_relaunch(e, f"step {step} was not saved",
                          "the newest committed step (this process committed none)" if self._last_saved is None
                          else f"step {self._last_saved}, the newest step this process saw committed")
            if handle._drain is not None and not handle._drain.done():
                handle._drain.cancel(CheckpointError(f"step {step} was not drained: its save failed"))
        finally:
            if snap is not None:
                snap.writer_finished()
            self._active_ids.discard(save_id)
            handle._finish(error)

    def _after_commit(self, save_id: str, step: int | None = None) -> None:
        """Retention and cleanup (``step``: just committed, kept); failures are logged, never raised."""
        try:
            crashpoints.point("cleanup")
            retire.clean_debris(self.storage, self._active_ids | {save_id}, settled=self._settled)
            o = self.options
            retire.apply_retention(self.storage, o.keep_last, o.keep_every, keep_best=o.keep_best,
                                   best_metric=o.best_metric, best_mode=o.best_mode, just_saved=step)
        except Exception as e:
            log.warning("ckptlib: retention/cleanup failed (will retry after the next save): %s", e)

    # ------------------------------------------------------------------ tiers
    def _wants_drain(self, persist: bool | None) -> bool:
        """Training thread, once per save call: is this save to be drained to ``url``?"""
        if self._tier is None:
            return False
        self._saves += 1
        if persist is not None:
            return bool(persist)
        return self.preempted or self._saves % self._persist_every == 0

    def _after_local_commit(self, handle: SaveHandle, save_id: str) -> None:
        """Persist thread, every rank, after a local commit: queue the drain, then (node
        leaders) local debris and retention, sparing steps whose drain is pending."""
        assert self._tier is not None and self._drainer is not None
        self._drainer.committed_locally(handle.step, handle._drain)  # queues the drain, if any
        topo = self._tier.topology
        if topo is not None and topo.is_leader(self.coordinator.rank):
            protect = self._drainer.pending_steps() | {handle.step}  # the step just saved: a rollback's too
            tier_local.after_local_commit(self._tier, self._active_ids | {save_id}, protect, self.coordinator.rank)

    def _after_drain(self, step: int) -> None:
        """Drain thread, coordinator, after ``step`` was committed on the persistent tier."""
        self._after_commit("", step)

    # ------------------------------------------------------------------ overlap mode
    def wait_for_snapshot(self, timeout: float | None = None) -> None:
        """Block until the in-flight snapshot has copied the state. Training thread.

        Optimizer step pre-hooks call this in overlap mode; call it before mutating parameters
        or optimizer state any other way. A copy that misses ``timeout`` (default: the snapshot
        deadline) abandons its save, which then fails (raised by the handle, not here).
        """
        self._check_process("wait_for_snapshot()")
        self._overlap.release(timeout)

    @property
    def snapshot_wait_seconds(self) -> float:
        """Seconds the training thread spent waiting for overlap-mode snapshots (all saves)."""
        return self._overlap.wait_seconds

    # ------------------------------------------------------------------ waiting
    def _join_thread(self, timeout: float | None = None) -> None:
        self._worker.join(self.options.save_timeout + 30.0 if timeout is None else timeout)

    def _raise_pending(self) -> None:
        for h in list(self._handles):
            if h.done():
                self._handles.remove(h)
                err = h._take_error()
                if err is not None:
                    raise err
        if self._drainer is not None:
            for t in list(self._drainer.tickets):
                if t.done():
                    self._drainer.tickets.remove(t)
                    err = t.take_error()
                    if err is not None:
                        raise err

    def wait(self, timeout: float | None = None) -> None:
        """Wait for all pending saves; raise the first failure not yet raised."""
        self._check_process("wait()")
        self._stager.check_caller("wait()")
        check_waiter([h._turn() for h in self._handles if not h.done()], "wait()")  # coord/turns.py
        self._overlap.finish()
        self._join_thread(timeout)
        self._raise_pending()

    def close(self, timeout: float | None = None, *, drain: bool = True) -> None:
        """Wait for pending saves (a save in flight commits), then release staging memory
        and threads, and restore signal handlers. Also via ``with``. With a local tier,
        ``drain=True`` also waits for pending drains (``False``: they are abandoned; the steps
        stay local) and raises a drain failure not yet raised."""
        if os.getpid() != self._pid:  # a forked child saves nothing through it: the parent's saves are not its own
            self._closed = True
            return
        if self._closed:
            return
        self._stager.check_caller("close()")
        check_waiter([h._turn() for h in self._handles if not h.done()], "close()")  # the manager stays open
        try:
            self.wait(timeout)
            if self._drainer is not None and drain:
                limit = self.options.save_timeout + 30.0 if timeout is None else timeout
                for t in list(self._drainer.tickets):
                    t.wait(limit)
                self._drainer.stop(limit)  # then local retention once more (drains pending no more)
                self._raise_pending()
        except BaseException as e:
            if not isinstance(e, Exception) and self._worker.busy():
                # Ctrl-C (or SystemExit) while a save is in flight: the manager stays open, so that
                # close() again, or the interpreter-exit drain, lets that save commit and reports it.
                raise
            self._release()
            raise
        self._release()

    def _release(self) -> None:
        """:meth:`close`, after waiting: mark the manager closed and free what it holds (a
        staging arena a stuck writer still reads is kept), restore signal handlers."""
        self._closed = True
        if self._drainer is not None:
            self._drainer.abandon()  # drain=False or a failed close: no drain thread outlives close
        stuck = self._worker.busy()
        self._worker.stop(0.0 if stuck else 5.0)  # idle: it ends at once
        if not stuck:
            self._stager.release()  # never free memory a stuck writer still reads
            if self._tier is not None:
                self._tier.storage.release_spares()  # a memory tier's recycled pages
        self._finalizer.detach()
        persist_worker.forget_at_exit(self._finalizer)
        if self._final is not None:
            self._final.watcher.uninstall()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ preemption
    def save_on_signal(
        self,
        state_fn: Callable[[], tuple[int, Any]] | None = None,
        *,
        signals: Iterable[int] = (signal.SIGTERM,),
        deadline: float = 60.0,
        save_in_handler: bool = False,
        exit_code: int = 0,
        failure_exit_code: int = FAILURE_EXIT_CODE,
    ) -> None:
        """Checkpoint and exit when one of ``signals`` arrives. Main thread.

        The handler records the request; the loop calls :meth:`maybe_save_on_preemption` once
        per step. With ``save_in_handler=True`` the handler itself saves ``state_fn()`` (a
        ``(step, state)`` pair) and exits (:mod:`ckptlib.engine.preemption`). Exit code:
        ``exit_code`` once committed, else ``failure_exit_code``, also from a watchdog
        ``deadline`` seconds after the signal.
        """
        self._check_process("save_on_signal()")
        if save_in_handler and state_fn is None:
            raise ValueError("save_in_handler=True needs a state_fn returning (step, state)")
        if self._final is not None:
            self._final.watcher.uninstall()
        watcher = PreemptionWatcher(signals, deadline, failure_exit_code=failure_exit_code)
        final = FinalCheckpoint(watcher, state_fn, exit_code)
        if save_in_handler:
            watcher.on_signal = lambda signum: final.on_signal(self)
        watcher.install()
        self._final = final

    @property
    def preempted(self) -> bool:
        """True once a signal registered with :meth:`save_on_signal` arrived."""
        return self._final is not None and self._final.watcher.requested

    def maybe_save_on_preemption(self, step: int | None = None, state: Any = None) -> bool:
        """Training thread, once per step: False when no signal arrived; otherwise save
        ``(step, state)`` (or ``state_fn()``), wait for the commit, close, raise ``SystemExit``."""
        return self._final is not None and self._final.poll(self, step, state)

    # ------------------------------------------------------------------ inspecting
    def steps(self, *, deep: bool = False) -> list[StepInfo]:
        """Every step under the root, oldest first, with status and reason."""
        self._check_process("steps()")
        try:
            infos = scan(self.storage, deep=deep)
        except CheckpointNotFoundError:
            infos = []
        if self._tier is not None:
            assert self._drainer is not None
            infos = tier_restore.step_infos(self._tier, infos, self._drainer.history)
        return sorted(infos, key=lambda i: (i.step, i.status == "committed"))

    def latest_step(self) -> int | None:
        """The newest committed step (quick check: manifest and sizes), or None."""
        self._check_process("latest_step()")
        if self._tier is None:  # newest first, stopping at the first committed step
            return newest_committed(self.storage)
        return tier_restore.newest_step(self._tier, self.storage)

    # ------------------------------------------------------------------ restoring
    @overload
    def restore(
        self, state: Any, *, step: int | None = ..., verify: bool = ..., per_rank: str = ...,
        strict: Literal[True] = ...,
    ) -> int | None: ...

    @overload
    def restore(
        self, state: Any, *, step: int | None = ..., verify: bool = ..., per_rank: str = ...,
        strict: bool,
    ) -> int | LoadResult | None: ...

    def restore(
        self, state: Any, *, step: int | None = None, verify: bool = True, per_rank: str = "error",
        strict: bool = True,
    ) -> int | LoadResult | None:
        """Load the newest usable step into ``state`` in place; return it, or None if no step
        was ever committed. Corrupt steps are skipped; collective (:mod:`ckptlib.engine.resume`).
        ``per_rank``: policy for ``PerRank`` values of another world size (error, rank0, all).
        ``strict``: as ``ckptlib.load``; with ``strict=False`` a step restored is returned as a
        :class:`~ckptlib.engine.load.LoadResult` (``.step``, ``.missing``, ``.unexpected``)."""
        self._check_process("restore()")
        resume.check_target(state, strict, verify)
        if step is not None:
            layout.step_dir(step)  # an int from 0 up, as save() takes (TypeError/ValueError naming it)
        self.wait()
        keys: dict[str, list[str]] = {}
        corrupt: list[int] = []
        try:
            with FinalCheckpoint.holding(self._final):  # a save_in_handler signal waits until restore returns
                if self._tier is not None:
                    got = tier_restore.restore(
                        self._tier, self.storage, state, self.coordinator, step=step, verify=verify,
                        per_rank=per_rank, timeout=self.options.save_timeout, strict=strict, keys=keys,
                    )
                else:
                    got = resume.restore(
                        self.storage, state, self.coordinator, step=step, verify=verify, per_rank=per_rank,
                        timeout=self.options.save_timeout, strict=strict, keys=keys, corrupt=corrupt,
                    )
        except Exception as e:
            note_relaunch(e, "the restore did not finish", "the newest committed step")
            raise
        finally:
            self._replace.update(corrupt)
        if self._final is not None:
            self._final.after_restore(self, got)
        if self._schedule is not None and got is not None:
            self._schedule.resumed(got)
        if strict or got is None:
            return got
        return LoadResult(state, keys["missing"], keys["unexpected"], got)

