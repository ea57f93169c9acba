"""Property-based fuzzing of manifest and payload decoding (hypothesis, derandomized).

The property: whatever the mutation, ``ckptlib.load`` either raises a ckptlib error
(``CheckpointError``: *rejected*) or returns exactly what the mutated folder's manifest declares
(*loaded*) -- never another exception, never a hang, never silently wrong tensors. Every load
that succeeds is compared, bit for bit, with :func:`chaos.declared.declared`: the same folder
decoded from docs/format.md alone, independently of ckptlib's reader (a shape, dtype or
value-tree edit with a recomputed checksum loads what it declares, and that is checked). Checked
in process on the pytest main thread, with a per-example wall-clock check; some of the mutated
folders are kept and loaded again at the end in a ``load_one.py`` subprocess under the
address-space cap (the memory check). Templates are the corpus's
(``chaos.corpus.make_templates``), so a load is also compared with ``corpus.base_state()``
where the mutation cannot have changed the data.

Each test's record counts its examples as rejected (a typed ckptlib error) or loaded (and equal
to the independent decoding); an example that is neither fails the test and the report.

What else each strategy requires:

- manifest *structure* (values replaced by other JSON values, keys dropped or added, numbers
  made huge, negative or off by one) with a recomputed checksum: an edit in the file layout
  (``files``, ``packs``, ``tensors``, ``checksum_algorithm``) may only load the original
  bytes (a dtype relabelled to one of the same size keeps them). With a stale checksum any
  real change is refused.
- payload bytes (bit flips, truncation, growth, overwrites, spliced zstd frames), with or
  without the manifest's file size updated: the exact original, or an error; and the deep
  check agrees with ``load`` (corrupt exactly when load refuses).
- a chunk replaced by a zstd frame (declared size or not, damaged or not) whose checksum is
  recomputed: an error, or exactly what the frame decodes to.

CI runs :data:`EXAMPLES` examples per test; ``CKPTLIB_CHAOS_FULL=1`` runs :data:`FULL_EXAMPLES`.
"""

from __future__ import annotations

import copy
import json
import os
import re
import resource
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from helpers import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.engine.scan import check_step
from ckptlib.format.checksum import checksum
from ckptlib.format.manifest import TABLE_KEY

from .corpus import (
    AS_LIMIT_MB,
    MANIFEST_NAME,
    SLOW_S,
    STEP,
    STEP_DIR,
    base_state,
    body_of,
    encode_manifest,
    make_templates,
)
from .declared import Undeclared, declared
from .record import Record, recording

pytestmark = [pytest.mark.chaos]

FULL = os.environ.get("CKPTLIB_CHAOS_FULL", "") not in ("", "0")
EXAMPLES = 40
FULL_EXAMPLES = 600
EXAMPLE_LIMIT_S = 10.0
"""Wall-clock seconds one example may take (a load of a 1 MB checkpoint); past it: a hang."""
KEEP_PER_TEST = 12
"""Mutated folders per test kept for the subprocess memory check."""

SETTINGS = settings(
    max_examples=FULL_EXAMPLES if FULL else EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)

LAYOUT_FIELDS = {"files", "packs", "tensors", TABLE_KEY, "checksum_algorithm"}
SAME_SIZE = {
    1: {"uint8", "int8", "bool", "float8_e4m3fn", "float8_e5m2"},
    2: {"float16", "bfloat16", "int16", "uint16"},
    4: {"float32", "int32", "uint32"},
    8: {"float64", "int64", "uint64", "complex64"},
}


HOW_FUZZ = ("every example loaded in process: rejected = `ckptlib.load` raised a `CheckpointError`; loaded = it "
            "returned a state bit for bit equal to the folder decoded from docs/format.md by the test's own "
            "decoder (tests/chaos/declared.py)")
HOW_FUZZ_TIME = "wall time of each example's `ckptlib.load` (time.monotonic())"


class Stats:
    """What one fuzz test saw, for its chaos record: every example is rejected, loaded (and
    checked equal to :func:`declared`), or failed the test."""

    def __init__(self) -> None:
        self.total = 0
        self.rejected = 0
        self.loaded = 0
        self.worst_s = 0.0
        self.outcomes: dict[str, int] = {}

    def saw(self, outcome: str, value: Any, s: float) -> None:
        self.total += 1
        self.worst_s = max(self.worst_s, s)
        key = type(value).__name__ if outcome == "error" else "loaded"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def passed(self, outcome: str) -> None:
        if outcome == "error":
            self.rejected += 1
        else:
            self.loaded += 1

    def record(self, rec: Record) -> None:
        rec.observe(HOW_FUZZ, malicious_total=self.total, malicious_rejected=self.rejected,
                    malicious_loaded=self.loaded)
        rec.observe(HOW_FUZZ_TIME, worst_time_s=round(self.worst_s, 3))
        rec.note = f"in-process; outcomes {self.outcomes}"


def as_declared(value: Any, root: Path, where: str) -> None:
    """A load of ``root``'s step returned ``value``: it must be exactly what the folder declares."""
    try:
        want = declared(root / STEP_DIR)
    except Undeclared as e:
        raise AssertionError(f"{where}: loaded, but the manifest declares no such value ({e})") from None
    assert_same(value, want, f"{where}: loaded, not what the manifest declares")


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_templates(tmp_path_factory.mktemp("fuzz-templates"))


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-kept")


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return base_state()


def flat_bytes(x: Any) -> Any:
    """Tensors as their raw bytes (so a same-size dtype relabel compares equal)."""
    if isinstance(x, torch.Tensor):
        return bytes(x.detach().contiguous().view(-1).view(torch.uint8).numpy())
    if isinstance(x, dict):
        return {k: flat_bytes(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(flat_bytes(v) for v in x)
    return x


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ckptlib-fuzz-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def framing(ck: Path) -> dict[str, Any]:
    """The template's own framing (format v1 or v2) for a rewritten manifest: a v2 body framed as
    v1 would be refused for that alone, whatever the edit."""
    return {"format_version": json.loads((ck / MANIFEST_NAME).read_bytes())["format_version"]}


def fresh_copy(templates: dict[str, Path], which: str, workdir: Path) -> Path:
    root = workdir / f"ex-{time.monotonic_ns()}"
    shutil.copytree(templates[which], root, symlinks=True)
    return root


def attempt(root: Path) -> tuple[str, Any, float]:
    """``ckptlib.load`` of ``root``'s step: ("error", exc, s) or ("ok", value, s)."""
    t0 = time.monotonic()
    try:
        value = ckptlib.load(root / STEP_DIR)
    except ckptlib.CheckpointError as e:
        return "error", e, time.monotonic() - t0
    return "ok", value, time.monotonic() - t0


def keep(root: Path, kept: Path, tag: str, count: list[int]) -> None:
    if count[0] < KEEP_PER_TEST:
        shutil.copytree(root, kept / f"{tag}-{count[0]:03d}", symlinks=True)
        count[0] += 1


# --------------------------------------------------------------------------- strategies

JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "float32",
            "int32",
            "uint8",
            "bfloat16",
            "raw",
            "zstd",
            "zstd-shuffle",
            "/big",
            "/small",
            "../outside.bin",
            "manifest.json",
            "",
            "t",
            "ref",
            "tensor",
            "dict",
            "bytes",
            "per_rank",
        ]
    )
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        node = node[k]
    return node


def number_variants(x: int) -> list[int]:
    return [
        -1,
        0,
        1,
        63,
        64,
        2**31,
        2**32,
        2**62,
        2**62 + 1,
        2**63,
        2**64,
        10**30,
        -(2**63),
        x + 1,
        x - 1,
        x * 2,
        x + 64,
        x // 2,
    ]


@st.composite
def manifest_edits(
    draw: st.DrawFn, body: dict[str, Any], focus: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """1-3 structure-aware edits of ``body``; returns the new body and a log of the edits.
    ``focus``: edit only inside that top-level field (while it exists)."""
    body = copy.deepcopy(body)
    log = []
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(body) if p]
        if focus is not None and any(p[0] == focus for p in paths):
            paths = [p for p in paths if p[0] == focus]
        path = draw(st.sampled_from(paths))
        parent, key = _get(body, path[:-1]), path[-1]
        old = parent[key]
        op = draw(st.sampled_from(["replace", "drop", "add", "number", "number"]))
        if op == "number" and type(old) is int:
            parent[key] = draw(st.sampled_from(number_variants(old)))
        elif op == "drop":
            del parent[key]
        elif op == "add" and isinstance(old, dict):
            old[draw(st.text(max_size=6))] = draw(JSON_VALUE)
        elif op == "add" and isinstance(old, list):
            old.insert(draw(st.integers(0, len(old))), draw(JSON_VALUE))
        else:
            op = "replace"
            parent[key] = draw(JSON_VALUE)
        log.append(f"{op} {'/'.join(map(str, path))}")
    return body, log


_DECLARES = re.compile(
    rf"^(tensors/.*/(shape|dtype)(/|$)|{TABLE_KEY}$|{TABLE_KEY}/(name|dtype|ndim|dims)(/|$))"
)


def layout_only(log: list[str]) -> bool:
    """Every edit touched the file layout (so a successful load must give the original bytes).

    Edits of a tensor's ``shape`` or ``dtype`` are not layout: with a recomputed manifest
    checksum they declare another tensor (e.g. dropping the only dimension of a packed
    ``[4]`` makes a scalar of its first element), which loads as declared. Regression: seed 0,
    ``drop tensors//small2/shape/0`` under ``CKPTLIB_CHAOS_FULL=1``. The same holds for the
    packed table's ``name``, ``dtype``, ``ndim`` and ``dims`` columns (and the table as a
    whole, which a replacement may turn into other rows); ``pack`` and ``offset`` are layout.
    """
    paths = [entry.split(" ", 1)[1] for entry in log]
    return all(p.split("/", 1)[0] in LAYOUT_FIELDS and not _DECLARES.match(p) for p in paths)


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(600)
def test_fuzz_manifest_structure(
    templates: dict[str, Path], kept: Path, expected: dict[str, Any], workdir: Path
) -> None:
    stats, count = Stats(), [0]
    originals = {k: body_of(v / STEP_DIR) for k, v in templates.items()}
    want = flat_bytes(expected)

    @SETTINGS
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        which = data.draw(st.sampled_from(sorted(templates)))
        # one example in three edits only the packed table (its few cells would be rare picks)
        focus = data.draw(st.sampled_from([None, None, TABLE_KEY]))
        body, log = data.draw(manifest_edits(originals[which], focus))
        stale = data.draw(st.sampled_from([False, False, False, True]))
        root = fresh_copy(templates, which, workdir)
        ck = root / STEP_DIR
        old = json.loads((ck / MANIFEST_NAME).read_bytes())["checksum"].split(":")[1]
        new = encode_manifest(body, digest=old if stale else None, **framing(ck))
        changed = new != (ck / MANIFEST_NAME).read_bytes()
        (ck / MANIFEST_NAME).write_bytes(new)
        outcome, value, s = attempt(root)
        stats.saw(outcome, value, s)
        assert s < EXAMPLE_LIMIT_S, f"{log}: load took {s:.1f}s"
        if stale and changed:
            assert outcome == "error", f"{log}: a stale checksum was accepted"
        if outcome == "ok":
            as_declared(value, root, str(log))
            if layout_only(log) or not changed:
                assert flat_bytes(value) == want, f"{log}: loaded different data without an error"
        if outcome == "error" or changed:
            keep(root, kept, "manifest", count)
        shutil.rmtree(root, ignore_errors=True)
        stats.passed(outcome)

    with recording("malicious", "fuzz-manifest-structure", seed=0) as rec:
        try:
            run()
        finally:
            stats.record(rec)


def _relabel_big(body: dict[str, Any]) -> None:
    body["tensors"]["/big"]["dtype"] = "int32"  # float32 -> int32: same size, same bytes


def _reshape_small2(body: dict[str, Any]) -> None:
    table = body[TABLE_KEY]
    i = table["name"].index("/small2")
    at = sum(table["ndim"][:i])
    table["dims"][at : at + 2] = [2, 8]  # [4, 4] -> [2, 8]: same bytes, another shape


def _tree_values(body: dict[str, Any]) -> None:
    for item in body["tree"]["items"]:
        if item[0] == "name":
            item[1] = "a longer name, \u00fcn\u00efc\u00f6d\u00e9"
        elif item[0] == "step":
            item[1] = 2**40 + 1


DECLARATION_EDITS = {
    "dtype-relabel": (_relabel_big, ("raw", "zstd", "v2")),
    "packed-reshape": (_reshape_small2, ("raw", "zstd")),  # v2 keeps shapes in index files
    "tree-values": (_tree_values, ("raw", "zstd", "v2")),
}
HOW_DECLARED = ("a fixed edit that declares other values (with a recomputed manifest checksum) must load, bit for "
                "bit as the test's own decoder (tests/chaos/declared.py) reads the edited folder")


@pytest.mark.parametrize(
    ("edit", "which"), [(e, w) for e, (_, ws) in DECLARATION_EDITS.items() for w in ws],
    ids=[f"{e}-{w}" for e, (_, ws) in DECLARATION_EDITS.items() for w in ws],
)
def test_declaration_edits_load_as_declared(
    templates: dict[str, Path], expected: dict[str, Any], workdir: Path, edit: str, which: str
) -> None:
    """Edits the fuzzing above rarely lands on: with a recomputed checksum a same-size dtype
    relabel, a packed tensor's other shape of the same size, and other plain values in the tree
    are self-consistent declarations (undetectable by design, docs/reliability.md "Limits"): the
    load returns exactly them, never the template's values or a mix."""
    with recording("malicious", f"declared-{edit}-{which}", seed=0) as rec:
        rec.observe(HOW_DECLARED, malicious_total=1)
        root = fresh_copy(templates, which, workdir)
        ck = root / STEP_DIR
        body = body_of(ck)
        DECLARATION_EDITS[edit][0](body)
        (ck / MANIFEST_NAME).write_bytes(encode_manifest(body, **framing(ck)))
        outcome, value, s = attempt(root)
        rec.observe(HOW_FUZZ_TIME, worst_time_s=round(s, 3))
        assert outcome == "ok", f"{edit}: {value!r}"
        as_declared(value, root, edit)
        with pytest.raises(AssertionError):  # the edit took effect: not the template's state
            assert_same(value, expected)
        rec.observe(HOW_DECLARED, malicious_loaded=1)


@st.composite
def payload_edits(draw: st.DrawFn, size: int) -> tuple[str, Any]:
    op = draw(st.sampled_from(["flip", "flip", "truncate", "grow", "overwrite", "zstd"]))
    if op == "flip":
        return op, (draw(st.integers(0, size - 1)), draw(st.integers(0, 7)))
    if op == "truncate":
        return op, draw(st.integers(0, size - 1))
    if op == "grow":
        return op, draw(st.binary(min_size=1, max_size=128))
    if op == "overwrite":
        return op, (draw(st.integers(0, size - 1)), draw(st.binary(min_size=1, max_size=64)))
    frame = zstandard.ZstdCompressor(level=1).compress(draw(st.binary(max_size=4096)))
    return op, (draw(st.integers(0, size - 1)), frame)


@pytest.mark.timeout(600)
def test_fuzz_payload_bytes(
    templates: dict[str, Path], kept: Path, expected: dict[str, Any], workdir: Path
) -> None:
    stats, count = Stats(), [0]
    want = flat_bytes(expected)

    @SETTINGS
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        which = data.draw(st.sampled_from(sorted(templates)))
        root = fresh_copy(templates, which, workdir)
        ck = root / STEP_DIR
        body = body_of(ck)
        path = ck / body["files"][0][0]
        raw = bytearray(path.read_bytes())
        op, arg = data.draw(payload_edits(len(raw)))
        if op == "flip":
            raw[arg[0]] ^= 1 << arg[1]
        elif op == "truncate":
            del raw[arg:]
        elif op == "grow":
            raw += arg
        else:
            at, blob = arg
            raw[at : at + len(blob)] = blob
        path.write_bytes(bytes(raw))
        fix_size = data.draw(st.booleans())
        if fix_size and len(raw) != body["files"][0][1]:
            body["files"][0][1] = len(raw)
            (ck / MANIFEST_NAME).write_bytes(encode_manifest(body, **framing(ck)))
        outcome, value, s = attempt(root)
        info = check_step(open_storage(str(root)), STEP_DIR, STEP, deep=True)
        stats.saw(outcome, value, s)
        where = f"{op} {arg!r:.80} fix_size={fix_size}"
        assert s < EXAMPLE_LIMIT_S, f"{where}: load took {s:.1f}s"
        if outcome == "ok":
            as_declared(value, root, where)
            assert flat_bytes(value) == want, f"{where}: loaded different data without an error"
            assert info.status == "committed", (
                f"{where}: load is fine but the deep check says {info.reason}"
            )
        else:
            assert isinstance(value, ckptlib.CorruptCheckpointError), f"{where}: {value!r}"
            assert info.status == "corrupt", (
                f"{where}: load refused ({value}) but the deep check passed"
            )
            keep(root, kept, "payload", count)
        shutil.rmtree(root, ignore_errors=True)
        stats.passed(outcome)

    with recording("malicious", "fuzz-payload-bytes", seed=0) as rec:
        try:
            run()
        finally:
            stats.record(rec)


@st.composite
def frames(draw: st.DrawFn) -> tuple[bytes, int, str]:
    """A zstd frame (maybe damaged), the raw size the manifest will claim, and a label."""
    raw = draw(st.binary(max_size=2048) | st.integers(0, 1 << 20).map(bytes))
    declared = draw(st.booleans())
    c = zstandard.ZstdCompressor(level=1, write_content_size=declared)
    frame = c.compress(raw)
    damage = draw(st.sampled_from(["none", "none", "flip", "truncate", "append", "concat"]))
    if damage == "flip" and frame:
        i = draw(st.integers(0, len(frame) - 1))
        frame = frame[:i] + bytes([frame[i] ^ (1 << draw(st.integers(0, 7)))]) + frame[i + 1 :]
    elif damage == "truncate":
        frame = frame[: draw(st.integers(0, max(0, len(frame) - 1)))]
    elif damage == "append":
        frame += draw(st.binary(min_size=1, max_size=16))
    elif damage == "concat":
        frame += c.compress(draw(st.binary(max_size=256)))
    claim = draw(st.sampled_from([len(raw), len(raw) + 1, max(0, len(raw) - 1), 0, 4096]))
    if claim == 0:
        claim = 1
    return frame, claim, f"raw={len(raw)} declared={declared} damage={damage} claim={claim}"


def decode_frames(data: bytes) -> bytes | None:
    """Frame by frame, independently of the library's reader: the bytes ``data`` decodes to,
    or None if any frame is damaged or incomplete."""
    out = b""
    try:
        while data:
            d = zstandard.ZstdDecompressor().decompressobj()
            out += d.decompress(data)
            if not d.eof:
                return None
            data = d.unused_data
    except zstandard.ZstdError:
        return None
    return out


@pytest.mark.timeout(600)
def test_fuzz_zstd_frames(templates: dict[str, Path], kept: Path, workdir: Path) -> None:
    stats, count = Stats(), [0]

    @SETTINGS
    @given(fr=frames())
    def run(fr: tuple[bytes, int, str]) -> None:
        frame, claim, label = fr
        root = fresh_copy(templates, "zstd", workdir)
        ck = root / STEP_DIR
        body = body_of(ck)
        rel = body["files"][0][0].rsplit("/", 1)[0] + "/frame.bin"
        (ck / rel).write_bytes(frame)
        body["files"].append([rel, len(frame)])
        body["tensors"]["/big"] = {
            "dtype": "uint8",
            "shape": [claim],
            "chunks": [
                [len(body["files"]) - 1, 0, len(frame), checksum(frame), [0], [claim], "zstd"]
            ],
        }
        (ck / MANIFEST_NAME).write_bytes(encode_manifest(body, **framing(ck)))
        outcome, value, s = attempt(root)
        stats.saw(outcome, value, s)
        assert s < EXAMPLE_LIMIT_S, f"{label}: load took {s:.1f}s"
        if outcome == "ok":
            as_declared(value, root, label)
            truth = decode_frames(frame)
            got = bytes(value["big"].numpy())
            assert truth is not None and got == truth[:claim] and len(truth) == claim, (
                f"{label}: loaded {len(got)} bytes that are not what the frame holds"
            )
        else:
            keep(root, kept, "zstd", count)
        shutil.rmtree(root, ignore_errors=True)
        stats.passed(outcome)

    with recording("malicious", "fuzz-zstd-frames", seed=0) as rec:
        try:
            run()
        finally:
            stats.record(rec)


@pytest.mark.timeout(300)
def test_fuzzed_inputs_under_memory_cap(kept: Path) -> None:
    """The kept mutated folders, loaded again in one load_one.py process under the cap: only
    ckptlib errors (or exact loads), bounded time, peak RSS under the cap."""
    from .test_malicious import HOW_LOADS, HOW_PEAKS, count_loads, run_batch

    roots = sorted(p for p in kept.iterdir() if p.is_dir())
    if not roots:
        pytest.skip("run with the fuzz tests above (they keep the folders this test loads)")
    with recording("malicious", "fuzz-subprocess-batch", seed=0) as rec:
        _, results, problem = run_batch(roots)
        assert not problem, problem
        bad = {}
        for name, r in results.items():
            for op, o in r["ops"].items():
                if o["outcome"] == "error" and not o["ckptlib"]:
                    bad[f"{name}:{op}"] = f"{o['cls']}: {o['msg'][:200]}"
                if o.get("s", 0) > SLOW_S:
                    bad[f"{name}:{op}"] = f"slow: {o['s']}s"
            load = r["ops"]["load"]
            if load["outcome"] == "ok" and not load.get("declared"):
                bad[f"{name}:load"] = f"loaded, not what the manifest declares {load.get('undeclared', '')}"
        rejected, loaded = count_loads(results, set(results) - {k.split(":")[0] for k in bad})
        rec.observe(HOW_LOADS, malicious_total=len(roots), malicious_rejected=rejected, malicious_loaded=loaded)
        rec.observe(HOW_PEAKS, worst_rss_mb=max(r["rss_peak_mb"] for r in results.values()),
                    worst_time_s=max(o["s"] for r in results.values() for o in r["ops"].values()))
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        rec.note = (
            f"AS cap {AS_LIMIT_MB} MB; the in-process fuzzing's pytest process peaked at {own} MB"
        )
        assert not bad, bad
        assert rec.worst_rss_mb < AS_LIMIT_MB
