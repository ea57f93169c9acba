"""What a checkpoint folder's manifest declares, decoded independently of ckptlib.

The oracle of tests/chaos/test_fuzz_decoding.py: when ``ckptlib.load`` accepts a mutated
checkpoint, the fuzz test compares what it returned with :func:`declared`, which reads the same
folder from the written specification alone (docs/format.md sections 2, 3 and 7) with the
standard ``json`` module, numpy, torch dtypes and ``zstandard`` -- none of ckptlib's reader,
manifest decoder, codecs, dtype table or tree decoder. It does not validate: it assembles what
the manifest says (boxes placed into zero-filled tensors, later pieces over earlier ones) and
raises :class:`Undeclared` where the manifest does not declare a value at all (an unknown node
kind, a reference to no tensor, a bytes value that is not a 1-D uint8 tensor, a frame that does
not decode, a range past its file). A load that succeeded where this raises, or that returned
anything else than this returns, is a load of something the manifest does not declare.

Called by the fuzz test's pytest thread, once per example that loaded.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

CODECS = {0: "raw", 1: "zstd", 2: "zstd-shuffle"}  # format v2 index files (docs/format.md 7.3)
MAGIC = b"CKPTIDX2"
COUNT_NAMES = ("names", "name_bytes", "chunks", "chunk_dims", "packs", "members", "member_dims")


class Undeclared(Exception):
    """The manifest declares no value here (what a load should have refused)."""


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise Undeclared(f"{name!r} is not a torch dtype")
    return dt


class _Folder:
    def __init__(self, folder: Path, body: dict[str, Any]) -> None:
        self.folder = folder
        self.files = [p for p, _ in body["files"]]

    def stored(self, file: int, start: int, length: int) -> bytes:
        """The stored bytes of a range; a range past the file is undeclared."""
        try:
            path = self.folder / self.files[file]
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(length)
        except (IndexError, OSError, ValueError, OverflowError) as e:
            raise Undeclared(f"file {file} range [{start}, +{length}): {e}") from None
        if len(data) != length:
            raise Undeclared(f"file {file} range [{start}, +{length}) runs past the file")
        return data


def _decode(data: bytes, codec: str, raw_size: int, itemsize: int) -> bytes:
    """Raw bytes of a stored range: one complete zstd frame of exactly ``raw_size`` bytes,
    un-shuffled for ``zstd-shuffle`` (docs/format.md 2.1)."""
    if codec == "raw":
        out = data
    elif codec in ("zstd", "zstd-shuffle"):
        d = zstandard.ZstdDecompressor().decompressobj()
        try:
            out = d.decompress(data)
        except zstandard.ZstdError as e:
            raise Undeclared(f"zstd frame: {e}") from None
        if not d.eof or d.unused_data:
            raise Undeclared("not exactly one complete zstd frame")
        if codec == "zstd-shuffle" and itemsize > 1 and len(out) % itemsize == 0:
            out = np.frombuffer(out, np.uint8).reshape(itemsize, -1).T.tobytes()
    else:
        raise Undeclared(f"codec {codec!r}")
    if len(out) != raw_size:
        raise Undeclared(f"{len(out)} raw bytes, {raw_size} declared")
    return out


class _Tensors:
    """Tensors assembled from their declared pieces (``name -> uint8 array shaped [*shape, itemsize]``)."""

    def __init__(self) -> None:
        self.meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.data: dict[str, np.ndarray] = {}

    def declare(self, name: str, dtype: Any, shape: Any) -> None:
        dt = _dtype(dtype)
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise Undeclared(f"{name}: shape {shape!r}")
        if math.prod(shape) * dt.itemsize > 1 << 30:
            raise Undeclared(f"{name}: {shape} is beyond what a test checkpoint holds")
        self.meta[name] = (dt, tuple(shape))
        self.data[name] = np.zeros((*shape, dt.itemsize), np.uint8)

    def place(self, name: str, raw: bytes, offset: list[int], box: list[int]) -> None:
        if name not in self.data:
            raise Undeclared(f"a piece of {name!r}, which the manifest does not declare")
        dt, shape = self.meta[name]
        if len(offset) != len(shape) or len(box) != len(shape):
            raise Undeclared(f"{name}: box {offset} {box} for shape {shape}")
        if len(raw) != math.prod(box) * dt.itemsize:
            raise Undeclared(f"{name}: {len(raw)} bytes for box {box}")
        region = tuple(slice(o, o + n) for o, n in zip(offset, box, strict=True))
        target = self.data[name][region]
        if target.shape[:-1] != tuple(box):
            raise Undeclared(f"{name}: box {offset} {box} outside {shape}")
        self.data[name][region] = np.frombuffer(raw, np.uint8).reshape(*box, dt.itemsize)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.data:
            raise Undeclared(f"a reference to {name!r}, which the manifest does not declare")
        dt, shape = self.meta[name]
        flat = torch.from_numpy(self.data[name].reshape(-1).copy())
        return flat.view(dt).reshape(shape)


def _v1(f: _Folder, body: dict[str, Any], t: _Tensors) -> None:
    packs = []
    for file, start, length, _ck, codec, raw_length in body.get("packs") or []:
        packs.append(_decode(f.stored(file, start, length), codec, raw_length, 1))
    for name, e in body["tensors"].items():
        t.declare(name, e["dtype"], e["shape"])
        item = t.meta[name][0].itemsize
        for file, start, length, _ck, offset, box, codec in e.get("chunks", []):
            t.place(name, _decode(f.stored(file, start, length), codec, math.prod(box) * item, item), offset, box)
        for piece in e.get("packed", []):
            pack, at = piece[0], piece[1]
            offset, box = (piece[2], piece[3]) if len(piece) == 4 else ([0] * len(e["shape"]), e["shape"])
            t.place(name, packs[pack][at : at + math.prod(box) * item], offset, box)
    table = body.get("packed_tensors")
    if table:
        dims = iter(table["dims"])
        for name, dtype, ndim, pack, at in zip(table["name"], table["dtype"], table["ndim"], table["pack"],
                                               table["offset"], strict=True):
            shape = [next(dims) for _ in range(ndim)]
            t.declare(name, dtype, shape)
            size = math.prod(shape) * t.meta[name][0].itemsize
            t.place(name, packs[pack][at : at + size], [0] * ndim, shape)


def _columns(data: bytes, schema: list[Any], counts: list[int]) -> dict[str, np.ndarray]:
    """A v2 index file's arrays, by the manifest's schema and the rank's counts (7.3)."""
    if data[: len(MAGIC)] != MAGIC:
        raise Undeclared("index file without its magic")
    n = dict(zip(COUNT_NAMES, counts, strict=True))
    out, at = {}, len(MAGIC)
    for name, dtype, length in schema:
        k, _, what = length.rpartition("*")
        count = (int(k) if k else 1) * n[what]
        dt = np.dtype(dtype)
        out[name] = np.frombuffer(data, dt, count, at)
        at += count * dt.itemsize
    return out


def _v2(f: _Folder, body: dict[str, Any], t: _Tensors) -> None:
    for name, e in body["tensors"].items():
        t.declare(name, e["dtype"], e["shape"])
    for path, size, _ck, _rank, first, num, counts in body["indexes"]:
        data = (f.folder / path).read_bytes()
        if num and f.files[first + num - 1] == path:  # the index is the tail of the rank's last payload file
            data = data[len(data) - size:] if size <= len(data) else b""
        if len(data) != size:
            raise Undeclared(f"index file {path}: {len(data)} bytes, {size} declared")
        c = _columns(data, body["index_schema"], counts)
        ends = [0, *map(int, c["name_end"])]
        raw_names = bytes(c["name_bytes"])
        names = [raw_names[a:b].decode() for a, b in itertools.pairwise(ends)]
        boxes = iter(map(int, c["chunk_box"]))
        for i in range(len(c["chunk_start"])):
            name, nd = names[c["chunk_tensor"][i]], int(c["chunk_ndim"][i])
            offset, box = [next(boxes) for _ in range(nd)], [next(boxes) for _ in range(nd)]
            item = t.meta[name][0].itemsize if name in t.meta else 1
            stored = f.stored(first + int(c["chunk_file"][i]), int(c["chunk_start"][i]), int(c["chunk_length"][i]))
            t.place(name, _decode(stored, CODECS[int(c["chunk_codec"][i])], math.prod(box) * item, item), offset, box)
        packs = [_decode(f.stored(first + int(c["pack_file"][i]), int(c["pack_start"][i]), int(c["pack_length"][i])),
                         CODECS[int(c["pack_codec"][i])], int(c["pack_raw_length"][i]), 1)
                 for i in range(len(c["pack_start"]))]
        boxes = iter(map(int, c["member_box"]))
        for i in range(len(c["member_offset"])):
            name, nd = names[c["member_tensor"][i]], int(c["member_ndim"][i])
            offset, box = [next(boxes) for _ in range(nd)], [next(boxes) for _ in range(nd)]
            item = t.meta[name][0].itemsize if name in t.meta else 1
            at = int(c["member_offset"][i])
            t.place(name, packs[c["member_pack"][i]][at : at + math.prod(box) * item], offset, box)


def _value(node: Any, t: _Tensors) -> Any:
    """The value a tree node declares (docs/format.md 3.6), loaded on one process."""
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if not isinstance(node, dict):
        raise Undeclared(f"a {type(node).__name__} is not a tree node")
    kind = node.get("t")
    if kind == "tensor":
        return t.tensor(node.get("ref"))  # type: ignore[arg-type]
    if kind == "dict":
        out: dict[Any, Any] = {}
        for key, v in node["items"]:
            if isinstance(key, bool) or not isinstance(key, str | int) or key in out:
                raise Undeclared(f"dict key {key!r}")
            out[key] = _value(v, t)
        return out
    if kind in ("list", "tuple"):
        values = [_value(v, t) for v in node["items"]]
        return values if kind == "list" else tuple(values)
    if kind == "float":
        if node.get("v") not in ("nan", "inf", "-inf"):
            raise Undeclared(f"float {node.get('v')!r}")
        return float(node["v"])
    if kind == "bytes":
        if "ref" in node:
            x = t.tensor(node["ref"])
            if x.dtype != torch.uint8 or x.dim() != 1:
                raise Undeclared(f"bytes stored as {x.dtype} {list(x.shape)}")
            return x.numpy().tobytes()
        return base64.b64decode(node["b64"], validate=True)
    if kind == "dtype":
        return _dtype(node.get("v"))
    if kind == "stateful":
        inner = _value(node.get("v"), t)
        if not isinstance(inner, dict):
            raise Undeclared("stateful value without a dict")
        return inner
    if kind == "per_rank":
        ranks = node.get("ranks")
        if not isinstance(ranks, list) or len(ranks) != 1:
            raise Undeclared("a per-rank value of other than one rank, loaded on one process")
        return _value(ranks[0], t)
    raise Undeclared(f"node kind {kind!r}")


def declared(folder: Path) -> Any:
    """The state that ``folder``'s manifest declares, decoded from the spec alone."""
    body = json.loads((folder / "manifest.json").read_bytes())["body"]
    try:
        f, t = _Folder(folder, body), _Tensors()
        (_v2 if "indexes" in body else _v1)(f, body, t)
        return _value(body["tree"], t)
    except (KeyError, TypeError, ValueError, IndexError, StopIteration, UnicodeDecodeError) as e:
        raise Undeclared(f"{type(e).__name__}: {e}") from None
