"""Format v2 in one process: index files, sharding descriptions, grid planning, round trips,
v1 compatibility, and hostile index files (the ``v2-*`` corpus entries, with their messages).

Multi-process v2 saves and resharding loads: tests/distributed/test_v2_reshard.py.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from chaos.corpus import STEP_DIR, V2_ENTRIES, build, make_templates

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.engine.scan import check_step, read_manifest
from ckptlib.errors import CorruptCheckpointError
from ckptlib.format.build import PackMember, WrittenChunk, WrittenPack
from ckptlib.format.checksum import checksum
from ckptlib.format.index_file import build_index, check_counts, decode_index
from ckptlib.format.schema import volume
from ckptlib.format.sharding import Sharding, check_index, decode_sharding
from ckptlib.format.validate import Checker
from ckptlib.plan.assign import PieceDesc
from ckptlib.plan.grid import cell, conform, describe, propose


@pytest.fixture
def v2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTLIB_FORMAT_VERSION", "2")


def state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {"w": torch.randn(300, 200, generator=g), "b": torch.randn(200, generator=g),
                  "e": torch.empty(0, 5), "h": torch.randn(8, 8, generator=g).to(torch.bfloat16)},
        "step": 12, "blob": bytes(range(256)) * 40,
        "rng": ckptlib.PerRank(torch.arange(4)),
    }


def same(a: object, b: object) -> None:
    if isinstance(b, ckptlib.PerRank) and not isinstance(a, ckptlib.PerRank):
        b = b.value  # load() returns this rank's value; the target keeps the wrapper
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, ckptlib.PerRank):
        same(a.value, b)
    else:
        assert a == b


# --------------------------------------------------------------------------- index files


def test_index_file_round_trip() -> None:
    files = [("p/r00000-0.bin", 10_000), ("p/r00000-1.bin", 5_000)]
    written = [
        WrittenChunk("/a", "p/r00000-1.bin", 64, 400, "00000000deadbeef", (10, 0), (10, 10), "raw", "float32"),
        WrittenPack("p/r00000-0.bin", 0, 100, "ffffffffffffffff", "zstd", 1000,
                    [PackMember("/b", "int64", (0,), (5,)), PackMember("/é", "uint8", (), ())], [0, 40]),
        WrittenChunk("/a", "p/r00000-0.bin", 128, 30, "0000000000000001", (0, 0), (10, 10), "zstd-shuffle", "float32"),
    ]
    built = build_index(files, written)
    v = Checker("idx")
    counts = check_counts([built.counts[k] for k in built.counts], len(built.data), v, "idx")
    table = decode_index(built.data, counts, 2, [s for _, s in files], "xxh3_64", v)
    tensors = {"/a": ("float32", (20, 10), Sharding((20, 10), (20, 10), 3, 0)),
               "/b": ("int64", (5,), Sharding((5,), (5,), 3, 0)),
               "/é": ("uint8", (), Sharding((), (), 3, 0))}
    got = check_index(table, 3, 10, 100, tensors, {"float32": 4, "int64": 8, "uint8": 1}, "xxh3_64", v)
    assert [(c.file, c.start, c.length, c.checksum, c.offset, c.shape, c.codec) for c in got.chunks["/a"]] == [
        (11, 64, 400, "00000000deadbeef", (10, 0), (10, 10), "raw"),
        (10, 128, 30, "0000000000000001", (0, 0), (10, 10), "zstd-shuffle"),
    ]
    assert [(p.file, p.start, p.length, p.checksum, p.codec, p.raw_length) for p in got.packs] == [
        (10, 0, 100, "ffffffffffffffff", "zstd", 1000)]
    assert [(p.pack, p.raw_offset, p.offset, p.shape) for p in got.pieces["/b"] + got.pieces["/é"]] == [
        (100, 0, (0,), (5,)), (100, 40, (), ())]
    with pytest.raises(CorruptCheckpointError, match="no part of the tensor"):  # rank 4 holds nothing
        check_index(table, 4, 10, 100, tensors, {"float32": 4, "int64": 8, "uint8": 1}, "xxh3_64", v)


def test_absurd_counts_are_refused_before_any_allocation() -> None:
    v = Checker("idx")
    t = time.perf_counter()
    for counts in ([1 << 62] * 7, [0, 0, 1 << 40, 0, 0, 0, 0], [0, 0, 1, 100, 0, 0, 0], [-1] * 7, ["1"] * 7, [1] * 6):
        with pytest.raises(CorruptCheckpointError):
            check_counts(counts, 8 + 8 * 3 + 3, v, "idx")
    assert time.perf_counter() - t < 5  # no work proportional to the claimed counts


# --------------------------------------------------------------------------- sharding


def test_ranks_for_matches_brute_force() -> None:
    rnd = random.Random(3)
    for _ in range(200):
        nd = rnd.randint(1, 3)
        shape = tuple(rnd.randint(1, 9) for _ in range(nd))
        block = tuple(rnd.randint(1, s) for s in shape)
        counts = [-(-s // b) for s, b in zip(shape, block, strict=True)]
        ncells = volume(counts)
        first, step = rnd.randint(0, 3), rnd.randint(1, 2)
        sh = decode_sharding("t", {"grid": list(block), "ranks": [first, step]}, shape, first + ncells * step,
                             Checker("m"))
        off = tuple(rnd.randint(0, s - 1) for s in shape)
        box = tuple(rnd.randint(1, s - o) for s, o in zip(shape, off, strict=True))
        want = set()
        for k in range(ncells):
            co, cs = sh.cell_box(k)
            assert cell(k, shape, block) == (co, cs)
            if all(a < o + n and o < a + m for a, m, o, n in zip(co, cs, off, box, strict=True)):
                want.add(first + k * step)
            assert sh.rank_boxes(first + k * step) == [(co, cs)]
        assert sh.ranks_for(off, box) == want


def test_sharding_refuses_grids_the_ranks_cannot_hold() -> None:
    v = Checker("m")
    for t, world, match in [
        ({"grid": [5, 10], "ranks": [0, 1]}, 1, "more than the saving ranks"),
        ({"grid": [5, 10], "ranks": [0, 0]}, 4, "one cell"),
        ({"grid": [0, 10], "ranks": [0, 1]}, 4, "at least 1"),
        ({"grid": [10], "ranks": [0, 1]}, 4, "at least 1"),
        ({"grid": [10, 10], "ranks": [4, 1]}, 4, "first rank"),
        ({"boxes": [[0, [0, 0], [10, 5]], [1, [0, 4], [10, 6]]]}, 2, "exactly once"),
        ({"boxes": [[0, [0, 0], [10, 11]]]}, 1, "outside"),
        ({"boxes": []}, 1, "no boxes"),
    ]:
        with pytest.raises(CorruptCheckpointError, match=match):
            decode_sharding("t", t, (10, 10), world, v)


# --------------------------------------------------------------------------- grid planning


def _fsdp(world: int, rows: int, name: str = "w", cols: int = 4) -> list[list[PieceDesc]]:
    """torch.chunk-style dim-0 sharding (a grid): rank r holds rows [r*b, (r+1)*b)."""
    b = -(-rows // world)
    out = []
    for r in range(world):
        lo, hi = min(r * b, rows), min((r + 1) * b, rows)
        out.append([PieceDesc(name, (lo, 0), (hi - lo, cols), (hi - lo) * cols * 4, "float32", (rows, cols))]
                   if hi > lo else [])
    return out


def test_grid_plan_sends_no_pieces_for_grids_and_boxes_for_the_rest() -> None:
    world = 4
    grid = _fsdp(world, 10)  # blocks of 3: 3,3,3,1
    uneven = []  # 10 rows split 3,3,2,2: not a grid of rank 0's block
    for lo, n in [(0, 3), (3, 3), (6, 2), (8, 2)]:
        uneven.append([PieceDesc("u", (lo,), (n,), n * 4, "float32", (10,))])
    small = _fsdp(world, 2, "s")  # two cells: ranks 2 and 3 hold nothing
    mine = [grid[r] + uneven[r] + small[r] for r in range(world)]
    proposal = propose(mine[0])
    assert {p[0] for p in proposal} == {"w", "u", "s"}
    odd = [conform(proposal, mine[r], r) for r in range(world)]
    assert odd == [[], [], ["u"], ["u"]]  # rank 1's [3, 6) is cell 1 of blocks of 3; [6, 8) is not
    union = set().union(*odd)
    assert union == {"u"}
    explicit = [(r, p) for r in range(world) for p in mine[r] if p.name in union]
    rep = [PieceDesc("plain", (0, 0), (2, 2), 16, "float32", (2, 2))]
    layout = describe(proposal, union, rep, [2], explicit)
    assert layout["w"] == {"dtype": "float32", "shape": [10, 4], "grid": [3, 4], "ranks": [0, 1]}
    assert layout["s"]["grid"] == [1, 4]
    assert layout["plain"] == {"dtype": "float32", "shape": [2, 2], "grid": [2, 2], "ranks": [2, 0]}
    assert layout["u"]["boxes"] == [[0, [0], [3]], [1, [3], [3]], [2, [6], [2]], [3, [8], [2]]]
    for name, t in layout.items():  # every description is valid and tiles
        decode_sharding(name, t, tuple(t["shape"]), world, Checker("m"))


def test_conform_catches_a_rank_whose_piece_is_not_its_cell() -> None:
    mine = _fsdp(3, 9)
    proposal = propose(mine[0])
    swapped = [mine[0], mine[2], mine[1]]  # ranks 1 and 2 hold each other's cells
    assert [conform(proposal, swapped[r], r) for r in range(3)] == [[], ["w"], ["w"]]
    extra = mine[1] + [PieceDesc("w", (0, 0), (3, 4), 48, "float32", (9, 4))]  # a replica of cell 0
    assert conform(proposal, extra, 1) == ["w"]
    empty = [PieceDesc("w", (9, 0), (0, 4), 0, "float32", (9, 4))]  # torch.chunk's empty trailing shard
    assert conform(proposal, empty, 3) == [] and conform(proposal, empty, 2) == ["w"]


# --------------------------------------------------------------------------- round trips


def test_v2_round_trip_one_process(tmp_path: Path, v2: None) -> None:
    s = state()
    for comp in (None, "zstd"):
        ck = tmp_path / f"ck-{comp}"
        ckptlib.save(s, ck, compression=comp)
        doc = json.loads((ck / "manifest.json").read_bytes())
        assert doc["format_version"] == 2 and len(doc["body"]["indexes"]) == 1
        assert "chunks" not in json.dumps(doc["body"]["tensors"])  # no piece records in the manifest
        same(ckptlib.load(ck), s)
        target = {"model": {k: torch.zeros_like(v) for k, v in s["model"].items()}, "step": 0, "blob": b"",
                  "rng": ckptlib.PerRank(torch.zeros(4, dtype=torch.int64))}
        ckptlib.load(ck, into=target)
        same(target, s)
        with ckptlib.open(ck) as view:
            assert torch.equal(view.read("/model/w", (slice(5, 9), slice(100, 110))), s["model"]["w"][5:9, 100:110])
        assert check_step(open_storage(str(tmp_path)), ck.name, deep=True).status == "committed"


def test_manager_restores_v2_and_v1_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = state()
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        monkeypatch.setenv("CKPTLIB_FORMAT_VERSION", "1")
        mgr.save(1, s)
        monkeypatch.setenv("CKPTLIB_FORMAT_VERSION", "2")
        mgr.save(2, s)
    versions = [json.loads((tmp_path / f"step-{i:012d}" / "manifest.json").read_bytes())["format_version"]
                for i in (1, 2)]
    assert versions == [1, 2]
    for step in (1, 2):
        target = {"model": {k: torch.zeros_like(v) for k, v in s["model"].items()}, "step": 0, "blob": b"",
                  "rng": ckptlib.PerRank(torch.zeros(4, dtype=torch.int64))}
        with ckptlib.CheckpointManager(tmp_path) as mgr:
            assert mgr.restore(target, step=step) == step
        same(target, s)


def test_load_reads_index_files_only_when_pieces_are_needed(tmp_path: Path, v2: None) -> None:
    from ckptlib.engine.load import load_checkpoint

    ckptlib.save({"x": 1, "w": torch.ones(3)}, tmp_path / "ck")
    storage = open_storage(str(tmp_path))
    m = read_manifest(storage, "ck", pieces=False)
    assert not m.complete and m.tensors["/w"].chunks == [] and m.tensors["/w"].pieces == []
    stats: dict[str, int] = {}
    out = load_checkpoint(storage, "ck", stats=stats)
    assert stats["index_files_read"] == 1 and torch.equal(out["w"], torch.ones(3))
    stats = {}
    assert load_checkpoint(storage, "ck", manifest=read_manifest(storage, "ck"), stats=stats)["x"] == 1
    assert stats["index_files_read"] == 0  # already loaded with the manifest


def test_format_version_option() -> None:
    from ckptlib.engine.save import SaveOptions

    assert SaveOptions().writes_v2(4) and not SaveOptions().writes_v2(1)
    assert SaveOptions(format_version=2).writes_v2(1) and not SaveOptions(format_version=1).writes_v2(8)
    with pytest.raises(ValueError, match="format_version"):
        SaveOptions(format_version=3)


# --------------------------------------------------------------------------- hostile index files

_MESSAGES = {
    "index-truncated": "size is 179 bytes, manifest records 359",
    "index-empty": "size is 0 bytes",
    "index-missing": "missing",
    "index-bit-flip": "index file checksum mismatch",
    "index-bad-magic": "bad magic",
    "index-absurd-counts": "counts describe",
    "indexes-none": "held by rank 0, which has no index file",
    "index-files-shared": "each payload file belongs to one rank",
    "index-absurd-size": "over the 268435456 byte limit",
    "index-schema-changed": "index_schema",
    "index-absurd-dim": "lies outside the tensor's shape",
    "index-offset-past-file": "ends past the end of payload file",
    "index-pack-past-file": "ends past the end of payload file",
    "index-overlapping-pieces": "overlap",
    "index-boxes-overlap": "overlap or leave gaps",
    "index-member-past-pack": "ends past its pack",
    "index-bad-tensor-ref": "chunk tensor out of range",
    "index-bad-codec": "chunk codec out of range",
    "index-bad-name-utf8": "not valid UTF-8",
    "grid-does-not-tile-ranks": "more than the saving ranks",
    "boxes-overlap": "exactly once",
    "boxes-gap": "exactly once",
}
MESSAGES = {f"v2file-{k}": v for k, v in _MESSAGES.items()}  # the index in a file of its own
MESSAGES.update({f"v2-{k}": v for k, v in _MESSAGES.items()})  # at the end of its payload file (the default)
MESSAGES.update({  # ... where a torn or missing index is a torn or missing payload file
    "v2-index-truncated": "payload file size is 529715 bytes, manifest records 529895",
    "v2-index-empty": "payload file size is 529536 bytes, manifest records 529895",
    "v2-index-missing": "payload file is missing",
    "v2-index-bit-flip": r"index \(the last 359 bytes of the payload file\) checksum mismatch",
})


@pytest.fixture(scope="module")
def v2_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("v2-corpus")
    templates = make_templates(out / "templates")
    return {e.name: build(e, out, templates) for e in V2_ENTRIES}


def test_every_v2_entry_has_its_message() -> None:
    assert {e.name for e in V2_ENTRIES} == set(MESSAGES)


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_hostile_index_is_refused_with_a_typed_error(v2_corpus: dict[str, Path], name: str) -> None:
    ck = v2_corpus[name] / STEP_DIR
    t = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match=MESSAGES[name]):
        ckptlib.load(ck)
    info = check_step(open_storage(str(v2_corpus[name])), STEP_DIR, deep=True)
    assert info.status == "corrupt", info
    assert time.perf_counter() - t < 20


def test_random_index_bytes_never_escape_as_foreign_errors(v2_corpus: dict[str, Path], tmp_path: Path) -> None:
    """Fuzz: random byte edits of a valid index file, checksum and size re-recorded so that the
    parser itself must refuse or accept them; only ckptlib errors (or exact data) come out."""
    import shutil

    from chaos.corpus import body_of, v2_index_bytes, v2_put_index, v2_write

    templates = v2_corpus["v2-boxes-gap"].parent / "templates"
    rnd = random.Random(11)
    for i in range(80):  # the index at the end of its payload file, then in a file of its own
        base = templates / ("v2" if i % 2 else "v2file") / STEP_DIR
        want = ckptlib.load(base)
        ck = tmp_path / f"f{i}"
        shutil.copytree(base, ck)
        body = body_of(ck)
        data = bytearray(v2_index_bytes(ck, body))
        for _ in range(rnd.randint(1, 4)):
            data[rnd.randrange(8, len(data))] = rnd.randrange(256)
        v2_put_index(ck, body, bytes(data))
        body["indexes"][0][2] = checksum(bytes(data))
        v2_write(ck, body)
        try:
            got = ckptlib.load(ck)
        except ckptlib.CheckpointError:
            continue
        for k, v in want.items():  # accepted only if the edit did not change what is read
            if isinstance(v, torch.Tensor):
                assert torch.equal(got[k], v), k
            else:
                assert got[k] == v


def test_cells_itertools_sanity() -> None:
    """The row-major cell order used by the writer's plan and by the reader's sharding agree."""
    shape, block = (7, 5, 3), (2, 2, 3)
    sh = Sharding(shape, block, 0, 1)
    boxes = [cell(k, shape, block) for k in range(volume(sh.counts))]
    assert boxes == [sh.cell_box(k) for k in range(len(boxes))]
    covered = np.zeros(shape, dtype=int)
    for off, box in boxes:
        covered[tuple(slice(o, o + n) for o, n in zip(off, box, strict=True))] += 1
    assert (covered == 1).all() and len(list(itertools.product(*map(range, sh.counts)))) == len(boxes)


def test_tree_digests_merge_like_the_full_merge() -> None:
    """v2 saves gather a skeleton digest and the PerRank values, not every rank's tree: the
    result equals the full merge, and a plain value that differs is still refused."""
    from ckptlib.format import jsonio
    from ckptlib.plan import trees
    from ckptlib.plan.flatten import flatten

    def tree_of(rank: int, lr: float = 0.5) -> object:
        st = {"m": {"w": torch.zeros(2)}, "lr": lr, 3: (1, "x"), "rng": ckptlib.PerRank({"seed": rank, "b": b"q"}),
              "deep": [ckptlib.PerRank(rank * 10)]}
        return flatten(st, rank).tree

    def digest(skel: object) -> str:
        return jsonio.dumps(skel, sort_keys=False)

    parts = [trees.split(tree_of(r)) for r in range(3)]
    joined = trees.join(parts[0][0], [digest(s) for s, _ in parts], [v for _, v in parts])
    assert joined == trees.merge([tree_of(r) for r in range(3)])
    bad = [trees.split(tree_of(r, lr=0.5 if r != 2 else 0.25)) for r in range(3)]
    with pytest.raises(trees.TreeMismatch, match=r"rank 2's state differs .* ckptlib\.PerRank"):
        trees.join(bad[0][0], [digest(s) for s, _ in bad], [v for _, v in bad])
