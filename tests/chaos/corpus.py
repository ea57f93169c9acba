"""A corpus of hand-made hostile checkpoints, generated on demand (never committed as binaries).

Who calls what: ``tests/chaos/test_malicious.py`` calls :func:`build_all` (or :func:`build`
for one entry) into a pytest tmp folder, then runs ``tests/chaos/load_one.py`` on the result
in subprocesses. ``python -m tests.chaos.corpus OUT`` writes the same corpus for a human to
look at. Everything runs on the caller's thread.

Each entry is a CheckpointManager *root* ``OUT/<name>/`` holding the hostile step folder
``step-000000000007/`` and, next to it, whatever the attack points at (``outside.bin``, a
copy of a payload reachable by ``..``; symlink targets). Most entries start from a real small
checkpoint saved by ckptlib (raw or zstd) and tamper with it; manifest edits recompute the
manifest's self-checksum so that the validation behind it is what has to refuse the input
(entries in the ``checksum`` category deliberately keep a wrong one). The corpus is
deterministic: the template's save id and time are fixed after saving, tensors come from
seeded generators, and every tampering is a pure function of the template.

An entry says which error ``ckptlib.load`` must raise (``expect``, class names; the error must
be one of them or a subclass), whether the damage is only visible to ``load`` (``tree_only``:
the value tree is decoded by ``load``, not by the scanner), whether plain ``load`` of the
folder may legitimately succeed with the exact original data (``load_ok``: damage in the
metadata, or a step number that only the manager checks), and whether it runs in a
subprocess of its own so that its peak memory is measured alone (``isolated``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ckptlib
from ckptlib.format import jsonio
from ckptlib.format.checksum import checksum
from ckptlib.format.manifest import MANIFEST_NAME, TABLE_KEY

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # load_one.py, python -m
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import (
    base_state,
    body_of,
    body_text,
    chunk0,
    encode_manifest,
    frame,
    random_tensor,
    tree_item,
    zstd_bomb,
    zstd_frame,
)

STEP = 7
STEP_DIR = f"step-{STEP:012d}"
SAVE_ID = "c0ffee00" * 4  # fixed save id of the templates (the corpus is deterministic)
CREATED = 1_700_000_000.0
METADATA = {"run": "corpus", "seed": 1234}
CORRUPT = ("CorruptCheckpointError",)
TEMPLATE_NAMES = ("raw", "zstd")


# --------------------------------------------------------------------------- manifest editing


def write_body(ck: Path, body: Any, **framing: Any) -> None:
    (ck / MANIFEST_NAME).write_bytes(encode_manifest(body, **framing))


def edit_body(fn: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    """A tamper that edits the body in place and rewrites it with a valid checksum."""

    def tamper(ck: Path) -> None:
        body = body_of(ck)
        fn(body)
        write_body(ck, body)

    return tamper


def edit_text(old: bytes, new: bytes, *, recompute: bool = True) -> Callable[[Path], None]:
    """Replace ``old`` by ``new`` in the body text; the checksum is recomputed unless asked not to."""

    def tamper(ck: Path) -> None:
        text = body_text(ck)
        assert old in text, old
        text = text.replace(old, new, 1)
        digest = (
            None
            if recompute
            else json.loads((ck / MANIFEST_NAME).read_bytes())["checksum"].split(":")[1]
        )
        (ck / MANIFEST_NAME).write_bytes(frame(text, digest=digest))

    return tamper


def raw_manifest(fn: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def tamper(ck: Path) -> None:
        (ck / MANIFEST_NAME).write_bytes(fn((ck / MANIFEST_NAME).read_bytes()))

    return tamper


def packed_row(body: dict[str, Any], name: str) -> int:
    """Row of tensor ``name`` in the packed table ``body[TABLE_KEY]`` (columns ``name, dtype,
    ndim, dims, pack, offset``; ``dims`` holds every row's shape, flat): small tensors stored
    whole in a pack are rows there, not ``tensors`` entries."""
    return body[TABLE_KEY]["name"].index(name)


def set_table(column: str, name: str, value: Any) -> Callable[[Path], None]:
    """Set tensor ``name``'s cell in ``column`` of the packed table (not ``dims``)."""
    return edit_body(lambda b: b[TABLE_KEY][column].__setitem__(packed_row(b, name), value))


def set_dims(name: str, shape: list[int]) -> Callable[[Path], None]:
    """Tensor ``name``'s row declares ``shape`` (``ndim`` and ``dims`` kept consistent)."""

    def edit(body: dict[str, Any]) -> None:
        t, row = body[TABLE_KEY], packed_row(body, name)
        start = sum(t["ndim"][:row])
        t["dims"][start : start + t["ndim"][row]] = shape
        t["ndim"][row] = len(shape)

    return edit_body(edit)


def set_tree(key: str, node: Any) -> Callable[[Path], None]:
    return edit_body(lambda b: tree_item(b, key).__setitem__(1, node))


def set_tensor(name: str, field: str, value: Any) -> Callable[[Path], None]:
    return edit_body(lambda b: b["tensors"][name].__setitem__(field, value))


def set_chunk(name: str, index: int, value: Any) -> Callable[[Path], None]:
    return edit_body(lambda b: chunk0(b, name).__setitem__(index, value))


def payload(ck: Path, body: dict[str, Any], index: int = 0) -> Path:
    return ck / body["files"][index][0]


def add_file(
    ck: Path, body: dict[str, Any], name: str, data: bytes | None = None, *, sparse: int = 0
) -> int:
    """A new payload file next to the others (``sparse``: a hole of that many bytes), listed in
    ``body["files"]`` with its real size; returns its index."""
    rel = f"{SAVE_ID}/{name}"
    with open(ck / rel, "wb") as f:
        if data is not None:
            f.write(data)
        if sparse:
            f.truncate(sparse)
    body["files"].append([rel, (ck / rel).stat().st_size])
    return len(body["files"]) - 1


def one_chunk(
    body: dict[str, Any],
    name: str,
    *,
    file: int,
    stored_checksum: str,
    length: int,
    dtype: str,
    shape: list[int],
    codec: str,
    start: int = 0,
) -> None:
    body["tensors"][name] = {
        "dtype": dtype,
        "shape": shape,
        "chunks": [[file, start, length, stored_checksum, [0] * len(shape), shape, codec]],
    }


# --------------------------------------------------------------------------- zstd frames


def big_as_stored(
    stored: bytes | Callable[[], bytes],
    *,
    claim: int = 4096,
    codec: str = "zstd",
    dtype: str = "uint8",
    name: str = "evil.bin",
) -> Callable[[Path], None]:
    """Make ``/big`` a ``dtype`` tensor of ``claim`` bytes stored as ``stored`` (correct checksum),
    in a new payload file: only decoding can catch what is wrong. ``stored`` may be a function
    making the bytes (bombs are built only when the entry is)."""

    def tamper(ck: Path) -> None:
        body = body_of(ck)
        data = stored() if callable(stored) else stored
        idx = add_file(ck, body, name, data)
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        one_chunk(
            body,
            "/big",
            file=idx,
            stored_checksum=checksum(data),
            length=len(data),
            dtype=dtype,
            shape=[claim // itemsize],
            codec=codec,
        )
        write_body(ck, body)

    return tamper


# --------------------------------------------------------------------------- tampers


def forged_checksum(ck: Path) -> None:
    doc = json.loads((ck / MANIFEST_NAME).read_bytes())
    body = doc["body"]
    tree_item(body, "step")[1] = 4
    write_body(ck, body, digest=doc["checksum"].split(":")[1])


def overlapping_tensors(ck: Path) -> None:
    """/big2 points at /big's bytes (same length) with a matching checksum."""
    body = body_of(ck)
    a, b = chunk0(body, "/big"), chunk0(body, "/big2")
    b[0], b[1], b[3] = a[0], a[1], a[3]
    write_body(ck, body)


def chunks_overlap_in_tensor(ck: Path) -> None:
    body = body_of(ck)
    f, start, length, _, _, _, codec = chunk0(body, "/big")
    half = length // 2
    data = payload(ck, body, f).read_bytes()
    body["tensors"]["/big"]["chunks"] = [
        [f, start, half, checksum(data[start : start + half]), [0, 0], [64, 512], codec],
        [
            f,
            start + half,
            half,
            checksum(data[start + half : start + length]),
            [0, 256],
            [64, 512],
            codec,
        ],
    ]
    write_body(ck, body)


def chunk_gap(ck: Path) -> None:
    body = body_of(ck)
    c = chunk0(body, "/big")
    c[5], c[2] = [63, 1024], 63 * 1024 * 4
    c[3] = checksum(payload(ck, body, c[0]).read_bytes()[c[1] : c[1] + c[2]])
    write_body(ck, body)


def chunk_listed_twice(ck: Path) -> None:
    body = body_of(ck)
    body["tensors"]["/big"]["chunks"].append(list(chunk0(body, "/big")))
    write_body(ck, body)


def scalar_two_chunks(ck: Path) -> None:
    body = body_of(ck)
    idx = add_file(ck, body, "extra.bin", b"\x00" * 8)
    z = checksum(b"\x00" * 4)
    body["tensors"]["/small"] = {
        "dtype": "float32",
        "shape": [],
        "chunks": [[idx, 0, 4, z, [], [], "raw"], [idx, 4, 4, z, [], [], "raw"]],
    }
    write_body(ck, body)


def range_past_eof(ck: Path) -> None:
    body = body_of(ck)
    c = chunk0(body, "/big")
    c[1] = body["files"][c[0]][1] - 100
    write_body(ck, body)


def pack_members_overlap(body: dict[str, Any]) -> None:
    t = body[TABLE_KEY]
    t["offset"][packed_row(body, "/small2")] = t["offset"][packed_row(body, "/small")]


def table_overlap_with_dict_form(body: dict[str, Any]) -> None:
    """/small2 moved to the older ``tensors`` form (still accepted), on /small's bytes."""
    t, row = body[TABLE_KEY], packed_row(body, "/small2")
    start = sum(t["ndim"][:row])
    shape = t["dims"][start : start + t["ndim"][row]]
    del t["dims"][start : start + t["ndim"][row]]
    for column in ("name", "dtype", "ndim", "pack", "offset"):
        del t[column][row]
    body["tensors"]["/small2"] = {
        "dtype": "bfloat16",
        "shape": shape,
        "packed": [[0, t["offset"][packed_row(body, "/small")]]],
    }


def table_rows_named_twice(body: dict[str, Any]) -> None:
    """/small2's row renamed /small: a second /small, on other bytes with another dtype."""
    t = body[TABLE_KEY]
    t["name"][packed_row(body, "/small2")] = "/small"


def many_rows(n: int) -> Callable[[Path], None]:
    """``n`` extra one-byte rows in the packed table, each on bytes of /small or /small2."""

    def edit(body: dict[str, Any]) -> None:
        t = body[TABLE_KEY]
        for i in range(n):
            for column, value in zip(
                ("name", "dtype", "ndim", "dims", "pack", "offset"),
                (f"/pad/{i}", "uint8", 1, 1, 0, i % 96),
                strict=True,
            ):
                t[column].append(value)

    return edit_body(edit)


def pack_over_chunk(body: dict[str, Any]) -> None:
    p, c = body["packs"][0], chunk0(body, "/big")
    p[0], p[1] = c[0], c[1]


def fragmented(n: int) -> Callable[[Path], None]:
    """``/big`` becomes an ``n x n`` uint8 tensor cut into 2n staggered chunks (row i split at
    column i): the chunk boundaries induce an n x n grid, ``n * n`` cells to check. Each chunk
    is one zstd byte of a sparse file (checksums match the zero bytes)."""

    def tamper(ck: Path) -> None:
        body = body_of(ck)
        idx = add_file(ck, body, "frag.bin", sparse=2 * n * 64)
        z = checksum(b"\x00")
        chunks = []
        for i in range(n):
            if i:
                chunks.append([idx, 128 * i, 1, z, [i, 0], [1, i], "zstd"])
            chunks.append([idx, 128 * i + 64, 1, z, [i, i], [1, n - i], "zstd"])
        body["tensors"]["/big"] = {"dtype": "uint8", "shape": [n, n], "chunks": chunks}
        write_body(ck, body)

    return tamper


def sparse_giant(claim_bytes: int, dtype: str = "uint8") -> Callable[[Path], None]:
    """``/big`` declares ``claim_bytes`` of ``dtype``, one zstd chunk spanning a sparse file just
    large enough for the claim to pass the expansion-ratio check (checksum of the zeros)."""

    def tamper(ck: Path) -> None:
        body = body_of(ck)
        length = max(1, (claim_bytes - 65536 + 32767) // 32768)
        idx = add_file(ck, body, "giant.bin", sparse=length)
        digest = checksum(bytes(length))
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        one_chunk(
            body,
            "/big",
            file=idx,
            stored_checksum=digest,
            length=length,
            dtype=dtype,
            shape=[claim_bytes // itemsize],
            codec="zstd" if itemsize == 1 else "zstd-shuffle",
        )
        write_body(ck, body)

    return tamper


def huge_file_claim(ck: Path) -> None:
    """A 2^62-byte uint8 tensor in a file the manifest claims is that big (it is 64 bytes)."""
    body = body_of(ck)
    idx = add_file(ck, body, "huge.bin", b"\x00" * 64)
    body["files"][idx][1] = 2**62
    one_chunk(
        body,
        "/big",
        file=idx,
        stored_checksum=checksum(b""),
        length=2**62,
        dtype="uint8",
        shape=[2**62],
        codec="raw",
    )
    write_body(ck, body)


def pack_bomb(ck: Path) -> None:
    body = body_of(ck)
    stored = zstd_bomb(256 << 20, declared=False)
    idx = add_file(ck, body, "packbomb.bin", stored)
    p = body["packs"][0]
    p[0], p[1], p[2], p[3], p[4] = idx, 0, len(stored), checksum(stored), "zstd"
    write_body(ck, body)


def outside_copy(ck: Path, body: dict[str, Any]) -> Path:
    """A byte-identical copy of payload 0 next to the step folder: following a path out of the
    folder would find valid data, so refusing is the only safe answer."""
    dst = ck.parent / "outside.bin"
    shutil.copyfile(payload(ck, body), dst)
    return dst


def set_path(make: Callable[[Path, dict[str, Any]], str]) -> Callable[[Path], None]:
    def tamper(ck: Path) -> None:
        body = body_of(ck)
        body["files"][0][0] = make(ck, body)
        write_body(ck, body)

    return tamper


def _backslash(ck: Path, body: dict[str, Any]) -> str:
    rel = body["files"][0][0]
    shutil.copyfile(ck / rel, ck / rel.replace("/", "\\"))
    return rel.replace("/", "\\")


def payload_symlink(target: Callable[[Path], str]) -> Callable[[Path], None]:
    """Replace payload 0 by a symlink to ``target(ck)`` (an absolute path or a relative one)."""

    def tamper(ck: Path) -> None:
        p = payload(ck, body_of(ck))
        dest = target(ck)
        p.unlink()
        os.symlink(dest, p)

    return tamper


def _symlink_to_copy(ck: Path) -> str:
    return str(outside_copy(ck, body_of(ck)))


def payload_dir_symlink(ck: Path) -> None:
    d = ck / SAVE_ID
    shutil.copytree(d, ck.parent / "outside-dir")
    shutil.rmtree(d)
    os.symlink(ck.parent / "outside-dir", d, target_is_directory=True)


def manifest_symlink(ck: Path) -> None:
    shutil.copyfile(ck / MANIFEST_NAME, ck.parent / "outside.json")
    (ck / MANIFEST_NAME).unlink()
    os.symlink(ck.parent / "outside.json", ck / MANIFEST_NAME)


def replace_with(kind: str, which: str) -> Callable[[Path], None]:
    """Replace the manifest or payload 0 by a FIFO or a folder."""

    def tamper(ck: Path) -> None:
        p = ck / MANIFEST_NAME if which == "manifest" else payload(ck, body_of(ck))
        p.unlink()
        if kind == "fifo":
            os.mkfifo(p)
        else:
            p.mkdir()

    return tamper


def flip(name: str, *, pack: bool = False) -> Callable[[Path], None]:
    def tamper(ck: Path) -> None:
        body = body_of(ck)
        if pack:
            p = body["packs"][body[TABLE_KEY]["pack"][packed_row(body, name)]]
            f, start, length = p[0], p[1], p[2]
        else:
            f, start, length = chunk0(body, name)[:3]
        with open(payload(ck, body, f), "r+b") as fh:
            fh.seek(start + length // 2)
            b = fh.read(1)
            fh.seek(start + length // 2)
            fh.write(bytes([b[0] ^ 0x08]))

    return tamper


def resize_payload(delta: int) -> Callable[[Path], None]:
    def tamper(ck: Path) -> None:
        p = payload(ck, body_of(ck))
        size = p.stat().st_size
        with open(p, "r+b") as f:
            f.truncate(size + delta if delta > -size else size // 2)

    return tamper


def manifest_over_limit(ck: Path) -> None:
    """A sparse 1 GiB + 1 byte manifest, far over ``MAX_MANIFEST_BYTES`` (256 MiB): refused by
    its size, never read."""
    with open(ck / MANIFEST_NAME, "r+b") as f:
        f.truncate((1 << 30) + 1)


def manifest_sparse(size: int) -> Callable[[Path], None]:
    """A sparse manifest of ``size`` NUL bytes; over ``MAX_MANIFEST_BYTES`` (256 MiB) it is
    refused by its size before reading, under it it is read and parsed."""

    def tamper(ck: Path) -> None:
        with open(ck / MANIFEST_NAME, "wb") as f:
            f.truncate(size)

    return tamper


def many_tensors(n: int) -> Callable[[Path], None]:
    """``n`` extra empty tensors (valid), then one with a dtype outside the allowlist."""

    def tamper(ck: Path) -> None:
        body = body_of(ck)
        for i in range(n):
            body["tensors"][f"/pad/{i}"] = {"dtype": "float32", "shape": [0]}
        body["tensors"]["/pad/last"] = {"dtype": "float128", "shape": [0]}
        write_body(ck, body)

    return tamper


def many_files(n: int) -> Callable[[Path], None]:
    """``n`` listed payload files (never opened), the last one listed twice."""

    def tamper(ck: Path) -> None:
        body = body_of(ck)
        body["files"].extend([f"{SAVE_ID}/pad-{i}.bin", 0] for i in range(n))
        body["files"].append([f"{SAVE_ID}/pad-{n - 1}.bin", 0])
        write_body(ck, body)

    return tamper


def huge_string(ck: Path) -> None:
    """A 64 MiB string in ``extra`` and a stale checksum: read, parsed and refused."""
    text = body_text(ck)
    pad = b'"extra":{"pad":"' + b"A" * (64 << 20) + b'"}'
    text = text.replace(b'"extra":{}', pad, 1)
    (ck / MANIFEST_NAME).write_bytes(frame(text, digest="0" * 16))


def deep_json(levels: int, open_: bytes, close: bytes) -> Callable[[Path], None]:
    return edit_text(b'["name","x"]', b'["name",' + open_ * levels + b"0" + close * levels + b"]")


def deep_tree(levels: int, field: str = "tree") -> Callable[[Path], None]:
    def edit(body: dict[str, Any]) -> None:
        node: Any = 1
        for _ in range(levels):
            node = {"t": "list", "items": [node]}
        if field == "tree":
            tree_item(body, "name")[1] = node
        else:
            body["metadata"] = {"t": "dict", "items": [["deep", node]]}

    return edit_body(edit)


def dup_tensor_key(ck: Path) -> None:
    """The tensors object names /big2 twice; the second entry points at /big's bytes."""
    body = body_of(ck)
    evil = dict(body["tensors"]["/big2"])
    a = chunk0(body, "/big")
    evil["chunks"] = [[a[0], a[1], a[2], a[3], [0, 0], [128, 256], a[6]]]
    text = body_text(ck)
    key = b'"/big2":'
    i = text.index(key)
    extra = key + jsonio.dumps(evil, sort_keys=False).encode() + b","
    (ck / MANIFEST_NAME).write_bytes(frame(text[:i] + extra + text[i:]))


def step_is_file(ck: Path) -> None:
    shutil.rmtree(ck)
    ck.write_bytes(b"not a folder")


# --------------------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Entry:
    name: str
    category: str
    description: str
    tamper: Callable[[Path], Any]
    template: str = "raw"
    expect: tuple[str, ...] = CORRUPT
    tree_only: bool = False
    load_ok: bool = False
    isolated: bool = False
    as_mb: int = 0
    """Address-space cap for this entry's own process (0: the test's default; isolated only)."""


def _entries() -> list[Entry]:
    E = Entry
    out = [
        # ---- manifest framing and checksum
        E("manifest-empty", "framing", "manifest.json is empty", raw_manifest(lambda d: b"")),
        E(
            "manifest-random-bytes",
            "framing",
            "manifest.json is 4 KiB of seeded random bytes",
            raw_manifest(lambda d: bytes(random_tensor((4096,), torch.uint8, 9).tolist())),
        ),
        E(
            "manifest-not-utf8",
            "framing",
            "manifest starts with a UTF-16 byte order mark",
            raw_manifest(lambda d: b"\xff\xfe" + d[2:]),
        ),
        E(
            "manifest-truncated",
            "framing",
            "manifest cut in half",
            raw_manifest(lambda d: d[: len(d) // 2]),
        ),
        E(
            "manifest-not-object",
            "framing",
            "manifest is a JSON list",
            raw_manifest(lambda d: b"[1,2,3]"),
        ),
        E(
            "manifest-format-marker",
            "framing",
            'format is "pickle" (checksum valid)',
            lambda ck: write_body(ck, body_of(ck), fmt="pickle"),
        ),
        E(
            "manifest-extra-top-key",
            "framing",
            "a fifth top-level key after the body",
            raw_manifest(lambda d: d[:-1] + b',"exec":"rm -rf /"}'),
        ),
        E(
            "checksum-forged",
            "checksum",
            "body edited (step 3 -> 4), old digest kept",
            forged_checksum,
        ),
        E(
            "checksum-whitespace",
            "checksum",
            "one space added inside the body, old digest kept",
            edit_text(b'"step":7', b'"step": 7', recompute=False),
        ),
        E(
            "checksum-algorithm",
            "checksum",
            "head names crc32c instead of xxh3_64",
            raw_manifest(lambda d: d.replace(b'"checksum":"xxh3_64:', b'"checksum":"crc32c:', 1)),
        ),
        E(
            "version-future",
            "version",
            "format_version 2 (checksum valid)",
            lambda ck: write_body(ck, body_of(ck), format_version=2),
            expect=("ManifestVersionError",),
        ),
        E(
            "version-huge",
            "version",
            "format_version 10**30",
            lambda ck: write_body(ck, body_of(ck), format_version=10**30),
            expect=("ManifestVersionError",),
        ),
        E(
            "version-zero",
            "version",
            "format_version 0",
            lambda ck: write_body(ck, body_of(ck), format_version=0),
        ),
        E(
            "version-string",
            "version",
            'format_version "1"',
            lambda ck: write_body(ck, body_of(ck), format_version="1"),
        ),
        # ---- strict JSON
        E(
            "dup-body-key",
            "duplicate-keys",
            'body holds "step" twice (checksum valid)',
            edit_text(b'"step":7', b'"step":7,"step":8'),
        ),
        E(
            "dup-top-key",
            "duplicate-keys",
            "the format key twice at the top",
            raw_manifest(
                lambda d: d.replace(
                    b'"format":"ckptlib"', b'"format":"ckptlib","format":"ckptlib"', 1
                )
            ),
        ),
        E(
            "dup-tensor-key",
            "duplicate-keys",
            "tensor /big2 listed twice, the copy aimed at /big's bytes",
            dup_tensor_key,
        ),
        E(
            "dup-tree-key",
            "duplicate-keys",
            "a dict node of the value tree repeats a key",
            set_tree("name", {"t": "dict", "items": [["a", 1], ["a", 2]]}),
            tree_only=True,
        ),
        E(
            "dup-file-path",
            "duplicate-keys",
            "a payload file listed twice",
            edit_body(lambda b: b["files"].append(list(b["files"][0]))),
        ),
        E(
            "json-nan-literal",
            "json",
            "created is a bare NaN literal",
            edit_text(b'"created":', b'"created":NaN,"x":'),
        ),
        E(
            "json-huge-int",
            "json",
            "created is a 5000-digit integer",
            edit_text(b'"created":', b'"created":' + b"9" * 5000 + b',"x":'),
        ),
        # ---- nesting
        E(
            "nesting-json-list-100k",
            "nesting",
            "100,000 nested JSON lists in the tree",
            deep_json(100_000, b"[", b"]"),
        ),
        E(
            "nesting-json-object-50k",
            "nesting",
            "50,000 nested JSON objects in the tree",
            deep_json(50_000, b'{"a":', b"}"),
        ),
        E(
            "nesting-tree-300",
            "nesting",
            "a well-formed value tree 300 list nodes deep",
            deep_tree(300),
            tree_only=True,
        ),
        E(
            "nesting-metadata-300",
            "nesting",
            "metadata 300 list nodes deep (load ignores metadata)",
            deep_tree(300, "metadata"),
            load_ok=True,
        ),
        # ---- body fields
        E(
            "save-id-traversal",
            "traversal",
            'save_id is "../../etc"',
            edit_body(lambda b: b.__setitem__("save_id", "../../etc")),
        ),
        E(
            "world-size-zero",
            "fields",
            "world_size 0",
            edit_body(lambda b: b.__setitem__("world_size", 0)),
        ),
        E(
            "world-size-huge",
            "fields",
            "world_size 2**40",
            edit_body(lambda b: b.__setitem__("world_size", 2**40)),
        ),
        E(
            "checksum-algorithm-md5",
            "fields",
            "chunk checksum algorithm md5",
            edit_body(lambda b: b.__setitem__("checksum_algorithm", "md5")),
        ),
        E(
            "files-not-list",
            "fields",
            "files is an object",
            edit_body(lambda b: b.__setitem__("files", {})),
        ),
        E(
            "tensors-not-object",
            "fields",
            "tensors is a list",
            edit_body(lambda b: b.__setitem__("tensors", [])),
        ),
        E(
            "step-mismatch",
            "fields",
            "folder step-7 holds a manifest of step 8 (only the manager checks)",
            edit_body(lambda b: b.__setitem__("step", 8)),
            load_ok=True,
        ),
        # ---- paths
        E(
            "path-dotdot",
            "traversal",
            "payload path ../outside.bin (a valid copy lies there)",
            set_path(lambda ck, b: (outside_copy(ck, b), "../outside.bin")[1]),
        ),
        E(
            "path-absolute",
            "traversal",
            "payload path is the absolute path of a valid copy",
            set_path(lambda ck, b: str(outside_copy(ck, b))),
        ),
        E(
            "path-dotdot-inside",
            "traversal",
            "payload path <id>/../<id>/r00000-0.bin",
            set_path(lambda ck, b: f"{SAVE_ID}/../{b['files'][0][0]}"),
        ),
        E(
            "path-backslash",
            "traversal",
            "payload path with backslashes (a file of that name exists)",
            set_path(_backslash),
        ),
        E(
            "path-nul",
            "traversal",
            "payload path with a NUL byte",
            set_path(lambda ck, b: b["files"][0][0] + "\x00"),
        ),
        E(
            "path-manifest",
            "traversal",
            "payload path is manifest.json",
            set_path(lambda ck, b: MANIFEST_NAME),
        ),
        E(
            "path-dev-zero",
            "traversal",
            "payload path /dev/zero",
            set_path(lambda ck, b: "/dev/zero"),
        ),
        E(
            "path-proc-self-mem",
            "traversal",
            "payload path ../../../../proc/self/mem",
            set_path(lambda ck, b: "../../../../proc/self/mem"),
        ),
        E(
            "path-is-directory",
            "traversal",
            "payload path names the payload folder",
            set_path(lambda ck, b: SAVE_ID),
        ),
        E(
            "path-5-levels",
            "traversal",
            "payload path 5 components deep",
            set_path(lambda ck, b: "a/b/c/d/e.bin"),
        ),
        # ---- symlinks, FIFOs, folders
        E(
            "symlink-payload",
            "symlink",
            "payload is a symlink to a byte-identical copy outside",
            payload_symlink(_symlink_to_copy),
        ),
        E(
            "symlink-payload-dev-zero",
            "symlink",
            "payload is a symlink to /dev/zero",
            payload_symlink(lambda ck: "/dev/zero"),
        ),
        E(
            "symlink-payload-loop",
            "symlink",
            "payload is a symlink to itself",
            payload_symlink(lambda ck: "r00000-0.bin"),
        ),
        E(
            "symlink-payload-dir",
            "symlink",
            "the payload folder is a symlink to a copy outside",
            payload_dir_symlink,
        ),
        E(
            "symlink-manifest",
            "symlink",
            "manifest.json is a symlink to a valid copy outside",
            manifest_symlink,
        ),
        E(
            "fifo-payload",
            "fifo",
            "payload is a FIFO nobody writes to",
            replace_with("fifo", "payload"),
        ),
        E(
            "fifo-manifest",
            "fifo",
            "manifest.json is a FIFO nobody writes to",
            replace_with("fifo", "manifest"),
        ),
        E("dir-payload", "fifo", "payload is a folder", replace_with("dir", "payload")),
        E("dir-manifest", "fifo", "manifest.json is a folder", replace_with("dir", "manifest")),
        E(
            "manifest-missing",
            "missing",
            "no manifest.json (never committed)",
            lambda ck: (ck / MANIFEST_NAME).unlink(),
            expect=("CheckpointNotFoundError",),
        ),
        E(
            "step-is-file",
            "missing",
            "step-000000000007 is a regular file",
            step_is_file,
            expect=("CheckpointNotFoundError", "CorruptCheckpointError"),
        ),
        # ---- dtypes
        E("dtype-float128", "dtype", "dtype float128", set_tensor("/big", "dtype", "float128")),
        E("dtype-quantized", "dtype", "dtype qint8", set_tensor("/big", "dtype", "qint8")),
        E("dtype-object", "dtype", 'dtype "object"', set_tensor("/big", "dtype", "object")),
        E(
            "dtype-prefixed",
            "dtype",
            'dtype "torch.float32"',
            set_tensor("/big", "dtype", "torch.float32"),
        ),
        E("dtype-int", "dtype", "dtype 5", set_tensor("/big", "dtype", 5)),
        E(
            "dtype-list",
            "dtype",
            "dtype [] (unhashable: decode crashed with TypeError before the fix)",
            set_tensor("/big", "dtype", []),
        ),
        E(
            "dtype-itemsize",
            "dtype",
            "float32 chunk relabelled float64 (stored size mismatch)",
            set_tensor("/big", "dtype", "float64"),
        ),
        E(
            "dtype-tree-node",
            "dtype",
            "a dtype node naming qint8",
            set_tree("name", {"t": "dtype", "v": "qint8"}),
            tree_only=True,
        ),
        E(
            "bytes-ref-bf16",
            "dtype",
            "a bytes node referencing a bfloat16 tensor",
            set_tree("name", {"t": "bytes", "ref": "/small2"}),
            tree_only=True,
        ),
        # ---- giant declared shapes
        E(
            "shape-2e62-elements",
            "giant-shape",
            "float32 shape [2**62]",
            set_tensor("/big", "shape", [2**62]),
        ),
        E(
            "shape-2e31-squared",
            "giant-shape",
            "shape [2**31, 2**31]",
            set_tensor("/big", "shape", [2**31, 2**31]),
        ),
        E("shape-2e70", "giant-shape", "shape [2**70]", set_tensor("/big", "shape", [2**70])),
        E(
            "shape-negative",
            "giant-shape",
            "shape [-1, 1024]",
            set_tensor("/big", "shape", [-1, 1024]),
        ),
        E(
            "shape-100-dims",
            "giant-shape",
            "100 dimensions",
            set_tensor("/big", "shape", [1] * 100),
        ),
        E(
            "shape-zero-times-huge",
            "giant-shape",
            "shape [0, 2**62, 2**62]: no elements, overflowing strides",
            edit_body(
                lambda b: b["tensors"].__setitem__(
                    "/big", {"dtype": "float32", "shape": [0, 2**62, 2**62]}
                )
            ),
        ),
        E(
            "file-size-2e62",
            "giant-shape",
            "a 2**62-byte uint8 tensor in a 64-byte file recorded as 2**62",
            huge_file_claim,
        ),
        E(
            "giant-sparse-1tib",
            "giant-shape",
            "1 TiB uint8 tensor, one zstd chunk over a 32 MiB sparse file (ratio check passes)",
            sparse_giant(1 << 40),
            expect=("CorruptCheckpointError", "CheckpointError"),
        ),
        E(
            "giant-sparse-16gib-f32",
            "giant-shape",
            "16 GiB float32 tensor, zstd-shuffle chunk over a sparse file",
            sparse_giant(16 << 30, "float32"),
            expect=("CorruptCheckpointError", "CheckpointError"),
        ),
        # ---- the packed table (small tensors stored whole in a pack, one row each)
        E(
            "table-dims-2e64",
            "giant-shape",
            "packed-table row /small declares dims [2**64] (past int64)",
            set_dims("/small", [2**64]),
        ),
        E(
            "table-row-2e62-elements",
            "giant-shape",
            "packed-table row /small declares float32 [2**62]",
            set_dims("/small", [2**62]),
        ),
        E(
            "table-row-2e62-bytes",
            "giant-shape",
            "packed-table row /blob declares uint8 [2**62] (exactly 2^62 bytes, in a 5 KiB pack)",
            set_dims("/blob", [2**62]),
        ),
        E(
            "table-columns-ragged",
            "fields",
            "the packed table's pack column has one value more than its other columns",
            edit_body(lambda b: b[TABLE_KEY]["pack"].append(0)),
        ),
        E(
            "table-ndim-regrouped",
            "fields",
            "ndim [2, 1, 1] for dims [16, 4, 4, 5120]: same sum, /small [16, 4] over /small2",
            edit_body(lambda b: b[TABLE_KEY].__setitem__("ndim", [2, 1, 1])),
        ),
        E(
            "table-pack-bool",
            "fields",
            "a packed-table pack index is true (a bool, not 0 or 1)",
            set_table("pack", "/small2", True),
        ),
        E(
            "table-offset-past-pack",
            "overlap",
            "/blob's row starts at its pack's raw length",
            set_table("offset", "/blob", 5216),
        ),
        E(
            "table-dtype-list",
            "dtype",
            'a packed-table dtype ["float32"] (unhashable)',
            set_table("dtype", "/small", ["float32"]),
        ),
        E(
            "table-name-twice",
            "duplicate-keys",
            "two packed-table rows named /small, the second on /small2's bytes",
            edit_body(table_rows_named_twice),
        ),
        E(
            "table-name-in-tensors",
            "duplicate-keys",
            "a packed-table row named /big (a tensors entry of its own)",
            set_table("name", "/small", "/big"),
        ),
        E(
            "table-row-missing",
            "tree",
            "the packed table is gone; the tree still references /small, /small2 and /blob",
            edit_body(lambda b: b.pop(TABLE_KEY)),
            tree_only=True,
        ),
        E(
            "table-200k-rows",
            "huge-manifest",
            "200,000 extra one-byte packed-table rows over /small's and /small2's bytes",
            many_rows(200_000),
        ),
        # ---- overlapping ranges and tiling
        E(
            "overlap-between-tensors",
            "overlap",
            "/big2 reads /big's bytes (checksum matches)",
            overlapping_tensors,
        ),
        E(
            "overlap-within-tensor",
            "overlap",
            "two chunks of /big overlap and leave a gap",
            chunks_overlap_in_tensor,
        ),
        E("chunk-gap", "overlap", "/big's chunk leaves its last row uncovered", chunk_gap),
        E("chunk-listed-twice", "overlap", "/big's chunk listed twice", chunk_listed_twice),
        E("scalar-two-chunks", "overlap", "a scalar with two chunks", scalar_two_chunks),
        E(
            "range-past-eof",
            "overlap",
            "a chunk ends past its file's recorded size",
            range_past_eof,
        ),
        E(
            "pack-members-overlap",
            "overlap",
            "two packed tensors share raw bytes",
            edit_body(pack_members_overlap),
        ),
        E(
            "table-overlap-across-forms",
            "overlap",
            "/small2 in the older tensors-entry form, on /small's bytes (a table row)",
            edit_body(table_overlap_with_dict_form),
        ),
        E(
            "pack-over-chunk",
            "overlap",
            "a pack's byte range lies on /big's chunk",
            edit_body(pack_over_chunk),
        ),
        E(
            "box-outside",
            "overlap",
            "chunk box offset [1, 0] pushes it outside the tensor",
            set_chunk("/big", 4, [1, 0]),
        ),
        E(
            "tiling-too-fragmented",
            "overlap",
            "4,410,000-cell chunk grid (2100 x 2100 staggered chunks)",
            fragmented(2100),
        ),
        E(
            "tiling-fragmented-under-limit",
            "overlap",
            "4,000,000-cell chunk grid, then undecodable chunks",
            fragmented(2000),
        ),
        # ---- zstd
        E(
            "zstd-bomb-1gib",
            "zstd-bomb",
            "1 GiB of zeros in one frame without content size, claim 4 KiB",
            big_as_stored(lambda: zstd_bomb(1 << 30, declared=False)),
            template="zstd",
            isolated=True,
        ),
        E(
            "zstd-bomb-256mib-declared",
            "zstd-bomb",
            "256 MiB frame declaring its size, claim 4 KiB",
            big_as_stored(lambda: zstd_bomb(256 << 20, declared=True)),
            template="zstd",
        ),
        E(
            "zstd-bomb-pack-256mib",
            "zstd-bomb",
            "a pack replaced by a 256 MiB frame",
            pack_bomb,
            template="zstd",
        ),
        E(
            "zstd-bomb-near-claim",
            "zstd-bomb",
            "claim 256 MiB, frame expands to 256 MiB + 1 byte",
            big_as_stored(lambda: zstd_bomb((256 << 20) + 1, declared=False), claim=256 << 20),
            template="zstd",
            expect=("CorruptCheckpointError", "CheckpointError"),
            isolated=True,
        ),
        E(
            "zstd-concatenated",
            "zstd-bomb",
            "two frames back to back, together past the claim",
            big_as_stored(zstd_frame(bytes(4096)) + zstd_frame(bytes(4096))),
            template="zstd",
        ),
        E(
            "zstd-incomplete-frame",
            "zstd-bomb",
            "a frame cut after its first block header whose partial output is the claimed 1 byte",
            big_as_stored(b"\x28\xb5\x2f\xfd\x00\x00\x08\x00\x00\x00", claim=1),
            template="zstd",
        ),
        E(
            "zstd-trailing-bytes",
            "zstd-bomb",
            "a complete frame of the claimed size followed by 3 stray bytes",
            big_as_stored(zstd_frame(bytes(4096)) + b"abc"),
            template="zstd",
        ),
        E(
            "zstd-claims-less",
            "zstd-bomb",
            "frame of 100 bytes declaring 100, claim 4096",
            big_as_stored(zstd_frame(bytes(100), declared=100)),
            template="zstd",
        ),
        E(
            "zstd-garbage",
            "zstd-bomb",
            "zstd magic then seeded random bytes",
            big_as_stored(b"\x28\xb5\x2f\xfd" + bytes(random_tensor((200,), torch.uint8, 5).tolist())),
            template="zstd",
        ),
        E(
            "zstd-skippable",
            "zstd-bomb",
            "a skippable frame claiming 4 GiB of skipped content",
            big_as_stored(b"\x50\x2a\x4d\x18" + b"\xff\xff\xff\xff" + b"\x00" * 64),
            template="zstd",
        ),
        E(
            "zstd-shuffle-bomb",
            "zstd-bomb",
            "zstd-shuffle float32 chunk whose frame expands to 64 MiB",
            big_as_stored(
                lambda: zstd_bomb(64 << 20, declared=False), codec="zstd-shuffle", dtype="float32"
            ),
            template="zstd",
        ),
        # ---- payload damage
        E("bitflip-raw-chunk", "payload", "one bit flipped in /big's raw chunk", flip("/big")),
        E(
            "bitflip-zstd-chunk",
            "payload",
            "one bit flipped in /big's zstd chunk",
            flip("/big"),
            template="zstd",
        ),
        E(
            "bitflip-pack",
            "payload",
            "one bit flipped in the pack holding /small",
            flip("/small", pack=True),
        ),
        E("payload-truncated", "payload", "payload file cut in half", resize_payload(-(1 << 62))),
        E("payload-extended", "payload", "payload file grew by 64 bytes", resize_payload(64)),
        E(
            "payload-missing",
            "payload",
            "payload file deleted",
            lambda ck: payload(ck, body_of(ck)).unlink(),
        ),
        # ---- huge manifests
        E(
            "manifest-over-limit",
            "huge-manifest",
            "sparse manifest.json of 1 GiB + 1 byte",
            manifest_over_limit,
        ),
        E(
            "manifest-64mib-string",
            "huge-manifest",
            "64 MiB string in extra, stale checksum",
            huge_string,
        ),
        E(
            "manifest-sparse-400mib",
            "huge-manifest",
            "sparse manifest.json of 400 MiB of NUL bytes (over the 256 MiB limit: refused by size "
            "before reading), under a 1.5 GiB address-space cap",
            manifest_sparse(400 << 20),
            expect=("CorruptCheckpointError", "CheckpointError"),
            isolated=True,
            as_mb=1536,
        ),
        E(
            "manifest-20k-tensors",
            "huge-manifest",
            "20,000 tensor entries, the last with dtype float128",
            many_tensors(20_000),
        ),
        E(
            "manifest-10k-files",
            "huge-manifest",
            "10,000 file entries, the last listed twice",
            many_files(10_000),
        ),
        # ---- value tree and metadata
        E(
            "tree-pickle-node",
            "tree",
            "a node of kind pickle carrying a base64 pickle",
            set_tree("name", {"t": "pickle", "v": "gASVAAAAAAAAAAB9lC4="}),
            tree_only=True,
        ),
        E(
            "tree-dangling-ref",
            "tree",
            "a tensor node naming a tensor not in the manifest",
            set_tree("name", {"t": "tensor", "ref": "/nope"}),
            tree_only=True,
        ),
        E(
            "tree-bad-base64",
            "tree",
            "inline bytes that are not base64",
            set_tree("name", {"t": "bytes", "b64": "!!!"}),
            tree_only=True,
        ),
        E(
            "tree-huge-inline-bytes",
            "tree",
            "2 MiB of inline base64 (limit 1 MiB)",
            set_tree("name", {"t": "bytes", "b64": "QUFB" * (1 << 19)}),
            tree_only=True,
        ),
        E(
            "tree-per-rank-empty",
            "tree",
            "a per_rank node with no ranks",
            set_tree("name", {"t": "per_rank", "ranks": []}),
            tree_only=True,
        ),
        E(
            "tree-float-key",
            "tree",
            "a dict key 1.5",
            set_tree("name", {"t": "dict", "items": [[1.5, 1]]}),
            tree_only=True,
        ),
        E(
            "metadata-pickle-node",
            "tree",
            "metadata holds an unknown node kind (load ignores metadata)",
            edit_body(lambda b: b.__setitem__("metadata", {"t": "pickle", "v": "x"})),
            load_ok=True,
        ),
        E(
            "metadata-tensor-ref",
            "tree",
            "metadata references a tensor (load ignores metadata)",
            edit_body(lambda b: b.__setitem__("metadata", {"t": "tensor", "ref": "/big"})),
            load_ok=True,
        ),
    ]
    names = [e.name for e in out]
    assert len(names) == len(set(names)), "corpus entry names must be unique"
    return out


ENTRIES: list[Entry] = _entries()
BY_NAME: dict[str, Entry] = {e.name: e for e in ENTRIES}


# --------------------------------------------------------------------------- judging


AS_LIMIT_MB = 2048
"""RLIMIT_AS of the loading processes (torch alone maps about 0.9 GiB of it)."""
SLOW_S = 20.0
"""An entry point slower than this on one hostile input is a failure (a quadratic check, a spin)."""


def judge(entry: Entry, r: dict[str, Any]) -> list[str]:
    """Every way ``r`` (``load_one.py``'s line for ``entry``) is wrong; empty: refused as it must be.

    ``ckptlib.load`` raises one of ``entry.expect`` (or, for ``load_ok`` damage that only the
    manager or ``load_metadata`` sees, returns exactly the saved state); ``load_metadata``,
    ``check_step`` (deep), ``CheckpointManager.steps()`` and ``restore`` raise nothing but ckptlib
    errors, and whatever succeeds returns exact data; the deep check does not call a damaged step
    committed (except ``tree_only`` damage, which only ``load`` decodes); the manager never
    restores a step whose load fails; nothing is slow; peak RSS (if measured) stays under the cap.
    """
    ops = r["ops"]
    bad = []

    def foreign(op: str) -> None:
        o = ops[op]
        if o["outcome"] == "error" and not o["ckptlib"]:
            bad.append(f"{op}: foreign {o['cls']}: {o['msg'][:200]}")

    load = ops["load"]
    if load["outcome"] == "ok":
        if not (entry.load_ok and load.get("exact")):
            bad.append(f"load succeeded (exact={load.get('exact')}): a hostile input was accepted")
    elif not load["ckptlib"] or not set(entry.expect) & set(load["mro"]):
        bad.append(f"load: {load['cls']} is not one of {entry.expect}: {load['msg'][:200]}")
    for op in ("load_metadata", "steps", "restore", "verify"):
        foreign(op)
    if ops["load_metadata"]["outcome"] == "ok" and not ops["load_metadata"].get("exact"):
        bad.append("load_metadata returned wrong metadata")
    verify = ops["verify"]
    loads_exactly = load["outcome"] == "ok" and load.get("exact")
    if verify.get("status") == "committed" and not (entry.tree_only or loads_exactly):
        bad.append("check_step(deep=True) calls the damaged step committed")
    restore = ops["restore"]
    if (
        restore["outcome"] == "ok"
        and restore.get("value") == STEP
        and not (loads_exactly and verify.get("status") == "committed")
    ):
        bad.append("restore() restored the hostile step")
    slow = {op: o["s"] for op, o in ops.items() if o.get("s", 0) > SLOW_S}
    if slow:
        bad.append(f"too slow: {slow}")
    cap = entry.as_mb or AS_LIMIT_MB
    if r.get("rss_peak_mb", 0) >= cap:
        bad.append(f"peak RSS {r['rss_peak_mb']} MB reached the {cap} MB cap")
    return bad



# --------------------------------------------------------------------------- building


def make_templates(out: Path) -> dict[str, Path]:
    """Save the base state once raw and once zstd as step 7 of a manager root each, then fix
    the save id and creation time so that the corpus is byte-for-byte deterministic."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in TEMPLATE_NAMES:
        root = out / name
        if root.exists():
            shutil.rmtree(root)
        with ckptlib.CheckpointManager(
            root, async_save=False, compression=None if name == "raw" else "zstd"
        ) as m:
            m.save(STEP, base_state(), metadata=METADATA)
        ck = root / STEP_DIR
        body = body_of(ck)
        old = body["save_id"]
        (ck / old).rename(ck / SAVE_ID)
        body["save_id"], body["created"] = SAVE_ID, CREATED
        body["files"] = [[p.replace(old, SAVE_ID, 1), s] for p, s in body["files"]]
        write_body(ck, body)
        marker = ck / ".ckptlib"
        if marker.exists():
            marker.write_text(json.dumps({"save_id": SAVE_ID, "created": CREATED}))
        paths[name] = root
    return paths


def build(entry: Entry, out: Path, templates: dict[str, Path]) -> Path:
    """Write ``entry`` as the manager root ``out/<name>`` and return it."""
    root = out / entry.name
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(templates[entry.template], root, symlinks=True)
    entry.tamper(root / STEP_DIR)
    (root / "CORPUS.txt").write_text(f"{entry.name} [{entry.category}]: {entry.description}\n")
    return root


def build_all(out: Path, entries: list[Entry] | None = None) -> dict[str, Path]:
    """Every entry (or those given) under ``out``; templates are made in a scratch folder."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ckptlib-corpus-", dir=out) as scratch:
        templates = make_templates(Path(scratch))
        return {e.name: build(e, out, templates) for e in (ENTRIES if entries is None else entries)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.chaos.corpus OUT", file=sys.stderr)
        return 2
    built = build_all(Path(argv[0]))
    for e in ENTRIES:
        print(f"{e.name:32} {e.category:14} {e.description}")
    print(f"{len(built)} hostile checkpoints under {argv[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
