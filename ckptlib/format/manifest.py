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

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptlib.errors import CorruptCheckpointError, ManifestVersionError
from ckptlib.format import jsonio
from ckptlib.format.checksum import ALGORITHMS, checksum
from ckptlib.format.dtypes import DTYPES, ITEMSIZE

FORMAT_NAME = "ckptlib"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CODECS = ("raw", "zstd", "zstd-shuffle")
COMMIT_MODES = ("rename", "conditional_put", "put_verify")

MAX_SIZE = 1 << 62  # no file, range or tensor may claim more bytes than this
MAX_NDIM = 64
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
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk]

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


def encode(m: Manifest) -> bytes:
    """Serialize ``m`` canonically, with a checksum over the body."""
    body = {
        "step": m.step,
        "save_id": m.save_id,
        "created": m.created,
        "world_size": m.world_size,
        "commit": m.commit,
        "checksum_algorithm": m.checksum_algorithm,
        "library": m.library,
        "files": [[f.path, f.size] for f in m.files],
        "tensors": {
            name: {"dtype": t.dtype, "shape": list(t.shape), "chunks": [_chunk_json(c) for c in t.chunks]}
            for name, t in m.tensors.items()
        },
        "tree": m.tree,
        "metadata": m.metadata,
        "extra": m.extra,
    }
    text = jsonio.dumps(body)
    digest = checksum(text.encode("ascii"))
    head = f'{{"format":"{FORMAT_NAME}","format_version":{FORMAT_VERSION},"checksum":"xxh3_64:{digest}"'
    return f'{head},"body":{text}}}'.encode("ascii")


# --------------------------------------------------------------------------- decode

class _V:
    """Small validation helpers that raise CorruptCheckpointError naming the manifest."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(msg, self.where)

    def obj(self, x: Any, what: str) -> dict[str, Any]:
        if not isinstance(x, dict):
            raise self.fail(f"{what} must be an object")
        return x

    def lst(self, x: Any, what: str) -> list[Any]:
        if not isinstance(x, list):
            raise self.fail(f"{what} must be a list")
        return x

    def int_(self, x: Any, what: str, lo: int = 0, hi: int = MAX_SIZE) -> int:
        if type(x) is not int or not lo <= x <= hi:
            raise self.fail(f"{what} must be an integer in [{lo}, {hi}], got {x!r:.60}")
        return x

    def str_(self, x: Any, what: str, maxlen: int = 4096) -> str:
        if not isinstance(x, str) or len(x) > maxlen:
            raise self.fail(f"{what} must be a string of at most {maxlen} characters")
        return x

    def shape(self, x: Any, what: str) -> tuple[int, ...]:
        dims = self.lst(x, what)
        if len(dims) > MAX_NDIM:
            raise self.fail(f"{what} has more than {MAX_NDIM} dimensions")
        out = tuple(self.int_(d, what) for d in dims)
        n = 1
        for d in out:
            n *= d
            if n > MAX_SIZE:
                raise self.fail(f"{what} {list(out)} declares more than 2^62 elements")
        return out


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
    v = _V(where)
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
    if algo != "xxh3_64" or checksum(jsonio.dumps(body).encode("ascii")) != digest:
        raise v.fail("manifest checksum mismatch (the manifest was modified or is damaged)")
    return _decode_body(body, v)


def _decode_body(body: dict[str, Any], v: _V) -> Manifest:
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
    tensors: dict[str, TensorEntry] = {}
    for name, t in v.obj(body.get("tensors"), "tensors").items():
        v.str_(name, "tensor name", 4096)
        tensors[name] = _decode_tensor(name, v.obj(t, f"tensor {name!r}"), files, ranges, v)

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
        checksum_algorithm=algorithm,
        library=str(body.get("library", ""))[:200],
        extra=extra,
    )


def _decode_tensor(
    name: str,
    t: dict[str, Any],
    files: list[FileEntry],
    ranges: list[list[tuple[int, int, str]]],
    v: _V,
) -> TensorEntry:
    what = f"tensor {name!r:.200}"
    dtype = t.get("dtype")
    if dtype not in DTYPES:
        raise v.fail(f"{what}: dtype {dtype!r:.60} is not in the allowlist")
    shape = v.shape(t.get("shape"), f"{what} shape")
    itemsize = ITEMSIZE[dtype]
    if _volume(shape) * itemsize > MAX_SIZE:
        raise v.fail(f"{what}: declares more than 2^62 bytes")
    chunks: list[Chunk] = []
    for j, c in enumerate(v.lst(t.get("chunks"), f"{what} chunks")):
        cw = f"{what} chunk {j}"
        c = v.lst(c, cw)
        if len(c) != 7:
            raise v.fail(f"{cw} must have 7 fields")
        fidx = v.int_(c[0], f"{cw} file", 0, max(len(files) - 1, 0))
        if not files:
            raise v.fail(f"{cw} references a file but none are listed")
        start = v.int_(c[1], f"{cw} start")
        length = v.int_(c[2], f"{cw} length")
        digest = v.str_(c[3], f"{cw} checksum", 64)
        offset = v.shape(c[4], f"{cw} offset")
        cshape = v.shape(c[5], f"{cw} shape")
        codec = c[6]
        if codec not in CODECS:
            raise v.fail(f"{cw}: unknown codec {codec!r:.40}")
        if len(offset) != len(shape) or len(cshape) != len(shape):
            raise v.fail(f"{cw}: offset/shape rank differs from the tensor's")
        for d in range(len(shape)):
            if offset[d] + cshape[d] > shape[d]:
                raise v.fail(f"{cw}: box lies outside the tensor's shape {list(shape)}")
        raw = _volume(cshape) * itemsize
        if codec == "raw" and length != raw:
            raise v.fail(f"{cw}: stored length {length} != raw size {raw}")
        if codec != "raw" and raw > length * MAX_ZSTD_RATIO + 65536:
            raise v.fail(f"{cw}: claims {raw} raw bytes from {length} compressed (impossible)")
        if start + length > files[fidx].size:
            raise v.fail(f"{cw}: byte range ends past the end of {files[fidx].path!r}")
        if length:
            ranges[fidx].append((start, start + length, name))
        chunks.append(Chunk(fidx, start, length, digest, offset, cshape, codec))
    _check_tiling(shape, chunks, what, v)
    return TensorEntry(dtype, shape, chunks)


_GRID_LIMIT = 1 << 22


def _check_tiling(shape: tuple[int, ...], chunks: list[Chunk], what: str, v: _V) -> None:
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
