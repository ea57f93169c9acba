"""Hugging Face safetensors folders (and single files) as manifests the engine's reader reads.

Who calls what, on the caller's thread: ``ckptlib.load`` (``api.py``) and ``ckptlib.open``
(``read/view.py``), after finding no ``manifest.json`` where they were pointed, call
:func:`find`; when it says the path holds safetensors, :func:`describe` lists the files (the
index's, or every ``*.safetensors`` of the folder), reads each file's header (8 bytes, then the
header: a few KiB, nothing else), validates it (``format/safetensors.py``) and returns a
:class:`Folder`: the storage and folder the files live in and a manifest of every tensor as
chunks of at most :data:`CHUNK_BYTES`, without checksums. The load (``engine/load.py``) and the
view then plan and read exactly as for a ckptlib checkpoint: Shard/DTensor targets fetch only the
rows they overlap, and nothing larger than a chunk is ever buffered.

Local folders: the Hugging Face cache's snapshot folders hold symlinks to blobs; they are
followed (every link resolved, then read through a storage rooted where the real files are),
as Hugging Face's own tools do. ckptlib checkpoints themselves never follow links.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptlib.backends import ReadHandle, Storage, join
from ckptlib.backends.posix import PosixStorage
from ckptlib.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptlib.format import safetensors as st
from ckptlib.format.schema import Manifest

CHUNK_BYTES = 16 << 20
"""Largest chunk a tensor is described as: the most a read that cannot go straight into its
destination (a column shard, a GPU or non-contiguous target, a chunk's edge) buffers at once."""


@dataclass(frozen=True, slots=True)
class Folder:
    """What :func:`describe` found: read ``manifest``'s files under ``folder`` of ``storage``."""

    storage: Storage
    """The storage the files are read through (the caller's, or one rooted at resolved links;
    the caller closes both)."""
    folder: str
    manifest: Manifest
    where: str
    """The URL errors name: the folder, or the single file."""


def find(storage: Storage, path: str) -> str | None:
    """``"file"`` if ``path`` (relative to ``storage``) is a ``*.safetensors`` file, ``"folder"``
    if it is a folder holding a safetensors index or ``*.safetensors`` files (and no
    ``manifest.json``: a ckptlib checkpoint is never read as one), else None. Lists the folder."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if name.endswith(st.SUFFIX) and _is_file(storage, path):
        return "file"
    try:
        names = [e.name for e in storage.listdir(path) if not e.is_dir]
    except (FileNotFoundError, NotADirectoryError):
        return None
    if "manifest.json" in names:
        return None
    return "folder" if any(n.endswith((st.SUFFIX, st.INDEX_SUFFIX)) for n in names) else None


def _is_file(storage: Storage, path: str) -> bool:
    if storage.size(path) is not None:
        return True
    return isinstance(storage, PosixStorage) and os.path.isfile(os.path.join(storage.root, path))  # a link


def describe(storage: Storage, path: str, kind: str, *, select: str | None = None,
             rename: st.Rename | None = None, chunk_bytes: int | None = None) -> Folder:
    """The :class:`Folder` of ``path`` (``kind`` from :func:`find`). Bad files raise
    :class:`CorruptCheckpointError` naming the file, as does a file the index names that is
    missing; a folder without safetensors files :class:`CheckpointNotFoundError`."""
    url = storage.url.rstrip("/")
    where = f"{url}/{path.rstrip('/')}" if path.rstrip("/") else url
    weight_map: dict[str, str] | None = None
    if kind == "file":
        folder, _, name = path.rstrip("/").rpartition("/")
        names, wheres, index_where = [name], [where], where
    else:
        folder = path.rstrip("/")
        names, weight_map, index_where = _listing(storage, folder, where)
        wheres = [f"{where}/{n}" for n in names]
    storage, folder, paths = _resolve_links(storage, folder, names)
    files: list[tuple[str, int, list[st.Entry]]] = []
    for rel, file_where in zip(paths, wheres, strict=True):
        size, entries = _read_header(storage, join(folder, rel), file_where)
        files.append((rel, size, entries))
    by_name = {name: entries for name, (_, _, entries) in zip(names, files, strict=True)}
    if weight_map is not None:
        st.check_index(weight_map, by_name, index_where)
    else:
        seen: dict[str, str] = {}
        for name, entries in by_name.items():
            for e in entries:
                if e.key in seen:
                    raise CorruptCheckpointError(f"tensor {e.key!r:.200} is in both {seen[e.key]} and {name}", where)
                seen[e.key] = name
    m = st.describe(files, select=select, rename=rename, chunk_bytes=chunk_bytes or CHUNK_BYTES)
    return Folder(storage, folder, m, where)


def _listing(storage: Storage, folder: str, where: str) -> tuple[list[str], dict[str, str] | None, str]:
    """The files to read, the index's weight map (None without an index) and the index's URL."""
    entries = [e for e in storage.listdir(folder) if not e.is_dir]
    indexes = sorted(e.name for e in entries if e.name.endswith(st.INDEX_SUFFIX))
    if len(indexes) > 1 and st.INDEX_NAME not in indexes:
        raise CheckpointNotFoundError(
            f"{where} holds several safetensors indexes ({', '.join(indexes)}); pass a folder with one")
    if indexes:
        index = st.INDEX_NAME if st.INDEX_NAME in indexes else indexes[0]
        index_where = f"{where}/{index}"
        at, under, (rel,) = _resolve_links(storage, folder, [index])
        data = _read_small(at, join(under, rel), st.MAX_INDEX_BYTES, index_where)
        weight_map = st.parse_index(data, index_where)
        names = sorted(set(weight_map.values()))
        present = {e.name for e in entries}
        missing = [n for n in names if n not in present]
        if missing:
            raise CorruptCheckpointError(f"the index names {', '.join(missing[:5])}, missing from the folder",
                                         index_where)
        return names, weight_map, index_where
    names = sorted(e.name for e in entries if st.is_plain_name(e.name))
    if not names:
        raise CheckpointNotFoundError(f"{where} holds no *.safetensors file")
    return names, None, where


def _resolve_links(storage: Storage, folder: str, names: list[str]) -> tuple[Storage, str, list[str]]:
    """Local folders whose files are symlinks (the Hugging Face cache): a storage rooted at the
    deepest folder holding every real file, and the files' paths under it. Else unchanged."""
    if not isinstance(storage, PosixStorage):
        return storage, folder, names
    base = os.path.join(storage.root, folder)
    plain = [os.path.join(base, n) for n in names]
    if not any(os.path.islink(p) for p in plain):
        return storage, folder, names
    real = [os.path.realpath(p) for p in plain]
    root = os.path.commonpath([os.path.dirname(r) for r in real])
    return PosixStorage(root), "", [os.path.relpath(r, root).replace(os.sep, "/") for r in real]


def _read_small(storage: Storage, path: str, limit: int, where: str) -> bytes:
    with _open(storage, path, where) as h:
        if h.size > limit:
            raise CorruptCheckpointError(f"{h.size} bytes, over the limit of {limit}", where)
        return h.read(0, h.size)


def _read_header(storage: Storage, path: str, where: str) -> tuple[int, list[st.Entry]]:
    with _open(storage, path, where) as h:
        n = st.header_length(h.read(0, min(8, h.size)), h.size, where)
        entries, _ = st.parse_header(h.read(8, n), h.size, where)
        return h.size, entries


def _open(storage: Storage, path: str, where: str) -> ReadHandle:
    try:
        return storage.open_read(path)
    except FileNotFoundError:
        raise CorruptCheckpointError("file is missing", where) from None
