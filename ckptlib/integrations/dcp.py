"""torch.distributed.checkpoint (DCP) storage through ckptlib.

:class:`CkptlibWriter` and :class:`CkptlibReader` plug into ``dcp.save`` / ``dcp.async_save``
/ ``dcp.load``: DCP keeps doing what it is good at (planning, deduplication, resharding,
``get_state_dict``/``set_state_dict``), ckptlib does the storage -- packed, checksummed payload
files written by its writer pipeline, one atomic commit (rename on POSIX, create-only put on
object stores), any ckptlib backend (local path, ``memory://``, ``s3://``) with its retries,
and a JSON manifest instead of DCP's pickled ``.metadata``. :func:`load_latest` is the resume
helper: newest consistent step first, older ones when a step turns out to be corrupt.

Who calls what (DCP drives; every method runs on the thread that called ``dcp.save`` -- for
``dcp.async_save`` that is DCP's upload thread -- on every rank unless noted):

save: ``reset`` (only if a ``checkpoint_id`` is given) -> ``storage_meta`` ->
``set_up_storage_writer`` -> ``prepare_local_plan`` -> ``prepare_global_plan`` (coordinator:
picks the save id and opens the staging area with :func:`ckptlib.engine.commit.begin`; the
payload prefix travels to the ranks inside their plans) -> ``write_data`` (every rank writes
its items with :func:`ckptlib.engine.writer.write_files`) -> ``finish`` (coordinator: builds
the ckptlib manifest, DCP's metadata as JSON in its ``extra["dcp"]``, and publishes it with
:func:`ckptlib.engine.commit.publish` -- the commit point).

load: ``reset`` -> ``read_metadata`` (reads and validates the manifest, rebuilds DCP's
``Metadata`` from JSON) -> ``set_up_storage_reader`` -> ``prepare_local_plan`` (refuses
pickled objects unless allowed, checks every requested box) -> ``prepare_global_plan`` ->
``read_data`` (ckptlib's reader: checksums verified, boxes placed into DCP's target tensors).

Non-tensor values (DCP's ``BYTE_IO`` items: learning rates, step counters, ...). DCP would
``torch.save`` them on save and ``torch.load(weights_only=False)`` them on load, i.e. unpickle
bytes read from storage. ckptlib instead stores plain values (None, bool, int, float, str,
bytes, dtype, and lists/tuples/dicts of those) as JSON in the manifest; on load it rebuilds
the value from JSON and hands DCP's planner a stream that it serialised itself, in this
process, from that value -- so the only pickle DCP's planner ever unpickles was produced
locally from validated JSON, never read from storage. Any other object is refused with
:class:`~ckptlib.errors.UnsupportedValueError` unless ``allow_pickled_objects=True`` on the
writer (the ``torch.save`` bytes are then stored as a checksummed payload) *and* on the reader
(which then hands those stored bytes to DCP's planner, which unpickles them).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckptlib.backends import Storage, deadline_scope, join, open_storage
from ckptlib.engine import commit
from ckptlib.engine import save as save_flow
from ckptlib.engine.reader import Reader, Request
from ckptlib.engine.scan import check_files, read_manifest, scan
from ckptlib.engine.writer import ChunkJob, split_chunks, write_files
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitError,
    CorruptCheckpointError,
    StateMismatchError,
    UnsupportedValueError,
)
from ckptlib.format import layout
from ckptlib.format import manifest as mf
from ckptlib.format import tree as tree_codec
from ckptlib.format.build import build_body
from ckptlib.format.dtypes import DTYPES, NAMES
from ckptlib.format.validate import Checker
from ckptlib.plan.flatten import flatten

__all__ = [
    "CkptlibReader",
    "CkptlibWriter",
    "DcpCheckpoint",
    "latest_checkpoint",
    "load_latest",
    "metadata_from_json",
    "metadata_to_json",
    "step_url",
]

log = logging.getLogger("ckptlib")

EXTRA_KEY = "dcp"
JSON_SCHEMA = 1
ROUND_BYTES = 1 << 30
"""``write_data`` resolves (copies to CPU) and writes at most about this many bytes at a time."""

_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_LAYOUT_NAMES = {v: k for k, v in _LAYOUTS.items()}
_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}
_KINDS = ("tensor", "json", "pickle")
try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION as _DCP_VERSION
except ImportError:  # older torch
    _DCP_VERSION = "1.0.0"


# --------------------------------------------------------------------------- locations


def _split(url: str | os.PathLike[str]) -> tuple[str, str]:
    from ckptlib.api import split_url

    return split_url(url)


def step_url(root: str | os.PathLike[str], step: int) -> str:
    """The folder URL of ``step`` under ``root`` (``<root>/step-000000000042``): the layout
    :func:`load_latest`, ``ckptlib ls`` and ``CheckpointManager`` scan."""
    return os.fspath(root).rstrip("/") + "/" + layout.step_dir(step)


def _resolve(url: str | os.PathLike[str] | None, step: int | None) -> tuple[str, str, int | None]:
    """``(parent URL, folder name, step)`` for a checkpoint folder URL (or root + step)."""
    if url is None:
        raise ValueError("a checkpoint URL is required (pass it here or as dcp's checkpoint_id)")
    if step is not None:
        url = step_url(url, step)
    parent, name = _split(url)
    if not name:
        raise ValueError(f"{url!r} names no checkpoint folder")
    return parent, name, layout.parse_step(name)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class _WritePlan:
    """``SavePlan.storage_data`` set by the coordinator: where this save's payloads go."""

    save_id: str
    prefix: str


@dataclass(frozen=True, slots=True)
class _RankPart:
    """What one rank wrote (carried to the coordinator on its first ``WriteResult``)."""

    save_id: str
    files: list[tuple[str, int]]
    chunks: list[Any]
    shapes: dict[str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class StoredItem:
    """``WriteResult.storage_data`` and ``Metadata.storage_data`` values: where an item lives.

    ``kind`` is ``tensor`` (a box of ``manifest.tensors[fqn]``), ``json`` (a plain value in
    the manifest's tree, ``node`` while saving) or ``pickle`` (``torch.save`` bytes stored
    as the 1-D uint8 tensor ``manifest.tensors[fqn]``).
    """

    kind: str
    node: Any = None
    part: _RankPart | None = field(default=None, compare=False)


# --------------------------------------------------------------------------- metadata <-> JSON


def _plain_node(value: Any) -> Any:
    """The manifest-tree node of ``value`` if it is a plain value (no tensors, no objects),
    else ``_NOT_PLAIN``."""
    try:
        flat = flatten(value, inline_bytes=True)
    except (UnsupportedValueError, TypeError, ValueError, RecursionError):
        return _NOT_PLAIN
    if flat.items or not _only_plain(flat.tree):
        return _NOT_PLAIN
    return flat.tree


_NOT_PLAIN = object()


def _only_plain(node: Any) -> bool:
    if node is None or isinstance(node, bool | int | float | str):
        return True
    if not isinstance(node, dict):
        return False
    kind = node.get("t")
    if kind in ("float", "dtype") or (kind == "bytes" and "b64" in node):
        return True
    if kind == "dict":
        return all(_only_plain(v) for _, v in node["items"])
    if kind in ("list", "tuple"):
        return all(_only_plain(v) for v in node["items"])
    return False  # tensors, stateful objects, per-rank values


def metadata_to_json(md: Metadata, stored: dict[MetadataIndex, StoredItem]) -> dict[str, Any]:
    """DCP's ``Metadata`` as JSON (``manifest.extra["dcp"]``). Raises ``UnsupportedValueError``
    for anything that has no exact JSON form (an unknown dtype or layout, custom planner data)."""
    sdm: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"kind": "bytes"}
            continue
        if not isinstance(m, TensorStorageMetadata):
            raise UnsupportedValueError(f"{fqn}: unknown DCP storage metadata {type(m).__name__}")
        p = m.properties
        if (
            p.dtype not in NAMES
            or p.layout not in _LAYOUT_NAMES
            or p.memory_format not in _MEMORY_FORMAT_NAMES
        ):
            raise UnsupportedValueError(
                f"{fqn}: dtype {p.dtype} / layout {p.layout} cannot be stored"
            )
        sdm[fqn] = {
            "kind": "tensor",
            "dtype": NAMES[p.dtype],
            "layout": _LAYOUT_NAMES[p.layout],
            "requires_grad": bool(p.requires_grad),
            "memory_format": _MEMORY_FORMAT_NAMES[p.memory_format],
            "pin_memory": bool(p.pin_memory),
            "size": [int(s) for s in m.size],
            "chunks": [[[int(o) for o in c.offsets], [int(s) for s in c.sizes]] for c in m.chunks],
        }
    planner = None
    if md.planner_data is not None:
        planner = _plain_node(md.planner_data)
        if planner is _NOT_PLAIN:
            raise UnsupportedValueError(
                f"the save planner's planner_data ({type(md.planner_data).__name__}) has no JSON form; "
                "ckptlib does not pickle metadata"
            )
    sm = md.storage_meta
    storage_meta = None
    if sm is not None:
        storage_meta = {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": [str(x) for x in sm.modules],
        }
    return {
        "schema": JSON_SCHEMA,
        "version": md.version,
        "state_dict_metadata": sdm,
        "storage_data": [
            [idx.fqn, None if idx.offset is None else [int(o) for o in idx.offset], s.kind]
            for idx, s in stored.items()
        ],
        "planner_data": planner,
        "storage_meta": storage_meta,
    }


def metadata_from_json(
    obj: Any, m: mf.Manifest, where: str = ""
) -> tuple[Metadata, dict[str, Any]]:
    """Rebuild DCP's ``Metadata`` from ``manifest.extra["dcp"]`` (untrusted input, no pickle).

    Returns ``(metadata, values)``, ``values`` being the decoded plain values of ``json`` items.
    Everything is checked against the manifest (which ckptlib validated): tensors exist with
    the recorded dtype and size, chunk boxes lie inside them, references resolve.
    """
    c = Checker(where, "DCP metadata: ")
    obj = c.typed(obj, dict, "extra.dcp")
    if obj.get("schema") != JSON_SCHEMA:
        raise c.fail(f"unknown schema {obj.get('schema')!r:.40}")
    sdm: dict[str, Any] = {}
    for fqn, e in c.typed(obj.get("state_dict_metadata"), dict, "state_dict_metadata").items():
        e = c.typed(e, dict, f"entry {fqn!r:.200}")
        kind = e.get("kind")
        if kind == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        if kind != "tensor":
            raise c.fail(f"{fqn!r:.200}: unknown kind {kind!r:.40}")
        if (
            e.get("dtype") not in DTYPES
            or e.get("layout") not in _LAYOUTS
            or e.get("memory_format") not in _MEMORY_FORMATS
        ):
            raise c.fail(f"{fqn!r:.200}: dtype, layout or memory_format not allowed")
        size = c.ints(e.get("size"), f"{fqn!r:.200} size")
        t = m.tensors.get(fqn)
        if t is None or t.dtype != e["dtype"] or list(t.shape) != size:
            raise c.fail(
                f"{fqn!r:.200} does not match the manifest's tensor (missing, dtype or shape)"
            )
        chunks = []
        for ch in c.typed(e.get("chunks"), list, f"{fqn!r:.200} chunks"):
            if type(ch) is not list or len(ch) != 2:
                raise c.fail(f"{fqn!r:.200}: chunk must be [offsets, sizes]")
            off, sz = c.ints(ch[0], "chunk offsets"), c.ints(ch[1], "chunk sizes")
            if (
                len(off) != len(size)
                or len(sz) != len(size)
                or any(o + s > n for o, s, n in zip(off, sz, size, strict=True))
            ):
                raise c.fail(f"{fqn!r:.200}: chunk {off}+{sz} lies outside the tensor {size}")
            chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
        props = TensorProperties(
            dtype=DTYPES[e["dtype"]],
            layout=_LAYOUTS[e["layout"]],
            requires_grad=c.typed(e.get("requires_grad"), bool, "requires_grad"),
            memory_format=_MEMORY_FORMATS[e["memory_format"]],
            pin_memory=c.typed(e.get("pin_memory"), bool, "pin_memory"),
        )
        sdm[fqn] = TensorStorageMetadata(props, torch.Size(size), chunks)

    tree = tree_codec.decode(m.tree, m.tensors, where)
    if not isinstance(tree, dict):
        raise c.fail("the manifest's tree must be a dict of DCP keys")
    stored: dict[MetadataIndex, StoredItem] = {}
    values: dict[str, Any] = {}
    for ent in c.typed(obj.get("storage_data"), list, "storage_data"):
        if (
            type(ent) is not list
            or len(ent) != 3
            or not isinstance(ent[0], str)
            or ent[2] not in _KINDS
        ):
            raise c.fail("storage_data entry must be [fqn, offset|null, kind]")
        fqn, off, kind = ent
        if fqn not in sdm:
            raise c.fail(f"storage_data names {fqn!r:.200}, which the state_dict_metadata lacks")
        if kind == "tensor":
            if not isinstance(sdm[fqn], TensorStorageMetadata):
                raise c.fail(f"{fqn!r:.200}: tensor storage for a non-tensor entry")
            off = c.ints(off, "storage offset")
        elif isinstance(sdm[fqn], TensorStorageMetadata) or off is not None:
            raise c.fail(f"{fqn!r:.200}: bytes storage for a tensor entry")
        node = tree.get(fqn, _NOT_PLAIN)
        if kind == "tensor" and not isinstance(node, tree_codec.TensorRef):
            raise c.fail(f"{fqn!r:.200}: the tree does not reference its tensor")
        if kind == "pickle":
            t = m.tensors.get(fqn)
            if (
                not isinstance(node, tree_codec.BytesRef)
                or t is None
                or t.dtype != "uint8"
                or len(t.shape) != 1
            ):
                raise c.fail(
                    f"{fqn!r:.200}: pickled bytes must be a 1-D uint8 tensor referenced from the tree"
                )
        if kind == "json":
            if node is _NOT_PLAIN or _has_refs(node):
                raise c.fail(f"{fqn!r:.200}: no plain value in the tree")
            values[fqn] = node
        stored[MetadataIndex(fqn, off)] = StoredItem(kind)

    planner_data = obj.get("planner_data")
    if planner_data is not None:
        planner_data = tree_codec.decode(planner_data, (), where)
    sm = obj.get("storage_meta")
    storage_meta = None
    if sm is not None:
        sm = c.typed(sm, dict, "storage_meta")
        cid, sid, mods = sm.get("checkpoint_id"), sm.get("save_id"), sm.get("modules", [])
        if not (cid is None or isinstance(cid, str)) or not (sid is None or isinstance(sid, str)):
            raise c.fail("storage_meta ids must be strings")
        if type(mods) is not list or not all(isinstance(x, str) for x in mods):
            raise c.fail("storage_meta modules must be strings")
        storage_meta = StorageMeta(checkpoint_id=cid, save_id=sid, modules=list(mods))
    version = obj.get("version")
    if version is not None and not isinstance(version, str):
        raise c.fail("version must be a string")
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=planner_data,
        storage_data=stored,
        storage_meta=storage_meta,
        version=version,
    )
    return md, values


def _has_refs(v: Any) -> bool:
    if isinstance(
        v,
        tree_codec.TensorRef | tree_codec.BytesRef | tree_codec.PerRankSaved | tree_codec.Stateful,
    ):
        return True
    if isinstance(v, dict):
        return any(_has_refs(x) for x in v.values())
    if isinstance(v, list | tuple):
        return any(_has_refs(x) for x in v)
    return False


# --------------------------------------------------------------------------- writer


class _Located:
    """Where a writer or reader points: ``url`` (+ ``step``) and its storage, opened once.

    Shared by :class:`CkptlibWriter` and :class:`CkptlibReader`; DCP calls them on the
    training thread (or an async-save thread), one save or load at a time per instance.
    """

    url: str | None
    step: int | None
    storage_options: dict[str, Any] | None
    _storage: Storage | None
    _storage_url: str | None

    def _open_target(self) -> tuple[Storage, str, int | None]:
        """(storage of the parent folder, checkpoint folder name, step); reopened on a new URL."""
        parent, name, step = _resolve(self.url, self.step)
        if self._storage is None or self._storage_url != parent:
            self._storage = open_storage(parent, self.storage_options)
            self._storage_url = parent
        return self._storage, name, step

    @property
    def checkpoint_id(self) -> str | None:
        if self.url is None:
            return None
        return step_url(self.url, self.step) if self.step is not None else self.url


class CkptlibWriter(_Located, StorageWriter):
    """A DCP ``StorageWriter`` that saves one ckptlib checkpoint folder.

    ``url`` is the checkpoint folder (any ckptlib URL: a local path, ``memory://...``,
    ``s3://bucket/...``); with ``step`` it is the root and the folder is ``step-<step>``
    under it (the layout :func:`load_latest` scans). ``dcp.save(checkpoint_id=...)`` replaces
    ``url`` (a folder URL). One instance may be reused for several saves, one at a time.

    ``allow_pickled_objects``: store non-plain values as DCP's ``torch.save`` bytes (see the
    module docstring); off by default, such values raise ``UnsupportedValueError``.
    ``overwrite``: replace a committed checkpoint already at the folder (else
    ``StepExistsError``). ``clean_debris``: after a commit, remove the leftovers of crashed
    saves under the root (as ``CheckpointManager`` does).

    Instances are picklable before a save starts (``AsyncCheckpointerType.PROCESS``).
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        step: int | None = None,
        storage_options: dict[str, Any] | None = None,
        compression: str | None = None,
        overwrite: bool = False,
        allow_pickled_objects: bool = False,
        num_files: int = 2,
        chunk_bytes: int = save_flow.DEFAULT_CHUNK_BYTES,
        timeout: float = 600.0,
        clean_debris: bool = True,
    ) -> None:
        super().__init__()
        save_flow.SaveOptions(compression=compression)  # ValueError for an unknown codec, now
        self.url = None if url is None else os.fspath(url)
        self.step = step
        self.storage_options = storage_options
        self.compression = compression
        self.overwrite = overwrite
        self.allow_pickled_objects = allow_pickled_objects
        self.num_files = num_files
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.clean_debris = clean_debris
        self._storage: Storage | None = None
        self._storage_url: str | None = None
        self._is_coordinator = True
        self._rank = 0
        self._staging: commit.Staging | None = None
        self.last_save_id: str | None = None
        """Save id of the last checkpoint this writer committed."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_storage"] = None
        state["_storage_url"] = None
        state["_staging"] = None
        return state

    # -- where
    def _target(self) -> tuple[Storage, str, int | None]:
        return self._open_target()

    # -- StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP: a new save; ``checkpoint_id`` (if given) is the checkpoint folder URL."""
        if checkpoint_id:
            self.url = os.fspath(checkpoint_id)
            self.step = None
        self._abort_staging()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise CheckpointError(
                "dcp.save(use_collectives=False) is not supported by ckptlib: its commit needs the "
                "coordinator to see every rank's results"
            )
        self._is_coordinator = is_coordinator
        self._rank = int(kwargs.get("rank") or 0)
        self._abort_staging()  # a previous save of this instance that never reached finish()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: choose the save id and open the staging area (``commit.begin``)."""
        storage, name, _ = self._target()
        save_id = save_flow.new_save_id()
        with deadline_scope(storage, self.timeout):
            storage.makedirs("")
            self._staging = commit.begin(storage, name, save_id)
        wp = _WritePlan(save_id, self._staging.payload_prefix)
        return [dataclasses.replace(p, storage_data=wp) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank: write this rank's items through ckptlib's writer pipeline."""
        wp = plan.storage_data
        if getattr(planner, "_enable_plan_caching", False) or not isinstance(wp, _WritePlan):
            raise CheckpointError(
                "ckptlib's DCP writer needs a fresh plan for every save: DCP plan caching "
                "(enable_plan_caching=True) is not supported"
            )
        storage, _, _ = self._target()
        try:
            with deadline_scope(storage, self.timeout):
                results = self._write(storage, wp, plan.items, planner)
        except BaseException:
            # DCP will not call finish(); the coordinator removes its staging area now. (A
            # failure on another rank leaves it to the next save of this writer, or to the
            # debris cleanup after the next commit under this root.)
            if self._is_coordinator:
                self._abort_staging()
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(
        self, storage: Storage, wp: _WritePlan, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        deadline = time.monotonic() + self.timeout
        stored: list[tuple[WriteItem, StoredItem, int]] = []
        shapes: dict[str, tuple[int, ...]] = {}
        files: list[tuple[str, int]] = []
        chunks: list[Any] = []
        pending: list[WriteItem] = []
        pending_bytes = 0

        def flush() -> None:
            nonlocal pending, pending_bytes
            if not pending:
                return
            jobs: list[ChunkJob] = []
            for item in pending:
                jobs.extend(self._jobs(item, planner, shapes, stored))
            tag = f"p{len(files)}" if files else ""
            f, w = write_files(
                storage,
                wp.prefix,
                self._rank,
                jobs,
                compression=self.compression,
                num_files=self.num_files,
                tag=tag,
                timeout=max(0.1, deadline - time.monotonic()),
            )
            files.extend(f)
            chunks.extend(w)
            pending, pending_bytes = [], 0

        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                value = (
                    planner.lookup_object(item.index)
                    if hasattr(planner, "lookup_object")
                    else _NOT_PLAIN
                )
                node = _NOT_PLAIN if value is _NOT_PLAIN else _plain_node(value)
                if node is not _NOT_PLAIN:
                    stored.append((item, StoredItem("json", node), 0))
                    continue
                if not self.allow_pickled_objects:
                    raise UnsupportedValueError(
                        f"{item.index.fqn}: a {type(value).__name__} value would be stored as pickle; "
                        "convert it to a plain value (None, bool, int, float, str, bytes, list, tuple, "
                        "dict) or pass allow_pickled_objects=True to the writer and the reader"
                    )
            size = item.tensor_storage_size() or 0
            if pending and pending_bytes + size > ROUND_BYTES:
                flush()
            pending.append(item)
            pending_bytes += size
        flush()

        part = _RankPart(wp.save_id, files, chunks, shapes)
        out = [
            WriteResult(index=item.index, size_in_bytes=n, storage_data=s) for item, s, n in stored
        ]
        if out:
            out[0] = dataclasses.replace(
                out[0], storage_data=dataclasses.replace(out[0].storage_data, part=part)
            )
        elif files:
            raise CommitError("wrote payload files but has no write results to report them")
        return out

    def _jobs(
        self,
        item: WriteItem,
        planner: SavePlanner,
        shapes: dict[str, tuple[int, ...]],
        stored: list[tuple[WriteItem, StoredItem, int]],
    ) -> list[ChunkJob]:
        fqn = item.index.fqn
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            t = (
                torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            shapes[fqn] = (t.numel(),)
            stored.append((item, StoredItem("pickle"), t.numel()))
            return split_chunks(fqn, t, (0,), self.chunk_bytes)
        td = item.tensor_data
        if not isinstance(data, torch.Tensor) or td is None:
            raise UnsupportedValueError(
                f"{fqn}: the planner resolved a tensor item to {type(data).__name__}"
            )
        if data.dtype not in NAMES:
            raise UnsupportedValueError(f"{fqn}: ckptlib cannot store dtype {data.dtype}")
        t = save_flow.cpu_contiguous(data)
        if tuple(t.shape) != tuple(td.chunk.sizes):
            raise CommitError(
                f"{fqn}: resolved shape {list(t.shape)} != planned chunk {list(td.chunk.sizes)}"
            )
        shapes[fqn] = tuple(int(s) for s in td.size)
        stored.append((item, StoredItem("tensor"), t.numel() * t.element_size()))
        return split_chunks(fqn, t, tuple(int(o) for o in td.chunk.offsets), self.chunk_bytes)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank wrote: build the manifest and commit atomically."""
        storage, _, step = self._target()
        staging = self._staging
        if staging is None:
            raise CommitError("finish() without prepare_global_plan() on this writer")
        self._staging = None
        try:
            with deadline_scope(storage, self.timeout):
                body = self._body(metadata, results, staging, step)
                data = mf.encode_body(body)
                mf.decode(
                    data, f"{storage.url}/{staging.final}/{mf.MANIFEST_NAME}"
                )  # never publish what we would refuse
                commit.publish(storage, staging, data, overwrite=self.overwrite)
        except BaseException as e:
            commit.abort(storage, staging)
            if isinstance(e, CommitError | KeyboardInterrupt | SystemExit):
                raise
            raise CommitError(
                f"{storage.url}/{staging.final} was not committed: {type(e).__name__}: {e}"
            ) from e
        self.last_save_id = staging.save_id
        if self.clean_debris:
            try:
                from ckptlib.engine import retire

                retire.clean_debris(storage, {staging.save_id})
            except Exception as e:  # never fails a committed save
                log.warning("ckptlib: cleaning debris after the DCP save failed: %s", e)

    def _body(
        self,
        metadata: Metadata,
        results: list[list[WriteResult]],
        staging: commit.Staging,
        step: int | None,
    ) -> dict[str, Any]:
        parts: list[dict[str, Any]] = []
        stored: dict[MetadataIndex, StoredItem] = {}
        items: list[list[Any]] = []
        seen: set[str] = set()
        for rank, res in enumerate(results):
            part = res[0].storage_data.part if res else None
            if part is not None and part.save_id != staging.save_id:
                raise CommitError(
                    f"rank {rank} wrote for save {part.save_id}, not {staging.save_id} (stale plan)"
                )
            parts.append(
                {"files": part.files, "chunks": part.chunks, "tree": None, "shapes": part.shapes}
                if part is not None
                else {"files": [], "chunks": [], "tree": None, "shapes": {}}
            )
            for wr in res:
                s: StoredItem = wr.storage_data
                if s.kind not in _KINDS:
                    raise CommitError(f"unknown storage record {s.kind!r}")
                stored[wr.index] = StoredItem(s.kind)
                fqn = wr.index.fqn
                if fqn in seen:
                    if s.kind != "tensor":
                        raise CommitError(f"{fqn}: non-tensor value written by two ranks")
                    continue
                seen.add(fqn)
                node = {
                    "tensor": {"t": "tensor", "ref": fqn},
                    "pickle": {"t": "bytes", "ref": fqn},
                }.get(s.kind, s.node)
                items.append([fqn, node])
        missing = [k for k in metadata.state_dict_metadata if k not in seen]
        if missing:
            raise CommitError(f"no rank wrote {missing[:5]}")
        metadata.version = metadata.version or _DCP_VERSION
        metadata.storage_data = stored
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta(checkpoint_id=self.checkpoint_id)
        metadata.storage_meta.save_id = staging.save_id
        body = build_body(
            parts, step, staging.save_id, time.time(), staging.mode, None, staging.payload_prefix, tree=None
        )
        order = {k: i for i, k in enumerate(metadata.state_dict_metadata)}
        items.sort(key=lambda kv: order.get(kv[0], len(order)))
        body["tree"] = {"t": "dict", "items": items}
        body["extra"] = {EXTRA_KEY: metadata_to_json(metadata, stored)}
        return body

    def _abort_staging(self) -> None:
        if self._staging is not None and self._storage is not None:
            commit.abort(self._storage, self._staging)
        self._staging = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)


# --------------------------------------------------------------------------- reader


class CkptlibReader(_Located, StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`CkptlibWriter`.

    ``url`` (or ``url`` + ``step``) names the checkpoint folder, as for the writer. Every
    byte is checked against the manifest's checksums while reading (``verify=False`` skips
    that); a mismatch is a :class:`CorruptCheckpointError` (inside DCP's
    ``CheckpointException`` when it crosses DCP). ``allow_pickled_objects``: hand values
    saved as ``torch.save`` bytes to DCP's planner, which unpickles them (off by default:
    such a checkpoint is refused with ``UnsupportedValueError`` before any payload is read).
    ``last_error`` keeps the last typed error this reader raised (DCP wraps errors from
    ``read_metadata`` into an ``AssertionError``).
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        step: int | None = None,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        allow_pickled_objects: bool = False,
        threads: int = 4,
        timeout: float | None = 600.0,
    ) -> None:
        super().__init__()
        self.url = None if url is None else os.fspath(url)
        self.step = step
        self.storage_options = storage_options
        self.verify = verify
        self.allow_pickled_objects = allow_pickled_objects
        self.threads = threads
        self.timeout = timeout
        self.last_error: BaseException | None = None
        self.stats: dict[str, int] = {}
        self._storage: Storage | None = None
        self._storage_url: str | None = None
        self._manifest: mf.Manifest | None = None
        self._values: dict[str, Any] = {}
        self._stored: dict[MetadataIndex, StoredItem] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(
            _storage=None,
            _storage_url=None,
            _manifest=None,
            _values={},
            _stored={},
            last_error=None,
        )
        return state

    def _target(self) -> tuple[Storage, str]:
        storage, name, _ = self._open_target()
        return storage, name

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.url = os.fspath(checkpoint_id)
            self.step = None
        self._manifest = None
        self._values = {}
        self._stored = {}
        self.last_error = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Every rank: read and validate the manifest, rebuild DCP's metadata from JSON."""
        if kwargs.get("rank") is not None:
            raise CheckpointNotFoundError("ckptlib writes no rank-local DCP metadata")
        try:
            storage, name = self._target()
            m = read_manifest(storage, name)
            where = f"{storage.url.rstrip('/')}/{join(name, mf.MANIFEST_NAME)}"
            check_files(storage, name, m)
            extra = m.extra.get(EXTRA_KEY)
            if extra is None:
                raise CorruptCheckpointError(
                    "not a DCP checkpoint (the manifest has no extra.dcp)", where
                )
            md, values = metadata_from_json(extra, m, where)
        except BaseException as e:
            self.last_error = e
            raise
        self._manifest, self._values = m, values
        self._stored = md.storage_data
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._manifest is None:  # metadata came from elsewhere: read our own, trusted copy
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Refuse pickled values (unless allowed) and impossible boxes before any read."""
        try:
            m = self._manifest
            assert m is not None
            pickled = []
            for item in plan.items:
                s = self._stored.get(item.storage_index) or self._stored.get(
                    MetadataIndex(item.storage_index.fqn)
                )
                if s is None:
                    raise StateMismatchError(f"{item.storage_index.fqn}: not in the checkpoint")
                if item.type == LoadItemType.BYTE_IO:
                    if s.kind == "pickle":
                        pickled.append(item.storage_index.fqn)
                    elif s.kind != "json":
                        raise StateMismatchError(
                            f"{item.storage_index.fqn}: checkpoint has a tensor, target a value"
                        )
                    continue
                if s.kind != "tensor":
                    raise StateMismatchError(
                        f"{item.storage_index.fqn}: checkpoint has a value, target a tensor"
                    )
                self._box(item, m)
            if pickled and not self.allow_pickled_objects:
                raise UnsupportedValueError(
                    f"{len(pickled)} value(s) were saved as pickle ({', '.join(pickled[:5])}); loading them "
                    "would unpickle bytes from storage. Pass allow_pickled_objects=True only for trusted checkpoints"
                )
        except BaseException as e:
            self.last_error = e
            raise
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @staticmethod
    def _box(item: ReadItem, m: mf.Manifest) -> tuple[tuple[int, ...], tuple[int, ...]]:
        e = m.tensors[item.storage_index.fqn]
        base = item.storage_index.offset or torch.Size([0] * len(e.shape))
        off = tuple(int(a) + int(b) for a, b in zip(base, item.storage_offsets, strict=True))
        lengths = tuple(int(n) for n in item.lengths)
        if (
            len(off) != len(e.shape)
            or len(lengths) != len(e.shape)
            or any(o + n > s for o, n, s in zip(off, lengths, e.shape, strict=True))
        ):
            raise CorruptCheckpointError(
                f"{item.storage_index.fqn}: box {list(off)}+{list(lengths)} lies outside the saved tensor {list(e.shape)}"
            )
        return off, lengths

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every rank: read the boxes this rank needs (checksums verified), hand them to DCP."""
        try:
            self._read(plan, planner)
        except BaseException as e:
            self.last_error = e
            raise
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        storage, name = self._target()
        m = self._manifest
        assert m is not None
        where = f"{storage.url.rstrip('/')}/{join(name, mf.MANIFEST_NAME)}"
        requests: list[Request] = []
        tensors: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        pickled: list[tuple[ReadItem, torch.Tensor]] = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                s = self._stored.get(MetadataIndex(fqn))
                if s is not None and s.kind == "pickle":
                    e = m.tensors[fqn]
                    t = torch.empty(e.shape, dtype=torch.uint8)
                    requests.append(Request(fqn, t, (0,), tuple(e.shape)))
                    pickled.append((item, t))
                    continue
                if fqn not in self._values:
                    raise CorruptCheckpointError(f"{fqn}: value missing", where)
                buf = io.BytesIO()
                # Serialised here, from a JSON-decoded plain value: DCP's planner unpickles
                # only what this process produced, never bytes read from storage.
                torch.save(self._values[fqn], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            off, lengths = self._box(item, m)
            saved = DTYPES[m.tensors[fqn].dtype]
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != lengths:
                raise StateMismatchError(
                    f"{fqn}: target box {list(target.shape)} != planned {list(lengths)}"
                )
            direct = (
                target.device.type == "cpu" and target.dtype == saved and target.is_contiguous()
            )
            dest = target if direct else torch.empty(lengths, dtype=saved)
            requests.append(Request(fqn, dest, off, lengths))
            tensors.append((item, target, dest))
        reader = Reader(
            storage, name, m, verify=self.verify, threads=self.threads, timeout=self.timeout
        )
        try:
            reader.read(requests)
        finally:
            reader.close()
        self.stats = {"bytes_read": reader.bytes_read}
        for item, target, dest in tensors:
            if dest is not target:
                target.copy_(dest)
            planner.commit_tensor(item, target)
        for item, t in pickled:
            planner.load_bytes(item, io.BytesIO(t.numpy().tobytes()))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)


# --------------------------------------------------------------------------- resume


@dataclass(slots=True)
class DcpCheckpoint:
    """A DCP checkpoint found by :func:`latest_checkpoint`."""

    step: int
    url: str
    """The folder URL, for ``CkptlibReader(url)`` or ``dcp.load(checkpoint_id=url, ...)``."""
    save_id: str
    world_size: int
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """Newer steps that were passed over, with the reason."""


def _candidates(
    root: str, storage_options: dict[str, Any] | None
) -> list[tuple[int, str, str, str, str, int]]:
    """(step, folder, status, reason, save_id, world_size), newest first (one listing)."""
    storage = open_storage(root, storage_options)
    try:
        infos = scan(storage)
    except CheckpointNotFoundError:
        return []
    out = []
    for i in infos:
        status, reason = i.status, i.reason
        if status == "committed" and (i.manifest is None or EXTRA_KEY not in i.manifest.extra):
            status, reason = "not_dcp", "a ckptlib checkpoint without DCP metadata"
        out.append((i.step, i.path, status, reason, i.save_id, i.world_size))
    return out


def latest_checkpoint(
    root: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> DcpCheckpoint | None:
    """The newest committed DCP step under ``root`` (manifest valid, every file present with its
    recorded size), or None. A quick check: payload checksums are verified when loading, and
    :func:`load_latest` falls back to older steps when that finds damage."""
    root = os.fspath(root)
    skipped = []
    for step, folder, status, reason, save_id, world in _candidates(root, storage_options):
        if status == "committed":
            return DcpCheckpoint(step, root.rstrip("/") + "/" + folder, save_id, world, skipped)
        skipped.append((step, f"{status}: {reason}"))
    return None


def _agree(value: Any, process_group: Any) -> Any:
    import torch.distributed as dist

    if (
        not (dist.is_available() and dist.is_initialized())
        or dist.get_world_size(process_group) == 1
    ):
        return value
    box = [value]
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(box, src=src, group=process_group)
    return box[0]


def _corruption(e: BaseException, reader: CkptlibReader) -> str | None:
    """Why a failed ``dcp.load`` means the checkpoint is damaged, or None for other failures.

    Decided from DCP's ``CheckpointException``, whose per-rank failures every rank receives
    identically, so all ranks take the same branch.
    """
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        bad = []
        for rank, f in sorted(failures.items()):
            exc = f[0] if isinstance(f, tuple) and f else f
            if isinstance(exc, CorruptCheckpointError):
                bad.append(f"rank {rank}: {exc}")
            elif isinstance(exc, AssertionError) and "CorruptCheckpointError" in repr(
                reader.last_error
            ):
                bad.append(f"rank {rank}: {reader.last_error}")
        return "; ".join(bad) or None
    if isinstance(e, CorruptCheckpointError):
        return str(e)
    return None


def load_latest(
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    verify: bool = True,
    allow_pickled_objects: bool = False,
) -> int | None:
    """Resume: ``dcp.load`` the newest consistent step under ``root`` into ``state_dict``.

    Collective when torch.distributed is initialized (every rank calls it; rank 0 lists the
    root and every rank gets the same candidates). Newest first: incomplete steps (crashed
    saves) are skipped; a step whose load finds damage (a checksum mismatch, a truncated or
    missing payload) on any rank is skipped by all ranks, and the next older one is loaded.
    Returns the step loaded, or None when there is no checkpoint. Raises
    ``CorruptCheckpointError`` when checkpoints exist but none is usable, and re-raises other
    load failures (a state that does not match the checkpoint).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    root = os.fspath(root)
    is_rank0 = (
        not (dist.is_available() and dist.is_initialized()) or dist.get_rank(process_group) == 0
    )
    cands = _agree(_candidates(root, storage_options) if is_rank0 else None, process_group)
    problems = []
    for step, folder, status, reason, _, _ in cands:
        if status != "committed":
            log.warning("ckptlib: skipping DCP step %d (%s): %s", step, status, reason)
            if status == "corrupt":
                problems.append(f"step {step}: {reason}")
            continue
        reader = CkptlibReader(
            root.rstrip("/") + "/" + folder,
            storage_options=storage_options,
            verify=verify,
            allow_pickled_objects=allow_pickled_objects,
        )
        try:
            dcp.load(
                state_dict, storage_reader=reader, planner=planner, process_group=process_group
            )
        except (CheckpointException, CheckpointError) as e:
            why = _agree(_corruption(e, reader), process_group)  # rank 0's verdict, on every rank
            if why is None:
                raise
            log.warning("ckptlib: DCP step %d is corrupt, trying an older one: %s", step, why)
            problems.append(f"step {step}: {why}")
            continue
        log.info("ckptlib: restored DCP step %d from %s", step, root)
        return step
    if problems:
        raise CorruptCheckpointError(
            f"no usable DCP checkpoint under {root}: " + "; ".join(problems)
        )
    return None
