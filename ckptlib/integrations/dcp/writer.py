"""``CkptlibWriter``: a DCP ``StorageWriter`` that saves through ckptlib's save session.

``dcp.async_save`` first calls :meth:`CkptlibWriter.stage` on its caller's thread (the training
thread, in program order): it reserves the save's turn on ckptlib's coordinator
(:mod:`ckptlib.coord.turns`), so that the upload thread's session meets in the same place among
the process's other ckptlib flows on every rank, then copies the state dict to CPU as DCP's own
default stager does. Then DCP drives, on the thread that called ``dcp.save`` (DCP's upload
thread for ``async_save``), every rank unless noted: ``reset`` -> ``storage_meta`` ->
``set_up_storage_writer`` -> ``prepare_local_plan`` (:meth:`SaveSession.begin`, collective
over ``default_coordinator()``) -> ``prepare_global_plan`` (coordinator: stamps the save id into every plan) -> ``write_data``
(:meth:`SaveSession.write`, then :meth:`SaveSession.collect`) -> ``finish`` (coordinator:
:meth:`SaveSession.publish`, the commit point). The turn is claimed by the upload thread in
``prepare_local_plan`` and ended where this rank's session ends (``write_data`` on the other
ranks, ``finish`` on the coordinator, or a failure there). The mapping table:
docs/integrations/dcp.md.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptlib.coord.coordinator import default_coordinator
from ckptlib.coord.turns import Turn
from ckptlib.engine.save import DEFAULT_CHUNK_BYTES, SaveOptions, SaveSession
from ckptlib.engine.writer import ChunkJob
from ckptlib.errors import CheckpointError, CommitError, UnsupportedValueError
from ckptlib.format.dtypes import NAMES
from ckptlib.integrations.dcp.location import Located
from ckptlib.integrations.dcp.metadata import (
    DCP_VERSION,
    EXTRA_KEY,
    KINDS,
    NOT_PLAIN,
    StoredItem,
    metadata_to_json,
    plain_node,
    raw_bytes,
)

log = logging.getLogger("ckptlib")

ROUND_BYTES = 1 << 30
"""``write_data`` resolves (copies to CPU) and writes at most about this many bytes at a time."""


@dataclass(eq=False, kw_only=True)
class CkptlibWriter(Located, StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` that saves one ckptlib checkpoint folder.

    ``url`` is the checkpoint folder (any ckptlib URL); with ``step`` it is the root and the
    folder is ``step-<step>`` under it (the layout :func:`load_latest` scans);
    ``dcp.save(checkpoint_id=...)`` replaces ``url``. The folder may not exist yet or be empty
    (``mkdtemp()``); a committed checkpoint there is kept unless ``overwrite``
    (``StepExistsError``), and a folder holding other files is refused and left untouched
    (``TargetNotEmptyError``), both before any rank writes. Options (``overwrite``, ``clean_debris``,
    ``timeout`` of the whole save, ...): docs/integrations/dcp.md. One save at a time per
    instance; ``dcp.save``'s ``process_group`` must span every rank, with DCP's coordinator
    on rank 0. Picklable before a save starts (``AsyncCheckpointerType.PROCESS``). As DCP's
    ``AsyncStager`` for ``dcp.async_save`` (:meth:`stage`) it stages like DCP's default stager.
    """

    compression: str | None = None
    overwrite: bool = False
    num_files: int = 2
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    timeout: float = 600.0
    clean_debris: bool = True
    last_save_id: str | None = field(default=None, init=False)
    """Save id of the last checkpoint this writer committed."""
    _session: SaveSession | None = field(default=None, init=False, repr=False)
    _results: list[dict[str, Any]] | None = field(default=None, init=False, repr=False)
    _turn: Turn | None = field(default=None, init=False, repr=False)
    _staged_on: int | None = field(default=None, init=False, repr=False)  # the thread that called stage()

    def __post_init__(self) -> None:
        super().__post_init__()
        self._options()  # bad arguments (codec, sizes, timeout) fail here, not in dcp.save

    def _options(self) -> SaveOptions:
        return SaveOptions(compression=self.compression, chunk_bytes=self.chunk_bytes, num_files=self.num_files,
                           timeout=self.timeout, overwrite=self.overwrite)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into DCP's upload process (AsyncCheckpointerType.PROCESS): the save meets there,
        # on that process's coordinator, so the turn reserved here is given back.
        self._end_turn()
        state = self.__dict__.copy()
        state.update(_storage=None, _storage_url=None, _session=None, _results=None, _turn=None, _staged_on=None)
        return state

    # -- AsyncStager (dcp.async_save, on its caller's thread)
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``, on the thread that called it, before the upload thread starts:
        reserve this save's turn among the flows on ckptlib's coordinator (program order, the
        same on every rank; :mod:`ckptlib.coord.turns`), then return a CPU copy of
        ``state_dict`` made as DCP's own default stager makes it."""
        self._abort()  # a previous save of this instance that never reached its end
        self._end_turn()
        self._turn = default_coordinator().turn(f"DCP save of {self.checkpoint_id or 'a checkpoint_id'}")
        self._staged_on = threading.get_ident()
        try:
            return _cpu_copy(state_dict)
        except BaseException:
            self._end_turn()
            raise

    def synchronize_staging(self) -> None:
        """Staging is done when :meth:`stage` returns."""

    def close(self) -> None:
        """Nothing held between saves."""

    def _claim_turn(self) -> None:
        """``prepare_local_plan``: the upload thread takes the turn :meth:`stage` reserved. On the
        thread that staged (a plain ``dcp.save`` after an async one that failed before its
        session), that turn is stale: it ends, and the session takes a turn of its own."""
        turn = self._turn
        if turn is None:
            return
        if threading.get_ident() == self._staged_on:
            self._end_turn()
        else:
            turn.line.claim(turn)

    def _end_turn(self) -> None:
        turn, self._turn = self._turn, None
        if turn is not None:
            turn.end()

    # -- StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP: a new save; ``checkpoint_id`` (if given) is the checkpoint folder URL."""
        if checkpoint_id:
            self.url = os.fspath(checkpoint_id)
            self.step = None
        self._abort()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            self._end_turn()
            raise CheckpointError(
                "dcp.save(use_collectives=False) is not supported by ckptlib: its commit needs the "
                "coordinator to see every rank's results"
            )
        self._abort()  # a previous save of this instance that never reached finish()
        if is_coordinator != default_coordinator().is_coordinator:
            self._end_turn()
            raise CheckpointError(
                "ckptlib's DCP writer needs DCP's coordinator to be rank 0 of the job "
                "(dcp.save with the default coordinator_rank and a process group spanning every rank)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Every rank (collective over ckptlib's coordinator): begin the save session."""
        self._claim_turn()
        try:
            storage, name, step = self.open_target()
            self._session = SaveSession.begin(storage, name, step=step, options=self._options(),
                                              coordinator=default_coordinator())
        except BaseException:
            self._end_turn()
            raise
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: stamp the save id into every plan (``write_data`` refuses stale plans)."""
        if self._session is None:
            raise CommitError("prepare_global_plan() without prepare_local_plan() on this writer")
        return [dataclasses.replace(p, storage_data=self._session.save_id) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank: write this rank's items, then wait until every rank wrote (collective).

        A failure on any rank fails this call on every rank (this rank's own error, or a
        :class:`CommitError` naming the failed ranks); the staging area is then removed."""
        session = self._session
        if session is None:
            raise CommitError("write_data() without prepare_local_plan() on this writer")
        error: BaseException | None = None
        shapes: dict[str, tuple[int, ...]] = {}
        results: list[WriteResult] = []
        try:
            planned = plan.storage_data  # the save id stamped by prepare_global_plan
            if getattr(planner, "_enable_plan_caching", False) or not isinstance(planned, str):
                raise CheckpointError(
                    "ckptlib's DCP writer needs a fresh plan for every save: DCP plan caching "
                    "(enable_plan_caching=True) is not supported"
                )
            if planned != session.save_id:
                raise CommitError(f"a plan for save {planned}, not {session.save_id} (stale plan)")
            results = self._write(session, plan.items, planner, shapes)
        except Exception as e:  # every rank must reach collect(), which fails the save everywhere
            error = e
        try:
            self._results = session.collect(shapes=shapes, error=error, release=True)
        except CommitError as e:
            session.abort(e)
            self._session = None
            self._end_turn()
            if error is not None:
                raise error from None  # this rank's own error says more
            raise
        if not session.coord.is_coordinator:
            session.close()  # the outcome reaches this rank through DCP's collectives
            self._session = None
            self._end_turn()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(
        self, session: SaveSession, items: list[WriteItem], planner: SavePlanner,
        shapes: dict[str, tuple[int, ...]],
    ) -> list[WriteResult]:
        stored: list[tuple[WriteItem, StoredItem, int]] = []
        pending: list[WriteItem] = []
        pending_bytes = 0

        def flush() -> None:
            nonlocal pending, pending_bytes
            jobs: list[ChunkJob] = []
            for item in pending:
                jobs.extend(self._jobs(session, item, planner, shapes, stored, own_bytes))
            session.write(jobs)
            pending, pending_bytes = [], 0

        own_bytes: dict[str, tuple[bytes, bool]] = {}  # fqn -> (its own bytes, was an io.BytesIO)
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                value = planner.lookup_object(item.index) if hasattr(planner, "lookup_object") else NOT_PLAIN
                data = None if value is NOT_PLAIN else raw_bytes(value)
                if data is not None:  # large bytes / io.BytesIO: a payload of its own bytes, no pickle
                    own_bytes[item.index.fqn] = (data, isinstance(value, io.BytesIO))
                    pending.append(item)
                    pending_bytes += len(data)
                    continue
                node = NOT_PLAIN if value is NOT_PLAIN else plain_node(value)
                if node is not NOT_PLAIN:
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
        if pending:
            flush()
        return [WriteResult(index=item.index, size_in_bytes=n, storage_data=s) for item, s, n in stored]

    @staticmethod
    def _jobs(
        session: SaveSession,
        item: WriteItem,
        planner: SavePlanner,
        shapes: dict[str, tuple[int, ...]],
        stored: list[tuple[WriteItem, StoredItem, int]],
        own_bytes: dict[str, tuple[bytes, bool]],
    ) -> list[ChunkJob]:
        fqn = item.index.fqn
        if fqn in own_bytes:  # the value's own bytes (not the planner's torch.save of it)
            own, as_io = own_bytes[fqn]
            t = torch.frombuffer(bytearray(own), dtype=torch.uint8)
            shapes[fqn] = (t.numel(),)
            stored.append((item, StoredItem("bytes", {"t": "bytes", "ref": fqn, "io": as_io}), t.numel()))
            return session.split(fqn, t, (0,))
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            shapes[fqn] = (t.numel(),)
            stored.append((item, StoredItem("pickle"), t.numel()))
            return session.split(fqn, t, (0,))
        td = item.tensor_data
        if not isinstance(data, torch.Tensor) or td is None:
            raise UnsupportedValueError(f"{fqn}: the planner resolved a tensor item to {type(data).__name__}")
        if data.dtype not in NAMES:
            raise UnsupportedValueError(f"{fqn}: ckptlib cannot store dtype {data.dtype}")
        if tuple(data.shape) != tuple(td.chunk.sizes):
            raise CommitError(f"{fqn}: resolved shape {list(data.shape)} != planned chunk {list(td.chunk.sizes)}")
        shapes[fqn] = tuple(int(s) for s in td.size)
        stored.append((item, StoredItem("tensor"), data.numel() * data.element_size()))
        if data.numel() == 0 and all(shapes[fqn]):
            # An empty piece of a tensor that has elements (FSDP2 gives trailing ranks of a small
            # dim zero rows) holds nothing: written, it would be the tensor's only chunk entry
            # beside the whole-tensor pack row of the rank that holds it all.
            return []
        return session.split(fqn, data, tuple(int(o) for o in td.chunk.offsets))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank wrote: record DCP's items and commit atomically."""
        session, gathered = self._session, self._results
        if session is None or gathered is None:
            self._end_turn()
            raise CommitError("finish() without write_data() on this writer")
        self._session = self._results = None
        try:
            tree, extra = self._describe(metadata, results, session)
            session.publish(gathered, tree=tree, extra={EXTRA_KEY: extra})
        except BaseException as e:
            session.abort()
            self._end_turn()
            if isinstance(e, CommitError | KeyboardInterrupt | SystemExit):
                raise
            raise CommitError(f"{session.storage.url}/{session.final} was not committed: {type(e).__name__}: {e}") from e
        session.close()
        self._end_turn()
        self.last_save_id = session.save_id
        if self.clean_debris:
            try:
                from ckptlib.engine import retire

                retire.clean_debris(session.storage, {session.save_id})
            except Exception as e:  # never fails a committed save
                log.warning("ckptlib: cleaning debris after the DCP save failed: %s", e)

    def _describe(
        self, metadata: Metadata, results: list[list[WriteResult]], session: SaveSession
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The manifest's value tree (DCP keys -> tensor refs and plain values) and DCP's
        metadata as JSON, from every rank's write results."""
        stored: dict[MetadataIndex, StoredItem] = {}
        items: list[list[Any]] = []
        seen: set[str] = set()
        for res in results:
            for wr in res:
                s: StoredItem = wr.storage_data
                if s.kind not in KINDS:
                    raise CommitError(f"unknown storage record {s.kind!r}")
                stored[wr.index] = StoredItem(s.kind)
                fqn = wr.index.fqn
                if fqn in seen:
                    if s.kind != "tensor":
                        raise CommitError(f"{fqn}: non-tensor value written by two ranks")
                    continue
                seen.add(fqn)
                node = {"tensor": {"t": "tensor", "ref": fqn}, "pickle": {"t": "bytes", "ref": fqn}}.get(s.kind, s.node)
                items.append([fqn, node])
        missing = [k for k in metadata.state_dict_metadata if k not in seen]
        if missing:
            raise CommitError(f"no rank wrote {missing[:5]}")
        metadata.version = metadata.version or DCP_VERSION
        metadata.storage_data = stored
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta(checkpoint_id=self.checkpoint_id)
        metadata.storage_meta.save_id = session.save_id
        order = {k: i for i, k in enumerate(metadata.state_dict_metadata)}
        items.sort(key=lambda kv: order.get(kv[0], len(order)))
        return {"t": "dict", "items": items}, metadata_to_json(metadata, stored)

    def _abort(self) -> None:
        if self._session is not None:
            self._session.abort()
        self._session = self._results = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)


def _cpu_copy(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of ``state_dict``, made as ``dcp.async_save`` makes one without a stager of its
    own: DCP's ``DefaultStager`` with every option off, or on a torch without it (before 2.9)
    its ``BlockingAsyncStager``. Called by :meth:`CkptlibWriter.stage`."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # pragma: no cover - older torch
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return BlockingAsyncStager().stage(state_dict)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        staged = stager.stage(state_dict)  # synchronous with use_async_staging off
    finally:
        stager.close()  # drops its cache of storages, not the copy it returned
    assert isinstance(staged, dict)
    return staged
