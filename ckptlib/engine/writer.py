"""The writer pipeline: chunk -> encode -> checksum -> write -> fsync, for one rank.

Called by the save flow (:mod:`ckptlib.engine.save`) on the thread that persists a save, with
tensors already safe to read. :func:`split_chunks` cuts pieces into chunks of at most
``chunk_bytes`` along dim 0; :func:`make_units` packs tensors up to ``PACK_MEMBER_MAX`` bytes
into packs of about ``PACK_BYTES`` (one checksum and write per pack); :func:`plan_files`
balances units over ``num_files`` files; :func:`write_files` writes them concurrently, one
thread per file, small writes gathered in a reused staging buffer (``pack_bytes`` per thread),
large raw chunks straight from tensor memory, everything checksummed and 64-byte aligned.
``close()`` makes each file durable; any failure aborts the file and propagates.
:func:`adopt_arena` is the other way to a payload file, for a memory tier whose snapshot lies in
a mapped arena already (ckptlib/engine/mapped_arena.py): checksum in place, then rename.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ckptlib import crashpoints
from ckptlib.backends import Storage, WriteStream, join, parent
from ckptlib.engine.bytes_view import Box, as_bytes
from ckptlib.engine.mapped_arena import Arena
from ckptlib.engine.pool import cpu_share, run_all
from ckptlib.errors import CommitError
from ckptlib.format import codec as codecs
from ckptlib.format import layout
from ckptlib.format.build import PackMember, WrittenChunk, WrittenPack
from ckptlib.format.checksum import DEFAULT_ALGORITHM, checksum
from ckptlib.format.dtypes import NAMES, dtype_name
from ckptlib.format.index_file import build_index

ALIGN = 64
PACK_MEMBER_MAX = 64 << 10  # tensors up to this size are packed together
PACK_BYTES = 4 << 20  # target raw size of one pack


@dataclass(slots=True)
class ChunkJob(Box):
    """One chunk to write; ``tensor`` is contiguous and holds exactly the box."""

    dtype: str
    nbytes: int


@dataclass(slots=True)
class PackJob:
    members: list[ChunkJob]
    nbytes: int


def split_chunks(
    name: str, t: torch.Tensor, global_offset: tuple[int, ...], chunk_bytes: int
) -> list[ChunkJob]:
    """Cut one contiguous CPU tensor piece into chunks along dim 0."""
    dtype = NAMES.get(t.dtype) or dtype_name(t.dtype)  # dtype_name raises for unknown dtypes
    nbytes = t.nbytes
    shape = tuple(t.shape)
    if nbytes <= chunk_bytes or not shape or shape[0] <= 1:
        return [ChunkJob(name, t, global_offset, shape, dtype, nbytes)]
    row = nbytes // shape[0]
    rows = max(1, chunk_bytes // max(row, 1))
    out = []
    for a in range(0, shape[0], rows):
        b = min(a + rows, shape[0])
        off = (global_offset[0] + a, *global_offset[1:])
        out.append(ChunkJob(name, t[a:b], off, (b - a, *shape[1:]), dtype, (b - a) * row))
    return out


def make_units(jobs: list[ChunkJob]) -> list[ChunkJob | PackJob]:
    """Group small chunks into packs; large (and empty) chunks stay on their own."""
    units: list[ChunkJob | PackJob] = []
    cur: list[ChunkJob] = []
    size = 0
    for j in jobs:
        if j.nbytes == 0 or j.nbytes > PACK_MEMBER_MAX:
            units.append(j)
            continue
        cur.append(j)
        size += j.nbytes
        if size >= PACK_BYTES:
            units.append(PackJob(cur, size))
            cur, size = [], 0
    if cur:
        units.append(PackJob(cur, size))
    return units


def plan_files(jobs: list[ChunkJob | PackJob], num_files: int) -> list[list[ChunkJob | PackJob]]:
    """Balance units over ``num_files`` files by bytes, keeping order within each file."""
    total = sum(j.nbytes for j in jobs)
    n = max(1, min(num_files, len(jobs), 1 + total // (64 << 20)))
    files: list[list[ChunkJob | PackJob]] = [[] for _ in range(n)]
    loads = [0] * n
    for j in sorted(jobs, key=lambda j: -j.nbytes) if n > 1 else jobs:
        i = loads.index(min(loads))
        files[i].append(j)
        loads[i] += j.nbytes
    return [f for f in files if f]


def create(storage: Storage, path: str) -> WriteStream:
    """A new file of this rank's in a folder that must exist already (the save's staging
    folder, which the coordinator made): never made again here, so a rank that comes late to a
    save the coordinator gave up and removed cannot leave a copy of that folder behind, and the
    create is the check (no ``stat`` before it: one metadata call per file, not two).
    :class:`CommitError` when the folder is gone."""
    try:
        return storage.open_write_in(path)
    except FileNotFoundError:
        raise CommitError(f"staging folder {parent(path)} is gone: the save was abandoned") from None


class _FileWriter:
    """Writes one payload file sequentially, packing small chunks into a staging buffer."""

    def __init__(self, storage: Storage, path: str, pack_bytes: int, rank: int = 0) -> None:
        self.rank = rank
        self.stream = create(storage, path)
        self.path = path
        self.pos = 0
        self.buf = bytearray(pack_bytes)
        self.view = memoryview(self.buf)
        self.fill = 0

    def _flush(self) -> None:
        if self.fill:
            self.stream.write(self.view[: self.fill])
            self.fill = 0
            crashpoints.point("write", self.rank)

    def pad(self) -> None:
        gap = -self.pos % ALIGN
        if gap:
            self.add(bytes(gap))

    def add(self, data) -> None:
        n = len(data)
        if n <= len(self.buf) - self.fill:
            self.view[self.fill : self.fill + n] = data
            self.fill += n
        else:
            self._flush()
            if n < len(self.buf) // 2:
                self.view[:n] = data
                self.fill = n
            else:
                self.stream.write(data)
                crashpoints.point("write", self.rank)
        self.pos += n

    def close(self) -> int:
        self._flush()
        self.stream.close()
        return self.pos


def _pack_bytes(members: list[ChunkJob], buf: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Copy the members' raw bytes back to back into ``buf`` (grown if needed): one ``memmove``
    per member (dense CPU tensors, so ``data_ptr()`` and ``nbytes`` are exactly their bytes)."""
    total = sum(m.nbytes for m in members)
    if buf.size < total:
        buf = np.empty(total, dtype=np.uint8)
    base = buf.ctypes.data
    offsets: list[int] = []
    add, memmove = offsets.append, ctypes.memmove
    off = 0
    for m in members:  # packs never hold empty members (make_units), so nbytes > 0
        add(off)
        memmove(base + off, m.tensor.data_ptr(), m.nbytes)
        off += m.nbytes
    return buf[:total], offsets


def _write_one(
    storage: Storage,
    path: str,
    jobs: list[ChunkJob | PackJob],
    compression: str | None,
    algorithm: str,
    pack_bytes: int,
    rank: int = 0,
    tail: Callable[[list[WrittenChunk | WrittenPack]], bytes] | None = None,
) -> tuple[int, list[WrittenChunk | WrittenPack]]:
    """Write one payload file; ``tail``: bytes to append after the jobs, from their records
    (the rank's piece index, :func:`write_files_indexed`), made durable with them."""
    # The staging buffer need not outsize the file (a small file of a many-rank save: no 4 MiB
    # zero-filled buffer for 100 kB), nor the scratch the packs.
    total = sum(j.nbytes + ALIGN for j in jobs)
    w = _FileWriter(storage, path, max(ALIGN, min(pack_bytes, total)), rank)
    out: list[WrittenChunk | WrittenPack] = []
    packed = max((j.nbytes for j in jobs if isinstance(j, PackJob)), default=0)
    scratch = np.empty(min(PACK_BYTES + PACK_MEMBER_MAX, packed), dtype=np.uint8)  # reused for every pack
    try:
        for j in jobs:
            w.pad()
            if isinstance(j, PackJob):
                raw, offsets = _pack_bytes(j.members, scratch)
                codec = "raw" if compression is None else "zstd"
                stored = codecs.encode(raw, codec, 1)
                start = w.pos
                w.add(stored)
                out.append(
                    WrittenPack(path, start, len(stored), checksum(stored, algorithm), codec, raw.size,
                                [PackMember(m.name, m.dtype, m.offset, m.shape) for m in j.members], offsets)
                )
                continue
            itemsize = j.tensor.element_size()
            codec = codecs.codec_for(compression, itemsize) if j.nbytes else "raw"
            raw = as_bytes(j.tensor)
            stored = codecs.encode(raw, codec, itemsize)
            digest = checksum(stored, algorithm)
            start = w.pos
            w.add(stored)
            out.append(
                WrittenChunk(j.name, path, start, len(stored), digest, j.offset, j.shape, codec, j.dtype)
            )
        if tail is not None:
            w.pad()
            w.add(tail(out))
        size = w.close()
    except BaseException:
        w.stream.abort()
        raise
    return size, out


def write_files(
    storage: Storage,
    prefix: str,
    rank: int,
    jobs: list[ChunkJob],
    *,
    compression: str | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
    num_files: int = 2,
    pack_bytes: int = PACK_BYTES,
    tag: str = "",
    timeout: float | None = None,
    exact: bool = False,
) -> tuple[list[tuple[str, int]], list[WrittenChunk | WrittenPack]]:
    """Write ``jobs`` into payload files under ``prefix``; returns ``(files, written)``, files
    as ``(path, size)``, all durable, or raises ``StorageTimeoutError`` after ``timeout``. At
    most ``num_files`` files, fewer when ranks share the machine's CPUs (``pool.cpu_share``);
    ``exact``: exactly as :func:`plan_files` splits ``num_files`` (a peer rebuilding another
    rank's files byte for byte, ckptlib/tiers/replicas.py). The same jobs with the same options
    give the same bytes, names and records."""
    files, chunks, _ = _write_groups(storage, prefix, rank, jobs, compression, algorithm,
                                     num_files if exact else cpu_share(num_files), pack_bytes, tag, timeout, False)
    return files, chunks


def write_files_indexed(
    storage: Storage,
    prefix: str,
    rank: int,
    jobs: list[ChunkJob],
    *,
    compression: str | None = None,
    num_files: int = 2,
    timeout: float | None = None,
) -> tuple[list[tuple[str, int]], list[WrittenChunk | WrittenPack], dict[str, object] | None]:
    """Format v2, all of a rank's part of a save in one call (``SaveSession.write``, a plain
    save's only write): as :func:`write_files`, and when the part fits in one payload file,
    the rank's piece index is appended to it before its one fsync (``IndexRef.tail``,
    docs/format.md): one file to create and sync per rank per save, not two. Returns the files,
    the write records and the index summary of :func:`write_index` (``path`` is the payload
    file's), or None when several files were written (the caller then writes the index file)."""
    return _write_groups(storage, prefix, rank, jobs, compression, DEFAULT_ALGORITHM, cpu_share(num_files),
                         PACK_BYTES, "", timeout, True)


def _write_groups(
    storage: Storage, prefix: str, rank: int, jobs: list[ChunkJob], compression: str | None, algorithm: str,
    num_files: int, pack_bytes: int, tag: str, timeout: float | None, index_tail: bool,
) -> tuple[list[tuple[str, int]], list[WrittenChunk | WrittenPack], dict[str, object] | None]:
    """:func:`write_files` and :func:`write_files_indexed`: plan the files, write them on one
    thread each, append the index to a lone file when ``index_tail``."""
    groups = plan_files(make_units(jobs), num_files)  # one thread per file
    # ``tag`` keeps names unique when one rank writes a save in several rounds.
    paths = [join(prefix, layout.payload_name(rank, tag, i)) for i in range(len(groups))]
    index: list[dict[str, object]] = []

    def tail(written: list[WrittenChunk | WrittenPack]) -> bytes:
        built = build_index([(paths[0], 0)], written)
        index.append(_summary(paths[0], built.data, built.counts))
        return built.data

    results = run_all(
        [
            partial(_write_one, storage, p, g, compression, algorithm, pack_bytes, rank,
                    tail if index_tail and len(groups) == 1 else None)
            for p, g in zip(paths, groups, strict=True)
        ],
        threads=len(groups),
        name="ckptlib-write",
        timeout=timeout,
    )
    files = [(p, size) for p, (size, _) in zip(paths, results, strict=True)]
    chunks = [c for _, cs in results for c in cs]
    return files, chunks, index[0] if index else None


def _summary(path: str, data: bytes, counts: dict[str, int]) -> dict[str, object]:
    """What the manifest records of a rank's piece index (``format.build``'s ``indexes`` row)."""
    return {"path": path, "size": len(data), "checksum": checksum(data), "counts": counts}


def adopt_arena(
    arena: Arena, root: str, prefix: str, rank: int, jobs: list[ChunkJob], *, algorithm: str = DEFAULT_ALGORITHM
) -> tuple[list[tuple[str, int]], list[WrittenChunk | WrittenPack]] | None:
    """Make ``arena`` this rank's payload file 0 under ``prefix`` (``root``: the storage root on
    the arena's memory file system), ``jobs`` (split from views of the arena) recorded where they
    lie, each checksummed there (one read pass, no write). Same names and records as
    :func:`write_files` with raw chunks, one chunk per job (no packs). None, with nothing done,
    when a job's bytes are not in the arena (the caller then writes them with
    :func:`write_files`). Called by ``SaveSession.write`` on the persist thread; raises
    :class:`~ckptlib.errors.StorageError` when the staging folder is gone."""
    path = join(prefix, layout.payload_name(rank, "", 0))
    base, size = arena.base, arena.nbytes
    out: list[WrittenChunk | WrittenPack] = []
    for j in jobs:
        start = j.tensor.data_ptr() - base if j.nbytes else 0
        if not (start >= 0 and start + j.nbytes <= size and j.tensor.is_contiguous()):
            return None
        out.append(WrittenChunk(j.name, path, start, j.nbytes, checksum(as_bytes(j.tensor), algorithm), j.offset,
                                j.shape, "raw", j.dtype))
    crashpoints.point("write", rank)  # checksummed, not adopted: the file is still the arena's
    arena.ring.adopt(arena, os.path.join(root, path))
    crashpoints.point("write", rank)
    return [(path, size)], out


def write_index(
    storage: Storage, prefix: str, rank: int, files: list[tuple[str, int]], written: list[WrittenChunk | WrittenPack]
) -> dict[str, object] | None:
    """Format v2: write this rank's piece index file (every chunk and pack in ``written``, which
    lie in ``files``) under ``prefix``, durably. Called once per save by ``SaveSession.collect``
    after the rank's payload writes, on the same thread. Returns its summary for the manifest
    (``path``, ``size``, xxh3_64 ``checksum``, ``counts``), or None when the rank wrote nothing."""
    if not written:
        return None
    built = build_index(files, written)
    path = join(prefix, layout.index_name(rank))
    stream = create(storage, path)
    try:
        stream.write(built.data)
        stream.close()
    except BaseException:
        stream.abort()
        raise
    return _summary(path, built.data, built.counts)
