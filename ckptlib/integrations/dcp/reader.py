"""``CkptlibReader``: a DCP ``StorageReader`` for checkpoints written by ``CkptlibWriter``.

Who calls what (DCP drives, every rank, on the thread that called ``dcp.load``): ``reset`` ->
``read_metadata`` (reads and validates the manifest, rebuilds DCP's ``Metadata`` from JSON
with :func:`~ckptlib.integrations.dcp.metadata.metadata_from_json`) ->
``set_up_storage_reader`` (the coordinator alone checks every payload file's size: DCP gathers
its failure to every rank) -> ``prepare_local_plan`` (refuses pickled objects unless allowed,
checks every requested box) -> ``prepare_global_plan`` -> ``read_data`` (ckptlib's reader:
checksums verified, boxes placed into DCP's target tensors).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptlib.backends import join
from ckptlib.engine.reader import Reader, Request
from ckptlib.engine.scan import check_files, read_manifest
from ckptlib.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
    UnsupportedValueError,
)
from ckptlib.format import manifest as mf
from ckptlib.format.dtypes import DTYPES
from ckptlib.integrations.dcp.location import Located
from ckptlib.integrations.dcp.metadata import EXTRA_KEY, StoredItem, metadata_from_json


@dataclass(eq=False, kw_only=True)
class CkptlibReader(Located, StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`CkptlibWriter`.

    ``url`` (or ``url`` + ``step``) names the checkpoint folder, as for the writer. Options
    (``verify``, ``allow_pickled_objects``: the bytes policy): docs/integrations/dcp.md. A
    checksum mismatch is a :class:`CorruptCheckpointError` (inside DCP's ``CheckpointException``
    when it crosses DCP). ``last_error`` keeps the last typed error this reader raised (DCP wraps errors from
    ``read_metadata`` into an ``AssertionError``).

    Payload file sizes are checked once per load, by DCP's coordinator rank (its failure reaches
    every rank through DCP's plan step), not by every rank: N ranks make N size requests, not N².
    Each rank's reader checks the size of every file it opens. ``judged=True`` (set by
    :func:`~ckptlib.integrations.dcp.load_latest`, whose coordinator has just judged the step,
    sizes included) skips the coordinator's check too.
    """

    verify: bool = True
    judged: bool = False
    threads: int = 4
    timeout: float | None = 600.0
    last_error: BaseException | None = field(default=None, init=False, repr=False)
    stats: dict[str, int] = field(default_factory=dict, init=False)
    _manifest: mf.Manifest | None = field(default=None, init=False, repr=False)
    _values: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _stored: dict[MetadataIndex, StoredItem] = field(default_factory=dict, init=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_storage=None, _storage_url=None, _manifest=None, _values={}, _stored={}, last_error=None)
        return state

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        """Around each step DCP calls: keep the error it raises in ``last_error``, then raise it."""
        try:
            yield
        except BaseException as e:
            self.last_error = e
            raise

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
        with self._recording():
            storage, name, _ = self.open_target()
            m = read_manifest(storage, name)
            where = f"{storage.url.rstrip('/')}/{join(name, mf.MANIFEST_NAME)}"
            extra = m.extra.get(EXTRA_KEY)
            if extra is None:
                raise CorruptCheckpointError("not a DCP checkpoint (the manifest has no extra.dcp)", where)
            md, values = metadata_from_json(extra, m, where)
        self._manifest, self._values = m, values
        self._stored = md.storage_data
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank, after ``read_metadata``; the coordinator checks every payload file's size
        (sizes first: no rank allocates or reads for a checkpoint that lies), unless ``judged``."""
        if self._manifest is None:  # metadata came from elsewhere: read our own, trusted copy
            self.read_metadata()
        if is_coordinator and not self.judged:
            with self._recording():
                storage, name, _ = self.open_target()
                assert self._manifest is not None
                check_files(storage, name, self._manifest)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Refuse pickled values (unless allowed) and impossible boxes before any read."""
        with self._recording():
            m = self._manifest
            assert m is not None
            pickled = []
            for item in plan.items:
                s = self._stored.get(item.storage_index) or self._stored.get(MetadataIndex(item.storage_index.fqn))
                if s is None:
                    raise StateMismatchError(f"{item.storage_index.fqn}: not in the checkpoint")
                if item.type == LoadItemType.BYTE_IO:
                    if s.kind == "pickle":
                        pickled.append(item.storage_index.fqn)
                    elif s.kind not in ("json", "bytes"):
                        raise StateMismatchError(f"{item.storage_index.fqn}: checkpoint has a tensor, target a value")
                    continue
                if s.kind != "tensor":
                    raise StateMismatchError(f"{item.storage_index.fqn}: checkpoint has a value, target a tensor")
                self._box(item, m)
            if pickled and not self.allow_pickled_objects:
                raise UnsupportedValueError(
                    f"{len(pickled)} value(s) were saved as pickle ({', '.join(pickled[:5])}); loading them "
                    "would unpickle bytes from storage. Pass allow_pickled_objects=True only for trusted checkpoints"
                )
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
        with self._recording():
            self._read(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        storage, name, _ = self.open_target()
        m = self._manifest
        assert m is not None
        where = f"{storage.url.rstrip('/')}/{join(name, mf.MANIFEST_NAME)}"
        requests: list[Request] = []
        tensors: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        pickled: list[tuple[ReadItem, torch.Tensor]] = []
        raw: list[tuple[ReadItem, torch.Tensor, bool]] = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                s = self._stored.get(MetadataIndex(fqn))
                if s is not None and s.kind in ("pickle", "bytes"):
                    e = m.tensors[fqn]
                    t = torch.empty(e.shape, dtype=torch.uint8)
                    requests.append(Request(fqn, t, (0,), tuple(e.shape)))
                    if s.kind == "pickle":
                        pickled.append((item, t))
                    else:
                        raw.append((item, t, self._values[fqn].io))
                    continue
                if fqn not in self._values:
                    raise CorruptCheckpointError(f"{fqn}: value missing", where)
                _hand_over(planner, item, self._values[fqn])
                continue
            off, lengths = self._box(item, m)
            saved = DTYPES[m.tensors[fqn].dtype]
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != lengths:
                raise StateMismatchError(f"{fqn}: target box {list(target.shape)} != planned {list(lengths)}")
            direct = target.device.type == "cpu" and target.dtype == saved and target.is_contiguous()
            dest = target if direct else torch.empty(lengths, dtype=saved)
            requests.append(Request(fqn, dest, off, lengths))
            tensors.append((item, target, dest))
        reader = Reader(storage, name, m, verify=self.verify, threads=self.threads, timeout=self.timeout)
        try:
            reader.read(requests)
        finally:
            reader.close()
        self.stats = {"bytes_read": reader.bytes_read}
        for item, target, dest in tensors:
            if dest is not target:
                target.copy_(dest)
            planner.commit_tensor(item, target)
        for item, t, as_io in raw:
            data = t.numpy().tobytes()
            _hand_over(planner, item, io.BytesIO(data) if as_io else data)
        for item, t in pickled:
            planner.load_bytes(item, io.BytesIO(t.numpy().tobytes()))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)


def _hand_over(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Give DCP's planner a value decoded from the checkpoint (a JSON value, or a ``bytes`` /
    ``io.BytesIO`` payload): serialised here, so DCP's planner unpickles only what this process
    produced, never bytes read from storage."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    planner.load_bytes(item, buf)
