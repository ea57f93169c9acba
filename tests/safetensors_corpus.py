"""Hostile Hugging Face safetensors folders: the one list (:data:`ENTRIES`), built on demand.

Who calls what: ``tests/test_safetensors_read.py`` builds each entry into a pytest tmp folder
(:func:`build`) and checks that ``ckptlib.load`` and ``ckptlib.open`` raise the entry's typed
error and leave a target untouched. ``python tests/safetensors_corpus.py OUT`` writes the
corpus for a human to look at.

Every entry starts from the same valid template (:func:`template`: two files and an index,
forged byte by byte with :func:`file_bytes`, so a test can write what no writer would) and
damages one thing. ``reference`` says whether the safetensors package's own parser refuses the
damaged file too (None: the damage is in the index or the folder, which that parser never sees).
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

INDEX = "model.safetensors.index.json"
F1, F2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def tensors() -> dict[str, dict[str, torch.Tensor]]:
    """The template's tensors, by file."""
    g = torch.Generator().manual_seed(7)
    return {
        F1: {"a.weight": torch.randn(4, 3, generator=g), "b": torch.arange(5, dtype=torch.int64)},
        F2: {"c.bias": torch.randn(2, 2, generator=g).to(torch.bfloat16)},
    }


def header_of(ts: dict[str, torch.Tensor]) -> tuple[dict[str, Any], bytes]:
    """A valid header (key order kept) and the data section for ``ts``."""
    names = {torch.float32: "F32", torch.int64: "I64", torch.bfloat16: "BF16"}
    header: dict[str, Any] = {}
    data = b""
    for k, t in ts.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return header, data


def file_bytes(header: Any, data: bytes, *, text: bytes | None = None, length: int | None = None) -> bytes:
    """A safetensors file: ``length`` (default: the real one) + the header JSON (or ``text``)
    padded to 8 bytes + ``data``."""
    if text is None:
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def template(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file, ts in tensors().items():
        (folder / file).write_bytes(file_bytes(*header_of(ts)))
        weight_map.update({k: file for k in ts})
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def _edit_header(edit: Callable[[dict[str, Any], bytes], tuple[Any, bytes]]) -> Callable[[Path], None]:
    """A damage that rewrites file 1 from its edited header and data."""
    def damage(folder: Path) -> None:
        header, data = header_of(tensors()[F1])
        header, data = edit(header, data)
        (folder / F1).write_bytes(file_bytes(header, data))
    return damage


def _set(key: str, field: str, value: Any) -> Callable[[Path], None]:
    def edit(h: dict[str, Any], d: bytes) -> tuple[Any, bytes]:
        h[key][field] = value
        return h, d
    return _edit_header(edit)


def _raw_header(text: bytes, length: int | None = None, data: bytes = b"") -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / F1).write_bytes(file_bytes(None, data, text=text, length=length))
    return damage


def _index(doc: Any) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / INDEX).write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return damage


def _weight_map(change: Callable[[dict[str, str]], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        doc = json.loads((folder / INDEX).read_text())
        change(doc["weight_map"])
        (folder / INDEX).write_text(json.dumps(doc))
    return damage


def _truncate(n: int) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        data = (folder / F1).read_bytes()
        (folder / F1).write_bytes(data[: len(data) - n])
    return damage


def _append(extra: bytes) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        with open(folder / F1, "ab") as f:
            f.write(extra)
    return damage


def _no_index_duplicate(folder: Path) -> None:
    (folder / INDEX).unlink()
    header, data = header_of({"a.weight": torch.zeros(4, 3)})
    (folder / F2).write_bytes(file_bytes(header, data))


def _overlap(h: dict[str, Any], d: bytes) -> tuple[Any, bytes]:
    h["b"]["data_offsets"] = [40, 80]  # a.weight is [0, 48)
    return h, d[:80]


def _gap(h: dict[str, Any], d: bytes) -> tuple[Any, bytes]:
    h["b"]["data_offsets"] = [56, 96]
    return h, d[:48] + bytes(8) + d[48:]


def _size_mismatch(h: dict[str, Any], d: bytes) -> tuple[Any, bytes]:
    h["a.weight"]["shape"] = [4, 2]  # 32 bytes of F32, the range holds 48
    return h, d


def _dtype_mismatch(h: dict[str, Any], d: bytes) -> tuple[Any, bytes]:
    h["a.weight"]["dtype"] = "F64"  # 96 bytes for [4, 3], the range holds 48
    return h, d


@dataclass(frozen=True)
class Entry:
    name: str
    damage: Callable[[Path], None]
    match: str
    """A regex the error message must match."""
    reference: bool | None
    """Whether the safetensors package's own parser refuses the damaged file 1 too (None: the
    damage is in the index or across files, which that parser never sees). ckptlib refuses
    every entry; the one the reference accepts is a header with a duplicate key."""


DEEP = b"[" * 100_000 + b"]" * 100_000

ENTRIES: list[Entry] = [
    Entry("file_too_short", lambda f: (f / F1).write_bytes(b"\x10\0\0"), "at least 8 bytes", True),
    Entry("header_length_over_limit", _raw_header(b"{}", length=1 << 40), "over the limit", True),
    Entry("header_length_max_u64", _raw_header(b"{}", length=(1 << 64) - 1), "over the limit", True),
    Entry("header_past_end_of_file", _raw_header(b"{}      ", length=4096), "runs past the end", True),
    Entry("header_empty", _raw_header(b"", length=0), "invalid JSON", True),
    Entry("header_not_utf8", _raw_header(b'{"\xff\xfe":1}  '), "not UTF-8", True),
    Entry("header_not_json", _raw_header(b"{not json"), "invalid JSON", True),
    Entry("header_is_a_list", _raw_header(b"[1, 2, 3]"), "must be a JSON object", True),
    Entry("header_duplicate_key", _raw_header(
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        data=b"x"), "duplicate key", False),
    Entry("header_nan", _raw_header(b'{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}', data=b"x"),
          "invalid JSON", True),
    Entry("header_deeply_nested", _raw_header(b'{"__metadata__":' + DEEP + b"}"), "invalid JSON", True),
    Entry("metadata_not_strings", _edit_header(lambda h, d: ({**h, "__metadata__": {"format": 1}}, d)),
          "__metadata__ must map strings to strings", True),
    Entry("entry_not_an_object", _edit_header(lambda h, d: ({**h, "zzz": 5}, d)), "must be an object", True),
    Entry("unknown_dtype", _set("a.weight", "dtype", "F99"), "unknown dtype", True),
    Entry("dtype_not_a_string", _set("a.weight", "dtype", 4), "unknown dtype", True),
    Entry("shape_negative", _set("a.weight", "shape", [-4, 3]), "shape must hold integers", True),
    Entry("shape_bool", _set("a.weight", "shape", [True, 3]), "shape must hold integers", True),
    Entry("shape_float", _set("a.weight", "shape", [4.0, 3]), "shape must hold integers", True),
    Entry("shape_not_a_list", _set("a.weight", "shape", "4x3"), "shape must be a list", True),
    Entry("shape_too_many_dims", _set("a.weight", "shape", [1] * 65), "more than 64 dimensions", True),
    Entry("shape_overflows", _set("a.weight", "shape", [1 << 40, 1 << 40]), "more than 2\\^62 elements", True),
    Entry("offsets_one_number", _set("a.weight", "data_offsets", [0]), "must be \\[begin, end\\]", True),
    Entry("offsets_reversed", _set("a.weight", "data_offsets", [48, 0]), "begin after they end", True),
    Entry("offsets_huge", _set("a.weight", "data_offsets", [0, 1 << 70]), "must be an integer", True),
    Entry("offsets_past_data", _set("b", "data_offsets", [48, 4096]), "lie outside the data section", True),
    Entry("dtype_size_x_shape_mismatch", _edit_header(_size_mismatch), "needs 32 bytes, data_offsets give 48", True),
    Entry("dtype_mismatch", _edit_header(_dtype_mismatch), "needs 96 bytes", True),
    Entry("tensors_overlap", _edit_header(_overlap), "overlaps the tensor before it", True),
    Entry("gap_between_tensors", _edit_header(_gap), "leaves a gap", True),
    Entry("trailing_bytes", _append(b"\0" * 16), "the data section has", True),
    Entry("truncated_data", _truncate(10), "lie outside the data section", True),
    Entry("index_not_json", _index(b"{weight_map"), "invalid JSON", None),
    Entry("index_without_weight_map", _index({"metadata": {}}), "weight_map object", None),
    Entry("index_path_traversal", _weight_map(lambda w: w.update({"b": "../" + F1})), "must be a file name", None),
    Entry("index_absolute_path", _weight_map(lambda w: w.update({"b": "/etc/passwd"})), "must be a file name", None),
    Entry("index_hidden_file", _weight_map(lambda w: w.update({"b": ".x.safetensors"})), "must be a file name", None),
    Entry("index_names_missing_file", _weight_map(lambda w: w.update({"b": "model-9.safetensors"})),
          "missing from the folder", None),
    Entry("index_disagrees_with_file", _weight_map(lambda w: w.update({"b": F2})), "which the index places in", None),
    Entry("index_lists_absent_key", _weight_map(lambda w: w.update({"ghost": F1})), "no file holds", None),
    Entry("index_omits_key", _weight_map(lambda w: w.pop("b")), "which the index does not list", None),
    Entry("same_key_in_two_files", _no_index_duplicate, "is in both", None),
]


def build(folder: Path, entry: Entry) -> Path:
    """The template with ``entry``'s damage, in ``folder`` (created)."""
    template(folder)
    entry.damage(folder)
    return folder


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for e in ENTRIES:
        build(out / e.name, e)
    print(f"wrote {len(ENTRIES)} hostile folders under {out}")
