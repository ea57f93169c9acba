"""Where a tier restore reads a step's files from: :class:`SourceView`, one step folder whose
files come from several sources (bytes fetched from peers, this node's local copies, the
persistent tier), and what this node holds of a step (:func:`holdings`).

Used by the tier restore (:mod:`ckptlib.tiers.restore`: the attempt's loads and its plans) and
its write-back (:mod:`ckptlib.tiers.write_back`), on the thread driving the restore; the reader
uses a view from its own threads (read-only, thread-safe).
"""

from __future__ import annotations

import logging
from typing import Any

from ckptlib.backends import Storage, join
from ckptlib.backends.base import Entry, ReadHandle, WriteStream
from ckptlib.engine.scan import read_manifest
from ckptlib.errors import CheckpointError, CorruptCheckpointError
from ckptlib.format.decode import decode
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.tiers.inventory import file_name, local_save_id, step_files, verify_files
from ckptlib.tiers.replicas import REPLICA_DIR

log = logging.getLogger("ckptlib")


class _Bytes(ReadHandle):
    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.size, self.where = data, len(data), where

    def read_into(self, start: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        end = start + len(out)
        if end > self.size:
            raise CorruptCheckpointError(f"file is shorter than expected (needed bytes up to {end}, has {self.size})",
                                         self.where)
        out[:] = self.data[start:end]

    def close(self) -> None:
        pass


class SourceView(Storage):
    """A read-only view of one step folder ``final`` whose files come from several sources, by
    file name: ``fetched`` bytes (peer copies and the manifest), ``local`` paths on this node's
    storage, else the persistent tier's folder (files under its ``persistent_prefix``).
    ``sizes``: the manifest's size of files this rank does not read and has no copy of (the
    restore planner found a verified copy elsewhere): reported by :meth:`size`, never opened."""

    def __init__(self, final: str, *, manifest: bytes, local: Storage | None, local_paths: dict[str, str],
                 fetched: dict[str, bytes], persistent: Storage | None, persistent_prefix: str,
                 sizes: dict[str, int] | None = None) -> None:
        self.final, self.manifest, self.sizes = final, manifest, sizes or {}
        self.local, self.local_paths, self.fetched = local, local_paths, fetched
        self.persistent, self.persistent_prefix = persistent, persistent_prefix
        self.url = f"tiers:{final}"

    def _where(self, path: str) -> tuple[str, Any]:
        if path == join(self.final, MANIFEST_NAME):
            return "bytes", self.manifest
        name = file_name(path)
        if name in self.fetched:
            return "bytes", self.fetched[name]
        if self.local is not None and name in self.local_paths:
            return "local", self.local_paths[name]
        if self.persistent is not None:
            return "persistent", join(self.final, self.persistent_prefix, name)
        return "none", None

    def open_read(self, path: str) -> ReadHandle:
        kind, ref = self._where(path)
        if kind == "bytes":
            return _Bytes(ref, f"{self.url}/{path}")
        if kind == "local":
            assert self.local is not None
            return self.local.open_read(ref)
        if kind == "persistent":
            assert self.persistent is not None
            return self.persistent.open_read(ref)
        if file_name(path) in self.sizes:
            raise CorruptCheckpointError("no copy of this file was fetched for this rank", f"{self.url}/{path}")
        raise FileNotFoundError(path)

    def size(self, path: str) -> int | None:
        kind, ref = self._where(path)
        if kind == "bytes":
            return len(ref)
        if kind == "local":
            assert self.local is not None
            return self.local.size(ref)
        if kind == "persistent":
            assert self.persistent is not None
            return self.persistent.size(ref)
        return self.sizes.get(file_name(path))

    def exists(self, path: str = "") -> bool:
        return self.size(path) is not None

    def listdir(self, path: str = "") -> list[Entry]:
        raise NotImplementedError("a tier view lists nothing")

    def open_write(self, path: str) -> WriteStream:
        raise CheckpointError("a tier view is read-only")

    def put_atomic(self, path: str, data: bytes) -> None:
        raise CheckpointError("a tier view is read-only")

    def makedirs(self, path: str) -> None:
        raise CheckpointError("a tier view is read-only")

    def delete(self, path: str) -> None:
        raise CheckpointError("a tier view is read-only")

    def delete_tree(self, path: str) -> None:
        raise CheckpointError("a tier view is read-only")


def node_view(local: Storage, final: str, manifest: bytes, paths: dict[str, str]) -> SourceView:
    """This node's copies of a step's files (name -> path on ``local``), as a step folder."""
    return SourceView(final, manifest=manifest, local=local, local_paths=paths, fetched={}, persistent=None,
                      persistent_prefix="")


def holdings(local: Storage, final: str, save_id: str, verify: bool) -> tuple[dict[str, str], bytes | None,
                                                                              list[list[Any]] | None]:
    """This rank: the files of step ``final`` (save ``save_id``) its node holds that verify --
    payloads and v2 index files, own copies or replicas: name -> path on ``local``; the manifest
    bytes; the manifest's (name, size) list of every file (:func:`step_files`). A payload counts
    only when its writer's index file verified too (its chunks are known from it)."""
    try:
        m = read_manifest(local, final, pieces=False)
        data = local.read(join(final, MANIFEST_NAME))
    except (CheckpointError, OSError):
        return {}, None, None
    if save_id not in (m.save_id, local_save_id(m)):
        return {}, None, None
    files = step_files(m)
    held: dict[str, str] = {}
    index_of = {f.rank: f for f in files if f.index is not None}
    for f in sorted(files, key=lambda f: f.index is None):  # index files first
        if f.file is not None and f.rank in index_of and index_of[f.rank] is not f and index_of[f.rank].name not in held:
            continue  # its chunks are unknown here: fetched with its index file
        for folder in (final, join(final, REPLICA_DIR)):
            path = join(folder, f.path)
            if local.size(path) != f.size:
                continue
            try:
                if verify:
                    verify_files(node_view(local, final, data, {f.name: path}), final, m, [f])
            except (CheckpointError, OSError) as e:
                log.warning("ckptlib: local copy %s is bad, looking for another: %s", path, e)
                continue
            held[f.name] = path
            break
    return held, data, [[f.name, f.size] for f in files]


def all_files(mdata: bytes | None, where: str) -> dict[str, int]:
    """Every file of the step: name -> size (empty when there is no readable manifest)."""
    try:
        return {} if mdata is None else {f.name: f.size for f in step_files(decode(mdata, where))}
    except CheckpointError:
        return {}  # the load reports the bad manifest


