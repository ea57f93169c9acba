"""The save flow: :class:`SaveSession`, the one implementation of a save, and its users.

Users: :func:`persist` (``CheckpointManager``, ``ckptlib.save``, the Megatron adapter), the
tiers' local save and drain (ckptlib/tiers/), and the DCP writer. Every rank calls, in order,
on one thread, inside one coordination session (the caller's flow's, or the save's own):

1. :meth:`~SaveSession.begin`: a share -- the coordinator picks the save id and opens the
   staging folder (:func:`ckptlib.engine.commit.begin`); a tier save's other node leaders open
   their node's copy;
2. the plan (:func:`write_state`, :func:`ckptlib.engine.save_plan.plan_items`): reports of what each rank holds, the
   coordinator's assignment answered to each rank (format v2: the grid proposal shared first);
3. :meth:`~SaveSession.write` (local, any number of times);
4. :meth:`~SaveSession.finish`: one report ("done" or this rank's error, with its results),
   :meth:`~SaveSession.publish` on the coordinator (the commit point), the outcome shared; the
   save's own session closes (the coordinator last: it returns once every rank has read it).

Every rank returns a :class:`SaveResult` or raises the same :class:`CommitError`; a rank that
lost the coordinator after reporting decides from storage (:meth:`~SaveSession._settle`). DCP,
which carries the outcome itself, calls ``collect(release=True)``, ``publish`` (coordinator),
then ``close``; ``abort`` gives a save up. The meetings: docs/distributed.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ckptlib import crashpoints
from ckptlib.backends import Storage, deadline_scope
from ckptlib.backends.posix import PosixStorage
from ckptlib.coord.coordinator import Coordinator, LocalCoordinator
from ckptlib.coord.session import Session, detail
from ckptlib.engine import commit, wire
from ckptlib.engine import options as argcheck
from ckptlib.engine.checks import StateChecks, digests_agree, mismatches
from ckptlib.engine.gc_pause import paused_gc
from ckptlib.engine.mapped_arena import Arena
from ckptlib.engine.save_plan import describe_item, plan_items
from ckptlib.engine.writer import (
    ChunkJob,
    adopt_arena,
    split_chunks,
    write_files,
    write_files_indexed,
    write_index,
)
from ckptlib.errors import (
    CheckpointError,
    CommitError,
    CommitTimeoutError,
    CommitUnknownError,
    NonFiniteError,
    ReplicaMismatchError,
    StepExistsError,
    TargetNotEmptyError,
    UnsupportedValueError,
)
from ckptlib.format import jsonio
from ckptlib.format import manifest as mf
from ckptlib.format.build import build_body, check_room, encode_body
from ckptlib.plan.flatten import FlatState, TensorItem, flatten
from ckptlib.plan.grid import propose
from ckptlib.plan.trees import TreeMismatch
from ckptlib.plan.trees import join as join_trees
from ckptlib.plan.trees import merge as merge_trees
from ckptlib.plan.trees import split as split_tree

log = logging.getLogger("ckptlib")
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
    nonfinite: str = "allow"
    """``"refuse"``: a floating-point tensor holding NaN or Inf fails the save on every rank
    (:class:`NonFiniteError`), checked on the bytes each rank writes."""
    check_replicas: bool | str = "auto"
    """``True``: every rank checksums its copy of every replicated tensor and the copies must
    agree (:class:`ReplicaMismatchError`); ``"auto"``: only where copies are written from
    several ranks' memory anyway (a tier save's replicated pieces, ckptlib/tiers/local.py);
    ``False``: never."""

    def __post_init__(self) -> None:
        """Every argument checked now, before any I/O (:mod:`ckptlib.engine.options`)."""
        argcheck.compression(self.compression)
        argcheck.one_of("nonfinite", self.nonfinite, ("allow", "refuse"))
        argcheck.one_of("check_replicas", self.check_replicas, (True, False, "auto"))
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


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a save's bytes go besides the coordinator's storage: the tier save's nodes
    (ckptlib/tiers/local.py). The default is a save with one commit point everyone can read."""

    stage_here: bool = False
    """This rank opens its node's own staging folder (a node leader other than the coordinator)."""
    copies: bool = False
    """Several nodes: after the commit, their leaders commit copies of the coordinator's manifest."""
    record_elsewhere: bool = False
    """The step's record (the coordinator's commit) is on storage this rank cannot read."""
    own_replicated: bool = False
    """This rank writes its replicated pieces into files of their own (tag :data:`REP_TAG`),
    which its peers rebuild from their own memory instead of receiving them
    (ckptlib/tiers/replicas.py): only bytes that exist on one node cross the network. Only for
    a save not streamed in rounds (the peers' copies must still be in memory after the writes)."""


REP_TAG = "rep"
"""The file tag of a rank's replicated pieces under :attr:`Placement.own_replicated`."""


def prepare(state: Any, rank: int = 0, *, metadata: Any = None, collective: bool = False) -> FlatState:
    """The caller's thread, before a save: ``state`` flattened (and ``metadata`` checked), raising
    what cannot be saved (:class:`UnsupportedValueError`, or what a ``state_dict()`` raised).
    ``collective`` (a save with other ranks, which will wait for this one): that failure is
    returned instead, as an empty state with ``error`` set, for :func:`persist` to take part in
    the save with, so that every rank fails it rather than waiting for this one or meeting its
    next save; :func:`persist` then raises the error here and a :class:`CommitError` naming it
    on the other ranks."""
    try:
        encode_metadata(metadata)
        with paused_gc():
            return flatten(state, rank)
    except Exception as e:
        if not collective:
            raise
        return FlatState(None, [], False, e)


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


_RAISED: dict[str, type[CommitError]] = {
    "TargetNotEmptyError": TargetNotEmptyError,  # a folder that filled up during the save (commit._clear_target)
    "NonFiniteError": NonFiniteError, "ReplicaMismatchError": ReplicaMismatchError,
    "CommitUnknownError": CommitUnknownError,  # the manifest's put may have landed (commit._put_manifest)
}


def _other_target(final: str, theirs: str, rank: int) -> str | None:
    """:meth:`SaveSession.begin`, every rank: why this rank cannot take part when the coordinator
    opened another folder than ``final`` (ranks called ``save`` with different steps: the
    coordinator's folder would get this rank's bytes), else None. Reported with the plan, which
    then fails the save on every rank."""
    if theirs == final:
        return None
    return (f"StepMismatch: rank {rank} saves {final} but the coordinator (rank 0) saves {theirs}: every rank must "
            "call save() with the same step at the same time (with save_on_signal, every rank must be signalled "
            "and act on it at the same step); nothing was written")


def _fail(storage: Storage, final: str, failures: dict[int, str], exists: bool = False) -> CommitError:
    detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
    timed_out = any(msg.startswith(("StorageTimeoutError", "CommitTimeoutError")) for msg in failures.values())
    cls: type[CommitError] = StepExistsError if exists else CommitTimeoutError if timed_out else CommitError
    for name, kind in _RAISED.items():  # a rank's failure every rank raises as its own kind
        if any(msg.startswith(name) for msg in failures.values()):
            cls = kind
    verdict = "may or may not be committed" if cls is CommitUnknownError else "was not committed"
    return cls(f"checkpoint {storage.url.rstrip('/')}/{final} {verdict}: {detail}", failures)


class SaveSession:
    """One save of the checkpoint folder ``final`` under ``storage`` (module docstring: who
    calls what, in which order). Not thread-safe: one thread per rank drives it."""

    def __init__(self, storage: Storage, final: str, session: Session, options: SaveOptions, save_id: str,
                 step: int | None, created: float, deadline: float, prefix: str, staging: commit.Staging | None,
                 own: bool, stage_error: str | None = None, placement: Placement | None = None) -> None:
        """Use :meth:`begin`."""
        self.placement = placement or Placement()
        self.storage, self.final, self.options = storage, final, options
        self.session = session
        self.coord = session.coord
        self._own = own  # the session is this save's (else the caller's flow's: it closes it)
        self.save_id, self.step, self.created, self.deadline = save_id, step, created, deadline
        self.prefix = prefix
        """Where this rank's payload files go (relative to the storage root)."""
        self._staging = staging  # the coordinator's, and a tier save's other node leaders' (their copy)
        self.stage_error = stage_error
        """Why this rank cannot take part, reported with the plan, which then fails on every rank:
        a node leader could not open its node's staging folder, or this rank's state cannot be
        saved (:func:`persist`, ``FlatState.error``)."""
        self._files: list[tuple[str, int]] = []
        self._chunks: list[Any] = []
        self._writes = 0
        self._open = True
        self._sent = False  # this rank's results went to the coordinator: it may commit them
        self.v2 = False
        """Format v2 (set by :func:`persist` on every rank): each rank writes a piece index file
        and the report carries per-rank summaries, not chunks."""
        self.layout: dict[str, dict[str, Any]] | None = None
        """v2, coordinator: every tensor's dtype, shape and sharding (from :func:`ckptlib.engine.save_plan.plan_items`)."""
        self.payload_bytes = 0
        """Bytes in payload files, after a successful :meth:`publish` (coordinator)."""
        self._index: tuple[dict[str, Any] | None] | None = None  # v2: written early (write_index)
        self.checks = StateChecks("allow", False, 1)
        """What :func:`write_state` checked of this rank's state (:mod:`ckptlib.engine.checks`)."""
        self.proposal: Any = None
        """Format v2: the coordinator's grid proposal, shared with the opening (:func:`persist`)."""
        self.index_tail = False
        """Format v2: this rank may put its piece index at the end of its payload file
        (:meth:`write` with ``last``); set by :func:`persist` for a save with no placement, no
        rounds and nothing written after the state (the tiers copy index files of their own)."""
        self.replicated: tuple[list[tuple[str, int]], list[Any], list[str]] | None = None
        """:attr:`Placement.own_replicated`: this rank's replicated files, their write records and
        the tensors in the order they were given to the writer (its files group them, so the
        records' order is not that order: a peer rebuilding the files needs the writer's)."""

    @classmethod
    def begin(cls, storage: Storage, final: str, *, step: int | None = None, options: SaveOptions | None = None,
              coordinator: Coordinator | None = None, session: Session | None = None, save_id: str | None = None,
              created: float | None = None, placement: Placement | None = None,
              proposal: Any = None) -> SaveSession:
        """Every rank (collective): start a save of ``final``, in one meeting (a share): the
        coordinator picks the save id (``save_id``, ``created``: its proposals) and opens the
        staging folder, and every rank learns both. One deadline, ``options.timeout`` (capped by
        the session's), bounds the whole save. Raises :class:`CommitError` on every rank when the
        staging area cannot be made.

        ``session``: the caller's flow's (a tier save, a drain), else the save opens its own on
        ``coordinator`` and closes it when it ends. ``stage_here``: this rank also opens a
        staging folder on ``storage`` (a tier save's node leader: its node's copy of the step,
        published with the coordinator's manifest, :meth:`finish`); a failure there is reported
        with the plan and fails the save on every rank before anything is written."""
        opts = options or SaveOptions()
        where = placement or Placement()
        own = session is None
        coord = session.coord if session is not None else coordinator or LocalCoordinator()
        s = session if session is not None else coord.session("save", coord.deadline(opts.timeout))
        deadline = min(s.deadline, s.now() + opts.timeout)
        staging: commit.Staging | None = None
        try:
            opening = None
            if s.is_coordinator:
                sid, made = save_id or new_save_id(), time.time() if created is None else created
                staging, error = _open_staging(storage, final, sid, opts)
                opening = [sid, made, staging.payload_prefix if staging else None, error, proposal, final]
            got = s.share(opening, deadline=deadline, what="open the save")
            sid, made, prefix, error, proposal = str(got[0]), float(got[1]), got[2], got[3], got[4]
            stage_error = _other_target(final, str(got[5]), s.rank)
            if error:  # the same error on every rank, before any payload is written
                refused = _REFUSED.get(error[0])
                if stage_error is not None:  # the coordinator's refusal is about another step, not this one
                    raise _fail(storage, final, {s.rank: stage_error})
                raise refused(error[1]) if refused else _fail(storage, final, {0: f"{error[0]}: {error[1]}"})
            if where.stage_here and not s.is_coordinator and stage_error is None:
                staging, err = _open_staging(storage, final, sid, opts, node=True)
                stage_error = None if err is None else f"{err[0]}: {err[1]}"
            save = cls(storage, final, s, opts, sid, step, made, deadline, prefix, staging, own, stage_error, where)
            save.proposal = proposal
            return save
        except BaseException as e:
            if own:
                s.close(e)
            raise

    @property
    def files(self) -> list[tuple[str, int]]:
        """This rank's payload files so far: (path under the storage root, size)."""
        return list(self._files)

    def left(self) -> float:
        """Seconds left before the save's deadline (at least 0.1)."""
        return self.session.left(self.deadline)

    def bounded(self) -> AbstractContextManager[Any]:
        """``with save.bounded():`` storage operations inside end by the save's deadline."""
        return deadline_scope(self.storage, self.left())

    def split(self, name: str, tensor: torch.Tensor, offset: tuple[int, ...]) -> list[ChunkJob]:
        """The write jobs for ``tensor`` (a piece of tensor ``name`` at ``offset`` in it),
        chunked by ``options.chunk_bytes``; copied to CPU only when needed."""
        return split_chunks(name, cpu_contiguous(tensor), offset, self.options.chunk_bytes)

    def write(self, jobs: list[ChunkJob], tag: str | None = None, arena: Arena | None = None,
              last: bool = False) -> list[Any]:
        """This rank: write ``jobs`` into new payload files (checksummed, compressed per
        ``options``) and remember them for :meth:`collect`; returns their write records.
        ``tag``: the files' tag (default: one per call, so rounds get names of their own).
        ``arena``: ``jobs`` lie in this mapped arena (all this rank writes): adopted as the file
        when the storage is its memory root (engine/writer.py ``adopt_arena``).
        ``last``: this is the rank's only write of the save (:func:`write_state`, nothing after it):
        with :attr:`index_tail`, its piece index goes at the end of its payload file when that is
        one file (engine/writer.py ``write_files_indexed``), and :meth:`write_index` writes nothing.
        Raises on failure; the caller then passes the error to :meth:`finish`/:meth:`collect`,
        which fails the save on every rank."""
        tail = last and self.index_tail and self.v2 and tag is None and not self._writes
        if tag is None:
            tag = f"p{self._writes}" if self._writes else ""
            self._writes += 1
        st, opts = self.storage, self.options
        with self.bounded():
            adopted = adopt_arena(arena, st.root, self.prefix, self.session.rank, jobs) if (
                arena is not None and tag == "" and isinstance(st, PosixStorage) and st.memory
                and st.root == arena.ring.root and opts.compression is None) else None
            if adopted is None and tail:
                files, written, index = write_files_indexed(
                    st, self.prefix, self.session.rank, jobs, compression=opts.compression,
                    num_files=opts.num_files, timeout=self.left())
                if index is not None:
                    self._index = (index,)
            else:
                files, written = adopted or write_files(
                    st, self.prefix, self.session.rank, jobs, compression=opts.compression,
                    num_files=opts.num_files, tag=tag, timeout=self.left(),
                )
        self._files += files
        self._chunks += written
        if tag == REP_TAG:
            self.replicated = (files, written, list(dict.fromkeys(j.name for j in jobs)))
        return written

    def write_index(self) -> dict[str, Any] | None:
        """Format v2, this rank, after its last :meth:`write` and before :meth:`finish`: write its
        piece index file now (``collect`` then reuses it) so that the caller can copy it with the
        payload (the tiers' replicas, ckptlib/tiers/local.py). Its summary (``path``, ``size``, ...),
        or None (v1, or nothing written). Raises on failure, like :meth:`write`."""
        if self.v2 and self._index is None:
            with self.bounded():
                self._index = (write_index(self.storage, self.prefix, self.session.rank, self._files, self._chunks),)
        return self._index[0] if self._index is not None else None

    def collect(self, *, tree: Any = None, per_rank: Any = None, shapes: dict[str, tuple[int, ...]] | None = None,
                error: BaseException | None = None, release: bool = False) -> list[dict[str, Any]] | None:
        """Every rank (collective), after its writes: one report to the coordinator, "done" (or
        this rank's ``error``) with this rank's files, chunks, ``tree``, ``per_rank`` values and
        global ``shapes``. Coordinator: the list (raises :class:`CommitError` naming the ranks that
        failed, died or froze; staging removed); others: None. ``release`` (the DCP writer, whose
        ``write_data`` must fail on every rank when one failed): the coordinator then shares the
        failures, and every rank raises them."""
        index = None
        if self.v2 and error is None:
            try:
                index = self.write_index()
            except Exception as e:  # reported like a failed write: the save fails on every rank
                error = e
        msg = None if error is None else f"{type(error).__name__}: {error}"
        s = self.session
        if msg is None:
            crashpoints.point("before_commit", s.rank)
        mine: dict[str, Any] | None = None
        if msg is None and self.v2:  # a summary: O(files), a tree digest and the PerRank values; never per piece
            skeleton, values = split_tree(tree)
            digest = hashlib.blake2b(jsonio.dumps(skeleton, sort_keys=False).encode(), digest_size=16).hexdigest()
            mine = {"files": self._files, "index": index, "tree_digest": digest,
                    "skeleton": skeleton if s.is_coordinator else None, "per_rank_values": values}
        elif msg is None and s.world > 1:  # records and shapes travel as JSON (engine/wire.py)
            mine = {"files": self._files, "chunks": wire.chunks_out(self._chunks), "tree": tree,
                    "per_rank": per_rank, "shapes": wire.shapes_out(shapes or {})}
        elif msg is None:
            mine = {"files": self._files, "chunks": self._chunks, "tree": tree, "per_rank": per_rank,
                    "shapes": shapes or {}}
        if mine is not None and self.checks.digest() is not None:
            mine["replicas"] = self.checks.digest()
        self._sent = mine is not None
        failures: dict[int, str] = {}
        results: list[dict[str, Any]] | None = None
        try:
            got = s.report([msg, mine], deadline=self.deadline, patient=True, hold=True)
        except CommitError as e:
            if not s.is_coordinator:
                raise  # the store is unreachable: the results may still arrive (finish settles)
            failures = e.failures or {0: str(e)}  # ranks died, froze or left
            got = None
        if got is not None:
            failures = {r: m for r, (m, _res) in enumerate(got) if m}
            results = [res for _m, res in got]
        if release:
            verdict = s.share({str(r): m for r, m in failures.items()} if s.is_coordinator else None,
                              deadline=self.deadline, what="finish the writes")
            failures = {int(r): m for r, m in verdict.items()}
        if failures and (s.is_coordinator or release):
            self._drop_staging()  # the session stays open: the caller shares the outcome, then closes it
            raise _fail(self.storage, self.final, failures)
        if results is not None and s.world > 1 and not self.v2:
            for res in results:
                res["chunks"], res["shapes"] = wire.chunks_in(res["chunks"]), wire.shapes_in(res["shapes"])
        return results

    def publish(self, results: list[dict[str, Any]], *, metadata: Any = None, tree: Any = None,
                extra: dict[str, Any] | None = None, metrics: dict[str, float] | None = None,
                manifest: bytes | None = None) -> bytes:
        """Coordinator, with :meth:`collect`'s results: build the manifest and commit it; returns
        the manifest bytes committed. ``metadata``: from :func:`encode_metadata`; ``tree``:
        recorded instead of the merged ranks' trees (adapters); ``extra``: the manifest's adapter
        data (JSON); ``metrics``: the step's metrics (str -> float, for ``keep_best``). On
        failure the staging area is removed and :class:`CommitError` (or
        :class:`StepExistsError`) raised. ``manifest``: ready-made manifest bytes committed
        instead of building one from ``results`` (a tier drain copying a committed step's
        files, ckptlib/tiers/drain.py)."""
        staging = self._staging
        if staging is None or not self.session.is_coordinator:
            raise CommitError("publish() runs on the coordinator of an open save")
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
                    if not extra:  # never publish what a reader would refuse (with extra: the decode below)
                        mf.check_built(body)
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
        return data

    def finish(self, *, tree: Any = None, per_rank: Any = None, shapes: dict[str, tuple[int, ...]] | None = None,
               error: BaseException | None = None, metadata: Any = None, extra: dict[str, Any] | None = None,
               metrics: dict[str, float] | None = None, manifest: bytes | None = None) -> SaveResult:
        """Every rank (collective): :meth:`collect`, :meth:`publish` on the coordinator, and the
        outcome shared with every rank (the coordinator leaves the session last, so every live
        rank has read it when the coordinator returns); a tier save's other node leaders
        then commit the same manifest in their node's folder (:meth:`_copies`). Returns on every
        rank or raises the same :class:`CommitError` on every rank. A rank that sent its results
        but gets no verdict (the coordinator died, froze or its store is gone) decides from
        storage (:meth:`_settle`), so what it reports is what storage holds.
        ``manifest``: see :meth:`publish`. Closes the save's own session."""
        s = self.session
        raised: BaseException | None = None
        try:
            if s.is_coordinator:
                outcome = self._decide(tree, per_rank, shapes, error, metadata, extra, metrics, manifest)
                s.share(outcome, deadline=self.deadline)  # read before the coordinator leaves (it leaves last)
            else:
                try:
                    self.collect(tree=tree, per_rank=per_rank, shapes=shapes, error=error)
                    outcome = s.share(None, deadline=self.deadline + s.dead_after, what="publish the save")
                except CommitError as e:
                    if not self._sent:
                        raise _fail(self.storage, self.final, e.failures or {0: str(e)}) from None
                    return self._settle(e.failures or {0: str(e)}, e)
            failures = {int(k): v for k, v in outcome["failures"].items()}
            if outcome.get("replicas") == "differ":  # the copies' checksums, to name the culprits
                got = s.report(self.checks.sums, deadline=self.deadline, hold=True)
                found = s.share(None if got is None else {str(r): m for r, m in mismatches(got).items()},
                                deadline=self.deadline, what="compare the replicas")
                failures = {int(r): m for r, m in found.items()} or {0: "ReplicaMismatchError: replicas differ"}
            if failures:
                self._drop_staging()
                raise _fail(self.storage, self.final, failures, bool(outcome.get("exists")))
            if self.placement.copies:
                self._copies(outcome.get("manifest"))
            return SaveResult(self.save_id, self.payload_bytes)
        except BaseException as e:
            raised = e
            raise
        finally:
            self.close(raised)

    def _decide(self, tree: Any, per_rank: Any, shapes: dict[str, tuple[int, ...]] | None,
                error: BaseException | None, metadata: Any, extra: dict[str, Any] | None,
                metrics: dict[str, float] | None, manifest: bytes | None) -> dict[str, Any]:
        """Coordinator, in :meth:`finish`: every rank's results in, the commit, the outcome
        (JSON) to share: ``failures`` (rank -> why), ``exists`` (the step was already there),
        ``manifest`` (the committed manifest, for the other node leaders of a tier save)."""
        try:
            results = self.collect(tree=tree, per_rank=per_rank, shapes=shapes, error=error)
            assert results is not None
            if not digests_agree([res.get("replicas") for res in results]):
                self._drop_staging()
                return {"failures": {}, "replicas": "differ"}  # every rank then reports its checksums
            data = self.publish(results, metadata=metadata, extra=extra, metrics=metrics, manifest=manifest)
        except CommitError as e:
            return {"failures": {str(r): m for r, m in (e.failures or {0: str(e)}).items()},
                    "exists": isinstance(e, StepExistsError)}
        return {"failures": {}, "manifest": data.decode("ascii") if self.placement.copies else None}

    def _copies(self, manifest: str | None) -> None:
        """A tier save with several nodes, every rank, after the commit: the other node leaders
        commit the coordinator's manifest in their node's staging folder, then every rank learns
        which copies stand (one exchange), so that no rank returns before its node's copy is
        in place (its drain reads it). The save is committed already (the coordinator's node
        holds its record): a copy that failed is logged, not raised (a restore then reads that
        node's files from their replicas or the persistent tier)."""
        ok = True
        if self._staging is not None and manifest is not None:
            try:
                crashpoints.point("local_commit", self.session.rank)
                with self.bounded():
                    commit.publish(self.storage, self._staging, manifest.encode("ascii"), overwrite=True)
                self._staging = None
            except (CheckpointError, OSError) as e:
                ok = False
                log.warning("ckptlib: step %s is committed, but this node's copy of it could not be committed in "
                            "%s: %s", self.final, self.storage.url, e)
                self._drop_staging()
        try:
            oks = self.session.exchange(ok, deadline=self.deadline)
        except CommitError as e:  # a rank died after the commit: the step stands
            log.warning("ckptlib: step %s is committed; not every node reported its copy: %s", self.final, e)
            return
        failed = [r for r, o in enumerate(oks) if not o]
        if failed:
            log.warning("ckptlib: step %s is committed; the node copies of ranks %s failed", self.final, failed)

    def _settle(self, failures: dict[int, str], cause: BaseException | None = None) -> SaveResult:
        """A non-coordinator that got no verdict after sending its results (in :meth:`finish`):
        decide from storage. Where the coordinator commits into this rank's storage (a save, a
        drain, a tier save's rank on the coordinator's node), :func:`ckptlib.engine.commit.fence`
        makes the commit impossible or finds it done: returns if committed, else raises
        :class:`CommitError` (the coordinator, if it ever wakes, fails too). Elsewhere (a tier
        save's other nodes) the record is out of reach: :class:`CommitUnknownError`."""
        why = detail(failures)
        if self.placement.record_elsewhere:
            self._drop_staging()
            raise CommitUnknownError(
                f"checkpoint {self.final}: the coordinator (rank 0) vanished after every rank's bytes were durable "
                f"({why}); whether it committed the step on its node cannot be read from here: the next restore "
                "decides", failures) from cause
        try:
            with deadline_scope(self.storage, max(self.left(), FENCE_SECONDS)):
                verdict = commit.fence(self.storage, self.final, self.save_id, self.session.rank, why[:500])
        except (CheckpointError, OSError) as e:
            failures = {**failures,
                        self.session.rank: f"could not fence the save, the coordinator may still commit it: {e}"}
            raise _fail(self.storage, self.final, failures) from cause or e
        if verdict == commit.COMMITTED:
            return SaveResult(self.save_id, 0)
        failures = {**failures,
                    self.session.rank: "gave up waiting for the coordinator; fenced the save: it cannot commit"}
        raise _fail(self.storage, self.final, failures) from cause

    def abort(self, error: BaseException | None = None) -> None:
        """Any rank, before the commit: give the save up. Staging removed (best effort); the
        save's own session closed. Idempotent."""
        self._drop_staging()
        self.close(error)

    def plan_failed(self, failures: dict[int, str]) -> CommitError:
        """Every rank, when the plan's answer is an error (:func:`~ckptlib.engine.save_plan.plan_items`):
        drops the staging folder (the coordinator) and returns the error to raise."""
        self._drop_staging()
        return _fail(self.storage, self.final, failures)

    def _drop_staging(self) -> None:
        """Remove this rank's staging area (best effort), once."""
        if self._staging is not None:
            with self.bounded():
                commit.abort(self.storage, self._staging)
            self._staging = None

    def close(self, error: BaseException | None = None) -> None:
        """End the save on this rank: its own session is closed (the coordinator's close waits
        until the others left). Idempotent."""
        if self._open:
            self._open = False
            if self._own:
                self.session.close(error)


def _open_staging(storage: Storage, final: str, save_id: str, opts: SaveOptions, node: bool = False,
                  ) -> tuple[commit.Staging | None, list[str] | None]:
    """The staging folder of save ``save_id`` (:func:`ckptlib.engine.commit.begin`), or the error
    (``[type name, message]``). ``node``: a tier save's other node leader (its copy)."""
    try:
        with deadline_scope(storage, opts.timeout):
            storage.makedirs("")
            return commit.begin(storage, final, save_id, overwrite=opts.overwrite or node), None
    except CheckpointError as e:
        return None, [type(e).__name__, str(e)]
    except FileExistsError as e:
        if not node:
            return None, [type(e).__name__, str(e)]
        return None, ["CommitError", f"the local folder {storage.url} already holds this save's staging folder: is it "
                                     "shared with another node? Put '{node}' in local= or use node-local disks"]
    except OSError as e:
        return None, [type(e).__name__, str(e)]


def persist(
    storage: Storage,
    final: str,
    flat: FlatState,
    *,
    step: int | None,
    metadata: Any = None,
    options: SaveOptions | None = None,
    coordinator: Coordinator | None = None,
    session: Session | None = None,
    save_id: str | None = None,
    created: float | None = None,
    rounds: Iterable[list[TensorItem]] | None = None,
    metrics: dict[str, float] | None = None,
    placement: Placement | None = None,
    before_write: Callable[[SaveSession, int], None] | None = None,
    after_write: Callable[[SaveSession, BaseException | None], BaseException | None] | None = None,
    arena: Arena | None = None,
) -> SaveResult:
    """The one save flow, every rank: begin, plan who writes what, write, finish.
    ``session``: the caller's flow's (else the save opens its own on ``coordinator``).
    ``rounds`` (streamed async saves, engine/snapshot.py): the tensors to write, one round at a
    time, each written before the next is requested (``flat.items`` then only supplies names and
    shapes); a round that raises fails this rank's part of the save. ``placement``,
    ``before_write`` and ``after_write`` (a tier save, ckptlib/tiers/local.py): where else the
    bytes go; what runs once the plan is known, given the bytes this rank will write (collective:
    the memory tier's room check; what it raises fails the save); and what runs after this
    rank's writes and before the commit (its replicas), given this rank's write error and
    returning it (or its own). ``arena``: see :func:`write_state`."""
    meta_tree = encode_metadata(metadata)
    coord = session.coord if session is not None else coordinator
    proposal = None  # format v2's grid proposal, sent with the opening (the coordinator's matters)
    if coord is not None and coord.is_coordinator and coord.world_size > 1:
        proposal = wire.proposal_out(propose([describe_item(it) for it in flat.items if not it.replicated]))
    save = SaveSession.begin(storage, final, step=step, options=options, coordinator=coordinator, session=session,
                             save_id=save_id, created=created, placement=placement, proposal=proposal)
    save.index_tail = placement is None and rounds is None and after_write is None
    if flat.error is not None:  # reported with the plan, which then fails on every rank
        save.stage_error = save.stage_error or f"{type(flat.error).__name__}: {flat.error}"
    try:
        error = write_state(save, flat, rounds, before_write, arena)
        if after_write is not None:
            error = after_write(save, error)
        shapes = {it.name: it.global_shape for it in flat.items}
        return save.finish(tree=flat.tree, per_rank=flat.per_rank, shapes=shapes, error=error,
                           metadata=meta_tree, metrics=metrics)
    except BaseException as e:
        save.abort(e)  # a no-op after finish
        if flat.error is not None:
            raise flat.error from None  # this rank's own error; the others raise the plan's
        raise


def write_state(session: SaveSession, flat: FlatState, rounds: Iterable[list[TensorItem]] | None = None,
                before_write: Callable[[SaveSession, int], None] | None = None,
                arena: Arena | None = None) -> BaseException | None:
    """Every rank (collective: the plan), between ``begin`` and ``finish``: plan who writes
    what and write this rank's part (``rounds``: see :func:`persist`). Returns this rank's
    write failure, for ``finish(error=...)``; used by :func:`persist` and the tiers' local save.
    ``arena``: ``flat`` lies in this mapped arena; adopted when this rank writes all of it."""
    session.v2 = session.options.writes_v2(session.session.world)
    one = session.session.world == 1
    try:  # a manifest certain to be over the limit fails the save before any payload is written
        exact = one and not session.v2 and not flat.per_rank  # the manifest's tree is flat.tree
        check_room((it.name for it in flat.items), flat.tree if exact else None)
    except UnsupportedValueError as e:
        if one:
            return e
        session.stage_error = session.stage_error or f"{type(e).__name__}: {e}"  # the plan fails everywhere
    items = plan_items(session, flat.items)
    mine = {it.name for it in items}
    if before_write is not None:
        before_write(session, sum(it.tensor.numel() * it.tensor.element_size() for it in items))
    opts = session.options
    checks = session.checks = StateChecks(opts.nonfinite, opts.check_replicas, session.session.world)
    apart = session.placement.own_replicated and rounds is None  # replicated pieces in files of their own
    try:
        for rnd in [items] if rounds is None else rounds:
            checks.see(flat.items if rounds is None else rnd, mine)
            with paused_gc():
                jobs = [j for it in rnd if it.name in mine and not (apart and it.replicated)
                        for j in session.split(it.name, it.tensor, it.global_offset)]
                rep = [j for it in rnd if apart and it.replicated and it.name in mine
                       for j in session.split(it.name, it.tensor, it.global_offset)]
            whole = arena is not None and rounds is None and not rep and len(jobs) and len(items) == len(flat.items)
            session.write(jobs, arena=arena if whole else None, last=rounds is None and not rep)
            if rep:
                session.write(rep, tag=REP_TAG)
    except Exception as e:  # any failure must still reach the commit protocol and abort
        return e
    return checks.error()
