"""The save flow: flatten -> (snapshot) -> write payloads -> gather -> commit.

Entry points, all called on every rank:
- :func:`prepare` (caller's thread): flatten ``state`` into a tree and tensor items; fails
  fast on values that cannot be saved without pickle, before any I/O.
- :func:`persist` (caller's thread for synchronous saves, the manager's background thread
  for async ones): writes this rank's payloads and runs the two-phase commit through the
  :class:`~ckptlib.coord.coordinator.Coordinator`. Returns a :class:`SaveResult`, or raises
  :class:`CommitError` on every rank, after removing the staging area.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ckptlib import crashpoints
from ckptlib.backends import Storage, deadline_scope
from ckptlib.coord.coordinator import Coordinator, LocalCoordinator
from ckptlib.engine import commit
from ckptlib.engine.gc_pause import paused_gc
from ckptlib.engine.writer import ChunkJob, split_chunks, write_files
from ckptlib.errors import (
    CheckpointError,
    CommitError,
    CommitTimeoutError,
    StepExistsError,
    UnsupportedValueError,
)
from ckptlib.format.build import build_body, encode_body
from ckptlib.format.codec import codec_for
from ckptlib.format.dtypes import dtype_name
from ckptlib.plan.assign import PieceDesc, PlanError, assign, digest
from ckptlib.plan.flatten import FlatState, TensorItem, flatten
from ckptlib.plan.trees import TreeMismatch
from ckptlib.plan.trees import merge as merge_trees

DEFAULT_CHUNK_BYTES = 32 << 20


@dataclass(slots=True)
class SaveOptions:
    compression: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    num_files: int = 2
    timeout: float = 600.0
    overwrite: bool = False

    def __post_init__(self) -> None:
        codec_for(self.compression, 1)  # ValueError for unknown compression, before any I/O


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
    """The tensor's values as a dense, standard-strided CPU tensor (a copy only when needed).

    Hot for states with many small tensors: a plain contiguous CPU tensor is returned as is,
    after five attribute checks (no new tensor object is made).
    """
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
) -> SaveResult:
    """Write this rank's share of ``flat`` and take part in the commit (every rank calls it).

    ``rounds`` (async saves streamed through a staging budget, see engine/snapshot.py):
    the tensors to write, handed out one round at a time; each round is written to its own
    files before the next is requested, and ``flat.items`` then only supplies names and
    shapes. A round that raises fails this rank's part of the save.
    """
    opts = options or SaveOptions()
    coord = coordinator or LocalCoordinator()
    deadline = time.monotonic() + opts.timeout
    created = time.time() if created is None else created
    meta_tree = encode_metadata(metadata)
    save_id = coord.agree(save_id or new_save_id(), opts.timeout)
    coord.begin_session(save_id)
    try:
        # One deadline for the whole save: every storage operation inside is bounded by it.
        with deadline_scope(storage, opts.timeout):
            return _persist(storage, final, flat, step, meta_tree, opts, coord, save_id, created, deadline, rounds)
    finally:
        coord.end_session()


def _describe(it: TensorItem) -> PieceDesc:
    t = it.tensor
    return PieceDesc(it.name, it.global_offset, tuple(t.shape), t.numel() * t.element_size(),
                     dtype_name(t.dtype), it.global_shape)


def _fail(storage: Storage, final: str, failures: dict[int, str], exists: bool = False) -> CommitError:
    detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
    timed_out = any(msg.startswith(("StorageTimeoutError", "CommitTimeoutError")) for msg in failures.values())
    cls = StepExistsError if exists else CommitTimeoutError if timed_out else CommitError
    return cls(f"checkpoint {storage.url.rstrip('/')}/{final} was not committed: {detail}", failures)


def _persist(
    storage: Storage,
    final: str,
    flat: FlatState,
    step: int | None,
    meta_tree: Any,
    opts: SaveOptions,
    coord: Coordinator,
    save_id: str,
    created: float,
    deadline: float,
    rounds: Iterable[list[TensorItem]] | None = None,
) -> SaveResult:
    # 1. The coordinator prepares the staging area; everyone learns where to write.
    staging: commit.Staging | None = None
    begin_error = None
    if coord.is_coordinator:
        try:
            staging = commit.begin(storage, final, save_id)
        except (CheckpointError, OSError) as e:
            begin_error = f"{type(e).__name__}: {e}"
    prefix, begin_error = coord.agree((staging.payload_prefix if staging else None, begin_error), _left(deadline))
    if begin_error:
        raise _fail(storage, final, {0: begin_error})

    # 2. Who writes what: replicas deduplicated, bytes balanced (coordinator plans).
    items = flat.items
    if coord.world_size > 1:
        rep = [it for it in items if it.replicated]
        shd = [it for it in items if not it.replicated]
        rep_desc = [_describe(it) for it in rep]
        mine_in = (digest(rep_desc), rep_desc if coord.is_coordinator else None, [_describe(it) for it in shd])
        everyone = coord.gather(mine_in, _left(deadline))
        plans: list[Any] | None = None
        if coord.is_coordinator:
            assert everyone is not None
            try:
                plans = [("ok", p) for p in assign(everyone[0][1], [e[0] for e in everyone], [e[2] for e in everyone])]
            except PlanError as e:
                plans = [("error", str(e))] * coord.world_size
        status, plan = coord.scatter(plans, _left(deadline))
        if status == "error":
            if staging is not None:
                commit.abort(storage, staging)
            raise _fail(storage, final, {0: plan})
        items = [rep[i] for i in plan.replicated] + [shd[i] for i in plan.sharded]

    # 3. Write; report; the coordinator waits for every rank (or judges it dead).
    result: dict[str, Any]
    error: str | None = None
    try:
        if rounds is None:
            jobs: list[ChunkJob] = []
            with paused_gc():
                for it in items:
                    jobs.extend(split_chunks(it.name, cpu_contiguous(it.tensor), it.global_offset, opts.chunk_bytes))
            files, written = write_files(
                storage, prefix, coord.rank, jobs, compression=opts.compression, num_files=opts.num_files,
                timeout=_left(deadline),
            )
        else:
            files, written = _write_rounds(storage, prefix, coord.rank, rounds, items, opts)
        crashpoints.point("before_commit", coord.rank)
        result = {"files": files, "chunks": written, "tree": flat.tree, "per_rank": flat.per_rank,
                  "shapes": {it.name: it.global_shape for it in flat.items}}
    except Exception as e:  # any failure must still reach the commit protocol and abort
        error = f"{type(e).__name__}: {e}"
        result = {"error": error}
    coord.report_done(error)
    if coord.is_coordinator:
        failures = coord.wait_all_done(deadline)
        coord.release(failures)
    else:
        failures = coord.wait_release(deadline)
    if failures:
        if staging is not None:
            commit.abort(storage, staging)
        raise _fail(storage, final, failures)

    # 4. Everyone is alive and wrote: gather results, publish, agree on the outcome.
    results = coord.gather(result, _left(deadline))
    outcome: dict[str, Any] = {"failures": {}}
    body: dict[str, Any] | None = None
    if coord.is_coordinator:
        assert results is not None and staging is not None
        failures = {r: res["error"] for r, res in enumerate(results) if "error" in res}
        try:
            if failures:
                raise CommitError("some ranks failed")
            with paused_gc():
                one = len(results) == 1 and not results[0].get("per_rank")  # nothing to merge
                tree = results[0]["tree"] if one else merge_trees([res["tree"] for res in results])
                body = build_body(results, step, save_id, created, staging.mode, meta_tree, staging.payload_prefix,
                                  tree=tree)
                data = encode_body(body)
            commit.publish(storage, staging, data, overwrite=opts.overwrite)
        except TreeMismatch as e:
            outcome = {"failures": {0: str(e)}}
        except Exception as e:
            outcome = {"failures": failures or {0: f"{type(e).__name__}: {e}"}, "exists": isinstance(e, FileExistsError)}
        if outcome["failures"]:
            commit.abort(storage, staging)
    outcome = coord.share_outcome(outcome if coord.is_coordinator else None, deadline)
    if outcome["failures"]:
        raise _fail(storage, final, {int(k): v for k, v in outcome["failures"].items()}, bool(outcome.get("exists")))
    return SaveResult(save_id, sum(size for _, size in body["files"]) if body else 0)


def _write_rounds(
    storage: Storage,
    prefix: str,
    rank: int,
    rounds: Iterable[list[TensorItem]],
    items: list[TensorItem],
    opts: SaveOptions,
) -> tuple[list[tuple[str, int]], list[Any]]:
    """Write streamed rounds, each into its own files; only this rank's assigned items."""
    mine = {it.name for it in items}
    files: list[tuple[str, int]] = []
    written: list[Any] = []
    for k, rnd in enumerate(rounds):
        jobs: list[ChunkJob] = []
        for it in rnd:
            if it.name in mine:
                jobs.extend(split_chunks(it.name, cpu_contiguous(it.tensor), it.global_offset, opts.chunk_bytes))
        f, w = write_files(
            storage, prefix, rank, jobs, compression=opts.compression, num_files=opts.num_files,
            tag=f"p{k}" if k else "", timeout=opts.timeout,
        )
        files += f
        written += w
    return files, written


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())
