"""The reader: fetch chunks, verify checksums, decode, and place boxes into tensors.

Called by :mod:`ckptlib.engine.load` on the caller's thread; reads run on a small thread pool.
For every chunk overlapping a :class:`Request` (a box of a saved tensor) it reads the stored
bytes (straight into the destination when uncompressed and contiguous there; small neighbours
in one read), verifies the checksum (unless ``verify=False``), decodes and copies the overlap
into place. Any mismatch raises :class:`CorruptCheckpointError` naming the file and tensor.
A manifest without checksums (``checksum_algorithm`` ``NO_CHECKSUM``: safetensors files) is
read unverified, and of its raw chunks only the rows (dimension 0) a request overlaps.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import KW_ONLY, dataclass, field, replace
from functools import partial

import numpy as np
import torch

from ckptlib.backends import ReadHandle, Storage, join
from ckptlib.engine.bytes_view import Box, as_bytes
from ckptlib.engine.gc_pause import paused_gc
from ckptlib.engine.pool import run_all
from ckptlib.engine.scan import missing_file
from ckptlib.errors import CheckpointError, CorruptCheckpointError
from ckptlib.format import codec as codecs
from ckptlib.format.checksum import NO_CHECKSUM, checksum
from ckptlib.format.dtypes import DTYPES, ITEMSIZE
from ckptlib.format.schema import Chunk, Manifest, Pack, Piece, volume

COALESCE_MAX = 8 << 20  # chunks smaller than this are fetched together with their neighbours
COALESCE_GAP = 64 << 10


Request = Box
"""What the caller asks for: a box of a saved tensor, read into ``tensor`` (CPU, saved dtype)."""


@dataclass(slots=True)
class _Target:
    req: Request
    lo: tuple[int, ...]  # intersection, global coordinates
    hi: tuple[int, ...]

    def within(self, origin: tuple[int, ...]) -> tuple[slice, ...]:
        """The intersection as slices of a box whose corner is at ``origin``."""
        return tuple(slice(lo - o, hi - o) for lo, hi, o in zip(self.lo, self.hi, origin, strict=True))


@dataclass(slots=True)
class _ChunkTask:
    name: str
    chunk: Chunk
    dtype: str
    targets: list[_Target] = field(default_factory=list)
    direct: np.ndarray | None = None  # destination bytes when read straight into place


@dataclass(slots=True)
class _PackTask:
    index: int
    pack: Pack
    members: list[tuple[Piece, str, _Target]] = field(default_factory=list)
    """Pieces placed through tensor views (boxes, non-contiguous destinations)."""
    whole: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    """``(destination, raw offset, bytes)`` of whole tensors read into contiguous destinations:
    one ``memmove`` each (the common case, hot with many small tensors). The tensor itself is
    kept, not its address, so a task left running past a failure never writes freed memory."""


def _intersect(c: Chunk | Piece, req: Request) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo, hi = [], []
    for d in range(len(c.shape)):
        a = max(c.offset[d], req.offset[d])
        b = min(c.offset[d] + c.shape[d], req.offset[d] + req.shape[d])
        if a >= b:
            return None
        lo.append(a)
        hi.append(b)
    return tuple(lo), tuple(hi)


def _row_range(c: Chunk, lo: int, hi: int, itemsize: int) -> Chunk:
    """Rows ``[lo, hi)`` (global, along dimension 0) of the raw chunk ``c``: a contiguous part
    of its bytes. Only for chunks no checksum covers (:data:`NO_CHECKSUM`)."""
    row = volume(c.shape[1:]) * itemsize
    first = lo - c.offset[0]
    return replace(c, start=c.start + first * row, length=(hi - lo) * row,
                   offset=(lo, *c.offset[1:]), shape=(hi - lo, *c.shape[1:]))


def _direct_view(task: _ChunkTask) -> np.ndarray | None:
    """Destination bytes if the whole chunk maps onto a contiguous run of one destination."""
    if task.chunk.codec != "raw" or len(task.targets) != 1:
        return None
    t = task.targets[0]
    c, req = task.chunk, t.req
    if t.lo != c.offset or tuple(h - lo for h, lo in zip(t.hi, t.lo, strict=True)) != c.shape:
        return None  # only part of the chunk is wanted
    if not req.tensor.is_contiguous() or len(c.shape) == 0:
        return as_bytes(req.tensor) if len(c.shape) == 0 and req.tensor.is_contiguous() else None
    # Contiguous iff the chunk spans the full destination extent on every dim after the first.
    if tuple(c.shape[1:]) != tuple(req.shape[1:]):
        return None
    row = ITEMSIZE[task.dtype]
    for s in c.shape[1:]:
        row *= s
    first = c.offset[0] - req.offset[0]
    return as_bytes(req.tensor)[first * row : (first + c.shape[0]) * row]


@dataclass(eq=False)
class Reader:
    storage: Storage
    folder: str
    m: Manifest
    _: KW_ONLY
    verify: bool = True
    threads: int = 4
    timeout: float | None = None
    reuse_packs: bool = False
    """Keep the last pack read (checksum checked, decoded) for the next :meth:`read`: a view
    reading tensors one at a time (``ckpt.read``, ``ckptlib diff``) reads and checks a pack of
    many small tensors once, not once per tensor in it (``read.view.CheckpointView`` sets it)."""
    bytes_read: int = field(default=0, init=False)
    _last_pack: tuple[int, np.ndarray] | None = field(default=None, init=False)
    _handles: dict[int, ReadHandle] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    @property
    def _checked(self) -> bool:
        """Verify checksums: asked for, and the manifest has them."""
        return self.verify and self.m.checksum_algorithm != NO_CHECKSUM

    @property
    def _partial(self) -> bool:
        """Raw chunks may be read in part (no checksum covers them whole)."""
        return self.m.checksum_algorithm == NO_CHECKSUM

    def _handle(self, file: int) -> ReadHandle:
        with self._lock:
            h = self._handles.get(file)
            if h is None:
                entry = self.m.files[file]
                try:
                    h = self.storage.open_read(join(self.folder, entry.path))
                except FileNotFoundError:
                    raise self._missing(file) from None
                if h.size != entry.size:
                    h.close()
                    raise CorruptCheckpointError(
                        f"size is {h.size} bytes, manifest records {entry.size}",
                        self._where(file),
                    )
                self._handles[file] = h
            return h

    def _missing(self, file: int) -> CheckpointError:
        """The error for a payload file that is not there (:func:`~ckptlib.engine.scan.missing_file`)."""
        return missing_file(self.storage, self.folder, self.m, self.m.files[file].path)

    def _where(self, file: int) -> str:
        return f"{self.storage.url}/{join(self.folder, self.m.files[file].path)}"

    def close(self) -> None:
        with self._lock:
            for h in self._handles.values():
                h.close()
            self._handles.clear()
            self._last_pack = None

    # ------------------------------------------------------------------ planning
    def _tasks(self, requests: list[Request]) -> tuple[list[_ChunkTask], list[_PackTask]]:
        tasks: dict[tuple[str, int, int, int], _ChunkTask] = {}
        partial = self._partial
        packs: dict[int, _PackTask] = {}
        for req in requests:
            entry = self.m.tensors[req.name]
            full = req.shape == entry.shape
            for p in entry.pieces:
                if full and p.shape == entry.shape and req.tensor.is_contiguous():
                    pt = packs.get(p.pack)
                    if pt is None:
                        pt = packs[p.pack] = _PackTask(p.pack, self.m.packs[p.pack])
                    pt.whole.append((req.tensor, p.raw_offset, req.tensor.nbytes))
                    continue
                hit: tuple[tuple[int, ...], tuple[int, ...]] | None
                if full:
                    hit = (p.offset, entry.shape)  # whole-tensor piece (the packed common case)
                    if p.shape != entry.shape:
                        hit = (p.offset, tuple(o + n for o, n in zip(p.offset, p.shape, strict=True)))
                else:
                    hit = _intersect(p, req) if p.shape else ((), ())
                    if hit is None:
                        continue
                pt = packs.get(p.pack)
                if pt is None:
                    pt = packs[p.pack] = _PackTask(p.pack, self.m.packs[p.pack])
                pt.members.append((p, entry.dtype, _Target(req, *hit)))
            for i, c in enumerate(entry.chunks):
                if not c.length and not all(c.shape):
                    continue
                box = _intersect(c, req) if c.shape else ((), ())
                if box is None:
                    continue
                key: tuple[str, int, int, int] = (req.name, i, 0, 0)
                if (partial and c.codec == "raw" and c.shape
                        and (box[0][0], box[1][0]) != (c.offset[0], c.offset[0] + c.shape[0])):
                    c = _row_range(c, box[0][0], box[1][0], ITEMSIZE[entry.dtype])
                    key = (req.name, i, box[0][0], box[1][0])
                task = tasks.get(key)
                if task is None:
                    task = tasks[key] = _ChunkTask(req.name, c, entry.dtype)
                task.targets.append(_Target(req, *box))
        out = list(tasks.values())
        for t in out:
            t.direct = _direct_view(t)
        return out, list(packs.values())

    # ------------------------------------------------------------------ execution
    def read(self, requests: list[Request]) -> None:
        """Fill every request's tensor (caller's thread; the chunks on ``threads`` workers). A
        stored chunk or its decoded bytes too large for this machine's memory (a manifest may
        declare terabytes) is a typed :class:`CheckpointError`, never a bare ``MemoryError``;
        every caller (``load``, ``CheckpointView.read``/``blocks``, the DCP reader) gets it."""
        try:
            self._read(requests)
        except MemoryError as e:
            raise CheckpointError(f"out of memory while reading {self.storage.url}/{self.folder}: {e}") from None

    def _read(self, requests: list[Request]) -> None:
        with paused_gc():
            tasks, packs = self._tasks(requests)
        big = [t for t in tasks if t.direct is not None and t.chunk.length >= COALESCE_MAX]
        small = [t for t in tasks if not (t.direct is not None and t.chunk.length >= COALESCE_MAX)]
        groups: list[list[_ChunkTask]] = [[t] for t in big]
        small.sort(key=lambda t: (t.chunk.file, t.chunk.start))
        cur: list[_ChunkTask] = []
        for t in small:
            if cur and (
                t.chunk.file != cur[-1].chunk.file
                or t.chunk.start - (cur[-1].chunk.start + cur[-1].chunk.length) > COALESCE_GAP
                or t.chunk.start + t.chunk.length - cur[0].chunk.start > COALESCE_MAX
            ):
                groups.append(cur)
                cur = []
            cur.append(t)
        if cur:
            groups.append(cur)
        groups.sort(key=lambda g: -(g[-1].chunk.start + g[-1].chunk.length - g[0].chunk.start))
        work = [partial(self._run, g) for g in groups] + [partial(self._run_pack, p) for p in packs]
        run_all(work, threads=self.threads, name="ckptlib-read", timeout=self.timeout)

    def _pack_raw(self, task: _PackTask) -> np.ndarray:
        """Pack ``task``'s raw bytes: read, checksum checked, decoded (a reader thread of
        :meth:`read`); the last one kept with :attr:`reuse_packs`."""
        last = self._last_pack
        if last is not None and last[0] == task.index:
            return last[1]
        p = task.pack
        stored = np.empty(p.length, dtype=np.uint8)
        self._handle(p.file).read_into(p.start, stored.data)
        self.bytes_read += p.length
        if self._checked and checksum(stored, self.m.checksum_algorithm) != p.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch in pack {task.index} at bytes [{p.start}, {p.start + p.length})",
                self._where(p.file),
            )
        if p.codec == "raw":
            raw = stored
        else:
            raw = np.empty(p.raw_length, dtype=np.uint8)
            codecs.decode_into(stored, p.codec, 1, raw, self._where(p.file))
        if self.reuse_packs:
            self._last_pack = (task.index, raw)
        return raw

    def _run_pack(self, task: _PackTask) -> None:
        raw = self._pack_raw(task)
        base = raw.ctypes.data
        memmove = ctypes.memmove
        for dest, raw_offset, n in task.whole:  # bounds: validated with the manifest
            memmove(dest.data_ptr(), base + raw_offset, n)
        for piece, dtype, tg in task.members:
            src = raw[piece.raw_offset : piece.raw_offset + volume(piece.shape) * ITEMSIZE[dtype]]
            view = torch.from_numpy(src).view(DTYPES[dtype]).reshape(piece.shape)
            tg.req.tensor[tg.within(tg.req.offset)] = view[tg.within(piece.offset)]

    def _run(self, group: list[_ChunkTask]) -> None:
        first = group[0].chunk
        h = self._handle(first.file)
        direct = group[0].direct
        if len(group) == 1 and direct is not None:
            h.read_into(first.start, direct.data)
            self.bytes_read += first.length
            self._check(group[0], direct)
            return
        start = first.start
        end = max(t.chunk.start + t.chunk.length for t in group)
        buf = np.empty(end - start, dtype=np.uint8)
        h.read_into(start, buf.data)
        self.bytes_read += end - start
        for t in group:
            stored = buf[t.chunk.start - start : t.chunk.start - start + t.chunk.length]
            self._check(t, stored)
            self._deliver(t, stored)

    def _check(self, t: _ChunkTask, stored: np.ndarray) -> None:
        if self._checked and checksum(stored, self.m.checksum_algorithm) != t.chunk.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch in chunk of tensor {t.name!r} at bytes "
                f"[{t.chunk.start}, {t.chunk.start + t.chunk.length})",
                self._where(t.chunk.file),
            )

    def _deliver(self, t: _ChunkTask, stored: np.ndarray) -> None:
        c = t.chunk
        itemsize = ITEMSIZE[t.dtype]
        if t.direct is not None:
            t.direct[:] = stored
            return
        size = int(np.prod(c.shape, dtype=np.int64)) * itemsize
        if c.codec == "raw" and stored.size == size and stored.ctypes.data % itemsize == 0:
            raw = stored  # placed from the read buffer itself: no second buffer, no copy
        else:
            raw = np.empty(size, dtype=np.uint8)
            codecs.decode_into(stored, c.codec, itemsize, raw, self._where(c.file))
        src = torch.from_numpy(raw).view(DTYPES[t.dtype]).reshape(c.shape)
        for tg in t.targets:
            tg.req.tensor[tg.within(tg.req.offset)] = src[tg.within(c.offset)]
