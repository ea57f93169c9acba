"""The v1 manifest: schema, canonical serialization, and validation of untrusted input. Pure.

Who calls what:
- the engine's commit step builds a :class:`Manifest` and calls :func:`encode` (coordinator);
- the scanner and reader call :func:`decode` on bytes read from storage; ``decode`` validates
  everything that can be checked without touching payload files (schema, dtype allowlist,
  sizes with overflow checks, byte ranges inside files and non-overlapping, chunk boxes
  tiling each tensor exactly, payload paths normalized and inside the step folder, the
  manifest's own checksum) and raises :class:`CorruptCheckpointError` naming what is wrong.

The tree of non-tensor values is validated lazily by :mod:`ckptlib.format.tree` when it is
decoded, with the tensor names checked against ``Manifest.tensors``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ckptlib.errors import CorruptCheckpointError, ManifestVersionError
from ckptlib.format import jsonio
from ckptlib.format.checksum import ALGORITHMS, checksum
from ckptlib.format.dtypes import DTYPES, ITEMSIZE
from ckptlib.format.validate import MAX_NDIM, MAX_SIZE, Checker

FORMAT_NAME = "ckptlib"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CODECS = ("raw", "zstd", "zstd-shuffle")
COMMIT_MODES = ("rename", "conditional_put", "put_verify")

# zstd cannot expand a frame by more than this factor (an RLE block: 4 bytes -> 128 KiB).
MAX_ZSTD_RATIO = 32768
_PATH_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One independently checksummed byte range holding a box of a tensor."""

    file: int
    """Index into :attr:`Manifest.files`."""
    start: int
    """Byte offset of the stored bytes in the file."""
    length: int
    """Number of stored bytes (after compression)."""
    checksum: str
    """Hex digest of the stored bytes with :attr:`Manifest.checksum_algorithm`."""
    offset: tuple[int, ...]
    """Position of the box in the global tensor."""
    shape: tuple[int, ...]
    """Shape of the box; its raw size is ``prod(shape) * itemsize``."""
    codec: str = "raw"
    """``raw``, ``zstd`` or ``zstd-shuffle`` (bytes grouped by position in the element)."""


@dataclass(frozen=True, slots=True)
class Pack:
    """One checksummed byte range holding many small tensor pieces, packed back to back.

    Small tensors are packed so that each costs neither a file, nor a write, nor a checksum of
    its own. The pack is stored (and compressed) as a whole; its members are raw bytes at
    ``raw_offset`` inside the decoded pack.
    """

    file: int
    start: int
    length: int
    """Stored bytes (after compression)."""
    checksum: str
    codec: str
    """``raw`` or ``zstd`` (members have mixed dtypes, so no byte shuffle)."""
    raw_length: int
    """Bytes after decoding."""


class Piece(NamedTuple):
    """A box of a tensor stored inside a :class:`Pack`."""

    pack: int
    raw_offset: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]


class TensorEntry(NamedTuple):
    """One saved tensor: its chunks of its own and/or its pieces inside packs.

    A tuple (not a dataclass) because a manifest holds one per tensor and decoding builds
    tens of thousands of them; ``chunks`` and ``pieces`` must not be mutated.
    """

    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk]
    pieces: list[Piece] = []

    @property
    def nbytes(self) -> int:
        return _volume(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    """Relative to the step folder, e.g. ``<save_id>/r00000-0.bin``."""
    size: int
    """Exact size in bytes; the scanner checks it against storage."""


@dataclass(slots=True)
class Manifest:
    step: int | None
    save_id: str
    created: float
    world_size: int
    commit: str
    files: list[FileEntry]
    tensors: dict[str, TensorEntry]
    tree: Any
    metadata: Any = None
    packs: list[Pack] = field(default_factory=list)
    checksum_algorithm: str = "xxh3_64"
    library: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def payload_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _volume(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --------------------------------------------------------------------------- encode

def _chunk_json(c: Chunk) -> list[Any]:
    # Compact positional form; documented in docs/format.md.
    return [c.file, c.start, c.length, c.checksum, list(c.offset), list(c.shape), c.codec]


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
    if t.chunks:
        out["chunks"] = [_chunk_json(c) for c in t.chunks]
    if t.pieces:
        out["packed"] = [
            [p.pack, p.raw_offset] if p.shape == t.shape else [p.pack, p.raw_offset, list(p.offset), list(p.shape)]
            for p in t.pieces
        ]
    return out


def is_whole_packed(t: TensorEntry) -> bool:
    """True if ``t`` is stored as one whole-tensor piece of a pack: a packed-table row.

    Rows are never empty; an empty tensor stays in ``tensors`` (as the writer stores it).
    """
    return not t.chunks and len(t.pieces) == 1 and t.pieces[0].shape == t.shape and all(t.shape)


class PackedTable:
    """The ``packed_tensors`` table being built: one row per tensor stored whole in a pack.

    Columnar, because a checkpoint may hold tens of thousands of small tensors: the reader
    validates whole columns at once (:func:`_decode_table`) instead of one JSON object per
    tensor. Filled by the save flow's manifest build (``engine/save.py``) and by
    :func:`to_body`; ``json()`` gives the manifest value.
    """

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, tuple[int, ...], int, int]] = []
        """``(name, dtype, shape, pack index, raw offset)`` per row, appended by the caller."""

    def json(self) -> dict[str, list[Any]]:
        if not self.rows:
            return {k: [] for k in TABLE_COLUMNS}
        name, dtype, shape, pack, offset = zip(*self.rows, strict=True)
        return {
            "name": list(name),
            "dtype": list(dtype),
            "ndim": list(map(len, shape)),
            "dims": list(itertools.chain.from_iterable(shape)),
            "pack": list(pack),
            "offset": list(offset),
        }


TABLE_KEY = "packed_tensors"
TABLE_COLUMNS = ("name", "dtype", "ndim", "dims", "pack", "offset")


def encode(m: Manifest) -> bytes:
    """Serialize ``m``, with a checksum over the body (see :func:`encode_body`)."""
    return encode_body(to_body(m))


def to_body(m: Manifest) -> dict[str, Any]:
    return {
        "step": m.step,
        "save_id": m.save_id,
        "created": m.created,
        "world_size": m.world_size,
        "commit": m.commit,
        "checksum_algorithm": m.checksum_algorithm,
        "library": m.library,
        "files": [[f.path, f.size] for f in m.files],
        "packs": [[p.file, p.start, p.length, p.checksum, p.codec, p.raw_length] for p in m.packs],
        "tensors": {name: _tensor_json(t) for name, t in m.tensors.items() if not is_whole_packed(t)},
        TABLE_KEY: _table(m).json(),
        "tree": m.tree,
        "metadata": m.metadata,
        "extra": m.extra,
    }


def _table(m: Manifest) -> PackedTable:
    table = PackedTable()
    for name, t in m.tensors.items():
        if is_whole_packed(t):
            table.rows.append((name, t.dtype, t.shape, t.pieces[0].pack, t.pieces[0].raw_offset))
    return table


def encode_body(body: dict[str, Any]) -> bytes:
    """The manifest file: a fixed head, the body's compact JSON, and ``}``.

    The head carries the format marker, version and an xxh3-64 checksum of exactly the body's
    bytes, so any change to the body is detected without re-serializing it.
    """
    text = jsonio.dumps(body, sort_keys=False).encode("ascii")
    return _head(FORMAT_VERSION, checksum(text)) + text + b"}"


def _head(version: int, digest: str) -> bytes:
    """Everything before the body text; the checksum covers exactly the body's bytes."""
    return (
        f'{{"format":"{FORMAT_NAME}","format_version":{version},"checksum":"xxh3_64:{digest}","body":'
    ).encode("ascii")


# --------------------------------------------------------------------------- decode

def check_path(path: str, where: str = "") -> str:
    """A payload path: relative, normalized, at most 4 levels, no dot-only parts."""
    parts = path.split("/")
    if not path or len(parts) > 4 or not all(_PATH_PART.match(p) for p in parts):
        raise CorruptCheckpointError(
            f"payload path {path!r:.200} is not a plain relative path inside the step folder", where
        )
    return path


def decode(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate untrusted manifest bytes."""
    v = Checker(where)
    top = v.obj(jsonio.loads(data, where), "manifest")
    if top.get("format") != FORMAT_NAME:
        raise v.fail("not a ckptlib manifest (missing format marker)")
    version = top.get("format_version")
    if type(version) is not int:
        raise v.fail("format_version must be an integer")
    if version > FORMAT_VERSION:
        raise ManifestVersionError(
            f"format_version {version} is newer than this ckptlib supports ({FORMAT_VERSION}); "
            "upgrade ckptlib to read it",
            where,
        )
    if version < 1:
        raise v.fail(f"unknown format_version {version}")
    body = v.obj(top.get("body"), "body")
    declared = v.str_(top.get("checksum"), "checksum", 200)
    algo, _, digest = declared.partition(":")
    head = _head(version, digest)
    data = bytes(data)
    if (
        algo != "xxh3_64"
        or set(top) != {"format", "format_version", "checksum", "body"}
        or not data.startswith(head)
        or not data.endswith(b"}")
        or checksum(data[len(head) : -1]) != digest
    ):
        raise v.fail("manifest checksum mismatch (the manifest was modified or is damaged)")
    return _decode_body(body, v)


def _decode_body(body: dict[str, Any], v: Checker) -> Manifest:
    step = body.get("step")
    if step is not None:
        v.int_(step, "step")
    save_id = v.str_(body.get("save_id"), "save_id", 64)
    if not re.fullmatch(r"[0-9a-f]{8,64}", save_id):
        raise v.fail("save_id must be lowercase hex")
    created = body.get("created")
    if type(created) not in (int, float):
        raise v.fail("created must be a number")
    world_size = v.int_(body.get("world_size"), "world_size", 1, 1 << 24)
    commit = body.get("commit")
    if commit not in COMMIT_MODES:
        raise v.fail(f"commit must be one of {COMMIT_MODES}")
    algorithm = body.get("checksum_algorithm")
    if algorithm not in ALGORITHMS:
        raise v.fail(f"checksum_algorithm must be one of {ALGORITHMS}")

    files: list[FileEntry] = []
    seen_paths: set[str] = set()
    for i, f in enumerate(v.lst(body.get("files"), "files")):
        f = v.lst(f, f"files[{i}]")
        if len(f) != 2:
            raise v.fail(f"files[{i}] must be [path, size]")
        path = check_path(v.str_(f[0], f"files[{i}].path", 600), v.where)
        if path in seen_paths or path == MANIFEST_NAME:
            raise v.fail(f"payload path {path!r} listed twice or shadows the manifest")
        seen_paths.add(path)
        files.append(FileEntry(path, v.int_(f[1], f"files[{i}].size")))

    ranges: list[list[tuple[int, int, str]]] = [[] for _ in files]
    packs = _decode_packs(body.get("packs", []), files, ranges, v)
    members: list[tuple[int, int, int, str]] = []
    tensors: dict[str, TensorEntry] = {}
    for name, t in v.obj(body.get("tensors"), "tensors").items():
        v.str_(name, "tensor name", 4096)
        tensors[name] = _decode_tensor(name, v.obj(t, f"tensor {name!r}"), files, ranges, packs, members, v)
    table = _decode_table(body[TABLE_KEY], packs, v) if TABLE_KEY in body else _NO_TABLE
    for name, entry in table.entries:
        if name in tensors:
            raise v.fail(f"tensor {name!r:.200} is listed twice")
        tensors[name] = entry
    _check_members(members, table, v)

    for i, rs in enumerate(ranges):
        rs.sort()
        prev_end, prev_name = 0, ""
        for start, end, tname in rs:
            if start < prev_end:
                raise v.fail(
                    f"byte ranges overlap in {files[i].path!r}: {prev_name!r} and {tname!r}"
                )
            prev_end, prev_name = end, tname

    metadata = body.get("metadata")
    extra = body.get("extra", {})
    v.obj(extra, "extra")
    return Manifest(
        step=step,
        save_id=save_id,
        created=float(created),
        world_size=world_size,
        commit=commit,
        files=files,
        tensors=tensors,
        tree=body.get("tree"),
        metadata=metadata,
        packs=packs,
        checksum_algorithm=algorithm,
        library=str(body.get("library", ""))[:200],
        extra=extra,
    )


def _decode_packs(
    raw: Any, files: list[FileEntry], ranges: list[list[tuple[int, int, str]]], v: Checker
) -> list[Pack]:
    packs = []
    for i, p in enumerate(v.lst(raw, "packs")):
        pw = f"pack {i}"
        p = v.lst(p, pw)
        if len(p) != 6:
            raise v.fail(f"{pw} must have 6 fields")
        if not files:
            raise v.fail(f"{pw} references a file but none are listed")
        fidx = v.int_(p[0], f"{pw} file", 0, len(files) - 1)
        start = v.int_(p[1], f"{pw} start")
        length = v.int_(p[2], f"{pw} length")
        digest = v.str_(p[3], f"{pw} checksum", 64)
        codec = p[4]
        if codec not in ("raw", "zstd"):
            raise v.fail(f"{pw}: unknown codec {codec!r:.40}")
        raw_length = v.int_(p[5], f"{pw} raw length")
        _check_stored(pw, f"<{pw}>", codec, start, length, raw_length, fidx, files, ranges, v)
        packs.append(Pack(fidx, start, length, digest, codec, raw_length))
    return packs


def _decode_tensor(
    name: str,
    t: dict[str, Any],
    files: list[FileEntry],
    ranges: list[list[tuple[int, int, str]]],
    packs: list[Pack],
    members: list[tuple[int, int, int, str]],
    v: Checker,
) -> TensorEntry:
    # Hot path for checkpoints with many tensors: messages are only formatted on failure.
    dtype = t.get("dtype")
    if type(dtype) is not str or dtype not in DTYPES:  # a list or dict here is unhashable
        raise v.fail(f"tensor {name!r:.200}: dtype {dtype!r:.60} is not in the allowlist")
    shape = v.shape(t.get("shape"), f"tensor {name!r:.200} shape")
    itemsize = ITEMSIZE[dtype]
    if _volume(shape) * itemsize > MAX_SIZE:
        raise v.fail(f"tensor {name!r:.200}: declares more than 2^62 bytes")
    chunks: list[Chunk] = []
    raw_chunks = t.get("chunks", ())
    if raw_chunks:
        for j, c in enumerate(v.lst(raw_chunks, f"tensor {name!r:.200} chunks")):
            chunks.append(_decode_chunk(name, j, c, shape, itemsize, files, ranges, v))
    pieces: list[Piece] = []
    raw_pieces = t.get("packed", ())
    if raw_pieces:
        for j, p in enumerate(v.lst(raw_pieces, f"tensor {name!r:.200} packed")):
            pieces.append(_decode_piece(name, j, p, shape, itemsize, packs, members, v))
    if not (len(chunks) + len(pieces) == 1 and (chunks or pieces)[0].shape == shape):
        _check_tiling(shape, [*chunks, *pieces], f"tensor {name!r:.200}", v)
    return TensorEntry(dtype, shape, chunks, pieces)


def _box(
    name: str, what: str, off: Any, shp: Any, shape: tuple[int, ...], v: Checker
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offset = v.shape(off, f"tensor {name!r:.200} {what} offset")
    box = v.shape(shp, f"tensor {name!r:.200} {what} shape")
    if len(offset) != len(shape) or len(box) != len(shape):
        raise v.fail(f"tensor {name!r:.200} {what}: offset/shape rank differs from the tensor's")
    for o, n, size in zip(offset, box, shape, strict=True):
        if o + n > size:
            raise v.fail(f"tensor {name!r:.200} {what}: box lies outside the tensor's shape {list(shape)}")
    return offset, box


def _decode_chunk(
    name: str,
    j: int,
    c: Any,
    shape: tuple[int, ...],
    itemsize: int,
    files: list[FileEntry],
    ranges: list[list[tuple[int, int, str]]],
    v: Checker,
) -> Chunk:
    if type(c) is not list or len(c) != 7:
        raise v.fail(f"tensor {name!r:.200} chunk {j} must be a list of 7 fields")
    cw = f"chunk {j}"
    if not files:
        raise v.fail(f"tensor {name!r:.200} {cw} references a file but none are listed")
    fidx = v.int_(c[0], f"tensor {name!r:.200} {cw} file", 0, len(files) - 1)
    start = v.int_(c[1], f"tensor {name!r:.200} {cw} start")
    length = v.int_(c[2], f"tensor {name!r:.200} {cw} length")
    digest = v.str_(c[3], f"tensor {name!r:.200} {cw} checksum", 64)
    offset, cshape = _box(name, cw, c[4], c[5], shape, v)
    codec = c[6]
    if codec not in CODECS:
        raise v.fail(f"tensor {name!r:.200} {cw}: unknown codec {codec!r:.40}")
    raw = _volume(cshape) * itemsize
    _check_stored(f"tensor {name!r:.200} {cw}", name, codec, start, length, raw, fidx, files, ranges, v)
    return Chunk(fidx, start, length, digest, offset, cshape, codec)


def _check_stored(
    what: str,
    owner: str,
    codec: str,
    start: int,
    length: int,
    raw: int,
    fidx: int,
    files: list[FileEntry],
    ranges: list[list[tuple[int, int, str]]],
    v: Checker,
) -> None:
    """Shared by chunks and packs: stored vs raw size, bounded expansion, range inside its file."""
    if codec == "raw" and length != raw:
        raise v.fail(f"{what}: stored length {length} != raw size {raw}")
    if codec != "raw" and raw > length * MAX_ZSTD_RATIO + 65536:
        raise v.fail(f"{what}: claims {raw} raw bytes from {length} compressed (impossible)")
    if start + length > files[fidx].size:
        raise v.fail(f"{what}: byte range ends past the end of {files[fidx].path!r}")
    if length:
        ranges[fidx].append((start, start + length, owner))


def _decode_piece(
    name: str,
    j: int,
    p: Any,
    shape: tuple[int, ...],
    itemsize: int,
    packs: list[Pack],
    members: list[tuple[int, int, int, str]],
    v: Checker,
) -> Piece:
    if type(p) is not list or len(p) not in (2, 4):
        raise v.fail(f"tensor {name!r:.200} packed piece {j} must be [pack, raw_offset(, offset, shape)]")
    if not packs:
        raise v.fail(f"tensor {name!r:.200} packed piece {j} references a pack but none are listed")
    pidx, raw_offset = p[0], p[1]
    if type(pidx) is not int or not 0 <= pidx < len(packs):
        raise v.fail(f"tensor {name!r:.200} packed piece {j}: pack index {pidx!r:.40} out of range")
    if type(raw_offset) is not int or not 0 <= raw_offset <= MAX_SIZE:
        raise v.fail(f"tensor {name!r:.200} packed piece {j}: bad raw offset {raw_offset!r:.40}")
    if len(p) == 2:  # the whole tensor
        offset, box = (0,) * len(shape), shape
    else:
        offset, box = _box(name, f"packed piece {j}", p[2], p[3], shape, v)
    end = raw_offset + _volume(box) * itemsize
    if end > packs[pidx].raw_length:
        raise v.fail(f"tensor {name!r:.200} packed piece {j}: ends past the end of pack {pidx}")
    if end > raw_offset:
        members.append((pidx, raw_offset, end, name))
    return Piece(pidx, raw_offset, offset, box)


class _Table(NamedTuple):
    """The decoded packed-tensor table: entries plus member extents for the overlap check."""

    entries: list[tuple[str, TensorEntry]]
    pack: np.ndarray
    start: np.ndarray
    end: np.ndarray


_NO_TABLE = _Table([], np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
_ZEROS = [(0,) * n for n in range(MAX_NDIM + 1)]
_LOG2_LIMIT = 62.5  # log2 of a row's byte size; above it the exact product could overflow int64


def _int_column(col: Any, what: str, lo: int, hi: int, v: Checker) -> np.ndarray:
    if type(col) is not list or not set(map(type, col)) <= {int}:  # bool is not int here
        raise v.fail(f"{what} must be a list of integers")
    try:
        arr = np.array(col, dtype=np.int64)
    except OverflowError:
        raise v.fail(f"{what} holds an integer outside [{lo}, {hi}]") from None
    if arr.size and (arr.min() < lo or arr.max() > hi):
        raise v.fail(f"{what} holds an integer outside [{lo}, {hi}]")
    return arr


def _decode_table(raw: Any, packs: list[Pack], v: Checker) -> _Table:
    """Validate the ``packed_tensors`` table column by column (numpy), then build entries.

    Rows are tensors stored whole in one pack, never empty (zero-size tensors are stored as
    chunks), so every dimension is at least 1 and a row's bytes ``prod(dims) * itemsize`` must
    fit inside its pack after ``offset``.
    """
    t = v.obj(raw, TABLE_KEY)
    if set(t) != set(TABLE_COLUMNS):
        raise v.fail(f"{TABLE_KEY} must have exactly the columns {list(TABLE_COLUMNS)}")
    names, dtypes = t["name"], t["dtype"]
    if type(names) is not list or not set(map(type, names)) <= {str} or any(len(n) > 4096 for n in names):
        raise v.fail(f"{TABLE_KEY}.name must be a list of strings of at most 4096 characters")
    if type(dtypes) is not list or not set(map(type, dtypes)) <= {str} or not set(dtypes) <= DTYPES.keys():
        bad = next((d for d in dtypes if type(d) is not str or d not in DTYPES), None) if type(dtypes) is list else dtypes
        raise v.fail(f"{TABLE_KEY}.dtype: {bad!r:.60} is not in the dtype allowlist")
    n = len(names)
    ndim = _int_column(t["ndim"], f"{TABLE_KEY}.ndim", 0, MAX_NDIM, v)
    dims = _int_column(t["dims"], f"{TABLE_KEY}.dims", 1, MAX_SIZE, v)
    pack = _int_column(t["pack"], f"{TABLE_KEY}.pack", 0, len(packs) - 1, v)
    offset = _int_column(t["offset"], f"{TABLE_KEY}.offset", 0, MAX_SIZE, v)
    if not len(dtypes) == len(ndim) == len(pack) == len(offset) == n:
        raise v.fail(f"{TABLE_KEY}: columns have different lengths")
    if len(set(names)) != n:
        raise v.fail(f"{TABLE_KEY}: a tensor name is listed twice")
    if int(ndim.sum()) != len(dims):
        raise v.fail(f"{TABLE_KEY}: dims holds {len(dims)} values, ndim adds up to {int(ndim.sum())}")
    if not n:
        return _NO_TABLE
    itemsize = np.array([ITEMSIZE[d] for d in dtypes], dtype=np.int64)
    first = np.zeros(n, dtype=np.int64)
    np.cumsum(ndim[:-1], out=first[1:])
    logs = np.concatenate(([0.0], np.cumsum(np.log2(dims.astype(np.float64)))))
    log_bytes = logs[first + ndim] - logs[first] + np.log2(itemsize.astype(np.float64))
    if log_bytes.max() > _LOG2_LIMIT:
        raise v.fail(f"{TABLE_KEY}: tensor {names[int(log_bytes.argmax())]!r:.200} declares more than 2^62 bytes")
    numel = np.multiply.reduceat(np.append(dims, 1), first)
    numel[ndim == 0] = 1  # reduceat yields the next value for an empty (scalar) row
    nbytes = numel * itemsize
    room = np.array([p.raw_length for p in packs], dtype=np.int64)[pack] - offset
    bad = np.flatnonzero(nbytes > room)  # room < 0 too: offset past the pack's end
    if bad.size:
        i = int(bad[0])
        raise v.fail(f"{TABLE_KEY}: tensor {names[i]!r:.200} ends past the end of pack {int(pack[i])}")
    entries = []
    dims_list, pos = t["dims"], 0
    for name, dt, nd, p, off in zip(names, dtypes, t["ndim"], t["pack"], t["offset"], strict=True):
        shape = tuple(dims_list[pos : pos + nd])
        pos += nd
        entries.append((name, TensorEntry(dt, shape, [], [Piece(p, off, _ZEROS[nd], shape)])))
    return _Table(entries, pack, offset, offset + nbytes)


def _check_members(members: list[tuple[int, int, int, str]], table: _Table, v: Checker) -> None:
    """No two pieces of a pack may share bytes (all pieces: table rows and ``packed`` lists)."""
    pack, start, end = table.pack, table.start, table.end
    if members:
        pack = np.concatenate((pack, np.array([m[0] for m in members], dtype=np.int64)))
        start = np.concatenate((start, np.array([m[1] for m in members], dtype=np.int64)))
        end = np.concatenate((end, np.array([m[2] for m in members], dtype=np.int64)))
    if len(pack) < 2:
        return
    order = np.lexsort((start, pack))
    p, s, e = pack[order], start[order], end[order]
    clash = np.flatnonzero((p[1:] == p[:-1]) & (s[1:] < e[:-1]))
    if clash.size:
        i = int(clash[0])
        names = [n for n, _ in table.entries] + [m[3] for m in members]
        a, b = names[int(order[i])], names[int(order[i + 1])]
        raise v.fail(f"pack {int(p[i])}: members {a!r:.200} and {b!r:.200} overlap")


_GRID_LIMIT = 1 << 22


def _check_tiling(shape: tuple[int, ...], chunks: list[Chunk | Piece], what: str, v: Checker) -> None:
    """Chunks must cover the tensor exactly once: no gaps (garbage) and no overlaps."""
    total = _volume(shape)
    if total == 0:
        return
    nonempty = [c for c in chunks if _volume(c.shape)]
    if sum(_volume(c.shape) for c in nonempty) != total:
        raise v.fail(f"{what}: chunks do not cover the tensor exactly once")
    if len(nonempty) == 1:
        return
    if not shape:
        raise v.fail(f"{what}: a scalar has more than one chunk")
    # Exact check on the grid induced by all chunk boundaries (sizes already sum to the
    # volume, so "no overlap" is equivalent to "no gap").
    bounds = []
    cells = 1
    for d, size in enumerate(shape):
        b = sorted({0, size} | {c.offset[d] for c in nonempty} | {c.offset[d] + c.shape[d] for c in nonempty})
        bounds.append(b)
        cells *= len(b) - 1
    if cells > _GRID_LIMIT:
        raise v.fail(f"{what}: chunk layout too fragmented to validate ({cells} cells)")
    pos = [{b: i for i, b in enumerate(bl)} for bl in bounds]
    grid = np.zeros([len(b) - 1 for b in bounds], dtype=np.int32)
    for c in nonempty:
        idx = tuple(
            slice(pos[d][c.offset[d]], pos[d][c.offset[d] + c.shape[d]]) for d in range(len(shape))
        )
        grid[idx] += 1
    if grid.min() != 1 or grid.max() != 1:
        raise v.fail(f"{what}: chunks overlap or leave gaps")
