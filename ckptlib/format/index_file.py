"""Format v2 piece index files: one binary, columnar file per writing rank. Pure.

Who calls what:
- each rank, after its payload writes (engine/save.py ``SaveSession.collect``, the thread that
  persists the save), calls :func:`build_index` on its write results and stores the bytes next
  to its payload files; the manifest records the file's path, size, checksum and
  :data:`COUNTS` (``format.build.build_body``);
- a loading rank (engine/index_io.py) reads only the index files it needs, checks size and
  checksum, and calls :func:`decode_index`, which validates every column with numpy (bounded
  time and memory: every count is fixed by the manifest and must add up to the file's size
  before a byte is parsed).

Layout (docs/format.md, "Format v2"): the 8-byte :data:`MAGIC`, then the columns of
:data:`SCHEMA` back to back, in that order, each a little-endian array whose length is given by
the manifest's counts (widest columns first, so every column is naturally aligned). Nothing in
the file is executable; it is never unpickled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ckptlib.format.build import WrittenChunk, WrittenPack
from ckptlib.format.checksum import ALGORITHMS
from ckptlib.format.schema import MAX_ZSTD_RATIO
from ckptlib.format.validate import MAX_NAME, MAX_NDIM, MAX_SIZE, Checker

MAGIC = b"CKPTIDX2"
MAX_INDEX_BYTES = 256 << 20
"""Largest index file accepted, like the v1 manifest's limit (about 4M pieces of 2 dimensions
written by one rank, ~66 bytes each); refused by its recorded size before reading."""

CODEC_IDS = {"raw": 0, "zstd": 1, "zstd-shuffle": 2}
CODEC_NAMES = tuple(CODEC_IDS)

COUNTS = ("names", "name_bytes", "chunks", "chunk_dims", "packs", "members", "member_dims")
"""The per-file counts the manifest records, in this order."""

SCHEMA: tuple[tuple[str, str, str], ...] = (
    # column, numpy dtype (little-endian), length (a count, or 2 x a dims count)
    ("name_end", "<u8", "names"),          # end of each name in name_bytes (cumulative)
    ("chunk_start", "<u8", "chunks"),      # byte offset in the payload file
    ("chunk_length", "<u8", "chunks"),     # stored bytes
    ("chunk_checksum", "<u8", "chunks"),   # the digest as an integer
    ("chunk_box", "<u8", "2*chunk_dims"),  # per chunk: ndim offsets, then ndim sizes
    ("pack_start", "<u8", "packs"),
    ("pack_length", "<u8", "packs"),
    ("pack_checksum", "<u8", "packs"),
    ("pack_raw_length", "<u8", "packs"),
    ("member_offset", "<u8", "members"),   # raw offset inside the decoded pack
    ("member_box", "<u8", "2*member_dims"),
    ("chunk_tensor", "<u4", "chunks"),     # index into the names
    ("chunk_file", "<u4", "chunks"),       # index into this rank's payload files
    ("pack_file", "<u4", "packs"),
    ("member_tensor", "<u4", "members"),
    ("member_pack", "<u4", "members"),     # index into this file's packs
    ("chunk_codec", "u1", "chunks"),       # CODEC_IDS
    ("chunk_ndim", "u1", "chunks"),
    ("pack_codec", "u1", "packs"),
    ("member_ndim", "u1", "members"),
    ("name_bytes", "u1", "name_bytes"),    # UTF-8 names, back to back
)  # fmt: skip


def schema_json() -> list[list[str]]:
    """The schema as the manifest records it (``index_schema``): ``[column, dtype, length]``."""
    return [list(c) for c in SCHEMA]


def _length(spec: str, counts: dict[str, int]) -> int:
    return 2 * counts[spec[2:]] if spec.startswith("2*") else counts[spec]


_WIDTHS = [(np.dtype(dt).itemsize * (2 if spec.startswith("2*") else 1), spec.removeprefix("2*"))
           for _, dt, spec in SCHEMA]


def expected_size(counts: dict[str, int]) -> int:
    """Bytes an index file with ``counts`` has (exact integers: no overflow)."""
    return len(MAGIC) + sum(w * counts[k] for w, k in _WIDTHS)


def digest_int(hexdigest: str) -> int:
    return int(hexdigest, 16)


def digest_hex(value: int, algorithm: str) -> str:
    return f"{value:016x}" if algorithm == "xxh3_64" else f"{value:08x}"


@dataclass(slots=True)
class BuiltIndex:
    data: bytes
    counts: dict[str, int]
    names: list[str]


def build_index(files: Sequence[tuple[str, int]], written: Sequence[WrittenChunk | WrittenPack]) -> BuiltIndex:
    """The index file of one rank: every chunk and pack it wrote (``written``), file paths
    replaced by their position in ``files`` (this rank's payload files, in order)."""
    file_index = {path: i for i, (path, _) in enumerate(files)}
    names: dict[str, int] = {}
    cols: dict[str, list[int]] = {name: [] for name, _, _ in SCHEMA if name not in ("name_end", "name_bytes")}

    def tid(name: str) -> int:
        i = names.get(name)
        if i is None:
            i = names[name] = len(names)
        return i

    npacks = 0
    for w in written:
        if isinstance(w, WrittenPack):
            cols["pack_file"].append(file_index[w.file])
            cols["pack_start"].append(w.start)
            cols["pack_length"].append(w.length)
            cols["pack_checksum"].append(digest_int(w.checksum))
            cols["pack_codec"].append(CODEC_IDS[w.codec])
            cols["pack_raw_length"].append(w.raw_length)
            for m, raw_offset in zip(w.members, w.offsets, strict=True):
                cols["member_tensor"].append(tid(m.name))
                cols["member_pack"].append(npacks)
                cols["member_offset"].append(raw_offset)
                cols["member_ndim"].append(len(m.shape))
                cols["member_box"] += [*m.offset, *m.shape]
            npacks += 1
            continue
        cols["chunk_tensor"].append(tid(w.name))
        cols["chunk_file"].append(file_index[w.file])
        cols["chunk_start"].append(w.start)
        cols["chunk_length"].append(w.length)
        cols["chunk_checksum"].append(digest_int(w.checksum))
        cols["chunk_codec"].append(CODEC_IDS[w.codec])
        cols["chunk_ndim"].append(len(w.shape))
        cols["chunk_box"] += [*w.offset, *w.shape]
    encoded = [n.encode("utf-8") for n in names]
    cols["name_end"] = np.cumsum([len(e) for e in encoded], dtype=np.uint64).tolist() if encoded else []
    blob = b"".join(encoded)
    counts = {
        "names": len(names), "name_bytes": len(blob), "chunks": len(cols["chunk_start"]),
        "chunk_dims": len(cols["chunk_box"]) // 2, "packs": npacks, "members": len(cols["member_offset"]),
        "member_dims": len(cols["member_box"]) // 2,
    }  # fmt: skip
    parts = [MAGIC]
    for name, dt, _ in SCHEMA:
        parts.append(blob if name == "name_bytes" else np.asarray(cols[name], dtype=dt).tobytes())
    data = b"".join(parts)
    assert len(data) == expected_size(counts)
    return BuiltIndex(data, counts, list(names))


@dataclass(slots=True)
class IndexTable:
    """One decoded, validated index file: numpy columns plus the tensor names."""

    names: list[str]
    cols: dict[str, np.ndarray]
    chunk_box_start: np.ndarray
    """Position of each chunk's box in ``chunk_box`` (offsets at it, sizes ndim later)."""
    member_box_start: np.ndarray


def check_counts(raw: object, size: int, v: Checker, what: str) -> dict[str, int]:
    """A manifest's counts for one index file: ints whose columns add up to ``size`` exactly."""
    if type(raw) is not list or len(raw) != len(COUNTS):
        raise v.fail(f"{what}: counts must be a list of {len(COUNTS)} integers")
    counts = {k: v.int_(x, f"{what} count {k}") for k, x in zip(COUNTS, raw, strict=True)}
    if size > MAX_INDEX_BYTES:
        raise v.fail(f"{what}: index file of {size} bytes is over the {MAX_INDEX_BYTES} byte limit")
    if expected_size(counts) != size:
        raise v.fail(f"{what}: counts describe {expected_size(counts)} bytes, the file is recorded as {size}")
    if counts["chunk_dims"] > counts["chunks"] * MAX_NDIM or counts["member_dims"] > counts["members"] * MAX_NDIM:
        raise v.fail(f"{what}: more dimensions than {MAX_NDIM} per piece")
    return counts


def decode_index(data: bytes, counts: dict[str, int], nfiles: int, file_sizes: Sequence[int],
                 algorithm: str, v: Checker) -> IndexTable:
    """Parse one index file whose size and checksum the caller checked; validate every column
    that needs no tensor shape (those checks are in ``format.sharding.check_index``)."""
    if algorithm not in ALGORITHMS:
        raise v.fail(f"unknown checksum algorithm {algorithm!r:.40}")
    if len(data) != expected_size(counts) or not data.startswith(MAGIC):
        raise v.fail("not a ckptlib v2 index file (bad magic or size)")
    cols: dict[str, np.ndarray] = {}
    pos = len(MAGIC)
    for name, dt, spec in SCHEMA:
        n = _length(spec, counts)
        arr = np.frombuffer(data, dtype=dt, count=n, offset=pos)
        cols[name] = arr.astype(np.int64) if arr.dtype.itemsize < 8 else arr  # u8: checked below
        pos += n * arr.dtype.itemsize
    for name in ("name_end", "chunk_start", "chunk_length", "chunk_box", "pack_start", "pack_length",
                 "pack_raw_length", "member_offset", "member_box"):  # checksums stay uint64
        a = cols[name]
        if a.size and int(a.max()) > MAX_SIZE:
            raise v.fail(f"index column {name} holds a value over 2^62")
        cols[name] = a.astype(np.int64)
    if algorithm == "crc32c":
        for name in ("chunk_checksum", "pack_checksum"):
            if cols[name].size and int(cols[name].max()) >= 1 << 32:
                raise v.fail(f"index column {name} holds a value wider than crc32c")
    # names
    ends = cols["name_end"]
    if ends.size and (np.any(np.diff(ends) < 0) or int(ends[-1]) != counts["name_bytes"]):
        raise v.fail("index names are not laid out back to back")
    blob = data[pos - counts["name_bytes"] : pos]
    starts = np.concatenate(([0], ends[:-1])) if ends.size else ends
    try:
        names = [blob[a:b].decode("utf-8") for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    except UnicodeDecodeError:
        raise v.fail("an index tensor name is not valid UTF-8") from None
    if len(set(names)) != len(names) or any(len(n) > MAX_NAME for n in names):
        raise v.fail(f"index tensor names must be unique strings of at most {MAX_NAME} characters")
    n_names = len(names)
    # chunks
    ch = counts["chunks"]
    _in_range(cols["chunk_tensor"], n_names, "chunk tensor", v)
    _in_range(cols["chunk_file"], nfiles, "chunk file", v)
    _in_range(cols["chunk_codec"], len(CODEC_NAMES), "chunk codec", v)
    _in_range(cols["chunk_ndim"], MAX_NDIM + 1, "chunk ndim", v)
    if int(cols["chunk_ndim"].sum()) != counts["chunk_dims"]:
        raise v.fail("index chunk ndims do not add up to chunk_dims")
    # packs
    _in_range(cols["pack_file"], nfiles, "pack file", v)
    _in_range(cols["pack_codec"], 2, "pack codec", v)  # raw or zstd
    _in_range(cols["member_tensor"], n_names, "member tensor", v)
    _in_range(cols["member_pack"], counts["packs"], "member pack", v)
    _in_range(cols["member_ndim"], MAX_NDIM + 1, "member ndim", v)
    if int(cols["member_ndim"].sum()) != counts["member_dims"]:
        raise v.fail("index member ndims do not add up to member_dims")
    sizes = np.asarray(list(file_sizes), dtype=np.int64)
    # stored ranges inside their files, and no two non-empty ranges overlapping
    files = np.concatenate((cols["chunk_file"], cols["pack_file"]))
    start = np.concatenate((cols["chunk_start"], cols["pack_start"]))
    length = np.concatenate((cols["chunk_length"], cols["pack_length"]))
    end = start + length  # both <= 2^62: no overflow in int64
    if files.size:
        bad = np.flatnonzero(end > sizes[files])
        if bad.size:
            raise v.fail(f"index: a stored range ends past the end of payload file {int(files[bad[0]])}")
        keep = length > 0
        f, s, e = files[keep], start[keep], end[keep]
        order = np.lexsort((s, f))
        f, s, e = f[order], s[order], e[order]
        if np.any((f[1:] == f[:-1]) & (s[1:] < e[:-1])):
            raise v.fail("index: two stored byte ranges overlap in one payload file")
    raw_pack = cols["pack_raw_length"]
    plen = cols["pack_length"]
    if np.any((cols["pack_codec"] == 0) & (plen != raw_pack)) or np.any(raw_pack > plen * MAX_ZSTD_RATIO + 65536):
        raise v.fail("index: a pack's raw length does not match its stored length")
    cbs = np.zeros(ch, dtype=np.int64)
    if ch:
        np.cumsum(2 * cols["chunk_ndim"][:-1], out=cbs[1:])
    mbs = np.zeros(counts["members"], dtype=np.int64)
    if counts["members"]:
        np.cumsum(2 * cols["member_ndim"][:-1], out=mbs[1:])
    return IndexTable(names, cols, cbs, mbs)


def _in_range(a: np.ndarray, hi: int, what: str, v: Checker) -> None:
    if a.size and (int(a.min()) < 0 or int(a.max()) >= hi):
        raise v.fail(f"index: {what} out of range")
