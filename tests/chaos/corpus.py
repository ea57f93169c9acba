"""The one list of hand-made hostile checkpoints (:data:`ENTRIES`), built on demand.

Long (over 2,000 lines) because it is the whole hostile-input list and its forging helpers, in one place.

Who calls what: ``tests/chaos/test_malicious.py`` calls :func:`build_all` into a pytest tmp
folder and runs ``tests/chaos/load_one.py`` on the result in subprocesses under memory and CPU
limits; ``tests/test_safe_loading.py`` builds each non-isolated entry and runs the same
:func:`judge` in-process, and checks the message of the entries that carry ``match`` (the
unit list, :data:`UNIT_ENTRIES`). ``python -m tests.chaos.corpus OUT`` writes the corpus for a
human to look at. Everything runs on the caller's thread. A new hostile input is one entry here.

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
from ckptlib.format.manifest import MANIFEST_NAME, TABLE_COLUMNS, TABLE_KEY

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # load_one.py, python -m
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import (
    add_payload,
    base_state,
    body_of,
    body_text,
    chunk0,
    drop_row,
    encode_manifest,
    flip_bit,
    frame,
    manifest_path,
    packed_location,
    payload_dir,
    payload_files,
    random_tensor,
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

STEP = 7
STEP_DIR = f"step-{STEP:012d}"
SAVE_ID = "c0ffee00" * 4  # fixed save id of the templates (the corpus is deterministic)
CREATED = 1_700_000_000.0
METADATA = {"run": "corpus", "seed": 1234}
CORRUPT = ("CorruptCheckpointError",)
TEMPLATE_NAMES = ("raw", "zstd", "v2", "v2file")


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
    rel = f"{body['save_id']}/{name}"
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
) -> Callable[[Path], str]:
    """Make ``/big`` a ``dtype`` tensor of ``claim`` bytes stored as ``stored`` (correct checksum),
    in a new payload file named ``name`` (returned): only decoding can catch what is wrong.
    ``stored`` may be a function making the bytes (bombs are built only when the entry is)."""

    def tamper(ck: Path) -> str:
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
        return name

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


def pack_bomb(ck: Path) -> str:
    body = body_of(ck)
    stored = zstd_bomb(256 << 20, declared=False)
    idx = add_file(ck, body, "packbomb.bin", stored)
    p = body["packs"][0]
    p[0], p[1], p[2], p[3], p[4] = idx, 0, len(stored), checksum(stored), "zstd"
    write_body(ck, body)
    return "packbomb.bin"


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
    d = ck / body_of(ck)["save_id"]
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
    match: str = ""
    """What ``load``'s message must match in ``tests/test_safe_loading.py``, which also checks that
    it names the file the tamper returns (default manifest.json); empty: not checked there."""


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
            match="checksum",
        ),
        E(
            "version-future",
            "version",
            "format_version 3 (checksum valid)",
            lambda ck: write_body(ck, body_of(ck), format_version=3),
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
            match="files",
        ),
        E(
            "tensors-not-object",
            "fields",
            "tensors is a list",
            edit_body(lambda b: b.__setitem__("tensors", [])),
            match="tensors",
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
            match="plain relative path",
        ),
        E(
            "path-absolute",
            "traversal",
            "payload path is the absolute path of a valid copy",
            set_path(lambda ck, b: str(outside_copy(ck, b))),
            match="plain relative path",
        ),
        E(
            "path-dotdot-inside",
            "traversal",
            "payload path <id>/../<id>/r00000-0.bin",
            set_path(lambda ck, b: f"{b['save_id']}/../{b['files'][0][0]}"),
            match="plain relative path",
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
            match="plain relative path",
        ),
        E(
            "path-manifest",
            "traversal",
            "payload path is manifest.json",
            set_path(lambda ck, b: MANIFEST_NAME),
            match="manifest",
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
            path_to_directory,
            match="regular file",
        ),
        E(
            "path-5-levels",
            "traversal",
            "payload path 5 components deep",
            set_path(lambda ck, b: "a/b/c/d/e.bin"),
            match="plain relative path",
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
            match="no manifest",
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
            match="allowlist",
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
            match="bytes|uint8|dtype",
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
            match="shape",
        ),
        E(
            "shape-100-dims",
            "giant-shape",
            "100 dimensions",
            set_tensor("/big", "shape", [1] * 100),
            match="dimensions",
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
            match="overlap",
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
            match=r"\['float32'\] is not in the dtype allowlist",
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
        E("scalar-two-chunks", "overlap", "a scalar with two chunks", scalar_two_chunks, match="cover|scalar"),
        E(
            "range-past-eof",
            "overlap",
            "a chunk ends past its file's recorded size",
            range_past_eof,
            match="past the end",
        ),
        E(
            "pack-members-overlap",
            "overlap",
            "two packed tensors share raw bytes",
            edit_body(pack_members_overlap),
            match="overlap",
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
            match="outside",
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
        E(
            "payload-truncated",
            "payload",
            "payload file cut in half",
            truncate_payload,
            match="size|shorter",
        ),
        E("payload-extended", "payload", "payload file grew by 64 bytes", extend_payload, match="size"),
        E("payload-missing", "payload", "payload file deleted", remove_payload, match="missing|no such"),
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


def file_of(folder: Path, body: dict[str, Any], index: int) -> Path:
    return folder / body["files"][index][0]


# --------------------------------------------------------------------------- the unit list
# Entries written for tests/test_safe_loading.py, with the message ``load`` must give.


def unit(
    name: str,
    tamper: Callable[[Path], str | None],
    match: str,
    *,
    compression: str | None = None,
    error: type[Exception] = ckptlib.CorruptCheckpointError,
    tree: bool = False,
) -> Entry:
    """An entry of the unit list: ``tamper`` may return the file name the error must mention
    (default: manifest.json), ``match`` is what the message must match, ``tree``: the damage
    is in the value tree (decoded by ``load`` only)."""
    return Entry(
        name,
        "unit",
        name,
        tamper,
        template="zstd" if compression else "raw",
        expect=(error.__name__,),
        tree_only=tree,
        match=match,
    )


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
        raw_manifest(text_sub(f'"created":{value}', f'"created":{new}'))(folder)

    return tamper


def set_body_field(field: str, value: Any) -> Callable[[Path], None]:
    def edit(body: dict[str, Any]) -> None:
        body[field] = value

    return edit_body(edit)





def flip_in_manifest_body(folder: Path) -> None:
    data = manifest_path(folder).read_bytes()
    i = data.index(b'"save_id":"') + len(b'"save_id":"')
    flip_bit(manifest_path(folder), i, 0)  # '0'..'9a'..'f' -> another hex-ish character





def nested_json(levels: int) -> Callable[[Path], None]:
    """10,000 levels of raw JSON nesting in the tree (no checksum: the parser must refuse)."""

    def tamper(folder: Path) -> None:
        raw_manifest(text_sub('["name","x"]', '["name",' + "[" * levels + "]" * levels + "]"))(folder)

    return tamper

















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


def set_file_path(make: Callable[[Path, str], str]) -> Callable[[Path], None]:
    """Point files[0] at ``make(folder, current_path)``; a readable copy of the real payload is
    put where a path-following reader would find it, so refusing is the only safe outcome."""

    def tamper(folder: Path) -> None:
        def edit(body: dict[str, Any]) -> None:
            body["files"][0][0] = make(folder, body["files"][0][0])

        rewrite_manifest(folder, edit)

    return tamper


def dot_prefix(folder: Path, rel: str) -> str:
    return "./" + rel


def backslashes(folder: Path, rel: str) -> str:
    (folder / rel.replace("/", "\\")).write_bytes((folder / rel).read_bytes())
    return rel.replace("/", "\\")


def double_slash(folder: Path, rel: str) -> str:
    return rel.replace("/", "//")


def dot_inside(folder: Path, rel: str) -> str:
    d, f = rel.split("/")
    return f"{d}/./{f}"


def to_directory(folder: Path, rel: str) -> str:
    return rel.split("/")[0]  # the save-id folder itself


def path_to_directory(folder: Path) -> str:
    set_file_path(to_directory)(folder)
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


# -- packs (small tensors)


def pack_edit(fn: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def tamper(folder: Path) -> None:
        assert body_of(folder).get("packs"), "the writer no longer packs small tensors"
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

    return edit_body(edit)


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


def tree_case(node: Any, match: str, name: str) -> Entry:
    return unit(name, set_tree("name", node), match, tree=True)


UNIT_ENTRIES: list[Entry] = [
    # ---- manifest bytes
    unit("garbled-head", raw_manifest(lambda d: d[:30] + b"#garbage#" + d[45:]), "format"),
    unit("garbled-body", raw_manifest(lambda d: d[: len(d) // 2] + b"\x00}]{[" + d[len(d) // 2 + 5 :]), "invalid JSON|checksum"),
    unit("not-utf8", raw_manifest(lambda d: b"\xff\xfe" + d[2:]), "UTF-8"),
    unit("empty", raw_manifest(lambda d: b""), "invalid JSON"),
    unit("truncated-half", raw_manifest(lambda d: d[: len(d) // 2]), "invalid JSON"),
    unit("truncated-1-byte", raw_manifest(lambda d: d[:-1]), "invalid JSON"),
    unit("not-an-object", raw_manifest(lambda d: b"[1, 2, 3]"), "object"),
    unit("null", raw_manifest(lambda d: b"null"), "object"),
    unit("checksum-mismatch", forged_checksum, "checksum mismatch"),
    unit("bit-flip-in-manifest", flip_in_manifest_body, "checksum mismatch|save_id"),
    unit("checksum-not-string", raw_manifest(text_sub('"checksum":"xxh3_64:', '"checksum":5,"x":"')), "checksum"),
    unit("format-marker", lambda f: write_manifest_bytes(f, encode_manifest(body_of(f), fmt="other")), "format marker"),
    unit("version-3", lambda f: write_manifest_bytes(f, encode_manifest(body_of(f), format_version=3)), "format_version 3 is newer", error=ckptlib.ManifestVersionError),
    unit("version-10**6", lambda f: write_manifest_bytes(f, encode_manifest(body_of(f), format_version=10**6)), "newer", error=ckptlib.ManifestVersionError),
    *[
        unit(f"version-{v!r}", lambda f, v=v: write_manifest_bytes(f, encode_manifest(body_of(f), format_version=v)), "format_version")
        for v in (0, -1, "1", 1.0, True, None)
    ],
    unit("duplicate-keys", raw_manifest(text_sub('"body":{', '"body":{"step":1,')), "duplicate"),
    unit("duplicate-top-keys", raw_manifest(text_sub('"format":"ckptlib"', '"format":"ckptlib","format":"ckptlib"')), "duplicate"),
    unit("nan-literal", created_sub("NaN"), "NaN"),
    unit("infinity-literal", created_sub("Infinity"), "Infinity"),
    unit("minus-infinity-literal", created_sub("-Infinity"), "Infinity"),
    unit("huge-int-literal", created_sub("9" * 5000), "invalid JSON"),
    unit("nesting-10000", nested_json(10_000), "invalid JSON|deep|recursion"),
    # ---- body fields
    unit("save-id", set_body_field("save_id", "../../etc"), "save_id"),
    unit("world-size", set_body_field("world_size", 0), "world_size"),
    unit("commit-mode", set_body_field("commit", "yolo"), "commit"),
    unit("checksum-algo", set_body_field("checksum_algorithm", "md5"), "checksum_algorithm"),
    unit("step-negative", set_body_field("step", -1), "step"),
    unit("step-string", set_body_field("step", "5"), "step"),
    unit("created-string", set_body_field("created", "now"), "created"),
    unit("extra-not-object", set_body_field("extra", []), "extra"),
    unit("files-missing", edit_body(lambda b: b.pop("files")), "files"),
    # ---- value tree
    unit("deep-tree-300", deep_tree(300), "deeper", tree=True),
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
    # ---- tensor entries
    unit("unknown-dtype", set_tensor("/big", "dtype", "float128"), "allowlist"),
    unit("quantized-dtype", set_tensor("/big", "dtype", "qint8"), "allowlist"),
    unit("dtype-null", set_tensor("/big", "dtype", None), "allowlist"),
    unit("shape-2**62", set_tensor("/big", "shape", [2**62]), "2\\^62"),
    unit("shape-2**31-squared", set_tensor("/big", "shape", [2**31, 2**31]), "2\\^62"),
    unit("shape-2**70", set_tensor("/big", "shape", [2**70]), "2\\^62"),
    unit("shape-float", set_tensor("/big", "shape", [64.0, 1024]), "shape"),
    unit("shape-string", set_tensor("/big", "shape", ["64", 1024]), "shape"),
    unit("shape-bool", set_tensor("/big", "shape", [True, 1024]), "shape"),
    unit("shape-null", set_tensor("/big", "shape", [None, 1024]), "shape"),
    unit("shape-not-list", set_tensor("/big", "shape", "64x1024"), "shape"),
    unit("shape-larger", set_tensor("/big", "shape", [64, 1025]), "cover"),
    unit("no-chunks", set_tensor("/big", "chunks", []), "cover"),
    unit("chunks-not-list", set_tensor("/big", "chunks", "x"), "list"),
    unit("uint8-2**62-bytes", huge_uint8_tensor, "huge.bin"),
    # ---- chunks
    unit("unknown-codec", set_chunk("/big", 6, "lz4"), "codec"),
    unit("codec-null", set_chunk("/big", 6, None), "codec"),
    unit("file-index-out-of-range", set_chunk("/big", 0, 99), "file"),
    unit("file-index-negative", set_chunk("/big", 0, -1), "file"),
    unit("file-index-bool", set_chunk("/big", 0, True), "file"),
    unit("start-negative", set_chunk("/big", 1, -64), "start"),
    unit("chunk-checksum-not-string", set_chunk("/big", 3, 12345), "checksum"),
    unit("offset-rank", set_chunk("/big", 4, [0]), "rank"),
    unit("chunk-6-fields", edit_body(lambda b: chunk0(b, "/big").pop()), "7 fields"),
    unit("raw-length-mismatch", raw_length_mismatch, "raw size"),
    unit("ranges-overlap-between-tensors", overlapping_tensors, "overlap"),
    unit("chunks-leave-gap", chunk_gap, "cover"),
    unit("chunks-overlap-in-tensor", chunks_overlap_in_tensor, "overlap or leave gaps"),
    # ---- files and paths
    unit("path-dot-prefix", set_file_path(dot_prefix), "plain relative path"),
    unit("path-backslashes", set_file_path(backslashes), "plain relative path"),
    unit("path-double-slash", set_file_path(double_slash), "plain relative path"),
    unit("path-dot-inside", set_file_path(dot_inside), "plain relative path"),
    unit("path-empty", set_file_path(lambda f, r: ""), "plain relative path"),
    unit("path-marker", set_file_path(lambda f, r: ".ckptlib"), "plain relative path"),
    unit("path-tilde", set_file_path(lambda f, r: "~/x.bin"), "plain relative path"),
    unit("file-listed-twice", duplicate_file, "twice"),
    unit("file-entry-short", edit_body(lambda b: b["files"][0].pop()), "path, size"),
    unit("file-size-negative", edit_body(lambda b: b["files"][0].__setitem__(1, -1)), "size"),
    unit("file-size-string", edit_body(lambda b: b["files"][0].__setitem__(1, "9")), "size"),
    unit("file-path-int", edit_body(lambda b: b["files"][0].__setitem__(0, 5)), "path"),
    # the saved structure dropped: it loaded as None (found by fuzz-manifest-structure, "drop tree")
    unit("tree-missing", edit_body(lambda b: b.pop("tree")), "no 'tree'"),
    unit("tree-missing-zstd", edit_body(lambda b: b.pop("tree")), "no 'tree'", compression="zstd"),
    # ---- payload files
    unit("bit-flip-chunk", flip_payload("/big"), "checksum mismatch"),
    unit("bit-flip-chunk-2", flip_payload("/big2"), "checksum mismatch"),
    unit("bit-flip-small-tensor", flip_payload("/small"), "checksum mismatch"),
    unit("bit-flip-zstd", flip_payload("/big"), "checksum mismatch", compression="zstd"),
    unit("bit-flip-small-zstd", flip_payload("/small"), "checksum mismatch", compression="zstd"),
    unit("payload-size-recorded-larger", manifest_size_edit(+1), "size"),
    unit("payload-size-recorded-smaller", manifest_size_edit(-1), "past the end|size"),
    unit("payload-and-manifest-truncated", truncate_payload_and_manifest, "past the end"),
    unit("payload-symlink", symlink_payload, "symlink"),
    unit("payload-dir-symlink", symlink_payload_dir, "symlink"),
    unit("payload-fifo", fifo_payload, "regular file"),
    unit("payload-directory", directory_payload, "regular file"),
    # ---- the manifest file itself
    unit("manifest-symlink", symlink_manifest, "symlink"),
    unit("manifest-fifo", fifo_manifest, "regular file"),
    unit("manifest-directory", directory_manifest, "regular file"),
    unit("folder-missing", lambda f: shutil.rmtree(f), "no checkpoint|no manifest", error=ckptlib.CheckpointNotFoundError),
    # ---- zstd
    unit("zstd-claims-more", big_as_stored(zstd_frame(bytes(RAW_CLAIM + 512), declared=RAW_CLAIM + 512)), "declares"),
    unit("zstd-expands-more", big_as_stored(zstd_frame(bytes(RAW_CLAIM + 512), declared=None)), "expands past"),
    unit("zstd-expands-less", big_as_stored(zstd_frame(bytes(100), declared=None)), "expands to 100"),
    unit("zstd-claims-less-raw", big_as_stored(zstd_frame(bytes(100), declared=100)), "declares|expands"),
    unit("zstd-garbage-raw", big_as_stored(b"\x28\xb5\x2f\xfd" + bytes(random_tensor((200,), torch.uint8, 6).tolist())), "zstd"),
    unit("zstd-no-magic", big_as_stored(b"not zstd at all" * 10), "zstd"),
    unit("zstd-bomb-declared", big_as_stored(lambda: zstd_bomb(1 << 30, declared=True)), "declares"),
    unit("zstd-bomb", big_as_stored(lambda: zstd_bomb(1 << 30, declared=False)), "expands past"),
    # ---- packs
    unit("pack-piece-past-end", pack_edit(piece_past_pack), "past the end"),
    unit("pack-raw-length", pack_edit(pack_bad_raw_length), "length"),
    unit("pack-codec", pack_edit(pack_codec), "codec"),
    unit("pack-index", pack_edit(pack_index), "pack"),
    unit("pack-overlaps-chunk", pack_edit(pack_over_chunk), "overlap"),
    unit("pack-zstd-bomb", pack_bomb, "expands past"),
    unit("pack-overlap-table-and-dict-form", pack_edit(pack_overlap_across_forms), "overlap"),
    # ---- the packed table
    unit("table-not-object", set_body_field(TABLE_KEY, [["/small", "float32", 1, 16, 0, 0]]), "packed_tensors must be an object"),
    unit("table-string", set_body_field(TABLE_KEY, "rows"), "packed_tensors must be an object"),
    unit("table-null", set_body_field(TABLE_KEY, None), "packed_tensors must be an object"),
    unit("table-missing", edit_body(lambda b: b.pop(TABLE_KEY)), "names no tensor", tree=True),
    unit("table-row-dropped", table_edit(lambda t, b: drop_row(b, "/small2")), "names no tensor", tree=True),
    unit("table-column-missing", table_edit(lambda t, b: t.pop("ndim")), "exactly the columns"),
    unit("table-column-extra", table_edit(lambda t, b: t.__setitem__("checksum", ["0"] * 3)), "exactly the columns"),
    unit("table-column-renamed", table_edit(lambda t, b: t.__setitem__("Name", t.pop("name"))), "exactly the columns"),
    unit("table-column-longer", table_edit(lambda t, b: t["pack"].append(0)), "different lengths"),
    unit("table-column-shorter", table_edit(lambda t, b: t["offset"].pop()), "different lengths"),
    unit("table-name-column-longer", table_edit(lambda t, b: t["name"].append("/extra")), "different lengths"),
    unit("table-dtype-column-shorter", table_edit(lambda t, b: t["dtype"].pop()), "different lengths"),
    unit("table-dims-longer-than-ndim", table_edit(lambda t, b: t["dims"].append(1)), "dims holds 5 values, ndim adds up to 4"),
    unit("table-ndim-short", set_cell("ndim", 1, 1), "dims holds 4 values, ndim adds up to 3"),
    unit("table-row-without-dims", table_edit(extra_row_without_dims), "dims holds 4 values, ndim adds up to 5"),
    # same sum(ndim), rows regrouped: /small becomes [16, 4] (256 bytes) over /small2's bytes
    unit("table-ndim-65", set_cell("ndim", 0, 65), r"ndim holds an integer outside \[0, 64\]"),
    unit("table-ndim-negative", set_cell("ndim", 0, -1), r"ndim holds an integer outside"),
    unit("table-pack-bool-row0", set_cell("pack", 0, True), "pack must be a list of integers"),
    unit("table-ndim-bool", set_cell("ndim", 2, False), "ndim must be a list of integers"),
    unit("table-dims-bool", set_cell("dims", 0, True), "dims must be a list of integers"),
    unit("table-offset-float", set_cell("offset", 0, 0.0), "offset must be a list of integers"),
    unit("table-dims-float", set_cell("dims", 0, 16.0), "dims must be a list of integers"),
    unit("table-ndim-string", set_cell("ndim", 0, "1"), "ndim must be a list of integers"),
    unit("table-pack-string", set_cell("pack", 0, "0"), "pack must be a list of integers"),
    unit("table-dims-null", set_cell("dims", 3, None), "dims must be a list of integers"),
    unit("table-offset-list", set_cell("offset", 1, [64]), "offset must be a list of integers"),
    unit("table-offset-not-list", set_column("offset", 0), "offset must be a list of integers"),
    unit("table-dims-object", set_column("dims", {"0": 16}), "dims must be a list of integers"),
    unit("table-dims-2**64", set_cell("dims", 0, 2**64), "dims holds an integer outside"),
    unit("table-dims-2**63", set_cell("dims", 0, 2**63), "dims holds an integer outside"),
    unit("table-dims-10**40", set_cell("dims", 0, 10**40), "dims holds an integer outside"),
    unit("table-dims-below-int64", set_cell("dims", 0, -(2**63) - 1), "dims holds an integer outside"),
    unit("table-dims-2**62+1", set_cell("dims", 0, 2**62 + 1), "dims holds an integer outside"),
    unit("table-offset-2**64", set_cell("offset", 0, 2**64), "offset holds an integer outside"),
    unit("table-pack-2**70", set_cell("pack", 0, 2**70), "pack holds an integer outside"),
    unit("table-dim-zero", set_cell("dims", 0, 0), r"dims holds an integer outside \[1, "),
    unit("table-dim-negative", set_cell("dims", 3, -1), "dims holds an integer outside"),
    unit("table-row-2**62-elements", set_cell("dims", 0, 2**62), "/small.*declares more than 2\\^62 bytes"),
    unit("table-row-2**31-squared", set_row_shape(1, [2**31, 2**31]), "/small2.*declares more than 2\\^62 bytes"),
    unit("table-row-64-dims-of-2", set_row_shape(0, [2] * 64), "/small.*declares more than 2\\^62 bytes"),
    unit("table-row-2**63-elements", set_row_shape(0, [2**21] * 3), "/small.*declares more than 2\\^62 bytes"),
    # exactly 2^62 bytes passes the size bound and must still fit in its pack
    unit("table-row-2**62-bytes", set_row_shape(2, [2**62]), "/blob.*ends past the end of pack 0"),
    unit("table-offset-at-pack-end", set_cell("offset", 2, 5216), "/blob.*ends past the end of pack 0"),
    unit("table-offset-1-past", set_cell("offset", 2, 97), "/blob.*ends past the end of pack 0"),
    unit("table-offset-2**62", set_cell("offset", 0, 2**62), "/small.*ends past the end of pack 0"),
    unit("table-offset-negative", set_cell("offset", 0, -1), "offset holds an integer outside"),
    unit("table-pack-index-1", set_cell("pack", 1, 1), r"pack holds an integer outside \[0, 0\]"),
    unit("table-pack-index-7", set_cell("pack", 0, 7), r"pack holds an integer outside \[0, 0\]"),
    unit("table-pack-negative", set_cell("pack", 0, -1), "pack holds an integer outside"),
    unit("table-no-packs", edit_body(lambda b: b.__setitem__("packs", [])), r"pack holds an integer outside \[0, -1\]"),
    unit("table-name-duplicate", set_cell("name", 1, "/small"), "a tensor name is listed twice"),
    unit("table-name-also-in-tensors", set_cell("name", 0, "/big"), "'/big' is listed twice"),
    unit("table-row-also-dict-form", table_edit(row_also_in_tensors), "'/small' is listed twice"),
    unit("table-name-int", set_cell("name", 0, 5), "name must be a list of strings"),
    unit("table-name-null", set_cell("name", 0, None), "name must be a list of strings"),
    unit("table-name-list", set_cell("name", 0, ["/small"]), "name must be a list of strings"),
    unit("table-name-too-long", set_cell("name", 0, "/" + "x" * 5000), "at most 4096 characters"),
    unit("table-name-not-list", set_column("name", "/small"), "name must be a list of strings"),
    unit("table-dtype-float128", set_cell("dtype", 0, "float128"), "'float128' is not in the dtype allowlist"),
    unit("table-dtype-prefixed", set_cell("dtype", 1, "torch.bfloat16"), "not in the dtype allowlist"),
    unit("table-dtype-object", set_cell("dtype", 0, {"float32": 1}), "not in the dtype allowlist"),
    unit("table-dtype-null", set_cell("dtype", 2, None), "None is not in the dtype allowlist"),
    unit("table-dtype-int", set_cell("dtype", 2, 1), "not in the dtype allowlist"),
    unit("table-dtype-not-list", set_column("dtype", "float32"), "not in the dtype allowlist"),
    # a wider dtype makes a row run over its neighbour or off the pack
    unit("table-dtype-wider-overlaps", set_cell("dtype", 1, "float32"), "pack 0: members '/small2' and '/blob' overlap"),
    unit("table-dtype-wider-past-end", set_cell("dtype", 2, "int64"), "/blob.*ends past the end of pack 0"),
    unit("table-rows-overlap", table_edit(lambda t, b: t["offset"].__setitem__(1, 0)), "pack 0: members '/small' and '/small2' overlap"),
]


# --------------------------------------------------------------------------- format v2 index files
# The "v2" template is the raw template's state saved in format v2 (its piece index at the end
# of its payload file); "v2file" is the same with the index moved into a file of its own (a tier
# save's layout). Tampering with an index recomputes its checksum and the manifest's record of it
# (size, checksum, counts; the payload file's size for the tail layout) unless the entry is about
# exactly that, so the validation behind has to act.


def v2_write(ck: Path, body: dict[str, Any]) -> None:
    write_body(ck, body, format_version=2)


def v2_edit_body(fn: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def tamper(ck: Path) -> None:
        body = body_of(ck)
        fn(body)
        v2_write(ck, body)

    return tamper


def v2_index_path(ck: Path, body: dict[str, Any]) -> Path:
    """The file holding rank 0's piece index: its payload file (the index at its end, the
    default layout) or an index file of its own (template ``v2file``)."""
    return ck / body["indexes"][0][0]


def v2_tail(body: dict[str, Any]) -> bool:
    """The index lies at the end of a payload file (``IndexRef.tail``)."""
    return body["indexes"][0][0] in {p for p, _ in body["files"]}


def v2_index_bytes(ck: Path, body: dict[str, Any]) -> bytes:
    data = v2_index_path(ck, body).read_bytes()
    return data[len(data) - body["indexes"][0][1]:] if v2_tail(body) else data


def v2_put_index(ck: Path, body: dict[str, Any], data: bytes) -> int:
    """Replace the index bytes (for the tail layout: the file's bytes after its payload);
    returns the file's new size."""
    path = v2_index_path(ck, body)
    head = b""
    if v2_tail(body):
        whole = path.read_bytes()
        head = whole[: len(whole) - body["indexes"][0][1]]
    path.write_bytes(head + data)
    return len(head) + len(data)


def v2_columns(data: bytes, counts: list[int]) -> dict[str, Any]:
    """An index file's columns as numpy arrays (the layout of ``format/index_file.py``)."""
    import numpy as np

    from ckptlib.format.index_file import COUNTS, MAGIC, SCHEMA

    c = dict(zip(COUNTS, counts, strict=True))
    cols, pos = {}, len(MAGIC)
    for name, dt, spec in SCHEMA:
        n = 2 * c[spec[2:]] if spec.startswith("2*") else c[spec]
        cols[name] = np.frombuffer(data, dtype=dt, count=n, offset=pos).copy()
        pos += cols[name].nbytes
    return cols


def v2_index_edit(fn: Callable[[dict[str, Any]], Any], *, keep_record: bool = False) -> Callable[[Path], str]:
    """Edit the index file's columns (``fn`` may replace arrays, changing their lengths: the
    counts follow), write it, and record its new size/checksum/counts in the manifest."""

    def tamper(ck: Path) -> str:
        from ckptlib.format.index_file import COUNTS, MAGIC, SCHEMA

        body = body_of(ck)
        entry = body["indexes"][0]
        path = v2_index_path(ck, body)
        cols = v2_columns(v2_index_bytes(ck, body), entry[6])
        fn(cols)
        counts = {"names": len(cols["name_end"]), "name_bytes": len(cols["name_bytes"]),
                  "chunks": len(cols["chunk_start"]), "chunk_dims": len(cols["chunk_box"]) // 2,
                  "packs": len(cols["pack_start"]), "members": len(cols["member_offset"]),
                  "member_dims": len(cols["member_box"]) // 2}
        data = MAGIC + b"".join(cols[n].astype(dt).tobytes() for n, dt, _ in SCHEMA)
        size = v2_put_index(ck, body, data)
        if not keep_record:
            for f in body["files"]:  # the tail layout: the payload file's size follows
                if f[0] == entry[0]:
                    f[1] = size
            entry[1], entry[2], entry[6] = len(data), checksum(data), [counts[k] for k in COUNTS]
            v2_write(ck, body)
        return path.name

    return tamper


def v2_raw_index(fn: Callable[[bytes], bytes], *, fix_checksum: bool = True) -> Callable[[Path], str]:
    """Replace the index file's bytes; the manifest keeps its size (and, unless
    ``fix_checksum``, its checksum), so the size or checksum check must refuse it."""

    def tamper(ck: Path) -> str:
        body = body_of(ck)
        path = v2_index_path(ck, body)
        data = fn(v2_index_bytes(ck, body))
        v2_put_index(ck, body, data)
        if fix_checksum and len(data) == body["indexes"][0][1]:
            body["indexes"][0][2] = checksum(data)
            v2_write(ck, body)
        return path.name

    return tamper


def _set(name: str, i: int, value: int) -> Callable[[dict[str, Any]], None]:
    def edit(cols: dict[str, Any]) -> None:
        cols[name][i] = value

    return edit


def _dup_first_chunk(cols: dict[str, Any]) -> None:
    """A second chunk record over the first one's bytes and box (overlapping pieces)."""
    import numpy as np

    nd = int(cols["chunk_ndim"][0])
    for name in ("chunk_start", "chunk_length", "chunk_checksum", "chunk_tensor", "chunk_file", "chunk_codec",
                 "chunk_ndim"):
        cols[name] = np.concatenate((cols[name], cols[name][:1]))
    cols["chunk_box"] = np.concatenate((cols["chunk_box"], cols["chunk_box"][: 2 * nd]))


def _split_overlapping(cols: dict[str, Any]) -> None:
    """Chunk 0 cut in two records over disjoint halves of its bytes whose boxes overlap (rows
    0-31 and 16-47 of a 64-row chunk): byte ranges are fine, the boxes do not tile the tensor."""
    import numpy as np

    nd = int(cols["chunk_ndim"][0])
    start, length = int(cols["chunk_start"][0]), int(cols["chunk_length"][0])
    rows = int(cols["chunk_box"][nd])
    half = length // 2
    box = cols["chunk_box"][: 2 * nd].copy()
    box[nd] = rows // 2
    second = box.copy()
    second[0] = rows // 4
    for name in ("chunk_checksum", "chunk_tensor", "chunk_file", "chunk_codec", "chunk_ndim"):
        cols[name] = np.concatenate((cols[name][:1], cols[name]))
    cols["chunk_start"] = np.concatenate(([start, start + half], cols["chunk_start"][1:]))
    cols["chunk_length"] = np.concatenate(([half, half], cols["chunk_length"][1:]))
    cols["chunk_box"] = np.concatenate((box, second, cols["chunk_box"][2 * nd :]))


def _split_grid(body: dict[str, Any]) -> None:
    """A grid whose cells the ranks cannot hold: two cells of /big on a one-rank save."""
    t = body["tensors"]["/big"]
    t["grid"] = [32, 1024]
    t["ranks"] = [0, 1]


def _overlapping_boxes(body: dict[str, Any]) -> None:
    t = body["tensors"]["/big"]
    t.pop("grid"), t.pop("ranks")
    t["boxes"] = [[0, [0, 0], [64, 1024]], [0, [32, 0], [32, 1024]]]


def _gap_boxes(body: dict[str, Any]) -> None:
    t = body["tensors"]["/big"]
    t.pop("grid"), t.pop("ranks")
    t["boxes"] = [[0, [0, 0], [32, 1024]]]


def _two_ranks_one_file(ck: Path) -> None:
    """A second rank whose index row claims rank 0's payload files; its index file, a copy of
    rank 0's index, exists (so that only the claim is wrong)."""
    from ckptlib.format.layout import index_name

    body = body_of(ck)
    body["world_size"] = 2
    row = list(body["indexes"][0])
    row[0], row[3] = f"{row[0].split('/', 1)[0]}/{index_name(1)}", 1
    (ck / row[0]).write_bytes(v2_index_bytes(ck, body))
    body["indexes"].append(row)
    v2_write(ck, body)


def _v2_entries() -> list[Entry]:
    """Every hostile index twice: at the end of the payload file (the layout a plain save
    writes, template ``v2``) and in a file of its own (a tier save's, template ``v2file``)."""
    return [*_v2_layout_entries("v2", "v2"), *_v2_layout_entries("v2file", "v2file")]


def _v2_layout_entries(prefix: str, template: str) -> list[Entry]:
    def V(name: str, what: str, tamper: Callable[[Path], Any], match: str = "", **kw: Any) -> Entry:
        return Entry(f"{prefix}-{name}", "v2-index", what, tamper, template=template, match=match, **kw)

    huge = 1 << 60
    return [
        V("index-truncated", "index file cut in half (manifest records the full size)",
          v2_raw_index(lambda d: d[: len(d) // 2])),
        V("index-empty", "index file emptied", v2_raw_index(lambda d: b"")),
        V("index-missing", "index file deleted", lambda ck: v2_index_path(ck, body_of(ck)).unlink()),
        V("index-bit-flip", "one bit flipped in the index file (manifest checksum kept)",
          v2_raw_index(lambda d: d[:20] + bytes([d[20] ^ 4]) + d[21:], fix_checksum=False)),
        V("index-bad-magic", "index magic replaced (checksum recomputed)",
          v2_raw_index(lambda d: b"NOTANIDX" + d[8:])),
        V("index-absurd-counts", "manifest counts claim 2^60 chunks",
          v2_edit_body(lambda b: b["indexes"][0][6].__setitem__(2, huge))),
        V("indexes-none", "the manifest lists no index at all (a load once read nothing and returned the tensors' "
          "memory as it was; found by fuzz-manifest-structure)", v2_edit_body(lambda b: b.__setitem__("indexes", []))),
        V("index-files-shared", "a second rank's index row claims rank 0's payload files",
          _two_ranks_one_file),
        V("index-absurd-size", "manifest records a 2^62-byte index with matching counts",
          v2_edit_body(lambda b: b["indexes"][0].__setitem__(1, 1 << 62))),
        V("index-schema-changed", "index_schema lists another column order",
          v2_edit_body(lambda b: b["index_schema"].reverse())),
        V("index-absurd-dim", "a chunk box dimension of 2^60",
          v2_index_edit(lambda c: c["chunk_box"].__setitem__(1 + int(c["chunk_ndim"][0]), huge))),
        V("index-offset-past-file", "a chunk starts past the end of its payload file",
          v2_index_edit(_set("chunk_start", 0, 1 << 40))),
        V("index-pack-past-file", "a pack's length runs past the end of its payload file",
          v2_index_edit(_set("pack_length", 0, 1 << 40))),
        V("index-overlapping-pieces", "a chunk listed twice (same bytes, same box)", v2_index_edit(_dup_first_chunk)),
        V("index-boxes-overlap", "chunk 0 cut into two records whose boxes overlap and leave a gap",
          v2_index_edit(_split_overlapping)),
        V("index-member-past-pack", "a packed piece starts past the end of its pack",
          v2_index_edit(_set("member_offset", 0, 1 << 40))),
        V("index-bad-tensor-ref", "a chunk names tensor 10^6 of a short name table",
          v2_index_edit(_set("chunk_tensor", 0, 1_000_000))),
        V("index-bad-codec", "a chunk codec id of 200", v2_index_edit(_set("chunk_codec", 0, 200))),
        V("index-bad-name-utf8", "a tensor name in the index is not UTF-8",
          v2_index_edit(lambda c: c["name_bytes"].__setitem__(0, 0xFF))),
        V("grid-does-not-tile-ranks", "a grid of two cells on a one-rank save", v2_edit_body(_split_grid)),
        V("boxes-overlap", "explicit boxes that overlap", v2_edit_body(_overlapping_boxes)),
        V("boxes-gap", "explicit boxes that leave half the tensor uncovered", v2_edit_body(_gap_boxes)),
    ]


V2_ENTRIES = _v2_entries()
ENTRIES: list[Entry] = _entries() + UNIT_ENTRIES + V2_ENTRIES
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
        old_env = os.environ.get("CKPTLIB_FORMAT_VERSION")
        os.environ["CKPTLIB_FORMAT_VERSION"] = "2" if name.startswith("v2") else "1"
        try:
            with ckptlib.CheckpointManager(
                root, async_save=False, compression="zstd" if name == "zstd" else None
            ) as m:
                m.save(STEP, base_state(), metadata=METADATA)
        finally:
            if old_env is None:
                os.environ.pop("CKPTLIB_FORMAT_VERSION")
            else:
                os.environ["CKPTLIB_FORMAT_VERSION"] = old_env
        ck = root / STEP_DIR
        body = body_of(ck)
        old = body["save_id"]
        (ck / old).rename(ck / SAVE_ID)
        body["save_id"], body["created"] = SAVE_ID, CREATED
        body["files"] = [[p.replace(old, SAVE_ID, 1), s] for p, s in body["files"]]
        for ix in body.get("indexes", ()):
            ix[0] = ix[0].replace(old, SAVE_ID, 1)
        if name == "v2file":
            _index_to_own_file(ck, body)
        write_body(ck, body, format_version=2 if "indexes" in body else 1)
        marker = ck / ".ckptlib"
        if marker.exists():
            marker.write_text(json.dumps({"save_id": SAVE_ID, "created": CREATED}))
        paths[name] = root
    return paths


def _index_to_own_file(ck: Path, body: dict[str, Any]) -> None:
    """Template ``v2file``: move each index from the end of its payload file into a file of
    its own (``r<rank>-index.bin``), the layout of a tier save and of ckptlib before it."""
    from ckptlib.format.layout import index_name

    assert v2_tail(body), "a plain save writes its index at the end of its payload file"
    for ix in body["indexes"]:
        holder = ck / ix[0]
        whole = holder.read_bytes()
        cut = len(whole) - ix[1]
        holder.write_bytes(whole[:cut])
        for f in body["files"]:
            if f[0] == ix[0]:
                f[1] = cut
        ix[0] = f"{ix[0].rsplit('/', 1)[0]}/{index_name(ix[3])}"  # beside the payload, under the save id
        (ck / ix[0]).write_bytes(whole[cut:])


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
