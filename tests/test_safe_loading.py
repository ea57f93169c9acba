"""Hostile and damaged checkpoints: every bad input is a typed error naming the file.

Each case starts from a real small checkpoint and tampers with it. Loading must raise
``CorruptCheckpointError`` (``CheckpointNotFoundError`` for a missing manifest) whose message
names the file that is wrong -- never another exception type, never a hang, never wrong data,
and never unbounded memory. Manifest edits re-compute the manifest's self-checksum
(``helpers.rewrite_manifest``) so they reach the validation behind it.

Library bugs found here are kept as strict xfails whose reason starts with ``BUG:``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from chaos.corpus import ENTRIES, build, judge, make_templates
from chaos.load_one import check
from helpers import (
    add_payload,
    add_row,
    assert_same,
    base_state,
    body_of,
    chunk0,
    drop_row,
    encode_manifest,
    flip_bit,
    manifest_digest,
    manifest_path,
    packed_location,
    packed_row,
    payload_dir,
    payload_files,
    rewrite_manifest,
    row_dims,
    row_to_dict_form,
    set_packed_location,
    set_single_chunk,
    table_rows,
    tensor_ranges,
    tree_item,
    write_manifest_bytes,
    zstd_bomb,
    zstd_frame,
)

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.engine import scan
from ckptlib.engine.scan import check_step
from ckptlib.format.checksum import checksum
from ckptlib.format.manifest import TABLE_COLUMNS, TABLE_KEY

MANIFEST = "manifest.json"


_TEMPLATES: dict[str | None, Path] = {}


@pytest.fixture(scope="module", autouse=True)
def _templates(tmp_path_factory: pytest.TempPathFactory):
    """Save the base checkpoints once per module; each test tampers with its own copy
    (copying is much cheaper than a save, which fsyncs)."""
    root = tmp_path_factory.mktemp("templates")
    for compression in (None, "zstd"):
        path = root / str(compression)
        path.mkdir()
        ckptlib.save(base_state(), path / "ck", compression=compression)
        _TEMPLATES[compression] = path / "ck"
    yield
    _TEMPLATES.clear()


def make_checkpoint(root: Path, compression: str | None = None) -> Path:
    """A fresh copy of a real checkpoint of ``base_state()`` at ``root/ck``."""
    path = root / "ck"
    shutil.copytree(_TEMPLATES[compression], path, symlinks=True)
    return path


def file_of(folder: Path, body: dict[str, Any], index: int) -> Path:
    return folder / body["files"][index][0]


# --------------------------------------------------------------------------- sanity


def test_untampered_rewrite_still_loads(tmp_path: Path) -> None:
    """The tampering helper itself writes valid manifests (so the cases below test what they
    claim to test, not the checksum)."""
    ck = make_checkpoint(tmp_path)
    before = manifest_path(ck).read_bytes()
    rewrite_manifest(ck, lambda body: None)
    assert manifest_path(ck).read_bytes() == before
    assert_same(ckptlib.load(ck), base_state())
    info = check_step(open_storage(str(tmp_path)), "ck", deep=True)
    assert info.status == "committed", info.reason


def test_chunked_and_packed_layout(tmp_path: Path) -> None:
    """The base checkpoint has the shapes of data the cases rely on."""
    body = body_of(make_checkpoint(tmp_path))
    assert len(body["tensors"]["/big"]["chunks"]) == 1
    assert len(body["tensors"]["/big2"]["chunks"]) == 1
    assert chunk0(body, "/big")[2] == chunk0(body, "/big2")[2] == 256 * 1024
    assert chunk0(body, "/big")[0] == chunk0(body, "/big2")[0]  # same payload file
    # small tensors are rows of the packed table, in one pack, back to back
    assert table_rows(body) == ["/small", "/small2", "/blob"]
    assert not {"/small", "/small2", "/blob"} & set(body["tensors"])
    assert len(body["packs"]) == 1
    assert [packed_location(body, n) for n in table_rows(body)] == [(0, 0), (0, 64), (0, 96)]
    assert body["packs"][0][5] == 64 + 32 + 5120  # raw length: nothing else in the pack


def test_legacy_packed_dict_form_still_loads(tmp_path: Path) -> None:
    """Rows moved back to the older ``tensors[name]["packed"]`` form load the same data (the
    decoder accepts both), including a checkpoint mixing both forms."""
    ck = make_checkpoint(tmp_path)

    def edit(body: dict[str, Any]) -> None:
        row_to_dict_form(body, "/small2")
        row_to_dict_form(body, "/blob")

    body = rewrite_manifest(ck, edit)
    assert table_rows(body) == ["/small"] and body["tensors"]["/small2"]["packed"] == [[0, 64]]
    assert_same(ckptlib.load(ck), base_state())
    rewrite_manifest(ck, lambda b: row_to_dict_form(b, "/small"))
    assert_same(ckptlib.load(ck), base_state())
    info = check_step(open_storage(str(tmp_path)), "ck", deep=True)
    assert info.status == "committed", info.reason


# --------------------------------------------------------------------------- case table


@dataclass
class Case:
    tamper: Callable[[Path], str | None]
    """Damages the checkpoint folder; returns the name the error must mention (default:
    manifest.json)."""
    match: str = ""
    compression: str | None = None
    error: type[Exception] = ckptlib.CorruptCheckpointError
    tree: bool = False
    """The damage is in the value tree (decoded by load(), not by the manifest validation)."""


def raw_edit(fn: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def tamper(folder: Path) -> None:
        write_manifest_bytes(folder, fn(manifest_path(folder).read_bytes()))

    return tamper


def body_edit(fn: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def tamper(folder: Path) -> None:
        rewrite_manifest(folder, fn)

    return tamper


def text_sub(old: str, new: str) -> Callable[[bytes], bytes]:
    def fn(data: bytes) -> bytes:
        text = data.decode("ascii")
        assert old in text, old
        return text.replace(old, new, 1).encode("ascii")

    return fn


def created_sub(new: str) -> Callable[[Path], None]:
    """Replace the ``created`` number in the manifest text (no re-checksum: parse errors come
    first)."""

    def tamper(folder: Path) -> None:
        value = json.dumps(body_of(folder)["created"])
        raw_edit(text_sub(f'"created":{value}', f'"created":{new}'))(folder)

    return tamper


def set_tree_value(key: str, node: Any) -> Callable[[Path], None]:
    def edit(body: dict[str, Any]) -> None:
        tree_item(body, key)[1] = node

    return body_edit(edit)


def set_tensor_field(name: str, field: str, value: Any) -> Callable[[Path], None]:
    def edit(body: dict[str, Any]) -> None:
        body["tensors"][name][field] = value

    return body_edit(edit)


def set_chunk_field(name: str, index: int, value: Any) -> Callable[[Path], None]:
    def edit(body: dict[str, Any]) -> None:
        chunk0(body, name)[index] = value

    return body_edit(edit)


def set_body_field(field: str, value: Any) -> Callable[[Path], None]:
    def edit(body: dict[str, Any]) -> None:
        body[field] = value

    return body_edit(edit)


def forged_checksum(folder: Path) -> None:
    """Edit the body but keep the old digest."""
    digest = manifest_digest(folder)
    body = body_of(folder)
    body["tree"]["items"][5][1] = 4  # "step": 3 -> 4
    write_manifest_bytes(folder, encode_manifest(body, digest=digest))


def flip_in_manifest_body(folder: Path) -> None:
    data = manifest_path(folder).read_bytes()
    i = data.index(b'"save_id":"') + len(b'"save_id":"')
    flip_bit(manifest_path(folder), i, 0)  # '0'..'9a'..'f' -> another hex-ish character


def deep_tree(levels: int) -> Callable[[Path], None]:
    def edit(body: dict[str, Any]) -> None:
        node: Any = 1
        for _ in range(levels):
            node = {"t": "list", "items": [node]}
        tree_item(body, "name")[1] = node

    return body_edit(edit)


def nested_json(levels: int) -> Callable[[Path], None]:
    """10,000 levels of raw JSON nesting in the tree (no checksum: the parser must refuse)."""

    def tamper(folder: Path) -> None:
        raw_edit(text_sub('["name","x"]', '["name",' + "[" * levels + "]" * levels + "]"))(folder)

    return tamper


def overlapping_tensors(folder: Path) -> None:
    """``/big2`` points at ``/big``'s bytes (same length), with a checksum that matches them:
    only the overlap check stands between this and silently wrong data."""

    def edit(body: dict[str, Any]) -> None:
        a, b = chunk0(body, "/big"), chunk0(body, "/big2")
        b[0], b[1], b[3] = a[0], a[1], a[3]

    rewrite_manifest(folder, edit)


def chunk_gap(folder: Path) -> None:
    def edit(body: dict[str, Any]) -> None:
        c = chunk0(body, "/big")
        c[5] = [63, 1024]
        c[2] = 63 * 1024 * 4
        data = file_of(folder, body, c[0]).read_bytes()[c[1] : c[1] + c[2]]
        c[3] = checksum(data)

    rewrite_manifest(folder, edit)


def chunk_overlap_and_gap(folder: Path) -> None:
    """Two chunks whose volumes sum to the tensor's, but that overlap (and so leave a gap)."""

    def edit(body: dict[str, Any]) -> None:
        f, start, length, _, _, _, codec = chunk0(body, "/big")
        half = length // 2
        data = file_of(folder, body, f).read_bytes()
        body["tensors"]["/big"]["chunks"] = [
            [f, start, half, checksum(data[start : start + half]), [0, 0], [64, 512], codec],
            [f, start + half, half, checksum(data[start + half : start + length]), [0, 256], [64, 512], codec],
        ]

    rewrite_manifest(folder, edit)


def scalar_two_chunks(folder: Path) -> None:
    body = body_of(folder)
    idx = add_payload(folder, body, b"\x00" * 8, "extra.bin")
    body["tensors"]["/small"] = {
        "dtype": "float32",
        "shape": [],
        "chunks": [[idx, 0, 4, checksum(b"\x00" * 4), [], [], "raw"],
                   [idx, 4, 4, checksum(b"\x00" * 4), [], [], "raw"]],
    }
    write_manifest_bytes(folder, encode_manifest(body))


def range_past_eof(folder: Path) -> None:
    def edit(body: dict[str, Any]) -> None:
        c = chunk0(body, "/big")
        c[1] = body["files"][c[0]][1] - 100

    rewrite_manifest(folder, edit)


def raw_length_mismatch(folder: Path) -> None:
    def edit(body: dict[str, Any]) -> None:
        chunk0(body, "/big")[2] -= 4

    rewrite_manifest(folder, edit)


def huge_uint8_tensor(folder: Path) -> str:
    """A 2**62-byte uint8 tensor in a file the manifest claims is that big (it is 64 bytes)."""
    body = body_of(folder)
    idx = add_payload(folder, body, b"\x00" * 64, "huge.bin")
    body["files"][idx][1] = 2**62
    set_single_chunk(body, "/big", file=idx, stored=b"", dtype="uint8", shape=[2**62])
    chunk0(body, "/big")[2] = 2**62
    write_manifest_bytes(folder, encode_manifest(body))
    return "huge.bin"


def set_path(make: Callable[[Path, str], str]) -> Callable[[Path], None]:
    """Point files[0] at ``make(folder, current_path)``; a readable copy of the real payload is
    put where a path-following reader would find it, so refusing is the only safe outcome."""

    def tamper(folder: Path) -> None:
        def edit(body: dict[str, Any]) -> None:
            body["files"][0][0] = make(folder, body["files"][0][0])

        rewrite_manifest(folder, edit)

    return tamper


def _outside_copy(folder: Path, rel: str) -> Path:
    dst = folder.parent / "outside.bin"
    shutil.copyfile(folder / rel, dst)
    return dst


def dotdot_path(folder: Path, rel: str) -> str:
    _outside_copy(folder, rel)
    return "../outside.bin"


def absolute_path(folder: Path, rel: str) -> str:
    return str(_outside_copy(folder, rel))


def dot_prefix(folder: Path, rel: str) -> str:
    return "./" + rel


def backslashes(folder: Path, rel: str) -> str:
    (folder / rel.replace("/", "\\")).write_bytes((folder / rel).read_bytes())
    return rel.replace("/", "\\")


def double_slash(folder: Path, rel: str) -> str:
    return rel.replace("/", "//")


def dotdot_inside(folder: Path, rel: str) -> str:
    d, f = rel.split("/")
    return f"{d}/../{d}/{f}"


def dot_inside(folder: Path, rel: str) -> str:
    d, f = rel.split("/")
    return f"{d}/./{f}"


def to_directory(folder: Path, rel: str) -> str:
    return rel.split("/")[0]  # the save-id folder itself


def path_to_directory(folder: Path) -> str:
    set_path(to_directory)(folder)
    return body_of(folder)["files"][0][0]


def duplicate_file(folder: Path) -> None:
    def edit(body: dict[str, Any]) -> None:
        body["files"].append(list(body["files"][0]))

    rewrite_manifest(folder, edit)


def manifest_size_edit(delta: int) -> Callable[[Path], str]:
    def tamper(folder: Path) -> str:
        body = rewrite_manifest(folder, lambda b: b["files"][0].__setitem__(1, b["files"][0][1] + delta))
        return Path(body["files"][0][0]).name

    return tamper


def flip_payload(name: str) -> Callable[[Path], str]:
    """Flip one bit in the middle of the stored bytes holding tensor ``name``."""

    def tamper(folder: Path) -> str:
        body = body_of(folder)
        f, start, length = tensor_ranges(body, name)[0]
        path = file_of(folder, body, f)
        flip_bit(path, start + length // 2, 3)
        return path.name

    return tamper


def truncate_payload(folder: Path) -> str:
    path = payload_files(folder)[0]
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    return path.name


def extend_payload(folder: Path) -> str:
    path = payload_files(folder)[0]
    with open(path, "ab") as f:
        f.write(b"\x00" * 64)
    return path.name


def truncate_payload_and_manifest(folder: Path) -> None:
    """Truncate the file and make the manifest agree on the new size: ranges now end past it."""
    path = payload_files(folder)[0]
    size = path.stat().st_size // 2
    with open(path, "r+b") as f:
        f.truncate(size)
    rewrite_manifest(folder, lambda b: b["files"][0].__setitem__(1, size))


def remove_payload(folder: Path) -> str:
    path = payload_files(folder)[0]
    path.unlink()
    return path.name


def symlink_payload(folder: Path) -> str:
    path = payload_files(folder)[0]
    outside = folder.parent / "outside.bin"
    shutil.copyfile(path, outside)
    path.unlink()
    path.symlink_to(outside)
    return path.name


def symlink_payload_dir(folder: Path) -> str:
    d = payload_dir(folder, body_of(folder))
    outside = folder.parent / "outside-dir"
    shutil.copytree(d, outside)
    shutil.rmtree(d)
    d.symlink_to(outside, target_is_directory=True)
    return d.name


def fifo_payload(folder: Path) -> str:
    path = payload_files(folder)[0]
    path.unlink()
    os.mkfifo(path)
    return path.name


def directory_payload(folder: Path) -> str:
    path = payload_files(folder)[0]
    path.unlink()
    path.mkdir()
    return path.name


def symlink_manifest(folder: Path) -> None:
    outside = folder.parent / "outside.json"
    shutil.copyfile(manifest_path(folder), outside)
    manifest_path(folder).unlink()
    manifest_path(folder).symlink_to(outside)


def fifo_manifest(folder: Path) -> None:
    manifest_path(folder).unlink()
    os.mkfifo(manifest_path(folder))


def directory_manifest(folder: Path) -> None:
    manifest_path(folder).unlink()
    manifest_path(folder).mkdir()


# -- zstd


RAW_CLAIM = 4096  # what the manifest says the chunk decodes to


def replace_big_with_stored(stored: bytes, codec: str = "zstd", name: str = "evil.bin") -> Callable[[Path], str]:
    """Make ``/big`` a uint8 tensor of RAW_CLAIM bytes stored as ``stored`` in a new payload
    file, with a checksum that matches (so decoding is what must catch the problem)."""

    def tamper(folder: Path) -> str:
        body = body_of(folder)
        idx = add_payload(folder, body, stored, name)
        set_single_chunk(body, "/big", file=idx, stored=stored, dtype="uint8", shape=[RAW_CLAIM], codec=codec)
        write_manifest_bytes(folder, encode_manifest(body))
        return name

    return tamper


# -- packs (small tensors); the cases skip themselves if the writer stops packing


def pack_edit(fn: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def tamper(folder: Path) -> None:
        if not body_of(folder).get("packs"):
            pytest.skip("this writer does not pack small tensors")
        rewrite_manifest(folder, fn)

    return tamper


def _small_is_a_row(body: dict[str, Any]) -> None:
    assert packed_row(body, "/small") is not None and packed_row(body, "/small2") is not None


def pack_overlap(body: dict[str, Any]) -> None:
    # /small2 (32 bytes) now starts where /small (64 bytes) does: members overlap
    _small_is_a_row(body)
    set_packed_location(body, "/small2", offset=packed_location(body, "/small")[1])


def pack_overlap_across_forms(body: dict[str, Any]) -> None:
    """/small2 in the older dict form, /small a table row, overlapping: the overlap check
    spans both forms."""
    pack_overlap(body)
    row_to_dict_form(body, "/small2")


def piece_past_pack(body: dict[str, Any]) -> None:
    # /small (64 bytes) starts 8 bytes before the end of its pack
    _small_is_a_row(body)
    pack, _ = packed_location(body, "/small")
    set_packed_location(body, "/small", offset=body["packs"][pack][5] - 8)


def pack_bad_raw_length(body: dict[str, Any]) -> None:
    body["packs"][0][5] += 1


def pack_codec(body: dict[str, Any]) -> None:
    body["packs"][0][4] = "zstd-shuffle"


def pack_index(body: dict[str, Any]) -> None:
    _small_is_a_row(body)
    set_packed_location(body, "/small", pack=7)


def pack_over_chunk(body: dict[str, Any]) -> None:
    p, c = body["packs"][0], chunk0(body, "/big")
    p[0], p[1] = c[0], c[1]


def pack_bomb(folder: Path) -> str:
    body = body_of(folder)
    if not body.get("packs"):
        pytest.skip("this writer does not pack small tensors")
    stored = zstd_bomb(256 << 20, declared=False)
    idx = add_payload(folder, body, stored, "packbomb.bin")
    p = body["packs"][0]
    p[0], p[1], p[2], p[3], p[4] = idx, 0, len(stored), checksum(stored), "zstd"
    write_manifest_bytes(folder, encode_manifest(body))
    return "packbomb.bin"



# -- the packed table (``body[TABLE_KEY]``): one row per small tensor stored whole in a pack.
# The base checkpoint's rows: 0 /small float32 [16] at 0, 1 /small2 bfloat16 [4, 4] at 64,
# 2 /blob uint8 [5120] at 96, all in pack 0 (raw length 5216); dims = [16, 4, 4, 5120].

ROWS = ["/small", "/small2", "/blob"]


def table_edit(fn: Callable[[dict[str, Any], dict[str, Any]], Any]) -> Callable[[Path], None]:
    """``fn(table, body)`` edits the packed table; the manifest is rewritten with a valid
    checksum so that the table's validation is what must refuse it."""

    def edit(body: dict[str, Any]) -> None:
        assert table_rows(body) == ROWS, body.get(TABLE_KEY)  # the cases rely on this layout
        fn(body[TABLE_KEY], body)

    return body_edit(edit)


def set_cell(column: str, row: int, value: Any) -> Callable[[Path], None]:
    return table_edit(lambda t, b: t[column].__setitem__(row, value))


def set_column(column: str, value: Any) -> Callable[[Path], None]:
    return table_edit(lambda t, b: t.__setitem__(column, value))


def set_row_shape(row: int, shape: list[int]) -> Callable[[Path], None]:
    """Row ``row`` declares ``shape`` (``ndim`` and ``dims`` kept consistent)."""

    def fn(t: dict[str, Any], body: dict[str, Any]) -> None:
        t["dims"][row_dims(body, row)] = shape
        t["ndim"][row] = len(shape)

    return table_edit(fn)


def row_also_in_tensors(t: dict[str, Any], body: dict[str, Any]) -> None:
    """/small is a table row and also a valid dict-form entry for the same bytes."""
    pack, offset = packed_location(body, "/small")
    body["tensors"]["/small"] = {"dtype": "float32", "shape": [16], "packed": [[pack, offset]]}


def extra_row_without_dims(t: dict[str, Any], body: dict[str, Any]) -> None:
    """A fourth row in every column but ``dims``: lengths agree, ``sum(ndim) != len(dims)``."""
    for column, value in zip(TABLE_COLUMNS, ["/extra", "uint8", 1, None, 0, 5215], strict=True):
        if column != "dims":
            t[column].append(value)


def tree_case(node: Any, match: str, id: str, *marks: Any) -> Any:
    return pytest.param(Case(set_tree_value("name", node), match, tree=True), id=id, marks=marks)


CASES = [
    # ---- manifest bytes
    pytest.param(Case(raw_edit(lambda d: d[:30] + b"#garbage#" + d[45:]), "format"), id="garbled-head"),
    pytest.param(Case(raw_edit(lambda d: d[: len(d) // 2] + b"\x00}]{[" + d[len(d) // 2 + 5 :]),
                      "invalid JSON|checksum"), id="garbled-body"),
    pytest.param(Case(raw_edit(lambda d: b"\xff\xfe" + d[2:]), "UTF-8"), id="not-utf8"),
    pytest.param(Case(raw_edit(lambda d: b""), "invalid JSON"), id="empty"),
    pytest.param(Case(raw_edit(lambda d: d[: len(d) // 2]), "invalid JSON"), id="truncated-half"),
    pytest.param(Case(raw_edit(lambda d: d[:-1]), "invalid JSON"), id="truncated-1-byte"),
    pytest.param(Case(raw_edit(lambda d: b"[1, 2, 3]"), "object"), id="not-an-object"),
    pytest.param(Case(raw_edit(lambda d: b"null"), "object"), id="null"),
    pytest.param(Case(forged_checksum, "checksum mismatch"), id="checksum-mismatch"),
    pytest.param(Case(flip_in_manifest_body, "checksum mismatch|save_id"), id="bit-flip-in-manifest"),
    pytest.param(Case(raw_edit(text_sub('"checksum":"xxh3_64:', '"checksum":"crc32c:')), "checksum"),
                 id="checksum-algorithm"),
    pytest.param(Case(raw_edit(text_sub('"checksum":"xxh3_64:', '"checksum":5,"x":"')), "checksum"),
                 id="checksum-not-string"),
    pytest.param(Case(lambda f: write_manifest_bytes(f, encode_manifest(body_of(f), fmt="other")),
                      "format marker"), id="format-marker"),
    pytest.param(Case(lambda f: write_manifest_bytes(f, encode_manifest(body_of(f), format_version=2)),
                      "format_version 2 is newer", error=ckptlib.ManifestVersionError), id="version-2"),
    pytest.param(Case(lambda f: write_manifest_bytes(f, encode_manifest(body_of(f), format_version=10**6)),
                      "newer", error=ckptlib.ManifestVersionError), id="version-huge"),
    *[
        pytest.param(Case(lambda f, v=v: write_manifest_bytes(f, encode_manifest(body_of(f), format_version=v)),
                          "format_version"), id=f"version-{v!r}")
        for v in (0, -1, "1", 1.0, True, None)
    ],
    pytest.param(Case(raw_edit(text_sub('"body":{', '"body":{"step":1,')), "duplicate"), id="duplicate-keys"),
    pytest.param(Case(raw_edit(text_sub('"format":"ckptlib"', '"format":"ckptlib","format":"ckptlib"')),
                      "duplicate"), id="duplicate-top-keys"),
    pytest.param(Case(created_sub("NaN"), "NaN"), id="nan-literal"),
    pytest.param(Case(created_sub("Infinity"), "Infinity"), id="infinity-literal"),
    pytest.param(Case(created_sub("-Infinity"), "Infinity"), id="minus-infinity-literal"),
    pytest.param(Case(created_sub("9" * 5000), "invalid JSON"), id="huge-int-literal"),
    pytest.param(Case(nested_json(10_000), "invalid JSON|deep|recursion"), id="nesting-10000"),
    # ---- body fields
    pytest.param(Case(set_body_field("save_id", "../../etc"), "save_id"), id="save-id"),
    pytest.param(Case(set_body_field("world_size", 0), "world_size"), id="world-size"),
    pytest.param(Case(set_body_field("commit", "yolo"), "commit"), id="commit-mode"),
    pytest.param(Case(set_body_field("checksum_algorithm", "md5"), "checksum_algorithm"), id="checksum-algo"),
    pytest.param(Case(set_body_field("step", -1), "step"), id="step-negative"),
    pytest.param(Case(set_body_field("step", "5"), "step"), id="step-string"),
    pytest.param(Case(set_body_field("created", "now"), "created"), id="created-string"),
    pytest.param(Case(set_body_field("files", {}), "files"), id="files-not-list"),
    pytest.param(Case(set_body_field("tensors", []), "tensors"), id="tensors-not-object"),
    pytest.param(Case(set_body_field("extra", []), "extra"), id="extra-not-object"),
    pytest.param(Case(body_edit(lambda b: b.pop("files")), "files"), id="files-missing"),
    # ---- value tree
    pytest.param(Case(deep_tree(300), "deeper", tree=True), id="deep-tree-300"),
    tree_case({"t": "pickle", "v": "gASVAA=="}, "unknown node kind", "unknown-node-kind"),
    tree_case({"t": "tensor", "ref": "/nope"}, "names no tensor", "dangling-tensor-ref"),
    tree_case({"t": "bytes", "ref": "/nope"}, "names no tensor", "dangling-bytes-ref"),
    tree_case({"t": "tensor"}, "names no tensor", "ref-missing"),
    tree_case({"t": "bytes", "b64": "!!not base64!!"}, "base64", "bad-base64"),
    tree_case({"t": "dict", "items": [[1.5, 1]]}, "key", "float-key"),
    tree_case({"t": "dict", "items": [[None, 1]]}, "key", "null-key"),
    tree_case({"t": "dict", "items": [["a", 1], ["a", 2]]}, "duplicate", "duplicate-tree-keys"),
    tree_case({"t": "dict", "items": [["a"]]}, "key, value", "bad-dict-item"),
    tree_case({"t": "list", "items": "abc"}, "items", "items-not-list"),
    tree_case({"t": "dtype", "v": "qint8"}, "allowlist", "dtype-node"),
    tree_case({"t": "float", "v": "1e5"}, "float", "float-node"),
    tree_case({"t": "stateful", "v": [1]}, "stateful|unexpected", "stateful-list"),
    tree_case([1, 2], "unexpected list", "bare-json-list"),
    tree_case({"t": "bytes", "ref": "/small2"}, "bytes|uint8|dtype", "bytes-ref-bf16"),
    # ---- tensor entries
    pytest.param(Case(set_tensor_field("/big", "dtype", "float128"), "allowlist"), id="unknown-dtype"),
    pytest.param(Case(set_tensor_field("/big", "dtype", "qint8"), "allowlist"), id="quantized-dtype"),
    pytest.param(Case(set_tensor_field("/big", "dtype", "torch.float32"), "allowlist"), id="dtype-prefixed"),
    pytest.param(Case(set_tensor_field("/big", "dtype", None), "allowlist"), id="dtype-null"),
    pytest.param(Case(set_tensor_field("/big", "shape", [2**62]), "2\\^62"), id="shape-2**62"),
    pytest.param(Case(set_tensor_field("/big", "shape", [2**31, 2**31]), "2\\^62"), id="shape-2**31-squared"),
    pytest.param(Case(set_tensor_field("/big", "shape", [2**70]), "2\\^62"), id="shape-2**70"),
    pytest.param(Case(set_tensor_field("/big", "shape", [-1, 1024]), "shape"), id="shape-negative"),
    pytest.param(Case(set_tensor_field("/big", "shape", [64.0, 1024]), "shape"), id="shape-float"),
    pytest.param(Case(set_tensor_field("/big", "shape", ["64", 1024]), "shape"), id="shape-string"),
    pytest.param(Case(set_tensor_field("/big", "shape", [True, 1024]), "shape"), id="shape-bool"),
    pytest.param(Case(set_tensor_field("/big", "shape", [None, 1024]), "shape"), id="shape-null"),
    pytest.param(Case(set_tensor_field("/big", "shape", [1] * 100), "dimensions"), id="shape-100-dims"),
    pytest.param(Case(set_tensor_field("/big", "shape", "64x1024"), "shape"), id="shape-not-list"),
    pytest.param(Case(set_tensor_field("/big", "shape", [64, 1025]), "cover"), id="shape-larger"),
    pytest.param(Case(set_tensor_field("/big", "chunks", []), "cover"), id="no-chunks"),
    pytest.param(Case(set_tensor_field("/big", "chunks", "x"), "list"), id="chunks-not-list"),
    pytest.param(Case(huge_uint8_tensor, "huge.bin"), id="uint8-2**62-bytes", marks=()),
    # ---- chunks
    pytest.param(Case(set_chunk_field("/big", 6, "lz4"), "codec"), id="unknown-codec"),
    pytest.param(Case(set_chunk_field("/big", 6, None), "codec"), id="codec-null"),
    pytest.param(Case(set_chunk_field("/big", 0, 99), "file"), id="file-index-out-of-range"),
    pytest.param(Case(set_chunk_field("/big", 0, -1), "file"), id="file-index-negative"),
    pytest.param(Case(set_chunk_field("/big", 0, True), "file"), id="file-index-bool"),
    pytest.param(Case(set_chunk_field("/big", 1, -64), "start"), id="start-negative"),
    pytest.param(Case(set_chunk_field("/big", 3, 12345), "checksum"), id="checksum-not-string"),
    pytest.param(Case(set_chunk_field("/big", 4, [1, 0]), "outside"), id="box-outside"),
    pytest.param(Case(set_chunk_field("/big", 4, [0]), "rank"), id="offset-rank"),
    pytest.param(Case(body_edit(lambda b: chunk0(b, "/big").pop()), "7 fields"), id="chunk-6-fields"),
    pytest.param(Case(raw_length_mismatch, "raw size"), id="raw-length-mismatch"),
    pytest.param(Case(range_past_eof, "past the end"), id="range-past-eof"),
    pytest.param(Case(overlapping_tensors, "overlap"), id="ranges-overlap-between-tensors"),
    pytest.param(Case(chunk_gap, "cover"), id="chunks-leave-gap"),
    pytest.param(Case(chunk_overlap_and_gap, "overlap or leave gaps"), id="chunks-overlap-in-tensor"),
    pytest.param(Case(scalar_two_chunks, "cover|scalar"), id="scalar-two-chunks"),
    # ---- files and paths
    pytest.param(Case(set_path(dotdot_path), "plain relative path"), id="path-dotdot"),
    pytest.param(Case(set_path(absolute_path), "plain relative path"), id="path-absolute"),
    pytest.param(Case(set_path(dot_prefix), "plain relative path"), id="path-dot-prefix"),
    pytest.param(Case(set_path(backslashes), "plain relative path"), id="path-backslashes"),
    pytest.param(Case(set_path(double_slash), "plain relative path"), id="path-double-slash"),
    pytest.param(Case(set_path(dotdot_inside), "plain relative path"), id="path-dotdot-inside"),
    pytest.param(Case(set_path(dot_inside), "plain relative path"), id="path-dot-inside"),
    pytest.param(Case(set_path(lambda f, r: ""), "plain relative path"), id="path-empty"),
    pytest.param(Case(set_path(lambda f, r: MANIFEST), "manifest"), id="path-manifest"),
    pytest.param(Case(set_path(lambda f, r: ".ckptlib"), "plain relative path"), id="path-marker"),
    pytest.param(Case(set_path(lambda f, r: "a/b/c/d/e.bin"), "plain relative path"), id="path-5-levels"),
    pytest.param(Case(set_path(lambda f, r: r + "\x00"), "plain relative path"), id="path-nul"),
    pytest.param(Case(set_path(lambda f, r: "~/x.bin"), "plain relative path"), id="path-tilde"),
    pytest.param(Case(path_to_directory, "regular file"), id="path-is-directory"),
    pytest.param(Case(duplicate_file, "twice"), id="file-listed-twice"),
    pytest.param(Case(body_edit(lambda b: b["files"][0].pop()), "path, size"), id="file-entry-short"),
    pytest.param(Case(body_edit(lambda b: b["files"][0].__setitem__(1, -1)), "size"), id="file-size-negative"),
    pytest.param(Case(body_edit(lambda b: b["files"][0].__setitem__(1, "9")), "size"), id="file-size-string"),
    pytest.param(Case(body_edit(lambda b: b["files"][0].__setitem__(0, 5)), "path"), id="file-path-int"),
    # ---- payload files
    pytest.param(Case(flip_payload("/big"), "checksum mismatch"), id="bit-flip-chunk"),
    pytest.param(Case(flip_payload("/big2"), "checksum mismatch"), id="bit-flip-chunk-2"),
    pytest.param(Case(flip_payload("/small"), "checksum mismatch"), id="bit-flip-small-tensor"),
    pytest.param(Case(flip_payload("/big"), "checksum mismatch", compression="zstd"), id="bit-flip-zstd"),
    pytest.param(Case(flip_payload("/small"), "checksum mismatch", compression="zstd"),
                 id="bit-flip-small-zstd"),
    pytest.param(Case(truncate_payload, "size|shorter"), id="payload-truncated"),
    pytest.param(Case(extend_payload, "size"), id="payload-extended"),
    pytest.param(Case(manifest_size_edit(+1), "size"), id="payload-size-recorded-larger"),
    pytest.param(Case(manifest_size_edit(-1), "past the end|size"), id="payload-size-recorded-smaller"),
    pytest.param(Case(truncate_payload_and_manifest, "past the end"), id="payload-and-manifest-truncated"),
    pytest.param(Case(remove_payload, "missing|no such"), id="payload-missing", marks=()),
    pytest.param(Case(symlink_payload, "symlink"), id="payload-symlink"),
    pytest.param(Case(symlink_payload_dir, "symlink"), id="payload-dir-symlink"),
    pytest.param(Case(fifo_payload, "regular file"), id="payload-fifo"),
    pytest.param(Case(directory_payload, "regular file"), id="payload-directory"),
    # ---- the manifest file itself
    pytest.param(Case(symlink_manifest, "symlink"), id="manifest-symlink"),
    pytest.param(Case(fifo_manifest, "regular file"), id="manifest-fifo"),
    pytest.param(Case(directory_manifest, "regular file"), id="manifest-directory"),
    pytest.param(Case(lambda f: manifest_path(f).unlink(), "no manifest",
                      error=ckptlib.CheckpointNotFoundError), id="manifest-missing"),
    pytest.param(Case(lambda f: shutil.rmtree(f), "no checkpoint|no manifest",
                      error=ckptlib.CheckpointNotFoundError), id="folder-missing"),
    # ---- zstd
    pytest.param(Case(replace_big_with_stored(zstd_frame(bytes(RAW_CLAIM + 512), declared=RAW_CLAIM + 512)),
                      "declares"), id="zstd-claims-more"),
    pytest.param(Case(replace_big_with_stored(zstd_frame(bytes(RAW_CLAIM + 512), declared=None)),
                      "expands past"), id="zstd-expands-more"),
    pytest.param(Case(replace_big_with_stored(zstd_frame(bytes(100), declared=None)),
                      "expands to 100"), id="zstd-expands-less"),
    pytest.param(Case(replace_big_with_stored(zstd_frame(bytes(100), declared=100)), "declares|expands"),
                 id="zstd-claims-less"),
    pytest.param(Case(replace_big_with_stored(b"\x28\xb5\x2f\xfd" + os.urandom(200)), "zstd"),
                 id="zstd-garbage"),
    pytest.param(Case(replace_big_with_stored(b"not zstd at all" * 10), "zstd"), id="zstd-no-magic"),
    pytest.param(Case(replace_big_with_stored(zstd_bomb(1 << 30, declared=True)), "declares"),
                 id="zstd-bomb-declared"),
    pytest.param(Case(replace_big_with_stored(zstd_bomb(1 << 30, declared=False)), "expands past"),
                 id="zstd-bomb"),
    # ---- packs
    pytest.param(Case(pack_edit(pack_overlap), "overlap"), id="pack-members-overlap"),
    pytest.param(Case(pack_edit(piece_past_pack), "past the end"), id="pack-piece-past-end"),
    pytest.param(Case(pack_edit(pack_bad_raw_length), "length"), id="pack-raw-length"),
    pytest.param(Case(pack_edit(pack_codec), "codec"), id="pack-codec"),
    pytest.param(Case(pack_edit(pack_index), "pack"), id="pack-index"),
    pytest.param(Case(pack_edit(pack_over_chunk), "overlap"), id="pack-overlaps-chunk"),
    pytest.param(Case(pack_bomb, "expands past"), id="pack-zstd-bomb"),
    pytest.param(Case(pack_edit(pack_overlap_across_forms), "overlap"), id="pack-overlap-table-and-dict-form"),
    # ---- the packed table
    pytest.param(Case(set_body_field(TABLE_KEY, [["/small", "float32", 1, 16, 0, 0]]), "packed_tensors must be an object"),
                 id="table-not-object"),
    pytest.param(Case(set_body_field(TABLE_KEY, "rows"), "packed_tensors must be an object"), id="table-string"),
    pytest.param(Case(set_body_field(TABLE_KEY, None), "packed_tensors must be an object"), id="table-null"),
    pytest.param(Case(body_edit(lambda b: b.pop(TABLE_KEY)), "names no tensor", tree=True), id="table-missing"),
    pytest.param(Case(table_edit(lambda t, b: drop_row(b, "/small2")), "names no tensor", tree=True),
                 id="table-row-dropped"),
    pytest.param(Case(table_edit(lambda t, b: t.pop("ndim")), "exactly the columns"), id="table-column-missing"),
    pytest.param(Case(table_edit(lambda t, b: t.__setitem__("checksum", ["0"] * 3)), "exactly the columns"),
                 id="table-column-extra"),
    pytest.param(Case(table_edit(lambda t, b: t.__setitem__("Name", t.pop("name"))), "exactly the columns"),
                 id="table-column-renamed"),
    pytest.param(Case(table_edit(lambda t, b: t["pack"].append(0)), "different lengths"), id="table-column-longer"),
    pytest.param(Case(table_edit(lambda t, b: t["offset"].pop()), "different lengths"), id="table-column-shorter"),
    pytest.param(Case(table_edit(lambda t, b: t["name"].append("/extra")), "different lengths"),
                 id="table-name-column-longer"),
    pytest.param(Case(table_edit(lambda t, b: t["dtype"].pop()), "different lengths"), id="table-dtype-column-shorter"),
    pytest.param(Case(table_edit(lambda t, b: t["dims"].append(1)), "dims holds 5 values, ndim adds up to 4"),
                 id="table-dims-longer-than-ndim"),
    pytest.param(Case(set_cell("ndim", 1, 1), "dims holds 4 values, ndim adds up to 3"), id="table-ndim-short"),
    pytest.param(Case(table_edit(extra_row_without_dims), "dims holds 4 values, ndim adds up to 5"),
                 id="table-row-without-dims"),
    # same sum(ndim), rows regrouped: /small becomes [16, 4] (256 bytes) over /small2's bytes
    pytest.param(Case(set_column("ndim", [2, 1, 1]), "overlap"), id="table-ndim-regrouped"),
    pytest.param(Case(set_cell("ndim", 0, 65), r"ndim holds an integer outside \[0, 64\]"), id="table-ndim-65"),
    pytest.param(Case(set_cell("ndim", 0, -1), r"ndim holds an integer outside"), id="table-ndim-negative"),
    pytest.param(Case(set_cell("pack", 0, True), "pack must be a list of integers"), id="table-pack-bool"),
    pytest.param(Case(set_cell("ndim", 2, False), "ndim must be a list of integers"), id="table-ndim-bool"),
    pytest.param(Case(set_cell("dims", 0, True), "dims must be a list of integers"), id="table-dims-bool"),
    pytest.param(Case(set_cell("offset", 0, 0.0), "offset must be a list of integers"), id="table-offset-float"),
    pytest.param(Case(set_cell("dims", 0, 16.0), "dims must be a list of integers"), id="table-dims-float"),
    pytest.param(Case(set_cell("ndim", 0, "1"), "ndim must be a list of integers"), id="table-ndim-string"),
    pytest.param(Case(set_cell("pack", 0, "0"), "pack must be a list of integers"), id="table-pack-string"),
    pytest.param(Case(set_cell("dims", 3, None), "dims must be a list of integers"), id="table-dims-null"),
    pytest.param(Case(set_cell("offset", 1, [64]), "offset must be a list of integers"), id="table-offset-list"),
    pytest.param(Case(set_column("offset", 0), "offset must be a list of integers"), id="table-offset-not-list"),
    pytest.param(Case(set_column("dims", {"0": 16}), "dims must be a list of integers"), id="table-dims-object"),
    pytest.param(Case(set_cell("dims", 0, 2**64), "dims holds an integer outside"), id="table-dims-2**64"),
    pytest.param(Case(set_cell("dims", 0, 2**63), "dims holds an integer outside"), id="table-dims-2**63"),
    pytest.param(Case(set_cell("dims", 0, 10**40), "dims holds an integer outside"), id="table-dims-10**40"),
    pytest.param(Case(set_cell("dims", 0, -(2**63) - 1), "dims holds an integer outside"),
                 id="table-dims-below-int64"),
    pytest.param(Case(set_cell("dims", 0, 2**62 + 1), "dims holds an integer outside"), id="table-dims-2**62+1"),
    pytest.param(Case(set_cell("offset", 0, 2**64), "offset holds an integer outside"), id="table-offset-2**64"),
    pytest.param(Case(set_cell("pack", 0, 2**70), "pack holds an integer outside"), id="table-pack-2**70"),
    pytest.param(Case(set_cell("dims", 0, 0), r"dims holds an integer outside \[1, "), id="table-dim-zero"),
    pytest.param(Case(set_cell("dims", 3, -1), "dims holds an integer outside"), id="table-dim-negative"),
    pytest.param(Case(set_cell("dims", 0, 2**62), "/small.*declares more than 2\\^62 bytes"),
                 id="table-row-2**62-elements"),
    pytest.param(Case(set_row_shape(1, [2**31, 2**31]), "/small2.*declares more than 2\\^62 bytes"),
                 id="table-row-2**31-squared"),
    pytest.param(Case(set_row_shape(0, [2] * 64), "/small.*declares more than 2\\^62 bytes"),
                 id="table-row-64-dims-of-2"),
    pytest.param(Case(set_row_shape(0, [2**21] * 3), "/small.*declares more than 2\\^62 bytes"),
                 id="table-row-2**63-elements"),
    # exactly 2^62 bytes passes the size bound and must still fit in its pack
    pytest.param(Case(set_row_shape(2, [2**62]), "/blob.*ends past the end of pack 0"), id="table-row-2**62-bytes"),
    pytest.param(Case(set_cell("offset", 2, 5216), "/blob.*ends past the end of pack 0"),
                 id="table-offset-at-pack-end"),
    pytest.param(Case(set_cell("offset", 2, 97), "/blob.*ends past the end of pack 0"), id="table-offset-1-past"),
    pytest.param(Case(set_cell("offset", 0, 2**62), "/small.*ends past the end of pack 0"), id="table-offset-2**62"),
    pytest.param(Case(set_cell("offset", 0, -1), "offset holds an integer outside"), id="table-offset-negative"),
    pytest.param(Case(set_cell("pack", 1, 1), r"pack holds an integer outside \[0, 0\]"), id="table-pack-index-1"),
    pytest.param(Case(set_cell("pack", 0, 7), r"pack holds an integer outside \[0, 0\]"), id="table-pack-index-7"),
    pytest.param(Case(set_cell("pack", 0, -1), "pack holds an integer outside"), id="table-pack-negative"),
    pytest.param(Case(body_edit(lambda b: b.__setitem__("packs", [])), r"pack holds an integer outside \[0, -1\]"),
                 id="table-no-packs"),
    pytest.param(Case(set_cell("name", 1, "/small"), "a tensor name is listed twice"), id="table-name-duplicate"),
    pytest.param(Case(set_cell("name", 0, "/big"), "'/big' is listed twice"), id="table-name-also-in-tensors"),
    pytest.param(Case(table_edit(row_also_in_tensors), "'/small' is listed twice"), id="table-row-also-dict-form"),
    pytest.param(Case(set_cell("name", 0, 5), "name must be a list of strings"), id="table-name-int"),
    pytest.param(Case(set_cell("name", 0, None), "name must be a list of strings"), id="table-name-null"),
    pytest.param(Case(set_cell("name", 0, ["/small"]), "name must be a list of strings"), id="table-name-list"),
    pytest.param(Case(set_cell("name", 0, "/" + "x" * 5000), "at most 4096 characters"), id="table-name-too-long"),
    pytest.param(Case(set_column("name", "/small"), "name must be a list of strings"), id="table-name-not-list"),
    pytest.param(Case(set_cell("dtype", 0, "float128"), "'float128' is not in the dtype allowlist"),
                 id="table-dtype-float128"),
    pytest.param(Case(set_cell("dtype", 1, "torch.bfloat16"), "not in the dtype allowlist"), id="table-dtype-prefixed"),
    pytest.param(Case(set_cell("dtype", 0, ["float32"]), r"\['float32'\] is not in the dtype allowlist"),
                 id="table-dtype-list"),
    pytest.param(Case(set_cell("dtype", 0, {"float32": 1}), "not in the dtype allowlist"), id="table-dtype-object"),
    pytest.param(Case(set_cell("dtype", 2, None), "None is not in the dtype allowlist"), id="table-dtype-null"),
    pytest.param(Case(set_cell("dtype", 2, 1), "not in the dtype allowlist"), id="table-dtype-int"),
    pytest.param(Case(set_column("dtype", "float32"), "not in the dtype allowlist"), id="table-dtype-not-list"),
    # a wider dtype makes a row run over its neighbour or off the pack
    pytest.param(Case(set_cell("dtype", 1, "float32"), "pack 0: members '/small2' and '/blob' overlap"),
                 id="table-dtype-wider-overlaps"),
    pytest.param(Case(set_cell("dtype", 2, "int64"), "/blob.*ends past the end of pack 0"),
                 id="table-dtype-wider-past-end"),
    pytest.param(Case(table_edit(lambda t, b: t["offset"].__setitem__(1, 0)), "pack 0: members '/small' and '/small2' overlap"),
                 id="table-rows-overlap"),
]




def _cases_for(*, keep: Callable[[Case], bool], drop_marks: tuple[Any, ...] = (),
               add_marks: dict[str, Any] | None = None) -> list[Any]:
    """CASES filtered by ``keep``, with the marks adjusted for a different entry point."""
    out = []
    for p in CASES:
        case = p.values[0]
        if not keep(case):
            continue
        marks = [m for m in p.marks if m not in drop_marks]
        if add_marks and p.id in add_marks:
            marks.append(add_marks[p.id])
        out.append(pytest.param(case, id=p.id, marks=marks))
    return out


def _apply(tmp_path: Path, case: Case) -> tuple[Path, str]:
    ck = make_checkpoint(tmp_path, case.compression)
    named = case.tamper(ck)
    return ck, named or MANIFEST


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES)
def test_load_refuses(tmp_path: Path, case: Case) -> None:
    ck, named = _apply(tmp_path, case)
    with pytest.raises(case.error, match=case.match) as ei:
        ckptlib.load(ck)
    assert named in str(ei.value), f"error does not name {named}: {ei.value}"


def test_value_tree_errors_name_the_manifest(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path)
    set_tree_value("name", {"t": "pickle"})(ck)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="unknown node kind") as ei:
        ckptlib.load(ck)
    assert MANIFEST in str(ei.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", _cases_for(keep=lambda c: True))
def test_no_foreign_exception_anywhere(tmp_path: Path, case: Case) -> None:
    """Every entry point that reads a checkpoint raises only CheckpointError subclasses (or
    succeeds, where damage is legitimately invisible, e.g. ``verify=False``)."""
    ck, _ = _apply(tmp_path, case)
    calls: dict[str, Callable[[], Any]] = {
        "load": lambda: ckptlib.load(ck),
        "load(verify=False)": lambda: ckptlib.load(ck, verify=False),
        "load(into=)": lambda: ckptlib.load(ck, into=base_state()),
        "load_metadata": lambda: ckptlib.load_metadata(ck),
        "check_step(deep)": lambda: check_step(open_storage(str(tmp_path)), "ck", deep=True),
    }
    foreign = {}
    for what, call in calls.items():
        try:
            call()
        except ckptlib.CheckpointError:
            pass
        except Exception as e:
            foreign[what] = f"{type(e).__name__}: {e}"
    assert not foreign, foreign


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", _cases_for(
    # the value tree is decoded by load() only: check_step judges manifest, sizes and checksums
    keep=lambda c: c.error is ckptlib.CorruptCheckpointError and not c.tree
    and c.tamper is not huge_uint8_tensor,

))
def test_check_step_deep_reports_corrupt(tmp_path: Path, case: Case) -> None:
    _, named = _apply(tmp_path, case)
    info = check_step(open_storage(str(tmp_path)), "ck", deep=True)
    assert info.status == "corrupt", (info.status, info.reason)
    assert named in info.reason, info.reason


# --------------------------------------------------------------------------- the corpus, in-process


@pytest.fixture(scope="module")
def corpus_templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_templates(tmp_path_factory.mktemp("corpus-templates"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e.isolated], ids=lambda e: e.name)
def test_corpus_entry_in_process(tmp_path: Path, corpus_templates: dict[str, Path], entry: Any) -> None:
    """The hostile corpus (``tests/chaos/corpus.py``), judged here by the same rule as in
    ``tests/chaos/test_malicious.py`` but in this process, without memory or CPU limits (the
    ``isolated`` bombs run only there)."""
    root = build(entry, tmp_path, corpus_templates)
    assert not judge(entry, {"ops": check(root)})


# --------------------------------------------------------------------------- specific checks


def test_bit_flip_with_verify_false_is_not_detected_but_loads(tmp_path: Path) -> None:
    """verify=False skips checksums by design: the flip shows up in the data (documented)."""
    ck = make_checkpoint(tmp_path)
    flip_payload("/big")(ck)
    loaded = ckptlib.load(ck, verify=False)
    assert not torch.equal(loaded["big"], base_state()["big"])


def test_overlapping_ranges_would_be_wrong_data(tmp_path: Path) -> None:
    """The overlap case is real: with the overlap check gone, /big2 would silently load /big's
    bytes (the checksum matches). The manifest check is what prevents it."""
    ck = make_checkpoint(tmp_path)
    overlapping_tensors(ck)
    body = body_of(ck)
    assert chunk0(body, "/big")[:4] == chunk0(body, "/big2")[:4]
    with pytest.raises(ckptlib.CorruptCheckpointError, match="overlap"):
        ckptlib.load(ck, verify=False)


def test_symlink_target_is_a_valid_copy(tmp_path: Path) -> None:
    """The symlinked payload points at a byte-identical copy: refusing is about the link."""
    ck = make_checkpoint(tmp_path)
    name = symlink_payload(ck)
    link = next(p for p in (ck).rglob(name))
    assert link.is_symlink() and link.resolve().read_bytes() == (tmp_path / "outside.bin").read_bytes()
    with pytest.raises(ckptlib.CorruptCheckpointError, match="symlink"):
        ckptlib.load(ck)


def test_huge_manifest_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = make_checkpoint(tmp_path)
    size = manifest_path(ck).stat().st_size
    monkeypatch.setattr(scan, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="limit") as ei:
        ckptlib.load(ck)
    assert MANIFEST in str(ei.value)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="limit"):
        ckptlib.load_metadata(ck)
    info = check_step(open_storage(str(tmp_path)), "ck")
    assert info.status == "corrupt" and "limit" in info.reason
    monkeypatch.setattr(scan, "MAX_MANIFEST_BYTES", size)
    assert_same(ckptlib.load(ck), base_state())


@pytest.mark.parametrize(
    ("node", "match"),
    [
        ({"t": "pickle", "v": "x"}, "unknown node kind"),
        ({"t": "tensor", "ref": "/big"}, "tensor"),
        ({"t": "dict", "items": [["a", {"t": "bytes", "b64": "%%%"}]]}, "base64"),
    ],
    ids=["unknown-kind", "tensor-ref", "bad-base64"],
)
def test_tampered_metadata(tmp_path: Path, node: Any, match: str) -> None:
    ck = make_checkpoint(tmp_path)
    rewrite_manifest(ck, lambda b: b.__setitem__("metadata", node))
    with pytest.raises(ckptlib.CorruptCheckpointError, match=match) as ei:
        ckptlib.load_metadata(ck)
    assert MANIFEST in str(ei.value)


def test_manifest_version_error_is_corrupt() -> None:
    assert issubclass(ckptlib.ManifestVersionError, ckptlib.CorruptCheckpointError)


def test_future_version_in_manager_steps(tmp_path: Path) -> None:
    with ckptlib.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        folder = next((tmp_path / "run").glob("step-*1"))
        write_manifest_bytes(folder, encode_manifest(body_of(folder), format_version=2))
        (info,) = mgr.steps()
        assert info.status == "corrupt" and "newer" in info.reason
        assert mgr.latest_step() is None
        with pytest.raises(ckptlib.CorruptCheckpointError, match="newer"):
            mgr.restore({"w": torch.zeros(2)})


def test_step_mismatch_between_folder_and_manifest(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(5, {"w": torch.ones(2)})
        mgr.save(7, {"w": torch.full((2,), 7.0)})
        (root / "step-000000000005").rename(root / "step-000000000006")  # folder says 6
        rewrite_manifest(root / "step-000000000007", lambda b: b.__setitem__("step", 8))  # manifest says 8
        infos = {i.step: i for i in mgr.steps()}
        assert infos[6].status == "corrupt"
        assert "manifest says step 5" in infos[6].reason
        assert infos[7].status == "corrupt"
        assert "manifest says step 8" in infos[7].reason
        assert mgr.latest_step() is None
        with pytest.raises(ckptlib.CorruptCheckpointError, match="step"):
            mgr.restore({"w": torch.zeros(2)})


def test_manager_skips_corrupt_newest_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(70_000)})
        mgr.save(2, {"w": torch.full((70_000,), 2.0)})
        flip_payload("/w")(root / "step-000000000002")
        quick = {i.step: i.status for i in mgr.steps()}
        assert quick == {1: "committed", 2: "committed"}  # sizes are fine: quick scan passes
        deep = {i.step: i for i in mgr.steps(deep=True)}
        assert deep[2].status == "corrupt" and "checksum mismatch" in deep[2].reason
        target = {"w": torch.zeros(70_000)}
        assert mgr.restore(target) == 1
        assert torch.equal(target["w"], torch.ones(70_000))


# --------------------------------------------------------------------------- memory bound

_MEMORY_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import ckptlib
    from ckptlib.backends import open_storage
    from ckptlib.engine.scan import check_step

    root, name = sys.argv[1], sys.argv[2]
    out = {}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        ckptlib.load(f"{root}/{name}")
        out["load"] = "no error"
    except Exception as e:
        out["load"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
    info = check_step(open_storage(root), name, deep=True)
    out["deep"] = [info.status, info.reason]
    out["rss_growth_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps(out))
    """
)


def _probe_in_fresh_process(root: Path) -> dict[str, Any]:
    """Run ``_MEMORY_PROBE`` on ``root/ck`` in a new interpreter (so its peak RSS is its own)."""
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(root), "ck"],
        capture_output=True, text=True, timeout=100, check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("content_size", [True, False], ids=["declared", "undeclared"])
def test_zstd_bomb_memory_stays_small(tmp_path: Path, content_size: bool) -> None:
    """A 1 GiB zstd bomb with a manifest claiming 4 KiB: refused, and the process that reads it
    (a fresh one, so its peak RSS is its own) grows by far less than the bomb."""
    ck = make_checkpoint(tmp_path, "zstd")
    replace_big_with_stored(zstd_bomb(1 << 30, declared=content_size))(ck)
    out = _probe_in_fresh_process(tmp_path)
    assert out["load"].startswith("ckptlib.errors.CorruptCheckpointError"), out
    assert "evil.bin" in out["load"]
    assert out["deep"][0] == "corrupt", out
    assert out["rss_growth_mb"] < 300, out  # the bomb is 1024 MB; a capped decode needs ~0


def many_rows(n: int, last: dict[str, Any]) -> Callable[[Path], None]:
    """``n`` extra one-byte rows in the packed table (overlapping the real members: refused),
    the last row's cells replaced by ``last``."""

    def fn(t: dict[str, Any], body: dict[str, Any]) -> None:
        for i in range(n):
            add_row(body, f"/pad/{i}", "uint8", [1], 0, i % 5216)
        for column, value in last.items():
            t[column][-1] = value

    return table_edit(fn)


TABLE_MEMORY_CASES = {
    "rows-overlap": (many_rows(200_000, {}), "overlap"),
    "rows-last-dim-2**64": (many_rows(200_000, {"dims": 2**64}), "dims holds an integer outside"),
    "rows-last-dtype-list": (many_rows(200_000, {"dtype": ["uint8"]}), "not in the dtype allowlist"),
    "row-2**62-elements": (set_cell("dims", 0, 2**62), "declares more than 2\\^62 bytes"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", sorted(TABLE_MEMORY_CASES))
def test_table_refusal_memory_stays_small(tmp_path: Path, which: str) -> None:
    """A packed table of 200,000 hostile rows, or a row declaring 2^64 bytes: refused by the
    column checks, quickly, and the reading process (a fresh one, so its peak RSS is its own)
    grows by far less than anything the rows declare."""
    tamper, match = TABLE_MEMORY_CASES[which]
    ck = make_checkpoint(tmp_path)
    tamper(ck)
    out = _probe_in_fresh_process(tmp_path)
    assert out["load"].startswith("ckptlib.errors.CorruptCheckpointError"), out
    assert MANIFEST in out["load"] and re.search(match, out["load"]), out
    assert out["deep"][0] == "corrupt" and re.search(match, out["deep"][1]), out
    assert out["rss_growth_mb"] < 250, out  # a 200,000-row manifest is about 7 MB of JSON
