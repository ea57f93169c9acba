"""The save flow: :class:`SaveSession`, the one implementation of a save, and its users.

Users: :func:`persist` (``CheckpointManager``, ``ckptlib.save``) and the DCP writer. Every rank
calls, in order, on one thread: :meth:`~SaveSession.begin` (collective: liveness session
opened, unless the caller's flow has one; save id agreed; staging opened by
:func:`ckptlib.engine.commit.begin`) -> :meth:`~SaveSession.write`
(local, any number of times) -> :meth:`~SaveSession.finish` (collective: :meth:`~SaveSession.collect`,
:meth:`~SaveSession.publish` on the coordinator, outcome shared). Every rank returns a
:class:`SaveResult` or raises the same :class:`CommitError`. DCP, which carries the outcome
itself, calls ``collect``, ``publish`` (coordinator), then ``close``; ``abort`` gives a save up.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ckptlib import crashpoints
from ckptlib.backends import Storage, deadline_scope
from ckptlib.coord.coordinator import Coordinator, LocalCoordinator, in_flow
from ckptlib.engine import commit, wire
from ckptlib.engine import options as argcheck
from ckptlib.engine.gc_pause import paused_gc
from ckptlib.engine.writer import ChunkJob, split_chunks, write_files, write_index
from ckptlib.errors import (
    CheckpointError,
    CommitError,
    CommitTimeoutError,
    StepExistsError,
    TargetNotEmptyError,
    UnsupportedValueError,
)
from ckptlib.format import jsonio
from ckptlib.format import manifest as mf
from ckptlib.format.build import build_body, encode_body
from ckptlib.format.dtypes import dtype_name
from ckptlib.plan.assign import PieceDesc, PlanError, assign, digest
from ckptlib.plan.flatten import FlatState, TensorItem, flatten
from ckptlib.plan.grid import conform, describe, propose
from ckptlib.plan.trees import TreeMismatch
from ckptlib.plan.trees import join as join_trees
from ckptlib.plan.trees import merge as merge_trees
from ckptlib.plan.trees import split as split_tree

DEFAULT_CHUNK_BYTES = 32 << 20
FENCE_SECONDS = 60.0
"""Storage time a rank that gave up on the coordinator may spend placing the fence, even past
the session's deadline (a fence cut short could let a late coordinator commit)."""


@dataclass(slots=True)
class SaveOptions:
    compression: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    num_files: int = 2
    timeout: float = 600.0
    overwrite: bool = False
    format_version: int | None = None
    """Manifest format :func:`persist` writes: 2 (piece index files per rank), 1, or None: 2 when
    several ranks save, else 1 (env ``CKPTLIB_FORMAT_VERSION`` overrides None)."""

    def __post_init__(self) -> None:
        """Every argument checked now, before any I/O (:mod:`ckptlib.engine.options`)."""
        argcheck.compression(self.compression)
        argcheck.positive_int("chunk_bytes", self.chunk_bytes)
        argcheck.positive_int("num_files", self.num_files)
        argcheck.positive_number("timeout", self.timeout)
        argcheck.flag("overwrite", self.overwrite)
        if self.format_version not in (None, 1, 2):
            raise ValueError(f"format_version must be 1, 2 or None, not {self.format_version!r}")

    def writes_v2(self, world_size: int) -> bool:
        version = self.format_version or int(os.environ.get("CKPTLIB_FORMAT_VERSION") or 0)
        return version == 2 if version in (1, 2) else world_size > 1


@dataclass(frozen=True, slots=True)
class SaveResult:
    save_id: str
    payload_bytes: int
    """Bytes in payload files (known on the coordinator; 0 elsewhere)."""


def prepare(state: Any, rank: int = 0) -> FlatState:
    with paused_gc():
        return flatten(state, rank)


def encode_metadata(metadata: Any) -> Any:
    if metadata is None:
        return None
    flat = flatten(metadata, inline_bytes=True)
    if flat.items:
        raise UnsupportedValueError("metadata must not contain tensors; put them in the state")
    return flat.tree


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a dense, standard-strided CPU tensor (a copy only when needed;
    hot with many small tensors: a contiguous CPU tensor is returned as is, no new object)."""
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_cpu:
        t = t.to("cpu")
    if not t.is_contiguous() or (t.dim() and t.stride(-1) != 1):
        t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return t


def new_save_id() -> str:
    return uuid.uuid4().hex


_REFUSED: dict[str, type[CommitError]] = {"StepExistsError": StepExistsError,
                                          "TargetNotEmptyError": TargetNotEmptyError}
"""Target refusals of :func:`ckptlib.engine.commit.begin`, raised as is on every rank."""


def _fail(storage: Storage, final: str, failures: dict[int, str], exists: bool = False) -> CommitError:
    detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
    timed_out = any(msg.startswith(("StorageTimeoutError", "CommitTimeoutError")) for msg in failures.values())
    cls = StepExistsError if exists else CommitTimeoutError if timed_out else CommitError
    if any(msg.startswith("TargetNotEmptyError") for msg in failures.values()):
        cls = TargetNotEmptyError  # a folder that filled up during the save (commit._clear_target)
    return cls(f"checkpoint {storage.url.rstrip('/')}/{final} was not committed: {detail}", failures)


class SaveSession:
    """One save of the checkpoint folder ``final`` under ``storage`` (module docstring: who
    calls what, in which order). Not thread-safe: one thread per rank drives it."""

    def __init__(self, storage: Storage, final: str, coord: Coordinator, options: SaveOptions, save_id: str,
                 step: int | None, created: float, deadline: float, prefix: str, staging: commit.Staging | None,
                 owns_session: bool = True) -> None:
        """Use :meth:`begin`."""
        self.storage, self.final, self.coord, self.options = storage, final, coord, options
        self._owns_session = owns_session  # False: inside the caller's (coord.liveness_session)
        self.save_id, self.step, self.created, self.deadline = save_id, step, created, deadline
        self.prefix = prefix
        """Where this rank's payload files go (relative to the storage root)."""
        self._staging = staging  # the coordinator's only
        self._files: list[tuple[str, int]] = []
        self._chunks: list[Any] = []
        self._writes = 0
        self._open = True
        self._sent = False  # this rank's results went to the coordinator: it may commit them
        self.v2 = False
        """Format v2 (set by :func:`persist` on every rank): each rank writes a piece index file
        and the gather carries per-rank summaries, not chunks."""
        self.layout: dict[str, dict[str, Any]] | None = None
        """v2, coordinator: every tensor's dtype, shape and sharding (from :func:`_plan`)."""
        self.payload_bytes = 0
        """Bytes in payload files, after a successful :meth:`publish` (coordinator)."""
        self._index: tuple[dict[str, Any] | None] | None = None  # v2: written early (write_index)

    @classmethod
    def begin(cls, storage: Storage, final: str, *, step: int | None = None, options: SaveOptions | None = None,
              coordinator: Coordinator | None = None, save_id: str | None = None, created: float | None = None,
              ) -> SaveSession:
        """Every rank (collective): start a save of ``final``. ``save_id`` and ``created`` are
        proposals; the coordinator's win. One deadline, ``options.timeout``, bounds the whole
        session. Raises :class:`CommitError` on every rank when the staging area cannot be made.

        Several ranks: a liveness session opens first (the caller's, if it opened one around a
        larger flow: a tier save, a drain), so every meeting of the save, these two agrees
        included, waits on a rank while it is alive, up to the deadline: a coordinator slow to
        make the staging folder, or a rank reaching the save long after the others, is waited
        for; a dead or frozen one fails the others within the coordination timeout."""
        opts = options or SaveOptions()
        coord = coordinator or LocalCoordinator()
        deadline = time.monotonic() + opts.timeout
        owns = not in_flow(coord)
        if owns:
            coord.begin_session("save")
        try:
            save_id, created = coord.agree([save_id or new_save_id(), time.time() if created is None else created],
                                           opts.timeout)
            staging: commit.Staging | None = None
            error = None
            if coord.is_coordinator:
                try:
                    with deadline_scope(storage, opts.timeout):
                        storage.makedirs("")
                        staging = commit.begin(storage, final, save_id, overwrite=opts.overwrite)
                except (CheckpointError, OSError) as e:
                    error = [type(e).__name__, str(e)]
            prefix, error = coord.agree([staging.payload_prefix if staging else None, error],
                                        max(0.1, deadline - time.monotonic()))
            if error:  # the same error on every rank, before any payload is written
                refused = _REFUSED.get(error[0])
                raise refused(error[1]) if refused else _fail(storage, final, {0: f"{error[0]}: {error[1]}"})
        except BaseException:
            if owns:
                coord.end_session()
            raise
        return cls(storage, final, coord, opts, save_id, step, created, deadline, prefix, staging, owns)

    @property
    def files(self) -> list[tuple[str, int]]:
        """This rank's payload files so far: (path under the storage root, size)."""
        return list(self._files)

    def left(self) -> float:
        """Seconds left before the session's deadline (at least 0.1)."""
        return max(0.1, self.deadline - time.monotonic())

    def bounded(self) -> AbstractContextManager[Any]:
        """``with session.bounded():`` storage operations inside end by the session's deadline."""
        return deadline_scope(self.storage, self.left())

    def split(self, name: str, tensor: torch.Tensor, offset: tuple[int, ...]) -> list[ChunkJob]:
        """The write jobs for ``tensor`` (a piece of tensor ``name`` at ``offset`` in it),
        chunked by ``options.chunk_bytes``; copied to CPU only when needed."""
        return split_chunks(name, cpu_contiguous(tensor), offset, self.options.chunk_bytes)

    def write(self, jobs: list[ChunkJob]) -> None:
        """This rank: write ``jobs`` into new payload files (checksummed, compressed per
        ``options``) and remember them for :meth:`collect`. Raises on failure; the caller then
        passes the error to :meth:`finish`/:meth:`collect`, which fails the save on every rank."""
        tag = f"p{self._writes}" if self._writes else ""
        self._writes += 1
        with self.bounded():
            files, written = write_files(
                self.storage, self.prefix, self.coord.rank, jobs, compression=self.options.compression,
                num_files=self.options.num_files, tag=tag, timeout=self.left(),
            )
        self._files += files
        self._chunks += written

    def write_index(self) -> dict[str, Any] | None:
        """Format v2, this rank, after its last :meth:`write` and before :meth:`finish`: write its
        piece index file now (``collect`` then reuses it) so that the caller can copy it with the
        payload (the tiers' replicas, ckptlib/tiers/local.py). Its summary (``path``, ``size``, ...),
        or None (v1, or nothing written). Raises on failure, like :meth:`write`."""
        if self.v2 and self._index is None:
            with self.bounded():
                self._index = (write_index(self.storage, self.prefix, self.coord.rank, self._files, self._chunks),)
        return self._index[0] if self._index is not None else None

    def collect(self, *, tree: Any = None, per_rank: Any = None, shapes: dict[str, tuple[int, ...]] | None = None,
                error: BaseException | None = None) -> list[dict[str, Any]] | None:
        """Every rank (collective), after its writes: report done (``error``: this rank failed),
        wait for every rank, gather each rank's files, chunks, ``tree``, ``per_rank`` values and
        global ``shapes``: the list on the coordinator, None elsewhere. A failed or dead rank
        raises :class:`CommitError` on every rank (staging removed, session closed)."""
        index = None
        if self.v2 and error is None:
            try:
                index = self.write_index()
            except Exception as e:  # reported like a failed write: the save fails on every rank
                error = e
        msg = None if error is None else f"{type(error).__name__}: {error}"
        if msg is None:
            crashpoints.point("before_commit", self.coord.rank)
        coord = self.coord
        coord.report_done(msg)
        if coord.is_coordinator:
            failures = coord.wait_all_done(self.deadline)
            coord.release(failures)
        else:
            failures = coord.wait_release(self.deadline)
        if failures:
            self.abort()
            raise _fail(self.storage, self.final, failures)
        if self.v2:  # a summary: O(files), a tree digest and the PerRank values; never per piece
            skeleton, values = split_tree(tree)
            digest = hashlib.blake2b(jsonio.dumps(skeleton, sort_keys=False).encode(), digest_size=16).hexdigest()
            mine: dict[str, Any] = {"files": self._files, "index": index, "tree_digest": digest,
                                    "skeleton": skeleton if coord.is_coordinator else None, "per_rank_values": values}
        elif coord.world_size > 1:  # records and shapes travel as JSON (engine/wire.py)
            mine = {"files": self._files, "chunks": wire.chunks_out(self._chunks), "tree": tree,
                    "per_rank": per_rank, "shapes": wire.shapes_out(shapes or {})}
        else:
            mine = {"files": self._files, "chunks": self._chunks, "tree": tree, "per_rank": per_rank,
                    "shapes": shapes or {}}
        self._sent = True
        results = coord.gather(mine, self.left())
        if results is not None and coord.world_size > 1 and not self.v2:
            for res in results:
                res["chunks"], res["shapes"] = wire.chunks_in(res["chunks"]), wire.shapes_in(res["shapes"])
        return results

    def publish(self, results: list[dict[str, Any]], *, metadata: Any = None, tree: Any = None,
                extra: dict[str, Any] | None = None, metrics: dict[str, float] | None = None,
                manifest: bytes | None = None) -> None:
        """Coordinator, with :meth:`collect`'s results: build the manifest and commit it.
        ``metadata``: from :func:`encode_metadata`; ``tree``: recorded instead of the merged
        ranks' trees (adapters); ``extra``: the manifest's adapter data (JSON); ``metrics``: the
        step's metrics (str -> float, for ``keep_best``). On failure the
        staging area is removed and :class:`CommitError` (or :class:`StepExistsError`) raised.
        ``manifest``: ready-made manifest bytes committed instead of building one from
        ``results`` (a tier drain copying a committed step's files, ckptlib/tiers/drain.py)."""
        staging = self._staging
        if staging is None:
            raise CommitError("publish() runs on the coordinator of an open session")
        try:
            if manifest is not None:  # never publish what a reader would refuse
                data = manifest
                nbytes = mf.decode(data, f"{self.storage.url}/{staging.final}/{mf.MANIFEST_NAME}").payload_bytes
            else:
                with paused_gc():
                    if tree is None and "skeleton" in results[0]:  # v2 summaries: digests, O(ranks)
                        tree = join_trees(results[0]["skeleton"], [res["tree_digest"] for res in results],
                                          [res["per_rank_values"] for res in results])
                    elif tree is None:
                        one = len(results) == 1 and not results[0].get("per_rank")  # nothing to merge
                        tree = results[0]["tree"] if one else merge_trees([res["tree"] for res in results])
                    body = build_body(results, self.step, self.save_id, self.created, staging.mode, metadata,
                                      staging.payload_prefix, tree=tree, metrics=metrics, layout=self.layout)
                    body["extra"] = extra or {}
                    data = encode_body(body)
                nbytes = sum(size for _, size in body["files"])
                if extra:  # adapter data: never publish what a reader would refuse
                    mf.decode(data, f"{self.storage.url}/{staging.final}/{mf.MANIFEST_NAME}")
            with self.bounded():
                commit.publish(self.storage, staging, data, overwrite=self.options.overwrite)
        except TreeMismatch as e:
            self._drop_staging()
            raise _fail(self.storage, self.final, {0: str(e)}) from e
        except Exception as e:
            self._drop_staging()  # the session stays open: finish() still shares the outcome
            raise _fail(self.storage, self.final, {0: f"{type(e).__name__}: {e}"},
                        isinstance(e, FileExistsError)) from e
        self._staging = None
        self.payload_bytes = nbytes

    def finish(self, *, tree: Any = None, per_rank: Any = None, shapes: dict[str, tuple[int, ...]] | None = None,
               error: BaseException | None = None, metadata: Any = None, extra: dict[str, Any] | None = None,
               metrics: dict[str, float] | None = None, manifest: bytes | None = None) -> SaveResult:
        """Every rank (collective): :meth:`collect`, :meth:`publish` on the coordinator, and the
        outcome shared with every rank; the session is closed. Returns on every rank or raises
        the same :class:`CommitError` on every rank. A rank that sent its results but gets no
        verdict from the coordinator (silent, unreachable, past the deadline) settles the save
        on storage itself (:meth:`_settle`), so what it reports is what storage holds.
        ``manifest``: see :meth:`publish`."""
        try:
            try:
                results = self.collect(tree=tree, per_rank=per_rank, shapes=shapes, error=error)
                outcome: dict[str, Any] | None = None
                if self.coord.is_coordinator:
                    assert results is not None
                    outcome = {"failures": {}}
                    try:
                        self.publish(results, metadata=metadata, extra=extra, metrics=metrics, manifest=manifest)
                    except CommitError as e:
                        outcome = {"failures": e.failures or {0: str(e)}, "exists": isinstance(e, StepExistsError)}
                outcome = self.coord.share_outcome(outcome, self.deadline)
            except CommitError as e:
                if self.coord.is_coordinator or not self._sent:
                    raise
                return self._settle(e.failures or {0: str(e)}, e)
            failures = {int(k): v for k, v in outcome["failures"].items()}
            if outcome.get("gave_up"):
                return self._settle(failures)
            if failures:
                raise _fail(self.storage, self.final, failures, bool(outcome.get("exists")))
            return SaveResult(self.save_id, self.payload_bytes)
        finally:
            self.close()

    def _settle(self, failures: dict[int, str], cause: BaseException | None = None) -> SaveResult:
        """A non-coordinator that gave up on the coordinator after sending it its results (in
        :meth:`finish`): :func:`ckptlib.engine.commit.fence` makes the coordinator's commit
        impossible or finds it done. Returns if the save is committed; else raises
        :class:`CommitError` (the coordinator, if it ever wakes, fails too)."""
        why = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        try:
            with deadline_scope(self.storage, max(self.left(), FENCE_SECONDS)):
                verdict = commit.fence(self.storage, self.final, self.save_id, self.coord.rank, why[:500])
        except (CheckpointError, OSError) as e:
            failures = {**failures, self.coord.rank: f"could not fence the save, the coordinator may still commit it: {e}"}
            raise _fail(self.storage, self.final, failures) from cause or e
        if verdict == commit.COMMITTED:
            return SaveResult(self.save_id, 0)
        failures = {**failures, self.coord.rank: "gave up waiting for the coordinator; fenced the save: it cannot commit"}
        raise _fail(self.storage, self.final, failures) from cause

    def abort(self) -> None:
        """Any rank, before the commit: give the save up. The coordinator removes the staging
        area (best effort); every rank stops liveness. Idempotent."""
        self._drop_staging()
        self.close()

    def _drop_staging(self) -> None:
        """Coordinator: remove the staging area (best effort), once."""
        if self._staging is not None:
            with self.bounded():
                commit.abort(self.storage, self._staging)
            self._staging = None

    def close(self) -> None:
        """End the session on this rank (unless the caller opened it). Idempotent."""
        if self._open:
            self._open = False
            if self._owns_session:
                self.coord.end_session()


def persist(
    storage: Storage,
    final: str,
    flat: FlatState,
    *,
    step: int | None,
    metadata: Any = None,
    options: SaveOptions | None = None,
    coordinator: Coordinator | None = None,
    save_id: str | None = None,
    created: float | None = None,
    rounds: Iterable[list[TensorItem]] | None = None,
    metrics: dict[str, float] | None = None,
) -> SaveResult:
    """Save ``flat`` through a :class:`SaveSession` (every rank): begin, plan who writes what,
    write, finish. ``rounds`` (streamed async saves, engine/snapshot.py): the tensors to write,
    one round at a time, each written before the next is requested (``flat.items`` then only
    supplies names and shapes); a round that raises fails this rank's part of the save."""
    meta_tree = encode_metadata(metadata)
    session = SaveSession.begin(storage, final, step=step, options=options, coordinator=coordinator,
                                save_id=save_id, created=created)
    try:
        error = write_state(session, flat, rounds)
        shapes = {it.name: it.global_shape for it in flat.items}
        return session.finish(tree=flat.tree, per_rank=flat.per_rank, shapes=shapes, error=error,
                              metadata=meta_tree, metrics=metrics)
    finally:
        session.abort()  # a no-op after finish


def write_state(session: SaveSession, flat: FlatState, rounds: Iterable[list[TensorItem]] | None = None,
                ) -> BaseException | None:
    """Every rank (collective: the plan), between ``begin`` and ``finish``: plan who writes
    what and write this rank's part (``rounds``: see :func:`persist`). Returns this rank's
    write failure, for ``finish(error=...)``; used by :func:`persist` and the tiers' local save."""
    session.v2 = session.options.writes_v2(session.coord.world_size)
    items = _plan(session, flat.items)
    mine = {it.name for it in items}
    try:
        for rnd in [items] if rounds is None else rounds:
            with paused_gc():
                jobs = [j for it in rnd if it.name in mine
                        for j in session.split(it.name, it.tensor, it.global_offset)]
            session.write(jobs)
    except Exception as e:  # any failure must still reach the commit protocol and abort
        return e
    return None


def _describe(it: TensorItem) -> PieceDesc:
    t = it.tensor
    return PieceDesc(it.name, it.global_offset, tuple(t.shape), t.numel() * t.element_size(),
                     dtype_name(t.dtype), it.global_shape)


@dataclass(slots=True)
class _Offer:
    """What the ranks put up for assignment (:func:`_offer_v1` or :func:`_offer_v2`), for
    :func:`_plan`. Coordinator-only fields are None elsewhere."""

    everyone: list[Any] | None
    """Coordinator: per rank ``(replica digest, replicated pieces (rank 0 only), ...)``."""
    explicit: list[list[PieceDesc]] | None
    """Coordinator: per rank, its sharded pieces to assign (sent piece by piece)."""
    mine: list[int]
    """This rank's entries in ``explicit``, as positions in its sharded items."""
    grid: list[TensorItem]
    """v2: this rank's sharded items written as its own grid cells (never gathered)."""
    base_load: list[int] | None = None
    """Coordinator, v2: bytes each rank writes as grid cells (balanced against)."""
    proposal: Any = None
    """v2: the agreed grid proposal (:mod:`ckptlib.plan.grid`)."""
    union: frozenset[str] = frozenset()
    """v2: the sharded tensors that are not a grid (their pieces are ``explicit``)."""


def _offer_v1(session: SaveSession, rep_desc: list[PieceDesc], shd_desc: list[PieceDesc]) -> _Offer:
    """Format v1: every sharded piece is gathered (one collective)."""
    coord = session.coord
    sent = coord.gather([digest(rep_desc), wire.pieces_out(rep_desc) if coord.is_coordinator else None,
                         wire.pieces_out(shd_desc)], session.left())
    everyone = None if sent is None else [[d, wire.pieces_in(r or []), wire.pieces_in(s)] for d, r, s in sent]
    return _Offer(everyone, [e[2] for e in everyone] if everyone is not None else None, list(range(len(shd_desc))), [])


def _offer_v2(session: SaveSession, shd: list[TensorItem], rep_desc: list[PieceDesc],
              shd_desc: list[PieceDesc]) -> _Offer:
    """Format v2: sharded tensors that form a grid with cell ``k`` on rank ``k`` are agreed on
    with :mod:`ckptlib.plan.grid` (a proposal out, a list of exceptions back); only the pieces
    of the other tensors are gathered."""
    coord = session.coord
    proposal = wire.proposal_in(coord.agree(wire.proposal_out(propose(shd_desc)) if coord.is_coordinator else None,
                                            session.left()))
    odd = conform(proposal, shd_desc, coord.rank)
    odd_set = set(odd)
    grid_bytes = sum(d.nbytes for d in shd_desc if d.name not in odd_set)
    sent = coord.gather([digest(rep_desc), wire.pieces_out(rep_desc) if coord.is_coordinator else None, odd,
                         grid_bytes], session.left())
    everyone = None if sent is None else [[d, wire.pieces_in(r or []), o, g] for d, r, o, g in sent]
    proposed_odd = sorted(set().union(*(e[2] for e in everyone))) if everyone is not None else None
    union: set[str] = set(coord.agree(proposed_odd, session.left()))
    mine_odd = [i for i, d in enumerate(shd_desc) if d.name in union]
    explicit: list[list[PieceDesc]] | None = [[]] * coord.world_size
    if union:
        got = coord.gather(wire.pieces_out(shd_desc[i] for i in mine_odd), session.left())
        explicit = None if got is None else [wire.pieces_in(x) for x in got]
    grid = [it for it, d in zip(shd, shd_desc, strict=True) if d.name not in union and all(d.shape)]
    return _Offer(everyone, explicit, mine_odd, grid, [e[3] for e in everyone] if everyone is not None else None,
                  proposal, frozenset(union))


def _plan(session: SaveSession, items: list[TensorItem]) -> list[TensorItem]:
    """Every rank (collective): this rank's items -- replicas deduplicated, bytes balanced
    (the coordinator plans) -- and, format v2 (``session.v2``), on the coordinator
    ``session.layout`` (every tensor's sharding for the v2 manifest). What is put up for
    assignment differs by format (:func:`_offer_v1`, :func:`_offer_v2`); the assignment and
    its distribution are one. Raises :class:`CommitError` on every rank when planning fails."""
    coord = session.coord
    if coord.world_size <= 1:
        if session.v2:
            session.layout = describe([], set(), [], [], [(0, _describe(it)) for it in items])
        return items
    rep = [it for it in items if it.replicated]
    shd = [it for it in items if not it.replicated]
    rep_desc = [_describe(it) for it in rep]
    shd_desc = [_describe(it) for it in shd]
    offer = _offer_v2(session, shd, rep_desc, shd_desc) if session.v2 else _offer_v1(session, rep_desc, shd_desc)
    plans: list[Any] | None = None
    if coord.is_coordinator:
        everyone, explicit = offer.everyone, offer.explicit
        assert everyone is not None and explicit is not None
        try:
            got = assign(everyone[0][1], [e[0] for e in everyone], explicit, offer.base_load)
            if session.v2:
                writer = [0] * len(rep_desc)
                for r, p in enumerate(got):
                    for i in p.replicated:
                        writer[i] = r
                chosen = [(r, explicit[r][i]) for r, p in enumerate(got) for i in p.sharded]
                session.layout = describe(offer.proposal, set(offer.union), everyone[0][1], writer, chosen)
            plans = [["ok", wire.plan_out(p)] for p in got]
        except PlanError as e:
            plans = [["error", str(e)]] * coord.world_size
    status, sent = coord.scatter(plans, session.left())
    if status == "error":
        session.abort()
        raise _fail(session.storage, session.final, {0: sent})
    plan = wire.plan_in(sent)
    return [rep[i] for i in plan.replicated] + offer.grid + [shd[offer.mine[i]] for i in plan.sharded]
