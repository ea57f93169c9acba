"""docs/format.md is enough to read a tensor without ckptlib: json + numpy only.

The index file columns are taken from the table of docs/format.md section 7.3, in the order the
page gives them, as a tool author would; the reads are compared bit for bit with what was saved.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import torch

import ckptlib
from ckptlib.format.index_file import SCHEMA

DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"
NP = {"float32": "<f4", "int64": "<i8", "bfloat16": "<u2"}  # element bytes, little-endian (section 2)
WIDTH = {"u64": "<u8", "u32": "<u4", "u8": "u1"}


def doc_columns() -> list[tuple[str, str, str]]:
    """``(column, numpy dtype, length)`` rows of the section 7.3 table, one per column name, in order."""
    text = DOC.read_text()
    table = text[text.index("### 7.3 Index files"):text.index("Checks (all before the pieces are used")]
    out = []
    for names, width, lengths in re.findall(r"^\| (`[^|]+`) \| (u\d+) \| ([^|]+) \|", table, re.M):
        cols = re.findall(r"`(\w+)`", names)
        lens = [x.strip().replace(" x ", "*") for x in lengths.split(",")]
        lens = lens if len(lens) == len(cols) else lens * len(cols)
        out += [(c, WIDTH[width], n) for c, n in zip(cols, lens, strict=True)]
    return out


def test_the_documented_index_columns_are_the_files_columns_in_file_order() -> None:
    """Before: the table listed chunk_tensor, member_tensor, chunk_file, pack_file, ... while files
    hold chunk_tensor, chunk_file, pack_file, member_tensor, ...: a reader built from the page
    misread every u32 and u8 column."""
    assert doc_columns() == [tuple(c) for c in SCHEMA]


def _v1(folder: Path, name: str) -> np.ndarray:
    body = json.loads((folder / "manifest.json").read_bytes())["body"]
    files = [folder / p for p, _ in body["files"]]
    t = body["tensors"].get(name)
    if t is not None:  # one raw chunk of its own
        f, start, length, _digest, _off, shape, codec = t["chunks"][0]
        assert codec == "raw"
        return np.frombuffer(files[f].read_bytes()[start:start + length], NP[t["dtype"]]).reshape(shape)
    table = body["packed_tensors"]
    i = table["name"].index(name)
    ndim = table["ndim"]
    shape = table["dims"][sum(ndim[:i]):sum(ndim[:i + 1])]
    f, start, length, _digest, codec, _raw = body["packs"][table["pack"][i]]
    assert codec == "raw"
    raw = files[f].read_bytes()[start:start + length]
    dt = np.dtype(NP[table["dtype"][i]])
    count = int(np.prod(shape))
    return np.frombuffer(raw, dt, count, table["offset"][i]).reshape(shape)


def _v2(folder: Path, name: str) -> np.ndarray:
    """Every rank's chunks of ``name`` placed into the whole tensor (raw chunks)."""
    body = json.loads((folder / "manifest.json").read_bytes())["body"]
    files = [folder / p for p, _ in body["files"]]
    entry = body["tensors"][name]
    out = np.zeros(entry["shape"], NP[entry["dtype"]])
    for path, size, _digest, _rank, first, _n, counts in body["indexes"]:
        data = (folder / path).read_bytes()[-size:]  # an index of its own, or at its payload's end
        assert data[:8] == b"CKPTIDX2"
        n = dict(zip(["names", "name_bytes", "chunks", "chunk_dims", "packs", "members", "member_dims"],
                     counts, strict=True))
        col, pos = {}, 8
        for c, dt, length in doc_columns():
            k = 2 * n[length[2:]] if length.startswith("2*") else n[length]
            col[c] = np.frombuffer(data, dt, k, pos)
            pos += k * np.dtype(dt).itemsize
        ends = [0, *col["name_end"].tolist()]
        names = [bytes(col["name_bytes"][a:b]).decode() for a, b in itertools.pairwise(ends)]
        box = 0
        for j in range(n["chunks"]):
            nd = int(col["chunk_ndim"][j])
            off, shape = col["chunk_box"][box:box + nd], col["chunk_box"][box + nd:box + 2 * nd]
            box += 2 * nd
            if names[col["chunk_tensor"][j]] != name:
                continue
            assert col["chunk_codec"][j] == 0
            start, length = int(col["chunk_start"][j]), int(col["chunk_length"][j])
            raw = files[first + int(col["chunk_file"][j])].read_bytes()[start:start + length]
            where = tuple(slice(int(o), int(o) + int(s)) for o, s in zip(off, shape, strict=True))
            out[where] = np.frombuffer(raw, out.dtype).reshape([int(s) for s in shape])
        box = 0
        for j in range(n["members"]):  # pieces inside packs
            nd = int(col["member_ndim"][j])
            off, shape = col["member_box"][box:box + nd], col["member_box"][box + nd:box + 2 * nd]
            box += 2 * nd
            if names[col["member_tensor"][j]] != name:
                continue
            p = int(col["member_pack"][j])
            assert col["pack_codec"][p] == 0
            start, length = int(col["pack_start"][p]), int(col["pack_length"][p])
            raw = files[first + int(col["pack_file"][p])].read_bytes()[start:start + length]
            count = int(np.prod([int(s) for s in shape]))
            piece = np.frombuffer(raw, out.dtype, count, int(col["member_offset"][j]))
            where = tuple(slice(int(o), int(o) + int(s)) for o, s in zip(off, shape, strict=True))
            out[where] = piece.reshape([int(s) for s in shape])
    return out


def _same(got: np.ndarray, want: torch.Tensor) -> None:
    assert got.tobytes() == want.contiguous().view(torch.uint8).numpy().tobytes()


def test_a_tensor_read_with_json_and_numpy_only(tmp_path: Path, monkeypatch) -> None:
    w = torch.randn(130, 140)
    state = {"w": w, "b": torch.arange(7), "h": torch.randn(9, 3).to(torch.bfloat16)}
    ckptlib.save(state, tmp_path / "v1")
    _same(_v1(tmp_path / "v1", "/w"), w)
    _same(_v1(tmp_path / "v1", "/b"), state["b"])
    _same(_v1(tmp_path / "v1", "/h"), state["h"])
    monkeypatch.setenv("CKPTLIB_FORMAT_VERSION", "2")  # format 2 from one process
    ckptlib.save(state, tmp_path / "v2")
    assert json.loads((tmp_path / "v2" / "manifest.json").read_bytes())["format_version"] == 2
    for key in ("w", "b", "h"):
        _same(_v2(tmp_path / "v2", f"/{key}"), state[key])
