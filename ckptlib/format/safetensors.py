"""Hugging Face safetensors files, parsed from untrusted bytes, as the reader's in-memory manifest. Pure.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON header,
then the data section. The header maps each key to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (offsets into the data section; optional ``"__metadata__"``: str -> str). A
folder holds one or more such files, and optionally ``*.safetensors.index.json``
(``{"weight_map": {key: file}}``) naming which file holds each key.

Who calls what: :mod:`ckptlib.engine.safetensors_folder` (caller's thread, for ``ckptlib.load``
and ``ckptlib.open`` of such a folder) reads the bytes and calls :func:`header_length`,
:func:`parse_header` per file and :func:`parse_index`, then :func:`describe`, which builds a
:class:`~ckptlib.format.schema.Manifest` the engine's reader consumes as it consumes a
checkpoint's: one chunk per contiguous box of at most ``chunk_bytes``, no checksums
(``checksum_algorithm`` :data:`~ckptlib.format.checksum.NO_CHECKSUM`).

Checks (each failure is a :class:`CorruptCheckpointError` naming the file; nothing is trusted):
the header length is at most :data:`MAX_HEADER_BYTES` and inside the file; the header is strict
JSON (no duplicate keys, NaN or deep nesting) of the documented types; dtypes come from the
format's list; shapes are non-negative ints (at most 64 dimensions, 2^62 elements); every
``data_offsets`` range lies inside the data section and holds exactly ``prod(shape) x itemsize``
bytes; the ranges tile the data section exactly, as the reference parser requires (no overlap,
no gap, no trailing bytes). An index must name plain file names (no folders, no ``..``) and
agree with the files' headers.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptlib.errors import CorruptCheckpointError, UnsupportedValueError
from ckptlib.format import jsonio
from ckptlib.format.checksum import NO_CHECKSUM
from ckptlib.format.dtypes import ITEMSIZE
from ckptlib.format.schema import Chunk, FileEntry, Manifest, TensorEntry, volume
from ckptlib.format.tree import escape
from ckptlib.format.validate import Checker

SAFETENSORS = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "complex64": "C64",
}
"""ckptlib dtype -> the safetensors dtype ``ckptlib export --to safetensors`` writes."""
FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS.items()} | {"F8_E8M0": "float8_e8m0fnu"}
"""safetensors dtype -> ckptlib dtype, for reading (``F8_E8M0``: read, not written, as the
safetensors package's own torch loader cannot read it back yet)."""
SUB_BYTE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
"""Bits per element of the safetensors dtypes smaller than a byte."""
NOT_LOADABLE = frozenset(SUB_BYTE_BITS)
"""safetensors dtypes ckptlib cannot hold (sub-byte floats): their headers are validated like
any other (sizes included, in bits, as the reference parser does), and describing a folder that
keeps such a tensor is refused (``UnsupportedValueError``); ``ckptlib.load(..., rename=)`` can skip it."""

MAX_HEADER_BYTES = 100_000_000
"""Largest header accepted (the reference implementation's limit)."""
MAX_INDEX_BYTES = 64 << 20
"""Largest ``*.safetensors.index.json`` accepted (a large model's is a few MiB)."""
INDEX_NAME = "model.safetensors.index.json"
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a safetensors file, validated; offsets are absolute in the file."""

    key: str
    st_dtype: str
    """The dtype as the file names it (``BF16``)."""
    shape: tuple[int, ...]
    start: int
    length: int

    @property
    def dtype(self) -> str | None:
        """The ckptlib dtype, or None for :data:`NOT_LOADABLE` dtypes."""
        return FROM_SAFETENSORS.get(self.st_dtype)


def header_length(first: bytes, file_size: int, where: str) -> int:
    """The header length from a file's first 8 bytes (``first``: what could be read of them)."""
    if file_size < 8 or len(first) < 8:
        raise CorruptCheckpointError(f"a safetensors file needs at least 8 bytes, this one has {file_size}", where)
    (n,) = struct.unpack("<Q", first[:8])
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(f"header of {n} bytes is over the limit of {MAX_HEADER_BYTES}", where)
    if 8 + n > file_size:
        raise CorruptCheckpointError(f"header of {n} bytes runs past the end of the file ({file_size} bytes)", where)
    return n


def parse_header(text: bytes, file_size: int, where: str) -> tuple[list[Entry], dict[str, str]]:
    """The tensors (sorted by offset) and ``__metadata__`` of one file whose header is ``text``."""
    v = Checker(where, "safetensors header: ")
    doc = jsonio.loads(text, where)
    if type(doc) is not dict:
        raise v.fail("must be a JSON object")
    base = 8 + len(text)
    data_len = file_size - base
    meta = doc.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if type(meta) is not dict or any(type(x) is not str for x in meta.values()):
        raise v.fail("__metadata__ must map strings to strings")
    entries = []
    for key, info in doc.items():
        what = f"tensor {key!r:.200}"
        if type(info) is not dict:
            raise v.fail(f"{what} must be an object")
        st_dtype = info.get("dtype")
        if not isinstance(st_dtype, str) or (st_dtype not in FROM_SAFETENSORS and st_dtype not in NOT_LOADABLE):
            raise v.fail(f"{what}: unknown dtype {st_dtype!r:.40}")
        shape = v.shape(info.get("shape"), f"{what} shape")
        offsets = info.get("data_offsets")
        if type(offsets) is not list or len(offsets) != 2:
            raise v.fail(f"{what}: data_offsets must be [begin, end]")
        begin = v.int_(offsets[0], f"{what} data_offsets begin")
        end = v.int_(offsets[1], f"{what} data_offsets end")
        if begin > end:
            raise v.fail(f"{what}: data_offsets [{begin}, {end}] begin after they end")
        if end > data_len:
            raise v.fail(f"{what}: data_offsets [{begin}, {end}] lie outside the data section of {data_len} bytes")
        dtype = FROM_SAFETENSORS.get(st_dtype)
        bits = volume(shape) * (ITEMSIZE[dtype] * 8 if dtype is not None else SUB_BYTE_BITS[st_dtype])
        if bits % 8:
            raise v.fail(f"{what}: {st_dtype} {list(shape)} is {bits} bits, not a whole number of bytes")
        if end - begin != bits // 8:
            raise v.fail(f"{what}: {st_dtype} {list(shape)} needs {bits // 8} bytes, data_offsets give {end - begin}")
        entries.append(Entry(key, st_dtype, shape, base + begin, end - begin))
    entries.sort(key=lambda e: (e.start, e.length))
    at = base
    for e in entries:
        if e.start != at:
            kind = "overlaps the tensor before it" if e.start < at else "leaves a gap before it"
            raise v.fail(f"tensor {e.key!r:.200} at data offset {e.start - base} {kind} (ends at {at - base})")
        at = e.start + e.length
    if at != file_size:
        raise v.fail(f"the tensors end at data offset {at - base}, the data section has {data_len} bytes")
    return entries, meta


def parse_index(data: bytes, where: str) -> dict[str, str]:
    """``weight_map`` of an index file: key -> file name (a plain ``*.safetensors`` name)."""
    v = Checker(where, "safetensors index: ")
    doc = jsonio.loads(data, where)
    if type(doc) is not dict or type(doc.get("weight_map")) is not dict:
        raise v.fail("must be a JSON object with a weight_map object")
    out = {}
    for key, file in doc["weight_map"].items():
        if type(file) is not str or not is_plain_name(file):
            raise v.fail(f"weight_map[{key!r:.200}] must be a file name in the folder, not {file!r:.200}")
        out[key] = file
    return out


def is_plain_name(name: str) -> bool:
    """A ``*.safetensors`` file name directly in the folder (no separators, not hidden)."""
    return (name.endswith(SUFFIX) and "/" not in name and "\\" not in name and "\0" not in name
            and not name.startswith(".") and len(name) <= 255)


def check_index(weight_map: dict[str, str], files: dict[str, list[Entry]], where: str) -> None:
    """The index and the headers of the files it names agree key by key."""
    for file, entries in files.items():
        for e in entries:
            if weight_map.get(e.key) != file:
                said = weight_map.get(e.key)
                raise CorruptCheckpointError(
                    f"{file} holds tensor {e.key!r:.200}, which the index "
                    + (f"places in {said}" if said else "does not list"), where)
    held = {e.key for entries in files.values() for e in entries}
    missing = [k for k in weight_map if k not in held]
    if missing:
        raise CorruptCheckpointError(
            f"the index lists {len(missing)} tensor(s) no file holds: {', '.join(repr(k) for k in missing[:5])}", where)


def contiguous_boxes(shape: tuple[int, ...], itemsize: int, max_bytes: int
                     ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes tiling a C-ordered tensor of ``shape``, each a contiguous byte range of at most
    ``max_bytes`` (or one element): ``(offset, shape, byte offset)``, in file order. Whole rows
    along the first dimension whose slabs fit; a row larger than ``max_bytes`` is cut along the
    next dimension, and so on."""
    n = len(shape)
    if not n or not volume(shape):
        return [((0,) * n, shape, 0)]
    slab = [0] * n  # bytes of one index step along dimension d
    size = itemsize
    for d in range(n - 1, -1, -1):
        slab[d] = size
        size *= shape[d]
    d = next(d for d in range(n) if slab[d] <= max_bytes or d == n - 1)
    per = max(1, max_bytes // slab[d])
    strides = [slab[k] for k in range(d)]
    out = []
    for prefix in itertools.product(*(range(s) for s in shape[:d])):
        at = sum(i * s for i, s in zip(prefix, strides, strict=True))
        for a in range(0, shape[d], per):
            b = min(shape[d], a + per)
            out.append((prefix + (a,) + (0,) * (n - d - 1), (1,) * d + (b - a,) + shape[d + 1:], at + a * slab[d]))
    return out


Rename = Callable[[str], str | None]
"""``rename`` of ``ckptlib.load``: a file's key -> the name to load it as, or None to skip it."""


def key_path(select: str | None) -> list[str]:
    """The dict keys ``select`` names (``"model"``, ``"/a/b"``; None or ``""``: the root)."""
    return [k for k in (select or "").split("/") if k]


def describe(files: list[tuple[str, int, list[Entry]]], *, select: str | None, rename: Rename | None,
             chunk_bytes: int) -> Manifest:
    """The manifest of a folder whose files are ``(path, size, entries)``: every kept key
    (``rename``: key -> name, or None to skip it) as tensor ``/SELECT/name`` (each part named
    as a save names it, :func:`~ckptlib.format.tree.escape`), the value tree ``{SELECT: {name: tensor}}`` with
    the innermost dict a ``stateful`` node, so that a module target gets ``load_state_dict``.
    Raises ``ValueError`` for a ``rename`` that returns something else than a str or None, or
    two keys renamed alike; :class:`UnsupportedValueError` for a kept :data:`NOT_LOADABLE` tensor."""
    prefix = "".join("/" + escape(k) for k in key_path(select))
    tensors: dict[str, TensorEntry] = {}
    items: list[list[Any]] = []
    source: dict[str, str] = {}
    for index, (path, _, entries) in enumerate(files):
        for e in entries:
            name = e.key if rename is None else rename(e.key)
            if name is None:
                continue
            if not isinstance(name, str):
                raise ValueError(f"rename({e.key!r}) returned {name!r}; it must return a str, or None to skip the key")
            if name in source:
                raise ValueError(f"rename maps both {source[name]!r} and {e.key!r} to {name!r}")
            source[name] = e.key
            if e.dtype is None:
                raise UnsupportedValueError(
                    f"{path}: tensor {e.key!r} has dtype {e.st_dtype}, which ckptlib cannot hold; "
                    "skip it with rename=lambda k: None if k == ... else k")
            itemsize = ITEMSIZE[e.dtype]
            chunks = [Chunk(index, e.start + at, volume(box) * itemsize, "", off, box)
                      for off, box, at in contiguous_boxes(e.shape, itemsize, chunk_bytes)]
            full = f"{prefix}/{escape(name)}"
            tensors[full] = TensorEntry(e.dtype, e.shape, chunks)
            items.append([name, {"t": "tensor", "ref": full}])
    tree: Any = {"t": "stateful", "type": "safetensors", "v": {"t": "dict", "items": items}}
    for k in reversed(key_path(select)):
        tree = {"t": "dict", "items": [[k, tree]]}
    return Manifest(
        step=None, save_id="", created=0.0, world_size=1, commit="", tree=tree, tensors=tensors,
        files=[FileEntry(path, size) for path, size, _ in files], checksum_algorithm=NO_CHECKSUM,
        library="safetensors",
    )
