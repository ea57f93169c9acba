"""Decoding the manifest (v1, and v2 without its index files): parse and validate untrusted bytes. Pure.

Called by the scanner and the reader (engine/scan.py, on whichever thread judges or loads a
step) on bytes read from storage, and by the save flows to check what they are about to
publish. :func:`decode` validates everything that can be checked without touching payload
files (schema, dtype allowlist, sizes with overflow checks, byte ranges inside files and
non-overlapping, chunk boxes tiling each tensor exactly, payload paths normalized and inside
the step folder, the manifest's own checksum) and raises :class:`CorruptCheckpointError`
naming what is wrong. The tree of non-tensor values is validated lazily by
:mod:`ckptlib.format.tree` when it is decoded, with the tensor names checked against
``Manifest.tensors``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from itertools import pairwise
from typing import Any

import numpy as np

from ckptlib.errors import CorruptCheckpointError, ManifestVersionError
from ckptlib.format import jsonio
from ckptlib.format.build import manifest_head
from ckptlib.format.checksum import ALGORITHMS, checksum
from ckptlib.format.dtypes import ITEMSIZE
from ckptlib.format.index_file import check_counts, schema_json
from ckptlib.format.packed_table import NO_TABLE, TABLE_KEY, check_members, decode_table
from ckptlib.format.schema import (
    CODECS,
    COMMIT_MODES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_ZSTD_RATIO,
    Chunk,
    FileEntry,
    IndexRef,
    Manifest,
    Pack,
    Piece,
    TensorEntry,
    check_metrics,
    volume,
)
from ckptlib.format.sharding import Sharding, decode_sharding
from ckptlib.format.validate import MAX_NAME, MAX_SIZE, Checker

_PATH_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")


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
    head = manifest_head(version, digest)
    data = bytes(data)
    if (
        algo != "xxh3_64"
        or set(top) != {"format", "format_version", "checksum", "body"}
        or not data.startswith(head)
        or not data.endswith(b"}")
        or checksum(data[len(head) : -1]) != digest
    ):
        raise v.fail("manifest checksum mismatch (the manifest was modified or is damaged)")
    if version == 2:
        return _decode_body_v2(body, v)
    return _decode_body(body, v)


def _common(body: dict[str, Any], v: Checker) -> tuple[Any, ...]:
    """The body fields v1 and v2 share: step .. checksum_algorithm, files, metadata, extra."""
    step = body.get("step")
    if step is not None:
        v.int_(step, "step")
    if "tree" not in body:  # null is a saved None; no key is a manifest cut or edited (it loaded as None)
        raise v.fail("no 'tree' (the saved structure, docs/format.md 3.6)")
    save_id = v.str_(body.get("save_id"), "save_id", 64)
    if not re.fullmatch(r"[0-9a-f]{8,64}", save_id):
        raise v.fail("save_id must be lowercase hex")
    created: Any = body.get("created")
    if type(created) not in (int, float):
        raise v.fail("created must be a number")
    world_size = v.int_(body.get("world_size"), "world_size", 1, 1 << 24)
    commit = body.get("commit")
    if commit not in COMMIT_MODES:
        raise v.unknown(f"commit must be one of {COMMIT_MODES}", commit)
    algorithm = body.get("checksum_algorithm")
    if algorithm not in ALGORITHMS:
        raise v.unknown(f"checksum_algorithm must be one of {ALGORITHMS}", algorithm)

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
    extra = body.get("extra", {})
    v.obj(extra, "extra")
    return step, save_id, created, world_size, commit, algorithm, files, extra, seen_paths


def _metrics(body: dict[str, Any], v: Checker) -> dict[str, float]:
    """The step's user metrics (``keep_best``); absent in manifests written before metrics existed."""
    try:
        return check_metrics(v.obj(body.get("metrics", {}), "metrics"))
    except ValueError as e:
        raise v.fail(str(e)) from None


def _decode_body(body: dict[str, Any], v: Checker) -> Manifest:
    step, save_id, created, world_size, commit, algorithm, files, extra, _ = _common(body, v)
    ranges: list[list[tuple[int, int, str]]] = [[] for _ in files]
    packs = _decode_packs(body.get("packs", []), files, ranges, v)
    members: list[tuple[int, int, int, str]] = []
    tensors: dict[str, TensorEntry] = {}
    for name, t in v.obj(body.get("tensors"), "tensors").items():
        v.str_(name, "tensor name", MAX_NAME)
        tensors[name] = _decode_tensor(name, v.obj(t, f"tensor {name!r}"), files, ranges, packs, members, v)
    table = decode_table(body[TABLE_KEY], packs, v) if TABLE_KEY in body else NO_TABLE
    for name, entry in table.entries:
        if name in tensors:
            raise v.fail(f"tensor {name!r:.200} is listed twice")
        tensors[name] = entry
    check_members(members, table, v)

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
    metrics = _metrics(body, v)
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
        metrics=metrics,
    )


def _decode_body_v2(body: dict[str, Any], v: Checker) -> Manifest:
    """A v2 body: tensors described once with their sharding, pieces in index files (not read
    here: ``engine/index_io.py`` loads the ones a reader needs, validated by
    ``format.sharding.check_index``). Everything here is O(ranks + tensors)."""
    step, save_id, created, world_size, commit, algorithm, files, extra, seen = _common(body, v)
    if body.get("index_schema") != schema_json():
        raise v.fail("index_schema is not the one this ckptlib knows (written by a newer version?)")
    indexes: list[IndexRef] = []
    by_rank: set[int] = set()
    for i, e in enumerate(v.lst(body.get("indexes"), "indexes")):
        w = f"indexes[{i}]"
        e = v.lst(e, w)
        if len(e) != 7:
            raise v.fail(f"{w} must be [path, size, checksum, rank, first_file, num_files, counts]")
        path = check_path(v.str_(e[0], f"{w}.path", 600), v.where)
        size = v.int_(e[1], f"{w}.size")
        digest = v.str_(e[2], f"{w}.checksum", 16)
        if not re.fullmatch(r"[0-9a-f]{16}", digest):
            raise v.fail(f"{w}.checksum must be 16 lowercase hex digits")
        rank = v.int_(e[3], f"{w}.rank", 0, world_size - 1)
        if rank in by_rank:
            raise v.fail(f"{w}: rank {rank} has two index files")
        by_rank.add(rank)
        first = v.int_(e[4], f"{w}.first_file", 0, len(files))
        nfiles = v.int_(e[5], f"{w}.num_files", 0, len(files) - first)
        counts = check_counts(e[6], size, v, w)
        # The index at the tail of the rank's last payload file (IndexRef.tail), or a file of its own.
        last = files[first + nfiles - 1] if nfiles else None
        tail = last is not None and path == last.path
        if last is not None and tail and size > last.size:
            raise v.fail(f"{w}: an index of {size} bytes cannot lie in the last {last.size} bytes of {path!r}")
        if not tail:  # two rows sharing a tail overlap: _check_file_ranges refuses them
            if path in seen or path == MANIFEST_NAME:
                raise v.fail(f"index path {path!r} listed twice or shadows the manifest or another rank's payload file")
            seen.add(path)
        indexes.append(IndexRef(path, size, digest, rank, first, nfiles, counts, tail))
    _check_file_ranges(indexes, v)
    tensors: dict[str, TensorEntry] = {}
    sharding: dict[str, Sharding] = {}
    for name, t in v.obj(body.get("tensors"), "tensors").items():
        v.str_(name, "tensor name", MAX_NAME)
        t = v.obj(t, f"tensor {name!r:.200}")
        dtype = t.get("dtype")
        if type(dtype) is not str or dtype not in ITEMSIZE:
            raise v.unknown(f"tensor {name!r:.200}: dtype {dtype!r:.60} is not in the allowlist", dtype)
        shape = v.shape(t.get("shape"), f"tensor {name!r:.200} shape")
        if volume(shape) * ITEMSIZE[dtype] > MAX_SIZE:
            raise v.fail(f"tensor {name!r:.200}: declares more than 2^62 bytes")
        sharding[name] = decode_sharding(name, t, shape, world_size, v)
        tensors[name] = TensorEntry(dtype, shape, [], [])
    _check_coverage(indexes, sharding, v)
    return Manifest(
        step=step, save_id=save_id, created=float(created), world_size=world_size, commit=commit, files=files,
        tensors=tensors, tree=body.get("tree"), metadata=body.get("metadata"), packs=[], checksum_algorithm=algorithm,
        library=str(body.get("library", ""))[:200], extra=extra, version=2, indexes=indexes, sharding=sharding,
        metrics=_metrics(body, v),
    )  # fmt: skip


def _check_file_ranges(indexes: list[IndexRef], v: Checker) -> None:
    """v2: each payload file belongs to one rank. The rows' ``files[first_file : first_file +
    num_files]`` ranges (a writer lays them out rank after rank) must not overlap: two ranks
    claiming one file would let one rank's index point into another's bytes, and a tier copy
    (``tiers/inventory.py``) would not know whose the file is. O(ranks log ranks)."""
    spans = sorted((ix.first_file, ix.num_files, ix.rank) for ix in indexes if ix.num_files)
    for (a, n, r), (b, _m, q) in pairwise(spans):
        if a + n > b:
            raise v.fail(f"indexes: rank {q}'s payload files (from files[{b}]) overlap rank {r}'s "
                         f"(files[{a}:{a + n}]): each payload file belongs to one rank")


def _check_coverage(indexes: list[IndexRef], sharding: dict[str, Sharding], v: Checker) -> None:
    """v2: every rank holding a piece of a tensor (by its sharding) has an ``indexes`` row, or
    no reader could find that piece: with no rows at all a load would read nothing and hand back
    the tensors' memory as it was. O(ranks x distinct layouts), no I/O: every decode checks it,
    so a manifest naming a rank without an index is corrupt before any load or status scan."""
    have = frozenset(ix.rank for ix in indexes)

    @cache  # grids with the same ranks share one answer
    def lacking(first: int, step: int, ncells: int) -> frozenset[int]:
        return frozenset(range(first, first + ncells * step, step) if step else (first,)) - have

    for name, sh in sharding.items():
        missing = lacking(sh.first, sh.step, volume(sh.counts)) if sh.block is not None else \
            frozenset(sh.ranks_held()) - have
        if missing:
            raise v.fail(f"tensor {name!r:.200} is held by rank {min(missing)}, which has no index file")


def _decode_packs(
    raw: Any, files: list[FileEntry], ranges: list[list[tuple[int, int, str]]], v: Checker
) -> list[Pack]:
    packs = []
    for i, p in enumerate(v.lst(raw, "packs")):
        pw = f"pack {i}"
        p = v.lst(p, pw)
        if len(p) != 6:
            raise v.fail(f"{pw} must have 6 fields")
        fidx, start, length, digest = _file_range(p, pw, files, v)
        codec = p[4]
        if codec not in ("raw", "zstd"):
            raise v.unknown(f"{pw}: unknown codec {codec!r:.40}", codec)
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
    if type(dtype) is not str or dtype not in ITEMSIZE:  # a list or dict here is unhashable
        raise v.unknown(f"tensor {name!r:.200}: dtype {dtype!r:.60} is not in the allowlist", dtype)
    shape = v.shape(t.get("shape"), f"tensor {name!r:.200} shape")
    itemsize = ITEMSIZE[dtype]
    if volume(shape) * itemsize > MAX_SIZE:
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
        check_tiling(shape, [*chunks, *pieces], f"tensor {name!r:.200}", v)
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
    where = f"tensor {name!r:.200} {cw}"
    fidx, start, length, digest = _file_range(c, where, files, v)
    offset, cshape = _box(name, cw, c[4], c[5], shape, v)
    codec = c[6]
    if codec not in CODECS:
        raise v.unknown(f"{where}: unknown codec {codec!r:.40}", codec)
    _check_stored(where, name, codec, start, length, volume(cshape) * itemsize, fidx, files, ranges, v)
    return Chunk(fidx, start, length, digest, offset, cshape, codec)


def _file_range(row: list[Any], where: str, files: list[FileEntry], v: Checker) -> tuple[int, int, int, str]:
    """A chunk's or pack's first four fields: file index, start, length, checksum."""
    if not files:
        raise v.fail(f"{where} references a file but none are listed")
    return (v.int_(row[0], f"{where} file", 0, len(files) - 1), v.int_(row[1], f"{where} start"),
            v.int_(row[2], f"{where} length"), v.str_(row[3], f"{where} checksum", 64))  # fmt: skip


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
    end = raw_offset + volume(box) * itemsize
    if end > packs[pidx].raw_length:
        raise v.fail(f"tensor {name!r:.200} packed piece {j}: ends past the end of pack {pidx}")
    if end > raw_offset:
        members.append((pidx, raw_offset, end, name))
    return Piece(pidx, raw_offset, offset, box)


def check_built(body: dict[str, Any]) -> None:
    """The coordinator, on a manifest body it built (``engine/save.py`` ``SaveSession.publish``),
    before it commits: every tensor's pieces cover it exactly once, as :func:`decode` requires,
    so ``Shard`` pieces that leave gaps or overlap fail the save instead of committing a
    checkpoint no reader accepts. Only tensors stored in several pieces are looked at (v1
    ``chunks``/``packed`` rows; v2 shardings, grids against the world size): O(those pieces)."""
    v = Checker("", "the pieces saved do not tile the tensor (Shard offsets and shapes must cover "
                    "each tensor exactly once): ")
    if "indexes" in body:  # v2: the planner's layout
        for name, t in body["tensors"].items():
            decode_sharding(name, t, tuple(t["shape"]), body["world_size"], v)
        return
    for name, t in body["tensors"].items():
        shape = tuple(t["shape"])
        pieces = [Piece(0, 0, tuple(c[4]), tuple(c[5])) for c in t.get("chunks", ())]
        pieces += [Piece(0, 0, tuple(p[2]), tuple(p[3])) for p in t.get("packed", ())]
        if not (len(pieces) == 1 and pieces[0].shape == shape):
            check_tiling(shape, pieces, f"tensor {name!r:.200}", v)


_GRID_LIMIT = 1 << 22


def check_tiling(shape: tuple[int, ...], chunks: Sequence[Chunk | Piece], what: str, v: Checker) -> None:
    """Chunks must cover the tensor exactly once: no gaps (garbage) and no overlaps."""
    total = volume(shape)
    if total == 0:
        return
    nonempty = [c for c in chunks if volume(c.shape)]
    if sum(volume(c.shape) for c in nonempty) != total:
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
