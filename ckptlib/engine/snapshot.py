"""Snapshots: a training-safe copy of every tensor, in reused staging memory.

- ``save()`` (training thread) calls :meth:`Stager.begin`, which plans where every tensor goes
  in the arena and returns this save's :class:`Snapshot`.
- :meth:`Snapshot.stage` copies rounds of tensors: on the training thread what must be copied
  before ``save()`` returns, on ``ckptlib-snapshot-<step>`` the rest in overlap mode.
- The persist thread reads :attr:`Snapshot.staged` after :meth:`Snapshot.wait_staged`, or one
  round at a time from :meth:`Snapshot.rounds` when the state streams through the budget.

Memory: one uint8 arena, reused by later saves (replaced only when the state outgrows it).
A state larger than the budget streams through two regions of ``budget // 2`` bytes: round
``k + 2`` waits until the writer finished round ``k`` (big tensors are cut into row slabs).
Copies: one ``torch._foreach_copy_`` per round; CUDA sources go through
:mod:`ckptlib.engine.staging_cuda` (pinned arena, side stream, event completion).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ckptlib.engine import hugepages, staging_cuda
from ckptlib.engine.gc_pause import paused_gc
from ckptlib.engine.mapped_arena import Arena, Ring
from ckptlib.errors import CheckpointError, CommitTimeoutError
from ckptlib.plan.flatten import FlatState, TensorItem

ALIGN = 64


class SnapshotAborted(CheckpointError):
    """The snapshot (or the save it belongs to) was abandoned; nothing will be committed."""


@dataclass(slots=True)
class _Piece:
    item: int
    """Index of the source item in ``FlatState.items``."""
    rows: tuple[int, int] | None
    """Row range of the source tensor for a slab; None for the whole tensor."""
    offset: int
    """Byte offset in the arena."""
    nbytes: int


@dataclass(slots=True)
class _Plan:
    rounds: list[list[_Piece]]
    sync_rounds: int
    """Rounds holding the items that must be staged before ``save()`` returns."""
    arena_bytes: int
    streaming: bool
    pinned: bool
    dsts: list[list[torch.Tensor]]
    """Per round: the arena views the pieces are copied into (filled by ``Stager``)."""
    staged: list[list[TensorItem]]
    """Per round: the items the writer reads (arena views with the pieces' offsets)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Stager:
    """Owns the staging arena of one manager. Used from one save at a time.

    ``budget``: the most bytes of staging memory to hold (None: as much as the state needs).
    """

    def __init__(self, budget: int | None = None) -> None:
        if budget is not None and budget < 2 * ALIGN:
            raise ValueError("staging budget must be at least 128 bytes")
        self.budget = budget
        self._arena: torch.Tensor | None = None
        self._plan_key: tuple | None = None
        self._plan: _Plan | None = None
        self.ring: Ring | None = None
        """A memory tier's mapped arenas (set by the manager; ckptlib/engine/mapped_arena.py)."""
        self._sized: tuple[tuple | None, bool, int] = (None, False, 0)
        """(plan key, mappable, arena bytes) of the last plan asked for a mapped arena."""
        self.current: Snapshot | None = None
        """The last snapshot begun (:meth:`check_caller`)."""
        self.saver: int | None = None
        """The thread inside ``CheckpointManager.save`` (ident; set by it), if any (:meth:`check_caller`)."""

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory currently held (mapped arenas not adopted by a step included)."""
        return (0 if self._arena is None else self._arena.numel()) + (0 if self.ring is None else self.ring.held)

    def release(self) -> None:
        """Drop the arena (``close()``). A later save allocates a new one."""
        self._arena = self._plan = self._plan_key = self.current = None
        if self.ring is not None:
            self.ring.release()

    def check_caller(self, what: str) -> None:
        """``wait()``/``close()``, first thing, on any thread: refuse at once to wait for a
        save that the calling thread is inside itself (a signal handler that interrupted
        ``save()``). During the copy that wait held the copy it waited for until
        ``snapshot_timeout`` (300 s), and then the save failed ("timed out waiting for the
        snapshot"); earlier (flattening, planning; a synchronous save's write) ``close()``
        closed the manager under the save, which went on on a persist thread nothing stopped."""
        me = threading.get_ident()
        snap = self.current
        if snap is not None and snap.copier == me:
            doing = "copying the state"
        elif self.saver == me:
            doing = "flattening, planning or writing the state"
        else:
            return
        raise CheckpointError(f"{what} was called on the thread that is inside save(), {doing} (a signal "
                              "handler?): it would wait for that save, which waits for it. Call it after save() "
                              "returns; on SIGTERM use save_on_signal() (docs/async.md, Preemption)")

    # ------------------------------------------------------------------ planning
    def begin(self, flat: FlatState, deferred: Sequence[bool] | None = None, direct: bool = False) -> Snapshot:
        """Plan this save's staging and return its :class:`Snapshot` (nothing copied yet;
        training thread). ``deferred[i]``: staged after ``save()`` returns (overlap mode).
        ``direct``: the save may adopt its staging memory as its payload file (a memory tier,
        this rank writing all it stages): staged in a mapped arena of :attr:`ring` when the
        state is on the CPU and fits the budget (:attr:`Snapshot.arena`), else as usual."""
        items = flat.items
        defer = list(deferred) if deferred is not None else [False] * len(items)
        with paused_gc():  # a few objects per tensor: see engine/gc_pause.py
            key = (
                self.budget,
                [
                    (it.name, t.shape, t.dtype, t.device, it.global_shape, it.global_offset, it.replicated, d)
                    for it, d in zip(items, defer, strict=True)
                    for t in (it.tensor,)
                ],
            )
            arena = self._mapped(key, items, defer) if direct and self.ring is not None else None
            if arena is not None:
                if arena.plan is None or arena.plan[0] != key:  # its first use with this layout
                    arena.plan = None
                    fresh = self._make_plan(items, defer)
                    self._attach(fresh, items, arena.tensor)
                    arena.plan = (key, fresh)
                plan = arena.plan[1]
                self._arena = self._plan = self._plan_key = None  # no ordinary arena beside it
            else:
                if key != self._plan_key or self._plan is None:
                    self._plan = None  # let a replaced arena go before allocating a new one
                    plan = self._make_plan(items, defer)
                    self._attach(plan, items, self._ordinary(plan))
                    self._plan, self._plan_key = plan, key
                plan = self._plan
            srcs: list[list[torch.Tensor]] = []
            for rnd in plan.rounds:
                row: list[torch.Tensor] = []
                for p in rnd:
                    t = items[p.item].tensor
                    row.append(t if p.rows is None else t[p.rows[0] : p.rows[1]])
                srcs.append(row)
        staged_items = [it for rnd in plan.staged for it in rnd]
        if plan.streaming:
            staged_flat = FlatState(flat.tree, items, flat.per_rank)  # only shapes/names are read from it
        else:
            staged_flat = FlatState(flat.tree, staged_items, flat.per_rank)
        snap = Snapshot(plan, srcs, staged_flat)
        self.current = snap
        snap.arena = arena
        if plan.pinned:
            devices = sorted({it.tensor.device for it in items if it.tensor.device.type == "cuda"}, key=str)
            snap.ready = staging_cuda.mark_ready(devices)
        return snap

    def _make_plan(self, items: list[TensorItem], defer: list[bool]) -> _Plan:
        sizes = [_aligned(it.tensor.numel() * it.tensor.element_size()) for it in items]
        total = sum(sizes)
        pinned = any(it.tensor.device.type == "cuda" for it in items)
        groups = [[i for i, d in enumerate(defer) if not d], [i for i, d in enumerate(defer) if d]]
        rounds: list[list[_Piece]] = []
        if self.budget is None or total <= self.budget:
            off = 0
            sync_rounds = 0
            for g, members in enumerate(groups):
                rnd = []
                for i in members:
                    rnd.append(_Piece(i, None, off, sizes[i]))
                    off += sizes[i]
                if rnd:
                    rounds.append(rnd)
                    if g == 0:
                        sync_rounds += 1
            return _Plan(rounds, sync_rounds, total, False, pinned, [], [])
        region = self.budget // 2 // ALIGN * ALIGN
        sync_rounds = 0
        for g, members in enumerate(groups):
            cur: list[_Piece] = []
            fill = 0
            for i in members:
                for rows, nbytes in _slabs(items[i].tensor, region):
                    if fill + nbytes > region and cur:
                        rounds.append(cur)
                        sync_rounds += g == 0
                        cur, fill = [], 0
                    cur.append(_Piece(i, rows, fill, nbytes))
                    fill += nbytes
            if cur:
                rounds.append(cur)
                sync_rounds += g == 0
        for k, rnd in enumerate(rounds):  # rounds alternate between the two regions
            for p in rnd:
                p.offset += (k % 2) * region
        return _Plan(rounds, sync_rounds, 2 * region, True, pinned, [], [])

    def _mapped(self, key: tuple, items: list[TensorItem], defer: list[bool]) -> Arena | None:
        """A mapped arena for this layout (None: pinned or streamed staging, or no room)."""
        assert self.ring is not None
        if self._sized[0] != key:
            p = self._make_plan(items, defer)
            self._sized = (key, not (p.pinned or p.streaming), p.arena_bytes)
        return self.ring.take(self._sized[2]) if self._sized[1] else None

    def _ordinary(self, plan: _Plan) -> torch.Tensor:
        """The ordinary arena, reused when big enough and of the right kind."""
        arena = self._arena
        if arena is None or arena.numel() < plan.arena_bytes or arena.is_pinned() != plan.pinned:
            self._arena = None
            arena = self._arena = _alloc(plan.arena_bytes, plan.pinned)
        return arena

    def _attach(self, plan: _Plan, items: list[TensorItem], arena: torch.Tensor) -> None:
        """Point the plan's pieces at views of ``arena``."""
        for rnd in plan.rounds:
            dsts: list[torch.Tensor] = []
            staged: list[TensorItem] = []
            for p in rnd:
                it = items[p.item]
                t = it.tensor
                if p.rows is None:
                    shape, goff = tuple(t.shape), it.global_offset
                else:
                    a, b = p.rows
                    shape = (b - a, *t.shape[1:])
                    goff = (it.global_offset[0] + a, *it.global_offset[1:])
                n = t.element_size()
                for s in shape:
                    n *= s
                view = arena[p.offset : p.offset + n].view(t.dtype).view(shape)
                dsts.append(view)
                staged.append(TensorItem(it.name, view, it.global_shape, goff, it.replicated, it.copies))
            plan.dsts.append(dsts)
            plan.staged.append(staged)


def _alloc(nbytes: int, pinned: bool) -> torch.Tensor:
    if pinned:
        return staging_cuda.alloc_pinned(nbytes)
    arena = torch.empty(nbytes, dtype=torch.uint8)
    hugepages.advise(arena)
    return arena


def _slabs(t: torch.Tensor, region: int) -> list[tuple[tuple[int, int] | None, int]]:
    """Cut ``t`` into row slabs that fit a region: ``[(rows or None, aligned bytes)]``."""
    nbytes = t.numel() * t.element_size()
    if _aligned(nbytes) <= region:
        return [(None, _aligned(nbytes))]
    row = nbytes // t.shape[0] if t.dim() and t.shape[0] else nbytes
    per = region // max(row, 1) if t.dim() else 0
    while per and _aligned(per * row) > region:
        per -= 1
    if per == 0:
        raise ValueError(
            f"staging budget too small: one row of a tensor of shape {tuple(t.shape)} is {row} "
            f"bytes; the budget must be at least {2 * _aligned(row)} bytes (two regions)"
        )
    rows = t.shape[0]
    return [((a, min(a + per, rows)), _aligned((min(a + per, rows) - a) * row)) for a in range(0, rows, per)]


class Snapshot:
    """The staging progress of one save, shared by the staging, persist and training threads
    (``_staged``/``_written``: rounds copied / finished by the writer). Waits take a deadline."""

    def __init__(self, plan: _Plan, srcs: list[list[torch.Tensor]], staged: FlatState) -> None:
        self._plan = plan
        self._srcs: list[list[torch.Tensor]] | None = srcs
        self.staged = staged
        """The state the writer reads when not streaming (arena views)."""
        self.streaming = plan.streaming
        self.nrounds = len(plan.rounds)
        self.sync_rounds = plan.sync_rounds
        self._cond = threading.Condition()
        self._staged = 0
        self._written = 0
        self._error: BaseException | None = None
        self._writer_done = False
        self.copy_seconds = 0.0
        self.arena: Arena | None = None
        """The mapped arena this snapshot lies in (:meth:`Stager.begin` with ``direct``), else None."""
        self.copier: int | None = None
        """The thread in :meth:`stage` (ident), if any (:meth:`Stager.check_caller`)."""
        self.ready: dict[torch.device, object] | None = None
        """CUDA only: per device, an event recorded on the training thread's stream in
        ``save()``; copies from any thread start after it."""

    # ------------------------------------------------------------------ staging side
    def stage(self, upto: int, deadline: float) -> None:
        """Copy rounds until ``upto`` are staged (training or snapshot thread). Raises
        :class:`SnapshotAborted` if the save was abandoned, :class:`CommitTimeoutError` if a
        region does not come free before ``deadline``."""
        plan = self._plan
        self.copier = threading.get_ident()
        try:
            for k in range(self._staged, min(upto, self.nrounds)):
                if self.streaming and k >= 2:
                    self._wait_for(functools.partial(self._round_written, k - 1), deadline,
                                   "the writer to free a region", True)
                elif self._error is not None:
                    raise SnapshotAborted(f"snapshot abandoned: {self._error}")
                assert self._srcs is not None
                t0 = time.perf_counter()
                copy_round(plan.dsts[k], self._srcs[k], deadline, self.ready)
                self.copy_seconds += time.perf_counter() - t0
                with self._cond:
                    self._staged = k + 1
                    if self._staged == self.nrounds:
                        self._srcs = None  # hold no references to the live state
                    self._cond.notify_all()
        finally:
            self.copier = None

    def fail(self, error: BaseException) -> None:
        """Abandon the snapshot: wake every waiter. Any thread; the first error wins."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._srcs = None
            self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def staged_done(self) -> bool:
        """True once every round is staged (or the snapshot was abandoned)."""
        return self._staged == self.nrounds or self._error is not None

    def wait_staged(self, deadline: float, upto: int | None = None) -> None:
        """Block until ``upto`` (default: all) rounds are staged or the snapshot failed (the
        save reports that failure). Raises :class:`CommitTimeoutError` at the deadline."""
        n = self.nrounds if upto is None else upto
        self._wait_for(lambda: self._staged >= n or self._error is not None, deadline, "the snapshot")

    # ------------------------------------------------------------------ writer side
    def rounds(self, deadline: float) -> Iterator[list[TensorItem]]:
        """Yield each round's staged items once staged (persist thread, streaming); resuming
        the generator means the writer has finished reading the previous round."""
        try:
            for k in range(self.nrounds):
                self._wait_for(functools.partial(self._round_staged, k), deadline, "the snapshot")
                if self._staged <= k:
                    raise SnapshotAborted(f"snapshot abandoned: {self._error}")
                yield self._plan.staged[k]
                with self._cond:
                    self._written = k + 1
                    self._cond.notify_all()
        finally:
            self.writer_finished()

    def writer_finished(self) -> None:
        """The persist thread is done with the arena (committed or failed). Any thread."""
        with self._cond:
            self._writer_done = True
            if self._staged < self.nrounds and self._error is None:
                self._error = SnapshotAborted("the save ended before its snapshot completed")
            self._cond.notify_all()

    # ------------------------------------------------------------------ helpers
    def _round_written(self, k: int) -> bool:
        return self._written >= k

    def _round_staged(self, k: int) -> bool:
        return self._staged > k or self._error is not None

    def _wait_for(
        self, ready: Callable[[], bool], deadline: float, what: str, abort: bool = False
    ) -> None:
        """Wait on the condition until ``ready()``; ``abort``: raise if the snapshot failed."""
        with self._cond:
            while not ready():
                if abort and self._error is not None:
                    raise SnapshotAborted(f"snapshot abandoned: {self._error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommitTimeoutError(f"timed out waiting for {what}")
                self._cond.wait(min(left, 1.0))


def copy_round(
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    deadline: float,
    ready: dict[torch.device, object] | None = None,
) -> None:
    """Copy ``srcs`` into ``dsts`` (host memory); CUDA sources: a side-stream copy per device,
    completed by polling its event until ``deadline``."""
    cpu_d: list[torch.Tensor] = []
    cpu_s: list[torch.Tensor] = []
    gpu: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    with paused_gc():
        for d, s in zip(dsts, srcs, strict=True):
            if s.is_cpu:
                cpu_d.append(d)
                cpu_s.append(s)
            else:
                pair = gpu.setdefault(s.device, ([], []))
                pair[0].append(d)
                pair[1].append(s)
    pending = [
        staging_cuda.copy_async(ds, ss, dev, (ready or {}).get(dev)) for dev, (ds, ss) in gpu.items()
    ]
    if cpu_d:
        copy_cpu(cpu_d, cpu_s)
    for p in pending:
        p.wait(deadline)


COPY_THREADS = max(1, min(2, os.cpu_count() or 1))
"""Threads for host copies. One ``_foreach_copy_`` runs each copy on one core here; two
threads, each with half the bytes, measured 1.7x faster on the 2-core machine."""
SPLIT_MIN_BYTES = 16 << 20
"""Below this many bytes a round is copied on the calling thread alone."""


def copy_cpu(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Host-to-host copy split by bytes over ``COPY_THREADS`` (the staging thread plus helper
    threads joined before returning). Tensors over half a share are sliced across the lanes;
    the others fill the lanes in order (no sort: cheap per tensor with many small tensors)."""
    with paused_gc():
        sizes = [s.nbytes for s in srcs]
    total = sum(sizes)
    if COPY_THREADS < 2 or total < SPLIT_MIN_BYTES:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
        return
    n = COPY_THREADS
    lanes: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(n)]
    big = total / n / 2
    with paused_gc():
        rest: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for d, s, nb in zip(dsts, srcs, sizes, strict=True):
            if nb > big and s.is_contiguous() and s.numel() >= n:
                fd, fs = d.view(-1), s.reshape(-1)
                step = (fd.numel() + n - 1) // n
                for k, a in enumerate(range(0, fd.numel(), step)):
                    lanes[k][0].append(fd[a : a + step])
                    lanes[k][1].append(fs[a : a + step])
            else:
                rest.append((d, s, nb))
        per_lane = sum(nb for _, _, nb in rest) / n
        lane, done = 0, 0
        for d, s, nb in rest:
            if done >= per_lane * (lane + 1) and lane < n - 1:
                lane += 1
            lanes[lane][0].append(d)
            lanes[lane][1].append(s)
            done += nb
    errors: list[BaseException] = []

    def run(lane: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        try:
            with torch.no_grad():
                torch._foreach_copy_(lane[0], lane[1])
        except BaseException as e:  # re-raised on the staging thread below
            errors.append(e)

    helpers = [
        threading.Thread(target=run, args=(lane,), name="ckptlib-copy", daemon=True)
        for lane in lanes[1:]
        if lane[0]
    ]
    for t in helpers:
        t.start()
    run(lanes[0])
    for t in helpers:
        t.join()  # a memory copy: bounded by bytes / memory bandwidth
    if errors:
        raise errors[0]


def failed_rounds(error: BaseException) -> Iterator[list[TensorItem]]:
    """Rounds of a save whose snapshot failed (the persist thread, ``CheckpointManager._persist``):
    raising inside ``persist`` fails the commit on every rank."""
    raise SnapshotAborted(f"snapshot failed: {type(error).__name__}: {error}") from error
    yield []  # pragma: no cover  (makes this a generator)
