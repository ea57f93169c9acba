"""Building the manifest: its body from what the ranks wrote (v1: every chunk; v2: per-rank
summaries and the planner's layout, :func:`build_body` with ``layout``), and its bytes. Pure.

Who calls what:
- each rank's writer (engine/writer.py) describes what it wrote as :class:`WrittenChunk` and
  :class:`WrittenPack` records; the save flow (engine/save.py) gathers them from every rank;
- the coordinator, on the thread that persists the save, calls :func:`build_body` with every
  rank's results, then :func:`encode_body`, and publishes the bytes (engine/commit.py);
- :func:`encode` serializes a :class:`~ckptlib.format.schema.Manifest` held in memory (tests,
  tools) through :func:`to_body`, which spells every key and row with the same helpers;
- decoding (:mod:`ckptlib.format.decode`) checks the head made by :func:`manifest_head`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ckptlib._version import __version__
from ckptlib.errors import UnsupportedValueError
from ckptlib.format import jsonio
from ckptlib.format.checksum import DEFAULT_ALGORITHM, checksum
from ckptlib.format.packed_table import TABLE_KEY, PackedTable
from ckptlib.format.schema import (
    FORMAT_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    TensorEntry,
    check_metrics,
    is_whole_packed,
)


class PackMember(NamedTuple):
    """A tensor piece stored in a pack: metadata only (results travel between ranks, so no
    tensor may ride along)."""

    name: str
    dtype: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(slots=True)
class WrittenChunk:
    """One chunk a rank wrote: a box of tensor ``name`` at ``[start, start + length)`` of ``file``."""

    name: str
    file: str
    """The payload file's path on storage (made relative to the step by :func:`build_body`)."""
    start: int
    length: int
    checksum: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    codec: str
    dtype: str


@dataclass(slots=True)
class WrittenPack:
    """One pack a rank wrote: many small pieces stored (and checksummed) as one range."""

    file: str
    start: int
    length: int
    checksum: str
    codec: str
    raw_length: int
    members: Sequence[PackMember]
    """The packed pieces, in order."""
    offsets: list[int]
    """Raw offset of each member inside the decoded pack."""


def chunk_row(
    file: int, start: int, length: int, digest: str, offset: tuple[int, ...], shape: tuple[int, ...], codec: str
) -> list[Any]:
    """A chunk's compact positional form (docs/format.md)."""
    return [file, start, length, digest, list(offset), list(shape), codec]


_BODY_KEYS = ("step", "save_id", "created", "world_size", "commit", "checksum_algorithm", "library", "files",
              "packs", "tensors", TABLE_KEY, "tree", "metadata", "extra", "metrics")  # fmt: skip


_BODY_KEYS_V2 = ("step", "save_id", "created", "world_size", "commit", "checksum_algorithm", "library", "files",
                 "index_schema", "indexes", "tensors", "tree", "metadata", "extra", "metrics")  # fmt: skip


def _body(**fields: Any) -> dict[str, Any]:
    """The body, keys in their order (v2 when it has ``indexes``): the one place that spells
    them (all are required)."""
    body = {k: fields.pop(k) for k in (_BODY_KEYS_V2 if "indexes" in fields else _BODY_KEYS)}
    assert not fields, f"unknown manifest body keys {sorted(fields)}"
    return body


def build_body(
    results: Sequence[Mapping[str, Any]],
    step: int | None,
    save_id: str,
    created: float,
    mode: str,
    metadata: Any,
    prefix: str,
    *,
    tree: Any,
    metrics: dict[str, float] | None = None,
    layout: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The manifest body (JSON-ready) from every rank's write results. Coordinator only.

    Format v1 (``layout`` None): ``results[r]`` is rank r's report: ``files`` (``(path, size)``
    pairs), ``chunks`` (its :class:`WrittenChunk` / :class:`WrittenPack` records) and ``shapes``
    (global shape per tensor name); other keys are ignored. Builds JSON structures directly (no
    intermediate objects): with tens of thousands of small tensors, per-tensor overhead here is
    a visible part of the save.

    Format v2 (``layout``: name -> ``{"dtype", "shape", **sharding}``, the sharding from
    :func:`ckptlib.format.sharding.grid_json` / ``boxes_json``, made by the save planner):
    ``results[r]`` is rank r's summary: ``files`` and ``index`` (``{"path", "size",
    "checksum", "counts"}`` of its piece index file, or None when it wrote nothing). O(ranks +
    tensors): no per-piece record passes through here, pieces live in the ranks' index files.

    Either way paths are made relative to the step folder, keeping ``<save_id>/...`` of
    ``prefix``; ``tree``: the merged tree of non-tensor values (the caller merges the ranks'
    trees); ``metrics``: the step's metrics (checked by
    :func:`~ckptlib.format.schema.check_metrics`).
    """
    strip = len(prefix) - len(prefix.rsplit("/", 1)[-1])  # keep "<save_id>/..." relative to the step
    files: list[list[Any]] = []
    firsts: list[int] = []  # rank r's payload files are files[firsts[r]:][:len(results[r]["files"])]
    for res in results:
        firsts.append(len(files))
        files += [[path[strip:], size] for path, size in res["files"]]
    parts = _pieces(results, firsts) if layout is None else _indexes(results, firsts, strip, layout)
    return _body(
        step=step, save_id=save_id, created=created, world_size=len(results), commit=mode,
        checksum_algorithm=DEFAULT_ALGORITHM, library=f"ckptlib {__version__}", files=files, **parts,
        tree=tree, metadata=metadata, extra={}, metrics=check_metrics(metrics),
    )  # fmt: skip


def _pieces(results: Sequence[Mapping[str, Any]], firsts: list[int]) -> dict[str, Any]:
    """v1: ``packs``, ``tensors`` (every chunk) and the packed table, from every rank's records."""
    index = {path: first + i for res, first in zip(results, firsts, strict=True)
             for i, (path, _size) in enumerate(res["files"])}
    shapes: dict[str, tuple[int, ...]] = {}
    for res in results:
        shapes.update(res["shapes"])
    tensors: dict[str, dict[str, Any]] = {}
    packs: list[list[Any]] = []
    table = PackedTable()
    add_row = table.rows.append
    for res in results:
        for c in res["chunks"]:
            if isinstance(c, WrittenPack):
                pidx = len(packs)
                packs.append([index[c.file], c.start, c.length, c.checksum, c.codec, c.raw_length])
                for m, raw_offset in zip(c.members, c.offsets, strict=True):
                    name, shape = m.name, m.shape
                    gshape = shapes[name]
                    if shape == gshape:  # the whole tensor: a row of the packed table
                        add_row((name, m.dtype, gshape, pidx, raw_offset))
                        continue
                    piece = [pidx, raw_offset, list(m.offset), list(shape)]
                    entry = tensors.get(name)
                    if entry is None:
                        tensors[name] = {"dtype": m.dtype, "shape": list(gshape), "packed": [piece]}
                    else:
                        entry.setdefault("packed", []).append(piece)
                continue
            entry = tensors.get(c.name)
            if entry is None:
                entry = tensors[c.name] = {"dtype": c.dtype, "shape": list(shapes[c.name])}
            entry.setdefault("chunks", []).append(
                chunk_row(index[c.file], c.start, c.length, c.checksum, c.offset, c.shape, c.codec)
            )
    return {"packs": packs, "tensors": tensors, TABLE_KEY: table.json()}


def _indexes(results: Sequence[Mapping[str, Any]], firsts: list[int], strip: int,
             layout: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """v2: the index files' schema and one row per rank that wrote one, and ``layout``."""
    from ckptlib.format.index_file import COUNTS, schema_json

    indexes: list[list[Any]] = []
    for rank, (res, first) in enumerate(zip(results, firsts, strict=True)):
        idx = res.get("index")
        if idx is not None:
            counts = [idx["counts"][k] for k in COUNTS]
            indexes.append([idx["path"][strip:], idx["size"], idx["checksum"], rank, first, len(res["files"]), counts])
    return {"index_schema": schema_json(), "indexes": indexes, "tensors": layout}


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
    if t.chunks:
        out["chunks"] = [chunk_row(c.file, c.start, c.length, c.checksum, c.offset, c.shape, c.codec) for c in t.chunks]
    if t.pieces:
        out["packed"] = [
            [p.pack, p.raw_offset] if p.shape == t.shape else [p.pack, p.raw_offset, list(p.offset), list(p.shape)]
            for p in t.pieces
        ]
    return out


def to_body(m: Manifest) -> dict[str, Any]:
    """The body of a manifest held in memory (what :func:`encode` serializes)."""
    table = PackedTable()
    for name, t in m.tensors.items():
        if is_whole_packed(t):
            table.rows.append((name, t.dtype, t.shape, t.pieces[0].pack, t.pieces[0].raw_offset))
    return _body(
        step=m.step, save_id=m.save_id, created=m.created, world_size=m.world_size, commit=m.commit,
        checksum_algorithm=m.checksum_algorithm, library=m.library,
        files=[[f.path, f.size] for f in m.files],
        packs=[[p.file, p.start, p.length, p.checksum, p.codec, p.raw_length] for p in m.packs],
        tensors={name: _tensor_json(t) for name, t in m.tensors.items() if not is_whole_packed(t)},
        packed_tensors=table.json(), tree=m.tree, metadata=m.metadata, extra=m.extra,
        metrics=check_metrics(m.metrics),
    )  # fmt: skip


def encode(m: Manifest) -> bytes:
    """Serialize ``m``, with a checksum over the body (see :func:`encode_body`)."""
    return encode_body(to_body(m))


def encode_body(body: dict[str, Any]) -> bytes:
    """The manifest file: a fixed head, the body's compact JSON, and ``}``.

    The head carries the format marker, version (2 when the body has ``indexes``, else 1) and
    an xxh3-64 checksum of exactly the body's bytes, so any change to the body is detected
    without re-serializing it. A manifest larger than ``MAX_MANIFEST_BYTES`` (which no reader
    would open) raises :class:`UnsupportedValueError`; the save's coordinator
    (``engine.save.SaveSession.publish``) turns it into the save's :class:`CommitError`.
    """
    text = jsonio.dumps(body, sort_keys=False).encode("ascii")
    data = manifest_head(2 if "indexes" in body else 1, checksum(text)) + text + b"}"
    if len(data) > MAX_MANIFEST_BYTES:  # readers refuse it by its size: never commit it
        raise _too_big(f"{len(data)} bytes")
    return data


def manifest_floor(names: Iterable[str], tree: Any = None) -> int:
    """A floor of the manifest's size, never more than :func:`encode_body` will make: its head,
    each distinct tensor name (a JSON string in every format: its characters, one byte or more
    each, two quotes, a separator) and, only where the caller passes it, ``tree``, which must be
    exactly the body's ``tree`` (a one-rank v1 save with no ``PerRank`` value)."""
    distinct = set(names)
    floor = len(manifest_head(1, "0" * 16)) + 1 + sum(map(len, distinct)) + 3 * len(distinct)
    if floor <= MAX_MANIFEST_BYTES and tree is not None:
        floor += len(jsonio.dumps(tree, sort_keys=False))
    return floor


def check_room(names: Iterable[str], tree: Any = None) -> None:
    """Every rank, on the save's thread, before any payload byte is written
    (``engine.save.write_state``): raise :class:`UnsupportedValueError`, as :func:`encode_body`
    would at the commit, when :func:`manifest_floor` proves the manifest over
    ``MAX_MANIFEST_BYTES``. Never refuses a manifest that fits; the commit's exact check stays."""
    floor = manifest_floor(names, tree)
    if floor > MAX_MANIFEST_BYTES:
        raise _too_big(f"at least {floor} bytes")


def _too_big(size: str) -> UnsupportedValueError:
    """The refusal of a manifest over the limit (:func:`encode_body`, :func:`check_room`)."""
    return UnsupportedValueError(
        f"the manifest would be {size}, over the {MAX_MANIFEST_BYTES} bytes a reader accepts "
        "(non-tensor values are stored in it: move long lists and strings into tensors or bytes, "
        "which go to payload files; docs/format.md 4.1)"
    )


def manifest_head(version: int, digest: str) -> bytes:
    """Everything before the body text; the checksum covers exactly the body's bytes."""
    return (
        f'{{"format":"{FORMAT_NAME}","format_version":{version},"checksum":"xxh3_64:{digest}","body":'
    ).encode("ascii")


def rebased(data: bytes, save_id: str, mode: str, extra: dict[str, Any]) -> bytes:
    """The manifest ``data`` (already validated: v1 or v2) moved to save ``save_id``: every
    payload and index path under the old save id renamed, commit mode ``mode``, ``extra``
    replaced. Used by the tier drain (ckptlib/tiers/drain.py) to publish a local step's manifest
    on the persistent tier; the result is decoded again before it is committed."""
    body = jsonio.loads(data)["body"]
    old = body["save_id"]

    def move(p: str) -> str:
        return save_id + p[len(old):] if p.startswith(old + "/") else p

    body["save_id"], body["commit"], body["extra"] = save_id, mode, extra
    body["files"] = [[move(p), *rest] for p, *rest in body["files"]]
    if "indexes" in body:
        body["indexes"] = [[move(p), *rest] for p, *rest in body["indexes"]]
    return encode_body(body)
