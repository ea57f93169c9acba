"""``ckptlib.open``: lazy reads fetch only the chunks they need, sharded checkpoints from
several real ranks read in one process, corrupt chunks raise, and nothing heavy is imported."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same, assert_tensor_equal, flip_bit, payload_files, random_tensor

import ckptlib
from ckptlib.engine import save as save_flow
from ckptlib.format.layout import step_dir

ROWS, COLS = 256, 4096  # float32: 16 KiB rows, 4 MiB in all
CHUNK = 256 << 10  # 16 rows per chunk


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(save_flow, "SaveOptions", functools.partial(save_flow.SaveOptions, chunk_bytes=CHUNK))


@pytest.fixture
def big(tmp_path: Path, small_chunks: None) -> tuple[Path, dict]:
    state = {"model": {"w": random_tensor((ROWS, COLS), torch.float32, 1), "b": torch.arange(7.0)},
             "opt": {"lr": 0.1, "m": random_tensor((5, 3), torch.bfloat16, 2)}, "step": 9}
    path = tmp_path / "ck"
    ckptlib.save(state, path)
    return path, state


def test_slice_reads_only_overlapping_chunks(big: tuple[Path, dict]) -> None:
    path, state = big
    w = state["model"]["w"]
    with ckptlib.open(path) as ck:
        assert ck.step is None
        infos = {i.name: i for i in ck.tensors()}
        assert infos["/model/w"] == ckptlib.TensorInfo("/model/w", "float32", (ROWS, COLS), ROWS * COLS * 4)
        assert set(infos) == {"/model/w", "/model/b", "/opt/m"}
        before = ck.bytes_read
        got = ck.read("/model/w", (slice(40, 50), slice(100, 200)))
        assert_tensor_equal(got, w[40:50, 100:200])
        used = ck.bytes_read - before
        # rows 40..50 lie in chunks [32, 48) and [48, 64): exactly two chunks, one per side at most
        assert used == 2 * CHUNK, used
        assert used <= (50 - 40 + 2 * 16) * COLS * 4  # within one chunk per side of the request
        before = ck.bytes_read
        assert_tensor_equal(ck.read("/model/w", (7, slice(None, None, 5))), w[7, ::5])
        assert ck.bytes_read - before == CHUNK
        assert_tensor_equal(ck.read("/model/w", (Ellipsis, -1)), w[..., -1])
        assert_tensor_equal(ck.read("/model/w"), w)
        assert ck.read("/model/w", (slice(10, 10),)).shape == (0, COLS)
        for bad in [(0, 0, 0), (ROWS,), (slice(None, None, -1),)]:
            with pytest.raises(IndexError):
                ck.read("/model/w", bad)
        with pytest.raises(TypeError):
            ck.read("/model/w", ("x",))
        with pytest.raises(KeyError, match="no tensor"):
            ck.read("/model/nope")


def test_tensorstore_array_is_lazy(big: tuple[Path, dict]) -> None:
    path, state = big
    w = state["model"]["w"]
    with ckptlib.open(path) as ck:
        arr = ck.array("/model/w")
        assert arr.shape == (ROWS, COLS) and arr.dtype.name == "float32"
        before = ck.bytes_read
        part = arr[40:50, 100:200].read().result()
        assert ck.bytes_read - before <= 2 * CHUNK
        np.testing.assert_array_equal(part, w[40:50, 100:200].numpy())
        m = ck.array("/opt/m").read().result()  # bfloat16: tensorstore's own dtype
        assert str(m.dtype) == "bfloat16"
        assert_tensor_equal(torch.from_numpy(m.view(np.uint16)).view(torch.bfloat16), state["opt"]["m"])
        with pytest.raises(ValueError, match="does not support writing"):  # read-only: tensorstore refuses
            arr[0, 0].write(1.0).result()


def test_load_select_and_steps(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for step in (10, 20):
            mgr.save(step, {"model": {"w": torch.full((4,), float(step))}, "extra": [1, "a"]})
    with ckptlib.open(root) as ck:
        assert ck.step == 20
        assert_same(ck.load(select="model"), {"w": torch.full((4,), 20.0)})
        assert ck.load(select="/extra/1") == "a"
        assert_same(ck.load(), {"model": {"w": torch.full((4,), 20.0)}, "extra": [1, "a"]})
        with pytest.raises(KeyError):
            ck.load(select="nope")
    with ckptlib.open(root, step=10) as ck:
        assert ck.step == 10 and ck.read("/model/w", 0).item() == 10.0
    with ckptlib.open(root / step_dir(10)) as ck:  # a step folder directly
        assert ck.step == 10
    with pytest.raises(ckptlib.CheckpointNotFoundError, match=r"no step 30 under .*\(newest steps: 10, 20\)"):
        ckptlib.open(root, step=30)  # a step that never existed is not called "incomplete"
    (root / step_dir(30)).mkdir()  # a step folder without manifest is
    with pytest.raises(ckptlib.CheckpointNotFoundError, match=r"step 30 under .* is incomplete"):
        ckptlib.open(root, step=30)
    with pytest.raises(ckptlib.CheckpointNotFoundError):
        ckptlib.open(tmp_path / "missing")


def test_damaged_step_raises_corrupt_and_the_newest_good_one_is_opened_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A step whose payload file is short is "corrupt": ``open(root, step=N)`` raises
    CorruptCheckpointError (as docs/read.md says; it used to be CheckpointNotFoundError), and
    ``open(root)`` opens the newest committed step below it, saying which newer one it passed."""
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": torch.full((64,), float(step))})
    (victim,) = payload_files(root / step_dir(20))
    os.truncate(victim, 10)
    with pytest.raises(ckptlib.CorruptCheckpointError, match=r"step 20 under .* is corrupt: .*payload file size"):
        ckptlib.open(root, step=20)
    with caplog.at_level(logging.WARNING, logger="ckptlib"), ckptlib.open(root) as ck:
        assert ck.step == 10 and ck.read("/w", 0).item() == 10.0
    assert "opening step 10 of" in caplog.text and "the newer step 20 is damaged" in caplog.text


def test_a_run_root_opens_judging_the_newest_steps_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``open(root)`` judges steps newest first up to the newest committed one (a root of 30
    steps whose newest is damaged: two step folders read), not every step of the root."""
    from helpers import CountingStorage

    from ckptlib.read import view

    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for step in range(1, 31):
            mgr.save(step, {"w": torch.full((8,), float(step))})
    (victim,) = payload_files(root / step_dir(30))
    os.truncate(victim, 10)
    opened: list[CountingStorage] = []
    real = view.open_storage

    def counting(url: str, options: dict | None = None) -> CountingStorage:
        opened.append(CountingStorage(real(url, options), key=lambda path: path.split("/")[0]))
        return opened[-1]

    monkeypatch.setattr(view, "open_storage", counting)
    with view.open_view(root) as ck:
        assert ck.step == 29 and ck.read("/w", 0).item() == 29.0
    assert sorted(p for p in opened[0].calls if p.startswith("step-")) == [step_dir(29), step_dir(30)]


def test_step_deleted_after_open_is_not_called_corrupt(tmp_path: Path) -> None:
    """A step pruned between ``open`` and a read raises CheckpointNotFoundError saying it was
    deleted (open it again), not CorruptCheckpointError ("payload file is missing"), which
    would send its user looking for bit rot; a payload file missing beside its manifest is
    still damage."""
    import shutil

    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((8,), float(step))})
    with ckptlib.open(root, step=1) as ck:
        shutil.rmtree(root / step_dir(1))  # ckptlib prune --keep-last 1, meanwhile
        with pytest.raises(ckptlib.CheckpointNotFoundError, match=r"was deleted while it was being read .*open it again"):
            ck.read("/w")
    with ckptlib.open(root, step=2) as ck:
        (victim,) = payload_files(root / step_dir(2))
        victim.unlink()
        with pytest.raises(ckptlib.CorruptCheckpointError, match="payload file is missing"):
            ck.read("/w")
    one = tmp_path / "one"
    ckptlib.save({"w": torch.zeros(8)}, one)
    with ckptlib.open(one) as ck:
        ckptlib.save({"w": torch.ones(8)}, one, overwrite=True)  # saved again meanwhile
        with pytest.raises(ckptlib.CheckpointNotFoundError, match="was replaced by another save while it was being"):
            ck.read("/w")
    assert ckptlib.load(one)["w"].tolist() == [1.0] * 8


@pytest.mark.parametrize("version", ["1", "2"])
@pytest.mark.parametrize("gap", ["before-sizes", "after-sizes"])
@pytest.mark.parametrize("meanwhile", ["pruned", "replaced"])
def test_load_of_a_step_deleted_or_replaced_meanwhile_is_not_called_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, gap: str, meanwhile: str
) -> None:
    """``ckptlib.load`` of a step that another process prunes or saves again with overwrite
    between its manifest read and its reads: CheckpointNotFoundError saying so, wherever the
    gap falls (the size check and the v2 index read said CorruptCheckpointError "payload file
    is missing"; seen by a reader looping over a trainer's newest step). A payload file
    missing beside its manifest is still damage."""
    import shutil

    from ckptlib.engine import load as load_flow

    monkeypatch.setenv("CKPTLIB_FORMAT_VERSION", version)
    ck = tmp_path / "ck"
    ckptlib.save({"w": torch.zeros(8)}, ck)

    def meanwhile_do() -> None:
        if meanwhile == "pruned":
            shutil.rmtree(ck)
        else:
            ckptlib.save({"w": torch.ones(8)}, ck, overwrite=True)

    real = load_flow.check_files

    def check_files(*args: object) -> None:
        if gap == "before-sizes":
            meanwhile_do()
        real(*args)
        if gap == "after-sizes":
            meanwhile_do()

    monkeypatch.setattr(load_flow, "check_files", check_files)
    said = "was deleted while it was being read" if meanwhile == "pruned" else "was replaced by another save"
    with pytest.raises(ckptlib.CheckpointNotFoundError, match=said):
        ckptlib.load(ck, into={"w": torch.zeros(8)})
    monkeypatch.setattr(load_flow, "check_files", real)
    if meanwhile == "replaced":
        assert ckptlib.load(ck)["w"].tolist() == [1.0] * 8
        (victim,) = payload_files(ck)
        victim.unlink()
        with pytest.raises(ckptlib.CorruptCheckpointError, match="payload file is missing"):
            ckptlib.load(ck)


def test_corrupt_chunk_raises_only_where_read(big: tuple[Path, dict]) -> None:
    path, state = big
    flip_chunk_bit(path, "/model/w", 48)  # the chunk holding rows [48, 64)
    with ckptlib.open(path) as ck:
        assert_tensor_equal(ck.read("/model/w", slice(0, 40)), state["model"]["w"][:40])  # untouched chunks
        with pytest.raises(ckptlib.CorruptCheckpointError, match="checksum mismatch"):
            ck.read("/model/w", (slice(50, 51), 0))
        with pytest.raises(ckptlib.CorruptCheckpointError):
            ck.load(select="model")
        arr = ck.array("/model/w")
        np.testing.assert_array_equal(arr[:40].read().result(), state["model"]["w"][:40].numpy())
        with pytest.raises(ckptlib.CorruptCheckpointError, match="checksum mismatch"):  # ours, through tensorstore
            arr[50:51].read().result()


def flip_chunk_bit(path: Path, name: str, row: int) -> None:
    """Flip one bit in the middle of the stored bytes of the chunk of ``name`` starting at ``row``."""
    with ckptlib.open(path) as ck:
        m = ck.manifest
    (c,) = [c for c in m.tensors[name].chunks if c.offset[0] == row]
    flip_bit(path / m.files[c.file].path, c.start + c.length // 2, 3)


def test_two_rank_sharded_checkpoint_read_lazily(tmp_path: Path) -> None:
    from distributed.launch import run
    from workers.dist_worker import full

    run("save", 2, tmp_path)  # two real gloo processes, each writing its own shards
    with ckptlib.open(tmp_path / "ck") as ck:
        files = {f.path for f in ck.manifest.files}
        assert any("r00001" in f for f in files) and any("r00000" in f for f in files)
        total = sum(i.nbytes for i in ck.tensors())
        for name, path in [("emb", "/emb"), ("col", "/col"), ("dt", "/dt"), ("half", "/nested/half")]:
            assert_tensor_equal(ck.read(path), full(name), path)
        assert_tensor_equal(ck.read("/col", (slice(2, 5), slice(10, 20))), full("col")[2:5, 10:20])  # spans both ranks
        before = ck.bytes_read
        assert_tensor_equal(ck.read("/emb", slice(0, 3)), full("emb")[:3])  # inside rank 0's shard
        assert ck.bytes_read - before < full("emb").nbytes < total
        np.testing.assert_array_equal(ck.array("/emb")[30:41].read().result(), full("emb")[30:].numpy())
        nested = ck.load(select="nested")
        assert_tensor_equal(nested["bias"], full("bias"))
        assert nested["lr"] == 0.5


def test_import_does_not_load_tensorstore_zarr_safetensors() -> None:
    code = ("import sys, ckptlib, ckptlib.cli.main; ckptlib.open;"
            "print([m for m in ('tensorstore', 'zarr', 'safetensors') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_fsspec_backend(memory_url: str) -> None:
    """Any backend: the same reads through fsspec's memory filesystem."""
    w = random_tensor((100, 30), torch.float16, 7)
    ckptlib.save({"w": w, "n": 3}, memory_url + "/ck")
    with ckptlib.open(memory_url + "/ck") as ck:
        assert_tensor_equal(ck.read("/w", (slice(10, 20), slice(None, None, 2))), w[10:20, ::2])
        assert ck.load()["n"] == 3


def test_open_says_what_to_pass_instead(tmp_path: Path) -> None:
    """A file, a parent of checkpoint folders, an empty folder, an unrelated folder and a run root
    of damaged steps each get a message naming what is there and what to pass."""
    ckptlib.save({"a": torch.ones(3)}, tmp_path / "runs" / "ck")
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    mgr = ckptlib.CheckpointManager(tmp_path / "root")
    mgr.save(5, {"a": torch.ones(2)}).wait()
    mgr.close()
    (tmp_path / "root" / step_dir(5) / "manifest.json").write_bytes(b"{}")
    cases = {
        tmp_path / "runs" / "ck" / "manifest.json": ["is a file", "checkpoint folder"],
        tmp_path / "runs": ["checkpoint folders inside it (ck)", str(tmp_path / "runs" / "ck")],
        tmp_path / "empty": ["empty folder"],
        tmp_path / "junk": ["neither manifest.json nor step folders"],
        tmp_path / "root": ["step 5: corrupt"],
    }
    for url, words in cases.items():
        with pytest.raises(ckptlib.CheckpointNotFoundError) as e:
            ckptlib.open(url)
        for w in words:
            assert w in str(e.value), (url, str(e.value))


def test_open_hints_on_object_stores(memory_url: str, moto_s3) -> None:
    from backends.servers import S3_BUCKET

    s3 = f"s3://{S3_BUCKET}/open-hints-{memory_url[-8:]}"
    for url, opts in ((memory_url, None), (s3, moto_s3.storage_options())):
        ckptlib.save({"a": torch.arange(4.0)}, f"{url}/parent/ck", storage_options=opts)
        with pytest.raises(ckptlib.CheckpointNotFoundError, match=r"checkpoint folders inside it \(ck\)"):
            ckptlib.open(f"{url}/parent", storage_options=opts)
        with pytest.raises(ckptlib.CheckpointNotFoundError, match="is a file"):
            ckptlib.open(f"{url}/parent/ck/manifest.json", storage_options=opts)
        with ckptlib.open(f"{url}/parent/ck", storage_options=opts) as ck:
            assert ck.read("/a").tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_tensor_name_without_its_leading_slash_gets_a_hint(tmp_path: Path) -> None:
    ckptlib.save({"model": {"w": torch.ones(3)}}, tmp_path / "ck")
    with ckptlib.open(tmp_path / "ck") as ck:
        with pytest.raises(KeyError, match=r"did you mean '/model/w'\? tensor names start with '/'"):
            ck.read("model/w")
        with pytest.raises(KeyError, match=r"no tensor '/model/x' .*see \.tensors\(\)"):
            ck.read("/model/x")
        assert ck.read("/model/w").tolist() == [1.0, 1.0, 1.0]


def test_reading_packed_tensors_one_by_one_reads_each_pack_once(tmp_path: Path) -> None:
    # ckpt.read(name) of each small tensor (and `ckptlib diff`, which reads tensor by tensor)
    # read and checksummed the whole pack holding it every time: quadratic in the tensors per
    # pack (80,000 tensors in one 2 MB pack: 320 GB read for one diff). Counted in bytes read.
    n = 2000
    state = {f"t{i}": torch.randn(4, generator=torch.Generator().manual_seed(i)) for i in range(n)}
    ckptlib.save(state, tmp_path / "ck")
    with ckptlib.open(tmp_path / "ck") as ckpt:
        packs = ckpt._reader.m.packs
        assert len(packs) == 1  # all of them packed together
        for name, t in state.items():
            assert torch.equal(ckpt.read(f"/{name}"), t)
        assert ckpt._reader.bytes_read == sum(p.length for p in packs)


def test_a_name_or_path_not_in_the_checkpoint_is_a_typed_error_and_a_key_error(tmp_path: Path) -> None:
    """``read``/``info`` of an unknown name and ``load(select=)`` of an unknown path raised a bare
    ``KeyError`` (printed quoted); now ``NotInCheckpointError``, a ``CheckpointError`` and a
    ``KeyError``, whose text is the message."""
    ckptlib.save({"model": {"w": torch.ones(3)}}, tmp_path / "ck")
    with ckptlib.open(tmp_path / "ck") as ck:
        for call in (lambda: ck.read("/model/x"), lambda: ck.info("/x"), lambda: ck.load(select="model/nope")):
            with pytest.raises(ckptlib.NotInCheckpointError) as got:
                call()
            assert isinstance(got.value, KeyError) and isinstance(got.value, ckptlib.CheckpointError)
            assert str(got.value).startswith(("no tensor '/", "/model/nope: not in the checkpoint")), str(got.value)
