"""The save flow: flatten -> (snapshot) -> write payloads -> gather -> commit.

Entry points, all called on every rank:
- :func:`prepare` (caller's thread): flatten ``state`` into a tree and tensor items; fails
  fast on values that cannot be saved without pickle, before any I/O.
- :func:`persist` (caller's thread for synchronous saves, the manager's background thread
  for async ones): writes this rank's payloads and runs the two-phase commit through the
  :class:`~ckptlib.dist.coordinator.Coordinator`. Returns a :class:`SaveResult`, or raises
  :class:`CommitError` on every rank, after removing the staging area.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from ckptlib import __version__
from ckptlib.backends import Storage
from ckptlib.dist.coordinator import Coordinator, LocalCoordinator
from ckptlib.engine import commit
from ckptlib.engine.writer import ChunkJob, WrittenPack, split_chunks, write_files
from ckptlib.errors import CheckpointError, CommitError, StepExistsError, UnsupportedValueError
from ckptlib.format import manifest as mf
from ckptlib.plan.flatten import FlatState, TensorItem, flatten

DEFAULT_CHUNK_BYTES = 32 << 20


@dataclass(slots=True)
class SaveOptions:
    compression: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    num_files: int = 2
    timeout: float = 600.0
    overwrite: bool = False


@dataclass(frozen=True, slots=True)
class SaveResult:
    save_id: str
    payload_bytes: int
    """Bytes in payload files (known on the coordinator; 0 elsewhere)."""


def prepare(state: Any, rank: int = 0) -> FlatState:
    return flatten(state, rank)


def encode_metadata(metadata: Any) -> Any:
    if metadata is None:
        return None
    flat = flatten(metadata)
    if flat.items:
        raise UnsupportedValueError("metadata must not contain tensors; put them in the state")
    return flat.tree


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a dense CPU tensor (a copy only when needed)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def jobs_for(items: list[TensorItem], chunk_bytes: int, rank: int, world_size: int) -> list[ChunkJob]:
    jobs: list[ChunkJob] = []
    for it in items:
        if it.replicated and rank != 0:
            continue  # one copy of replicated tensors (balanced across ranks: distributed issue)
        jobs.extend(split_chunks(it.name, cpu_contiguous(it.tensor), it.global_offset, chunk_bytes))
    return jobs


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
) -> SaveResult:
    opts = options or SaveOptions()
    coord = coordinator or LocalCoordinator()
    deadline = time.monotonic() + opts.timeout
    created = time.time() if created is None else created
    save_id = coord.agree(save_id or new_save_id(), opts.timeout)
    meta_tree = encode_metadata(metadata)

    staging: commit.Staging | None = None
    result: dict[str, Any]
    try:
        if coord.is_coordinator:
            staging = commit.begin(storage, final, save_id)
        prefix = coord.agree(staging.payload_prefix if staging else None, _left(deadline))
        jobs = jobs_for(flat.items, opts.chunk_bytes, coord.rank, coord.world_size)
        files, chunks = write_files(
            storage, prefix, coord.rank, jobs, compression=opts.compression, num_files=opts.num_files
        )
        result = {"ok": True, "files": files, "chunks": chunks, "tree": flat.tree,
                  "shapes": {it.name: it.global_shape for it in flat.items}}
    except CheckpointError as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    except OSError as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    results = coord.gather(result, _left(deadline))

    outcome: dict[str, Any] = {"ok": True}
    body: dict[str, Any] | None = None
    if coord.is_coordinator:
        assert results is not None
        failures = {r: res["error"] for r, res in enumerate(results) if not res["ok"]}
        if failures:
            outcome = {"ok": False, "failures": failures}
        else:
            try:
                assert staging is not None
                body = _build_body(results, step, save_id, created, staging.mode, meta_tree, staging.payload_prefix)
                commit.publish(storage, staging, mf.encode_body(body), overwrite=opts.overwrite)
            except (CheckpointError, OSError) as e:
                outcome = {"ok": False, "failures": {0: f"{type(e).__name__}: {e}"}, "exists": isinstance(e, FileExistsError)}
        if not outcome["ok"] and staging is not None:
            commit.abort(storage, staging)
    outcome = coord.agree(outcome, _left(deadline))
    if not outcome["ok"]:
        failures = {int(k): v for k, v in outcome["failures"].items()}
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
        err_cls = StepExistsError if outcome.get("exists") else CommitError
        raise err_cls(f"checkpoint {storage.url.rstrip('/')}/{final} was not committed: {detail}", failures)
    return SaveResult(save_id, sum(size for _, size in body["files"]) if body else 0)


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _build_body(
    results: list[dict[str, Any]],
    step: int | None,
    save_id: str,
    created: float,
    mode: str,
    metadata: Any,
    prefix: str,
) -> dict[str, Any]:
    """The manifest body (JSON-ready) from every rank's write results. Coordinator only.

    Builds JSON structures directly (no intermediate objects): with tens of thousands of
    small tensors, per-tensor overhead here is a visible part of the save.
    """
    files: list[list[Any]] = []
    index: dict[str, int] = {}
    strip = len(prefix) - len(prefix.rsplit("/", 1)[-1])  # keep "<save_id>/..." relative to the step
    for res in results:
        for path, size in res["files"]:
            index[path] = len(files)
            files.append([path[strip:], size])
    shapes: dict[str, tuple[int, ...]] = {}
    for res in results:
        shapes.update(res["shapes"])
    tensors: dict[str, dict[str, Any]] = {}
    packs: list[list[Any]] = []
    for res in results:
        for c in res["chunks"]:
            if isinstance(c, WrittenPack):
                pidx = len(packs)
                packs.append([index[c.file], c.start, c.length, c.checksum, c.codec, c.raw_length])
                for name, raw_offset, offset, shape, dtype in c.members:
                    gshape = shapes[name]
                    piece = [pidx, raw_offset] if shape == gshape else [pidx, raw_offset, list(offset), list(shape)]
                    entry = tensors.get(name)
                    if entry is None:
                        tensors[name] = {"dtype": dtype, "shape": list(gshape), "packed": [piece]}
                    else:
                        entry.setdefault("packed", []).append(piece)
                continue
            entry = tensors.get(c.name)
            if entry is None:
                entry = tensors[c.name] = {"dtype": c.dtype, "shape": list(shapes[c.name])}
            entry.setdefault("chunks", []).append(
                [index[c.file], c.start, c.length, c.checksum, list(c.offset), list(c.shape), c.codec]
            )
    return {
        "step": step,
        "save_id": save_id,
        "created": created,
        "world_size": len(results),
        "commit": mode,
        "checksum_algorithm": "xxh3_64",
        "library": f"ckptlib {__version__}",
        "files": files,
        "packs": packs,
        "tensors": tensors,
        "tree": results[0]["tree"],
        "metadata": metadata,
        "extra": {},
    }
