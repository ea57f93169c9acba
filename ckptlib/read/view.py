"""``ckptlib.open``: a read-only view of one committed checkpoint, without a training job.

Who calls what: the user (or ``ckptlib export`` / ``ckptlib diff``) calls :func:`open_view`
on their own thread, then :meth:`CheckpointView.tensors`, :meth:`~CheckpointView.read`,
:meth:`~CheckpointView.array` (its tensorstore read callbacks run on tensorstore's threads and
call :meth:`~CheckpointView.read`) and :meth:`~CheckpointView.load`. Opening reads and
validates the manifest and checks payload sizes once; every read goes through the engine's
:class:`~ckptlib.engine.reader.Reader`, which fetches only the chunks overlapping the
requested box and verifies their checksums (a mismatch is :class:`CorruptCheckpointError`).
A Hugging Face safetensors folder (or file) opens too (``engine/safetensors_folder.py``): its
headers are read and validated once, its tensors are named ``/<key>``, and reads fetch only the
rows they need, unverified (safetensors has no checksums).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from ckptlib.backends import Storage, join, open_storage, split_url
from ckptlib.engine import index_io, safetensors_folder, target
from ckptlib.engine.load import Merge, alloc_tensor, resolve_lazy, run_plan
from ckptlib.engine.options import flag
from ckptlib.engine.reader import Reader, Request
from ckptlib.engine.scan import StepInfo, check_files, check_step, iter_steps, read_manifest
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotInCheckpointError,
)
from ckptlib.format import layout
from ckptlib.format import tree as tree_codec
from ckptlib.format.dtypes import DTYPES, ITEMSIZE
from ckptlib.format.manifest import MANIFEST_NAME, Manifest
from ckptlib.read.index import Index, plan_box

log = logging.getLogger("ckptlib")
_INT = re.compile(r"-?[0-9]+")  # a path segment naming an int key or list index (load)

BLOCK_BYTES = 32 << 20
"""Largest block :meth:`CheckpointView.blocks` reads at once (bounds export/diff memory)."""


def _nothing_committed(storage: Storage, infos: list[StepInfo]) -> str:
    """The message for a root :func:`open_view` found no committed step in, saying what is
    there and what to pass instead (a run root of damaged steps, an empty or unrelated folder,
    a parent of checkpoint folders)."""
    where = storage.url.rstrip("/")
    if infos:
        shown = "; ".join(f"step {i.step}: {i.status} ({i.reason})" for i in infos[:3])
        more = f"; and {len(infos) - 3} more" if len(infos) > 3 else ""
        return f"no committed checkpoint under {where}: {shown}{more}"
    t = target.judge(storage, "")
    if t.kind == "empty":
        return f"{where} is an empty folder: no checkpoint was saved there"
    inside = [e.name for e in storage.listdir("")[:_PEEK]
              if e.is_dir and storage.size(join(e.name, MANIFEST_NAME)) is not None]
    if inside:
        return (f"{where} holds no checkpoint itself but checkpoint folders inside it "
                f"({', '.join(sorted(inside))}); pass one of them, e.g. {where}/{sorted(inside)[0]}")
    return f"no committed checkpoint under {where} (it holds neither {MANIFEST_NAME} nor step folders)"


_PEEK = 50
"""How many entries of an unrelated folder :func:`_nothing_committed` looks into."""


class TensorInfo(NamedTuple):
    name: str
    """The tensor's path, as ``ckptlib inspect`` prints it (``/model/0.weight``)."""
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class CheckpointView:
    """A read-only view of one committed checkpoint (see :func:`open_view`). Context manager."""

    def __init__(self, storage: Storage, folder: str, manifest: Manifest, *, verify: bool = True,
                 where: str | None = None) -> None:
        self.storage = storage
        self.folder = folder
        self.manifest = manifest
        self.where = where or f"{storage.url.rstrip('/')}/{join(folder, MANIFEST_NAME)}"
        check_files(storage, folder, manifest)
        index_io.resolve(storage, folder, manifest)  # v2: every piece (a scan's manifest has none)
        self._reader = Reader(storage, folder, manifest, verify=verify, reuse_packs=True)

    @property
    def step(self) -> int | None:
        """The step number (None for a folder written by ``ckptlib.save``)."""
        return self.manifest.step

    @property
    def bytes_read(self) -> int:
        """Payload bytes fetched from storage so far by :meth:`read` (and what uses it)."""
        return self._reader.bytes_read

    def tensors(self, select: str | None = None) -> list[TensorInfo]:
        """Every saved tensor, sorted by name; with ``select``, those at or under that path."""
        top = "/" + (select or "").strip("/")
        return [
            TensorInfo(n, e.dtype, e.shape, e.nbytes) for n, e in sorted(self.manifest.tensors.items())
            if top == "/" or n == top or n.startswith(top + "/")
        ]

    def info(self, name: str) -> TensorInfo:
        """Name, dtype, shape and size of the tensor ``name`` (``"/model/0.weight"``); a
        :class:`~ckptlib.errors.NotInCheckpointError` (a ``KeyError``) that names the nearest
        match when there is none. Any thread; no I/O."""
        e = self.manifest.tensors.get(name)
        if e is None:
            near = "/" + name if not name.startswith("/") and "/" + name in self.manifest.tensors else None
            hint = f"did you mean {near!r}? tensor names start with '/'" if near else (
                "see .tensors() or `ckptlib inspect`")
            raise NotInCheckpointError(f"no tensor {name!r} in {self.where} ({hint})")
        return TensorInfo(name, e.dtype, e.shape, e.nbytes)

    def read(self, name: str, index: Index = None) -> torch.Tensor:
        """``tensor[index]`` as a new CPU tensor, reading only the chunks that overlap it.

        ``index`` is numpy-style: an int, a slice (positive steps) or a tuple of them, with at
        most one ``...``; None reads the whole tensor, consolidated from all its shards.
        """
        info = self.info(name)
        offset, box, post = plan_box(info.shape, index)
        dest = alloc_tensor(box, DTYPES[info.dtype], name)
        if dest.numel():
            self._reader.read([Request(name, dest, offset, box)])
        return dest[post] if post else dest

    def blocks(self, name: str, max_bytes: int = BLOCK_BYTES) -> Iterator[tuple[int, torch.Tensor]]:
        """``(row, block)`` pairs covering the tensor along dimension 0, each block at most
        ``max_bytes`` (or one row); a 0-d tensor is one block, a tensor with no rows none. For
        streaming exports: every block lives in one reused buffer, valid only until the next one
        is produced."""
        info = self.info(name)
        if not info.shape:
            yield 0, self.read(name)
            return
        if not info.shape[0]:
            return  # no rows (shape (0, ...)): nothing to read, and no block size to step by
        row = ITEMSIZE[info.dtype]
        for s in info.shape[1:]:
            row *= s
        rows = min(info.shape[0], max(1, max_bytes // max(row, 1)))
        buf = alloc_tensor((rows * row,), torch.uint8, name)  # reused: fresh pages cost more than the copy
        for start in range(0, info.shape[0], rows):
            box = (min(rows, info.shape[0] - start), *info.shape[1:])
            dest = buf[: box[0] * row].view(DTYPES[info.dtype]).reshape(box)
            if dest.numel():
                self._reader.read([Request(name, dest, (start,) + (0,) * (len(box) - 1), box)])
            yield start, dest

    def array(self, name: str) -> Any:
        """A read-only lazy ``tensorstore.TensorStore`` over this tensor (imports tensorstore)."""
        from ckptlib.read.lazy_array import lazy_array

        return lazy_array(self, name)

    def load(self, select: str | None = None, *, per_rank: str = "all") -> Any:
        """The saved value at path ``select`` (``"model"``, ``"/model/layers/0"``; None: the
        whole state) as ``ckptlib.load`` returns it: CPU tensors, checksums verified."""
        saved = tree_codec.decode(self.manifest.tree, self.manifest.tensors, self.where)
        path = ""
        for key in [k for k in (select or "").split("/") if k]:
            path += "/" + key
            number = int(key) if _INT.fullmatch(key) else None  # ASCII only: int("²") raises, int("\u0661") is 1
            if isinstance(saved, dict) and (key in saved or number in saved):
                saved = saved[key] if key in saved else saved[number]
            elif isinstance(saved, list | tuple) and number is not None and 0 <= number < len(saved):
                saved = saved[int(key)]
            else:
                raise NotInCheckpointError(f"{path}: not in the checkpoint {self.where}")
        plan = Merge(self.manifest, per_rank=per_rank, where=self.where)
        result = plan.fresh(saved, path)
        run_plan(plan, self.storage, self.folder, self.manifest, verify=self._reader.verify)
        return resolve_lazy(result)

    def close(self) -> None:
        """Release the reader's threads and the storage; also at the end of a ``with`` block."""
        self._reader.close()
        self.storage.close()

    def __enter__(self) -> CheckpointView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_view(
    url: str | os.PathLike[str],
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    verify: bool = True,
) -> CheckpointView:
    """Open ``url`` read-only: a checkpoint folder, or a CheckpointManager root (its newest
    committed step, or ``step``). Raises :class:`CheckpointNotFoundError` when there is no
    such committed step, :class:`CorruptCheckpointError` for a bad manifest or payload size."""
    flag("verify", verify)  # verify=None would silently skip every checksum
    storage = open_storage(url, storage_options)
    try:
        found = _safetensors(url, storage, storage_options)
        if found is not None:
            if step is not None:
                raise CheckpointNotFoundError(f"{found.where} is safetensors, which has no steps; omit step=")
            if found.storage is not storage:
                storage.close()
            return CheckpointView(found.storage, found.folder, found.manifest, where=found.where)
        if storage.size("") is not None:  # the URL names a file (manifest.json, a payload)
            raise CheckpointNotFoundError(target.file_hint(storage.url, " or the run root above it"))
        if storage.size(MANIFEST_NAME) is not None:
            m = read_manifest(storage, "")
            if step is not None and m.step != step:
                raise CheckpointNotFoundError(f"{url} holds step {m.step}, not step {step}")
            return CheckpointView(storage, "", m, verify=verify)
        if step is not None:
            info = check_step(storage, layout.step_dir(step), step)
            if info.manifest is None:
                steps = _step_folders(storage)
                if step not in steps:
                    have = ", ".join(map(str, steps[-10:])) or "none"
                    raise CheckpointNotFoundError(f"no step {step} under {storage.url} (newest steps: {have})")
                cls = CorruptCheckpointError if info.status == "corrupt" else CheckpointNotFoundError
                raise cls(f"step {step} under {storage.url} is {info.status}: {info.reason}")
        else:
            infos = []  # newest first, judged up to the newest committed one (all of them when none is)
            for i in iter_steps(storage):
                infos.append(i)
                if i.status == "committed" and i.manifest is not None:
                    break
            committed = [i for i in infos if i.status == "committed" and i.manifest is not None]
            if not committed:
                raise CheckpointNotFoundError(_nothing_committed(storage, infos))
            info = committed[0]
            for newer in (i for i in infos if i.step > info.step and i.status == "corrupt"):
                log.warning("ckptlib: opening step %d of %s: the newer step %d is damaged (%s); "
                            "`ckptlib verify %s --step %d` says more", info.step, storage.url, newer.step,
                            newer.reason, storage.url, newer.step)
        assert info.manifest is not None
        return CheckpointView(storage, info.path, info.manifest, verify=verify)
    except (CheckpointError, OSError):
        storage.close()
        raise


def _step_folders(storage: Storage) -> tuple[int, ...]:
    """The steps of the ``step-N`` folders under the root, ascending (for an error message)."""
    try:
        return layout.step_folders(storage.listdir(""))
    except OSError:
        return ()


def _safetensors(url: str | os.PathLike[str], storage: Storage, storage_options: dict[str, Any] | None,
                 ) -> safetensors_folder.Folder | None:
    """The safetensors folder at ``storage``'s root, or the single file ``url`` names (then
    read through a storage on its parent folder); None if neither (a folder holding
    ``manifest.json`` is a checkpoint)."""
    if not os.fspath(url).rstrip("/").endswith(".safetensors"):
        if storage.size("") is None and safetensors_folder.find(storage, "") == "folder":
            return safetensors_folder.describe(storage, "", "folder")
        return None
    parent, name = split_url(url)
    outer = open_storage(parent, storage_options)
    try:
        if safetensors_folder.find(outer, name) == "file":
            found = safetensors_folder.describe(outer, name, "file")
            if found.storage is not outer:  # resolved links: read through another storage
                outer.close()
            return found
    except BaseException:
        outer.close()
        raise
    outer.close()
    return None
