"""Hugging Face safetensors folders read by ``ckptlib.load`` and ``ckptlib.open``
(ckptlib/format/safetensors.py, ckptlib/engine/safetensors_folder.py).

Folders are written by the safetensors package itself (two shard files + index, without the
index, one file, the Hugging Face cache's symlinked snapshot layout, fsspec URLs) and loaded
bitwise into modules, ``Shard`` targets (only their rows read: counted by the reader) and
views; export to safetensors and import back is bitwise for every dtype; the hostile corpus
(tests/safetensors_corpus.py) raises typed errors and leaves targets untouched. The 2-rank
test is tests/distributed/test_safetensors_ranks.py.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import fsspec
import pytest
import safetensors_corpus as corpus
import torch
from helpers import assert_tensor_equal, random_tensor
from torch import nn

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.engine import load as load_flow
from ckptlib.engine import safetensors_folder
from ckptlib.engine.reader import COALESCE_GAP
from ckptlib.format import safetensors as st_format
from ckptlib.format.dtypes import DTYPES
from ckptlib.read.to_safetensors import export_safetensors

st = pytest.importorskip("safetensors.torch")


class Net(nn.Module):
    def __init__(self, seed: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(64, 16, dtype=dtype)
        self.proj = nn.Linear(16, 32, dtype=dtype)
        self.norm = nn.LayerNorm(32, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()


def write_folder(folder: Path, sd: dict[str, torch.Tensor], files: int = 2, index: bool = True) -> Path:
    """``sd`` as Hugging Face writes it: ``files`` shard files (+ the index)."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(sd)
    per = -(-len(keys) // files)
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {k: sd[k].detach().contiguous() for k in keys[i * per:(i + 1) * per]}
        st.save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    if index:
        (folder / st_format.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def assert_module_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert_tensor_equal(sb[k], sa[k], k)


def test_folder_with_index_loads_into_module_and_new_values(tmp_path: Path) -> None:
    src = Net(0)
    folder = write_folder(tmp_path / "hf", src.state_dict())
    assert sorted(p.name for p in folder.iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", st_format.INDEX_NAME]
    dst = Net(1)
    assert ckptlib.load(folder, into=dst) is dst
    assert_module_equal(src, dst)
    state = {"model": Net(2), "step": 3}
    ckptlib.load(folder, into={"model": state["model"]}, select="model")
    assert_module_equal(src, state["model"])
    fresh = ckptlib.load(folder, select="model")  # key "a.b" -> /model/a.b
    assert list(fresh) == ["model"] and sorted(fresh["model"]) == sorted(src.state_dict())
    for k, v in src.state_dict().items():
        assert_tensor_equal(fresh["model"][k], v, k)
    nested = ckptlib.load(folder, select="/outer/inner")
    assert sorted(nested["outer"]["inner"]) == sorted(src.state_dict())


def test_without_index_and_single_file(tmp_path: Path) -> None:
    src = Net(0)
    three = write_folder(tmp_path / "three", src.state_dict(), files=3, index=False)
    dst = Net(1)
    ckptlib.load(three, into=dst)
    assert_module_equal(src, dst)
    one = write_folder(tmp_path / "one", src.state_dict(), files=1, index=False)
    dst = Net(2)
    ckptlib.load(one / "model-00001-of-00001.safetensors", into=dst)  # one file
    assert_module_equal(src, dst)
    with ckptlib.open(one / "model-00001-of-00001.safetensors") as view:
        assert_tensor_equal(view.read("/proj.weight"), src.proj.weight)


def test_rename_skip_and_strict(tmp_path: Path) -> None:
    src = Net(0)
    hf = {f"transformer.{k}": v for k, v in src.state_dict().items()} | {"lm_head.weight": torch.ones(3)}
    folder = write_folder(tmp_path / "hf", hf)
    dst = Net(1)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ckptlib.StateMismatchError, match=r"keys differ.*transformer\.emb\.weight") as ei:
        ckptlib.load(folder, into=dst)
    assert "lm_head.weight" in str(ei.value)
    for k, v in dst.state_dict().items():  # refused before any byte was read
        assert torch.equal(v, before[k]), k

    def rename(key: str) -> str | None:
        return None if key == "lm_head.weight" else key.removeprefix("transformer.")

    ckptlib.load(folder, into=dst, rename=rename)
    assert_module_equal(src, dst)
    res = ckptlib.load(folder, into=Net(2), rename=lambda k: k.removeprefix("transformer."), strict=False)
    assert res.missing == [] and res.unexpected == ["/lm_head.weight"]
    with pytest.raises(ValueError, match="maps both"):
        ckptlib.load(folder, rename=lambda k: "same")
    with pytest.raises(ValueError, match="must return a str"):
        ckptlib.load(folder, rename=lambda k: 1)  # type: ignore[arg-type, return-value]
    with pytest.raises(ckptlib.StateMismatchError, match=re.escape("checkpoint dtype float32, target dtype torch.bfloat16")):
        ckptlib.load(folder, into=Net(3, torch.bfloat16), rename=rename)
    ckptlib.save({"w": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(ValueError, match="apply to safetensors folders"):
        ckptlib.load(tmp_path / "ck", select="model")


def test_select_loads_the_model_part_of_a_whole_training_state(tmp_path: Path) -> None:
    """API.md: ``ckptlib.load(folder, into=state, select="model")`` with the training state
    (model, optimizer, step): the folder holds only ``/model``, so the rest of the state is
    neither loaded nor missing (strict raised naming /optimizer and /step); keys missing inside
    ``/model`` still raise, and ``strict=False`` reports only those."""
    src = Net(0)
    folder = write_folder(tmp_path / "hf", src.state_dict())
    dst = Net(1)
    opt = torch.optim.Adam(dst.parameters())
    dst.proj(torch.ones(2, 16)).sum().backward()
    opt.step()
    moments = {k: v.clone() for k, v in opt.state[dst.proj.weight].items()}
    state = {"model": dst, "optimizer": opt, "step": 5}
    assert ckptlib.load(folder, into=state, select="model") is state
    assert_module_equal(src, dst)
    assert state["step"] == 5 and all(torch.equal(opt.state[dst.proj.weight][k], v) for k, v in moments.items())
    bigger = {"model": {**Net(2).state_dict(), "extra": torch.zeros(2)}, "optimizer": {}, "step": 5}
    with pytest.raises(ckptlib.StateMismatchError, match="in the target but not in the checkpoint: /model/extra") as ei:
        ckptlib.load(folder, into=bigger, select="model")
    assert "/optimizer" not in str(ei.value) and "/step" not in str(ei.value)
    res = ckptlib.load(folder, into=bigger, select="model", strict=False)
    assert res.missing == ["/model/extra"] and res.unexpected == []
    with pytest.raises(ckptlib.StateMismatchError, match="in the checkpoint but not in the target: /model"):
        ckptlib.load(folder, into={"optimizer": {}}, select="model")


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2, Llama 3.2 1B, Gemma)."""

    def __init__(self, seed: int, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(32, 8)
        self.lm_head = nn.Linear(8, 32, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight


def test_tied_weights_load_strictly_from_the_one_name_hugging_face_writes(tmp_path: Path) -> None:
    """Hugging Face writes a tied weight once (safetensors refuses two names for one storage):
    the folder holds ``embed.weight``, the module's state dict lists ``lm_head.weight`` too.
    strict=True raised "in the target but not in the checkpoint: /lm_head.weight" for every such
    model; the tied name is loaded through its twin, so it is not missing. An untied target's
    lm_head is still missing."""
    src = TiedLM(0)
    folder = write_folder(tmp_path / "hf", {"embed.weight": src.embed.weight}, files=1)
    dst = TiedLM(1)
    assert ckptlib.load(folder, into=dst) is dst
    assert torch.equal(dst.embed.weight, src.embed.weight) and dst.lm_head.weight is dst.embed.weight
    res = ckptlib.load(folder, into=TiedLM(2), strict=False)
    assert res.missing == [] and res.unexpected == []
    with pytest.raises(ckptlib.StateMismatchError, match=re.escape("in the target but not in the checkpoint: /lm_head.weight")):
        ckptlib.load(folder, into=TiedLM(3, tied=False))


ROWS, COLS = 600, 1024  # float32: 4 KiB rows, 2.4 MiB


@pytest.fixture
def rows_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, torch.Tensor]]:
    """Tensors cut into chunks of 256 KiB (64 rows of ``big``; ``wide`` rows of 320 KiB are
    cut along dimension 1), written as two files."""
    monkeypatch.setattr(safetensors_folder, "CHUNK_BYTES", 256 << 10)
    sd = {
        "big": random_tensor((ROWS, COLS), torch.float32, 1),
        "wide": random_tensor((5, 2, 40_000), torch.float32, 2),
        "ids": random_tensor((1000,), torch.int64, 3),
        "scalar": random_tensor((), torch.bfloat16, 4),
        "empty": torch.empty(0, 7),
    }
    return write_folder(tmp_path / "hf", sd), sd


def test_open_reads_slices_and_only_their_rows(rows_folder: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, sd = rows_folder
    with ckptlib.open(folder) as view:
        assert view.step is None and view.where == str(folder)
        assert [(t.name, t.dtype, t.shape) for t in view.tensors()] == [
            ("/big", "float32", (ROWS, COLS)), ("/empty", "float32", (0, 7)), ("/ids", "int64", (1000,)),
            ("/scalar", "bfloat16", ()), ("/wide", "float32", (5, 2, 40_000))]
        assert len(view.manifest.tensors["/big"].chunks) == -(-ROWS // 64)
        got = view.read("/big", (slice(100, 110),))  # inside one chunk
        assert_tensor_equal(got, sd["big"][100:110])
        assert view.bytes_read == 10 * COLS * 4  # exactly the rows: no checksum forces the whole chunk
        n = view.bytes_read
        assert_tensor_equal(view.read("/big", (slice(60, 200, 3),)), sd["big"][60:200:3])  # across chunks
        assert view.bytes_read - n == (198 - 60 + 1) * COLS * 4
        assert_tensor_equal(view.read("/big", 599), sd["big"][599])
        assert_tensor_equal(view.read("/big", (..., slice(5, 9))), sd["big"][:, 5:9])
        assert_tensor_equal(view.read("/wide", (3, 1, slice(100, 200))), sd["wide"][3, 1, 100:200])
        loaded = view.load()
        assert sorted(loaded) == sorted(sd)
        for k, v in sd.items():
            assert_tensor_equal(loaded[k], v, k)


def test_shard_targets_read_only_their_rows(rows_folder: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Row and column shards, uneven and across chunk edges, bitwise; the reader fetches
    exactly the bytes of the rows each row shard holds (counted by the reader)."""
    folder, sd = rows_folder
    found = safetensors_folder.describe(open_storage(str(folder.parent)), folder.name, "folder", select="m")
    for lo, hi in ((0, 300), (300, 600), (37, 501), (64, 128)):
        target = {"m": {"big": ckptlib.Shard(torch.zeros(hi - lo, COLS), (ROWS, COLS), (lo, 0)),
                        "wide": ckptlib.Shard(torch.zeros(5, 1, 40_000), (5, 2, 40_000), (0, 1, 0)),
                        "ids": ckptlib.Shard(torch.zeros(3, dtype=torch.int64), (1000,), (lo, ))}}
        stats: dict[str, int] = {}
        load_flow.load_checkpoint(found.storage, found.folder, target, manifest=found.manifest, stats=stats,
                                  strict=False, where=found.where)
        assert_tensor_equal(target["m"]["big"].local, sd["big"][lo:hi])
        assert_tensor_equal(target["m"]["wide"].local, sd["wide"][:, 1:2])
        assert_tensor_equal(target["m"]["ids"].local, sd["ids"][lo:lo + 3])
        want = (hi - lo) * COLS * 4 + 5 * 40_000 * 4 + 3 * 8  # rows of big and ids; wide: half of each row
        assert stats["bytes_needed"] == want
        # The reader fetches small neighbours in one read when at most COALESCE_GAP apart: here
        # the rest of ids (7,976 bytes) before big, which the safetensors package writes next.
        assert want <= stats["bytes_read"] <= want + COALESCE_GAP, (lo, hi, stats)
        assert stats["bytes_read"] < ROWS * COLS * 4 * (hi - lo + 64) / ROWS + 5 * 40_000 * 4 + 8000
    col = {"big": ckptlib.Shard(torch.zeros(ROWS, 100), (ROWS, COLS), (0, 900))}  # a column shard
    ckptlib.load(folder, into=col, strict=False)
    assert_tensor_equal(col["big"].local, sd["big"][:, 900:1000])


def test_unpadded_header_unaligned_data(tmp_path: Path) -> None:
    """A header whose length is not a multiple of 8 (allowed, unusual) leaves the data at odd
    file offsets: direct reads, partial rows and buffered column reads are all still exact."""
    w = random_tensor((50, 30), torch.float32, 1)
    ids = random_tensor((7,), torch.int64, 2)
    header, data = corpus.header_of({"w": w, "b": ids})
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (1 if len(text) % 2 == 0 else 0)  # odd length
    (tmp_path / "odd.safetensors").write_bytes(corpus.file_bytes(None, data, text=text))
    assert (8 + len(text)) % 2 == 1
    assert_tensor_equal(st.load_file(str(tmp_path / "odd.safetensors"))["w"], w)  # valid for the reference too
    got = ckptlib.load(tmp_path / "odd.safetensors")
    assert_tensor_equal(got["w"], w)
    assert_tensor_equal(got["b"], ids)
    col = {"w": ckptlib.Shard(torch.zeros(50, 11), (50, 30), (0, 19)), "b": ckptlib.Shard(torch.zeros(2, dtype=torch.int64), (7,), (3,))}
    ckptlib.load(tmp_path / "odd.safetensors", into=col)
    assert_tensor_equal(col["w"].local, w[:, 19:])
    assert_tensor_equal(col["b"].local, ids[3:5])


def test_fsspec_urls(tmp_path: Path, memory_url: str) -> None:
    src = Net(0)
    folder = write_folder(tmp_path / "hf", src.state_dict())
    fs = fsspec.filesystem("memory")
    for p in folder.iterdir():
        with fs.open(f"{memory_url}/hf/{p.name}", "wb") as f:
            f.write(p.read_bytes())
    for url in (f"{memory_url}/hf", f"file://{folder}"):
        dst = Net(1)
        ckptlib.load(url, into=dst)
        assert_module_equal(src, dst)
        with ckptlib.open(url) as view:
            assert_tensor_equal(view.read("/emb.weight", (slice(3, 5),)), src.emb.weight[3:5])
            assert view.bytes_read == 2 * 16 * 4


def test_symlinked_cache_snapshot(tmp_path: Path) -> None:
    """The Hugging Face cache: snapshots/<rev>/ holds links to blobs/<hash>; they are followed."""
    src = Net(0)
    staged = write_folder(tmp_path / "staged", src.state_dict())
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, p in enumerate(sorted(staged.iterdir())):
        p.rename(blobs / f"blob{i}")
        (snap / p.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    dst = Net(1)
    ckptlib.load(snap, into=dst)
    assert_module_equal(src, dst)
    with ckptlib.open(snap) as view:
        assert_tensor_equal(view.read("/norm.bias"), src.norm.bias)


def every_dtype() -> dict[str, torch.Tensor]:
    out = {name: random_tensor((7, 5), DTYPES[name], i) for i, name in enumerate(sorted(st_format.SAFETENSORS))}
    out["rows"] = random_tensor((300, 70), torch.int32, 99)
    out["scalar"] = random_tensor((), torch.float64, 98)
    out["empty"] = torch.empty(3, 0, dtype=torch.float16)
    return out


def test_round_trip_every_dtype_bitwise(tmp_path: Path) -> None:
    """ckptlib checkpoint -> export to safetensors (several files) -> load back: bitwise, every
    dtype safetensors has; exporting the imported folder again gives the same files, byte for
    byte; the safetensors package reads our files and we read its files (F8_E8M0 too)."""
    state = every_dtype()
    ckptlib.save({"t": state, "other": 1}, tmp_path / "ck")
    with ckptlib.open(tmp_path / "ck") as view:
        summary = export_safetensors(view, str(tmp_path / "out"), "t", max_shard_bytes=600)
    assert len(summary["files"]) >= 4
    back = ckptlib.load(tmp_path / "out", select="t")["t"]
    assert sorted(back) == sorted(state)
    for k, v in state.items():
        assert_tensor_equal(back[k], v, k)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    ckptlib.load(tmp_path / "out", into=target)
    for k, v in state.items():
        assert_tensor_equal(target[k], v, k)
    with ckptlib.open(tmp_path / "out") as hf:
        again = export_safetensors(hf, str(tmp_path / "again"), None, max_shard_bytes=600)
    assert again["files"] == summary["files"]
    for f in summary["files"] + [st_format.INDEX_NAME]:
        assert (tmp_path / "again" / f).read_bytes() == (tmp_path / "out" / f).read_bytes(), f
    theirs = {"e8m0": random_tensor((4, 4), torch.float8_e8m0fnu, 5), "x": random_tensor((2,), torch.float8_e4m3fn, 6)}
    st.save_file(theirs, str(tmp_path / "theirs.safetensors"))
    got = ckptlib.load(tmp_path / "theirs.safetensors")
    for k, v in theirs.items():
        assert_tensor_equal(got[k], v, k)


@pytest.mark.parametrize("entry", corpus.ENTRIES, ids=lambda e: e.name)
def test_damaged_corpus_raises_typed_errors(tmp_path: Path, entry: corpus.Entry) -> None:
    folder = corpus.build(tmp_path / entry.name, entry)
    target = {k: torch.full_like(v, 7) for ts in corpus.tensors().values() for k, v in ts.items()}
    with pytest.raises(ckptlib.CorruptCheckpointError, match=entry.match) as ei:
        ckptlib.load(folder, into=target)
    assert str(folder) in str(ei.value)  # names the file or folder
    assert all(bool((v == 7).all()) for v in target.values())  # nothing was written into the target
    with pytest.raises(ckptlib.CorruptCheckpointError, match=entry.match):
        ckptlib.open(folder)
    if entry.reference is not None:  # the safetensors package's own parser, on the same file
        try:
            st.load_file(str(folder / corpus.F1))
            refused = False
        except Exception:
            refused = True
        assert refused == entry.reference


def test_corpus_template_is_valid(tmp_path: Path) -> None:
    corpus.template(tmp_path / "t")
    got = ckptlib.load(tmp_path / "t")
    for file, ts in corpus.tensors().items():
        theirs = st.load_file(str(tmp_path / "t" / file))
        for k, v in ts.items():
            assert_tensor_equal(got[k], v, k)
            assert_tensor_equal(theirs[k], v, k)


def test_limits_and_unloadable_dtypes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus.template(tmp_path / "t")
    monkeypatch.setattr(st_format, "MAX_INDEX_BYTES", 100)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="over the limit of 100"):
        ckptlib.load(tmp_path / "t")
    monkeypatch.undo()
    header = {"f4": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
              "ok": {"dtype": "U8", "shape": [3], "data_offsets": [2, 5]}}
    (tmp_path / "f4").mkdir()
    (tmp_path / "f4" / "model.safetensors").write_bytes(corpus.file_bytes(header, b"\x12\x34abc"))
    with pytest.raises(ckptlib.UnsupportedValueError, match="F4"):
        ckptlib.load(tmp_path / "f4")
    got = ckptlib.load(tmp_path / "f4", rename=lambda k: None if k == "f4" else k)
    assert got == {"ok": got["ok"]} and bytes(got["ok"].numpy()) == b"abc"
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_text("{}")
    with pytest.raises(ckptlib.CheckpointNotFoundError):
        ckptlib.load(tmp_path / "none")


@pytest.mark.parametrize(("dtype", "shape", "nbytes", "match"), [
    ("F4", [4], 5, "needs 2 bytes, data_offsets give 5"),
    ("F6_E2M3", [3], 2, "18 bits, not a whole number of bytes"),
    ("F6_E3M2", [4], 4, "needs 3 bytes, data_offsets give 4"),
])
def test_sub_byte_tensor_sizes_are_checked_even_when_skipped(tmp_path: Path, dtype: str, shape: list[int],
                                                            nbytes: int, match: str) -> None:
    """A sub-byte tensor (F4, F6) whose data_offsets hold the wrong number of bytes is a damaged
    file, as the reference parser says, even when ``rename`` skips it: it was loaded (the other
    tensors' bytes trusted) because only loadable dtypes had their sizes checked."""
    header = {"sub": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]},
              "ok": {"dtype": "U8", "shape": [3], "data_offsets": [nbytes, nbytes + 3]}}
    (tmp_path / "model.safetensors").write_bytes(corpus.file_bytes(header, b"\x12" * nbytes + b"abc"))
    with pytest.raises(ckptlib.CorruptCheckpointError, match=match):
        ckptlib.load(tmp_path, rename=lambda k: None if k == "sub" else k)
    import safetensors

    with pytest.raises(safetensors.SafetensorError):  # the reference parser refuses the file too
        safetensors.deserialize((tmp_path / "model.safetensors").read_bytes())
    good = {"sub": {**header["sub"], "data_offsets": [0, 3 if dtype.startswith("F6") else 2]}}
    good["sub"]["shape"] = [4]
    data = b"\x12" * good["sub"]["data_offsets"][1]
    (tmp_path / "model.safetensors").write_bytes(corpus.file_bytes(good, data))
    safetensors.deserialize((tmp_path / "model.safetensors").read_bytes())
    assert ckptlib.load(tmp_path, rename=lambda k: None) == {}  # a right size passes, skipped


def test_contiguous_boxes_tile_in_file_order() -> None:
    for shape, itemsize, limit in (((10, 3), 4, 24), ((3, 5, 7), 2, 20), ((2, 3), 8, 1), ((4,), 1, 100),
                                   ((2, 0, 3), 4, 8), ((), 8, 1), ((3, 4, 5), 1, 1000)):
        boxes = st_format.contiguous_boxes(shape, itemsize, limit)
        at = 0
        covered = torch.zeros(shape, dtype=torch.int32)
        strides = torch.empty(shape).stride() if shape else ()
        for off, box, start in boxes:
            assert start == at, (shape, boxes)
            n = itemsize
            for s in box:
                n *= s
            assert n <= max(limit, itemsize) or not all(shape), (shape, box)
            assert start == itemsize * sum(o * s for o, s in zip(off, strides, strict=True))
            covered[tuple(slice(o, o + s) for o, s in zip(off, box, strict=True))] += 1
            at += n
        assert bool((covered == 1).all()), (shape, boxes)


def test_header_length_checks_before_reading() -> None:
    where = "x.safetensors"
    with pytest.raises(ckptlib.CorruptCheckpointError, match="at least 8 bytes"):
        st_format.header_length(b"\0" * 7, 7, where)
    assert st_format.header_length(struct.pack("<Q", 16), 24, where) == 16
    with pytest.raises(ckptlib.CorruptCheckpointError, match=re.escape("runs past the end of the file (23 bytes)")):
        st_format.header_length(struct.pack("<Q", 16), 23, where)


def test_dtype_tables_are_inverse() -> None:
    assert all(st_format.FROM_SAFETENSORS[v] == k for k, v in st_format.SAFETENSORS.items())
    assert os.path.basename(st_format.INDEX_NAME) == "model.safetensors.index.json"


def test_the_index_file_given_instead_of_its_folder_says_to_pass_the_folder(tmp_path: Path) -> None:
    """It said to pass "the checkpoint folder (the one holding manifest.json)", which a Hugging
    Face folder does not have."""
    folder = write_folder(tmp_path / "hf", {"a": torch.arange(4.0), "b": torch.ones(3)}, files=2)
    for call in (ckptlib.load, ckptlib.open):
        with pytest.raises(ckptlib.CheckpointNotFoundError, match="pass the folder that holds it") as e:
            call(str(folder / "model.safetensors.index.json"))
        assert "manifest.json" not in str(e.value)
    assert torch.equal(ckptlib.load(str(folder))["a"], torch.arange(4.0))
