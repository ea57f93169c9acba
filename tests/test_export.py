"""``ckptlib export``: zarr3 (read back with tensorstore and zarr-python) and safetensors (read
back with the safetensors package) equal the source state bit for bit for every dtype (compared
with the tensors that were saved, never with ckptlib's own reading of the checkpoint); sharded
pieces are consolidated; a corrupt chunk stops the export; memory stays bounded (measured)."""

from __future__ import annotations

import _thread
import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_tensor_equal, random_tensor
from test_read_view import flip_chunk_bit

import ckptlib
from ckptlib.cli.main import main as cli
from ckptlib.format.dtypes import DTYPES
from ckptlib.read import to_zarr3
from ckptlib.read.dtypes import SAFETENSORS
from ckptlib.read.to_safetensors import INDEX_NAME, export_safetensors
from ckptlib.read.to_zarr3 import array_key, export_zarr3

ts = pytest.importorskip("tensorstore")
zarr = pytest.importorskip("zarr")
st = pytest.importorskip("safetensors.torch")
# complex32 tensors make torch warn once ("ComplexHalf support is experimental"): not ours.
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")


def every_dtype_state() -> dict:
    tensors = {name: random_tensor((6, 5), dt, i) for i, (name, dt) in enumerate(sorted(DTYPES.items()))}
    return {"t": tensors, "scalar": torch.tensor(2.5, dtype=torch.float64), "rows": random_tensor((300, 70), torch.int32, 99)}


def source_tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The source state's tensors by checkpoint name (``/`` + the dict keys joined by ``/``)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(source_tensors(v, f"{prefix}/{k}"))
        else:
            out[f"{prefix}/{k}"] = v
    return out


def as_torch(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """An array read back from zarr3 as the original dtype (bits arrays viewed back)."""
    t = torch.from_numpy(np.array(arr, order="C", copy=True))
    return t if t.dtype == DTYPES[dtype] else t.view(DTYPES[dtype])


def test_zarr3_every_dtype_tensorstore_and_zarr_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(to_zarr3, "CHUNK_BYTES", 8 << 10)  # several zarr chunks and blocks per tensor
    monkeypatch.setattr(to_zarr3, "BLOCK_BYTES", 20 << 10)
    state = every_dtype_state()
    ckptlib.save(state, tmp_path / "ck")
    out = tmp_path / "z"
    with ckptlib.open(tmp_path / "ck") as ck:
        summary = export_zarr3(ck, str(out))
    expected = source_tensors(state)  # the source state itself, not ckptlib's reading of it
    assert summary["tensors"] == len(expected) == len(DTYPES) + 2
    assert {a["name"] for a in summary["arrays"]} == set(expected)
    group = zarr.open_group(str(out), mode="r")
    for name, want in expected.items():
        dtype = next(a for a in summary["arrays"] if a["name"] == name)["dtype"]
        arr = ts.open({"driver": "zarr3", "kvstore": f"file://{out}/{array_key(name)}/"}, read=True).result()
        assert arr.schema.codec.to_json()["codecs"][-1]["name"] == "zstd"
        assert_tensor_equal(as_torch(arr.read().result(), dtype), want, f"tensorstore {name}")
        node = group[array_key(name)]
        assert node.attrs["ckptlib_path"] == name and node.attrs["ckptlib_dtype"] == dtype
        assert node.attrs["ckptlib_stored_as"] == ("native" if str(node.dtype) == dtype else "bits")
        assert_tensor_equal(as_torch(node[...], dtype), want, f"zarr-python {name}")
    assert group["rows"].chunks[0] < 300  # really chunked
    assert group["t/bfloat16"].attrs["ckptlib_stored_as"] == "bits" and str(group["t/bfloat16"].dtype) == "uint16"


def test_safetensors_every_dtype_and_sharded_files(tmp_path: Path) -> None:
    state = every_dtype_state()
    ckptlib.save(state, tmp_path / "ck")
    out = tmp_path / "st"
    with ckptlib.open(tmp_path / "ck") as ck:
        with pytest.raises(ckptlib.UnsupportedValueError, match="complex32"):
            export_safetensors(ck, str(out), "t")
        assert not out.exists() or not list(out.iterdir())  # refused before writing anything
        for name in DTYPES:
            if name not in SAFETENSORS:
                continue
            export_safetensors(ck, str(out / name), f"t/{name}")
            (got,) = st.load_file(str(out / name / "model-00001-of-00001.safetensors")).items()
            assert got[0] == name  # the selected tensor itself: its last path part
            assert_tensor_equal(got[1], state["t"][name], name)


def test_safetensors_load_state_dict_from_two_ranks(tmp_path: Path) -> None:
    from distributed.launch import run
    from workers.dist_worker import full

    run("save", 2, tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    ckptlib.save({"model": model.state_dict(), "step": 3}, tmp_path / "m")
    out = tmp_path / "hf"
    code = cli(["export", str(tmp_path / "m"), "--to", "safetensors", str(out), "--select", "model",
                "--max-shard-size", "5KiB", "--json"])
    assert code == 0
    index = json.loads((out / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) >= 2  # size-limited shards
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in model.state_dict().values())
    loaded: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        loaded.update(st.load_file(str(out / file)))
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    fresh.load_state_dict(loaded)  # strict: names dotted and relative to "model"
    for k, v in model.state_dict().items():
        assert_tensor_equal(fresh.state_dict()[k], v, k)
    # pieces written by two ranks come out whole
    with ckptlib.open(tmp_path / "ck") as ck:
        export_safetensors(ck, str(tmp_path / "sh"), "/")
    got = st.load_file(str(tmp_path / "sh" / "model-00001-of-00001.safetensors"))
    for name in ("emb", "col", "dt"):
        assert_tensor_equal(got[name], full(name), name)


def test_corrupt_chunk_stops_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptlib.engine import save as save_flow

    monkeypatch.setattr(save_flow, "SaveOptions", functools.partial(save_flow.SaveOptions, chunk_bytes=128 << 10))
    w = random_tensor((64, 4096), torch.float32, 5)  # 16 KiB rows, 8 rows per chunk (over the packing size)
    ckptlib.save({"model": {"w": w}}, tmp_path / "ck")
    flip_chunk_bit(tmp_path / "ck", "/model/w", 32)
    with ckptlib.open(tmp_path / "ck") as ck, pytest.raises(ckptlib.CorruptCheckpointError, match="checksum"):
        export_zarr3(ck, str(tmp_path / "z"))
    assert cli(["export", str(tmp_path / "ck"), "--to", "zarr3", str(tmp_path / "z2")]) == 2
    assert cli(["export", str(tmp_path / "ck"), "--to", "safetensors", str(tmp_path / "s"), "--select", "model"]) == 2
    assert not (tmp_path / "z").exists() and not (tmp_path / "z2").exists() and not (tmp_path / "s").exists()
    assert cli(["export", str(tmp_path / "ck"), "--to", "safetensors", str(tmp_path / "s")]) == 2  # no --select


def files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def two_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, str, str]:
    """State A saved in ``good``; a different state B in ``bad``, with a flipped byte in the
    payload of its last tensor (``/model/w``, the chunk at row 32): an export of ``bad`` writes
    the tensors before it, then stops there."""
    from ckptlib.engine import save as save_flow

    monkeypatch.setattr(save_flow, "SaveOptions", functools.partial(save_flow.SaveOptions, chunk_bytes=128 << 10))
    a = {"model": {"a": random_tensor((16, 16), torch.float32, 1), "b": random_tensor((16, 16), torch.float32, 2),
                   "w": random_tensor((64, 4096), torch.float32, 3)}}
    b = {"model": {k: v + 1 for k, v in a["model"].items()}}
    ckptlib.save(a, tmp_path / "good")
    ckptlib.save(b, tmp_path / "bad")
    flip_chunk_bit(tmp_path / "bad", "/model/w", 32)
    return a, str(tmp_path / "good"), str(tmp_path / "bad")


def no_debris(tmp_path: Path) -> None:
    left = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert not left, f"staging folders left behind: {left}"


def test_failed_zarr3_export_leaves_out_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    a, good, bad = two_steps(tmp_path, monkeypatch)
    out = tmp_path / "z"
    assert cli(["export", bad, "--to", "zarr3", str(out), "--select", "model"]) == 2
    assert not out.exists()  # not even an empty folder
    assert cli(["export", good, "--to", "zarr3", str(out), "--select", "model"]) == 0
    before = files(out)
    assert cli(["export", bad, "--to", "zarr3", str(out), "--select", "model"]) == 2
    assert files(out) == before  # no array of B, none left at its fill value
    group = zarr.open_group(str(out), mode="r")
    for k, want in a["model"].items():
        assert_tensor_equal(torch.from_numpy(group[f"model/{k}"][...]), want, k)
    out.joinpath("nothing").mkdir()  # not a zarr node: refused, before anything is written
    capsys.readouterr()
    assert cli(["export", good, "--to", "zarr3", str(out), "--select", "model"]) == 2
    assert "not a zarr3 export (nothing)" in capsys.readouterr().err
    assert files(out) == before and out.joinpath("nothing").is_dir()
    out.joinpath("nothing").rmdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(["export", bad, "--to", "zarr3", str(empty)]) == 2
    assert empty.is_dir() and not list(empty.iterdir())  # an empty folder stays so
    with ckptlib.open(bad) as ck, pytest.raises(ckptlib.CorruptCheckpointError, match="checksum"):
        export_zarr3(ck, "file://" + str(out))  # a file:// URL is local too
    assert files(out) == before
    no_debris(tmp_path)


def test_failed_safetensors_export_leaves_out_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    a, good, bad = two_steps(tmp_path, monkeypatch)
    out = tmp_path / "st"
    args = ["--to", "safetensors", str(out), "--select", "model", "--max-shard-size", "1KiB"]
    assert cli(["export", bad, *args]) == 2
    assert not out.exists()
    assert cli(["export", good, *args]) == 0
    before = files(out)
    assert len(before) == 4  # a, b, w in a file each, and the index
    assert cli(["export", bad, *args]) == 2  # a and b of B written, then the corrupt chunk of w
    assert files(out) == before
    loaded = ckptlib.load(out, select="model")["model"]
    for k, want in a["model"].items():
        assert_tensor_equal(loaded[k], want, k)
    # a successful export with fewer files replaces the earlier one as a whole: no stale shards
    ckptlib.save({"model": {"a": a["model"]["a"]}}, tmp_path / "one")
    assert cli(["export", str(tmp_path / "one"), *args]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00001.safetensors", INDEX_NAME]
    assert_tensor_equal(ckptlib.load(out, select="model")["model"]["a"], a["model"]["a"], "a")
    # a folder holding anything else is refused before anything is written, and left alone
    (out / "config.json").write_text("{}")
    before = files(out)
    capsys.readouterr()
    assert cli(["export", good, *args]) == 2
    assert "config.json" in capsys.readouterr().err and files(out) == before
    (tmp_path / "file").write_text("x")
    assert cli(["export", good, "--to", "safetensors", str(tmp_path / "file"), "--select", "model"]) == 2
    assert (tmp_path / "file").read_text() == "x"
    no_debris(tmp_path)


def test_ctrl_c_during_export_removes_its_staging_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while an export writes: the command's worker is stopped too and deletes its
    staging folder before the process exits (exit 130, one line, and with ``--json`` a JSON error
    document); OUT is never created. The interrupt lands while a file is being written."""
    from ckptlib.read import to_safetensors

    ckptlib.save({"model": {"w": random_tensor((8, 8), torch.float32, 1)}}, tmp_path / "ck")
    writing = threading.Event()

    def slow_write(*args: object, **kwargs: object) -> None:
        writing.set()
        for _ in range(100):  # bounded: the worker of a CLI that ignores Ctrl-C ends too
            time.sleep(0.05)

    monkeypatch.setattr(to_safetensors, "_write_file", slow_write)
    threading.Thread(target=lambda: writing.wait(10) and _thread.interrupt_main(), daemon=True).start()
    out = tmp_path / "st"
    code = cli(["export", str(tmp_path / "ck"), "--to", "safetensors", str(out), "--select", "model", "--json"])
    captured = capsys.readouterr()
    assert code == 130
    assert json.loads(captured.out) == {"error": "interrupted", "exit_code": 130}
    assert captured.err.strip() == "ckptlib: interrupted"
    assert not out.exists()
    no_debris(tmp_path)


def test_empty_tensors_export(tmp_path: Path) -> None:
    """Tensors with no rows (or no columns) export to both formats and read back equal."""
    state = {"model": {"rows": torch.zeros(0, 4), "flat": torch.zeros(0), "cols": torch.zeros(3, 0, dtype=torch.int64),
                       "w": random_tensor((5, 3), torch.float32, 7)}}
    ckptlib.save(state, tmp_path / "ck")
    ck = str(tmp_path / "ck")
    assert cli(["export", ck, "--to", "safetensors", str(tmp_path / "st"), "--select", "model"]) == 0
    got = st.load_file(str(tmp_path / "st" / "model-00001-of-00001.safetensors"))
    assert set(got) == set(state["model"])
    loaded = ckptlib.load(tmp_path / "st", select="model")
    for k, want in state["model"].items():
        assert_tensor_equal(got[k], want, f"safetensors {k}")
        assert_tensor_equal(loaded["model"][k], want, f"load {k}")
    assert cli(["export", ck, "--to", "zarr3", str(tmp_path / "z"), "--select", "model"]) == 0
    group = zarr.open_group(str(tmp_path / "z"), mode="r")
    for k, want in state["model"].items():
        assert_tensor_equal(as_torch(group[f"model/{k}"][...], str(want.dtype).removeprefix("torch.")), want, k)


@pytest.mark.parametrize("fmt", ["zarr3", "safetensors"])
def test_export_memory_stays_bounded(tmp_path: Path, fmt: str) -> None:
    """Export a 384 MiB state in a subprocess; its peak RSS grows by well under the state's size."""
    state_bytes = 384 << 20
    n = state_bytes // 4 // 3
    ckptlib.save({"model": {f"w{i}": torch.arange(n, dtype=torch.float32).reshape(-1, 1024) + i for i in range(3)}},
                 tmp_path / "ck")
    script = textwrap.dedent(f"""
        import json, sys, tensorstore, safetensors, ckptlib
        from ckptlib.read.to_zarr3 import export_zarr3
        from ckptlib.read.to_safetensors import export_safetensors
        def rss(key):
            return int([l for l in open("/proc/self/status") if l.startswith(key)][0].split()[1]) << 10
        with ckptlib.open({str(tmp_path / "ck")!r}) as ck:
            ck.read("/model/w0", (0, 0))
            base = rss("VmRSS:")
            if {fmt!r} == "zarr3":
                export_zarr3(ck, {str(tmp_path / "out")!r})
            else:
                export_safetensors(ck, {str(tmp_path / "out")!r}, "model")
        print(json.dumps({{"base": base, "peak": rss("VmHWM:")}}))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    growth = got["peak"] - got["base"]
    print(f"{fmt}: peak RSS growth {growth >> 20} MiB for a {state_bytes >> 20} MiB state")
    assert growth < state_bytes // 2, f"peak RSS grew by {growth >> 20} MiB exporting {state_bytes >> 20} MiB"


def test_zarr3_keys_that_read_as_paths_each_get_their_own_array(tmp_path: Path) -> None:
    # Keys "..", ".", "zarr.json" and ones with spaces or "%" were percent-encoded, then decoded
    # again by tensorstore's kvstore URL: "/m/.." was written over the root, "/m/x/.." replaced the
    # group "m" (deleting the arrays already in it), "zarr.json" failed deep in tensorstore; the
    # export still said "exported 7 tensors". Every tensor now has its own array, bitwise.
    import tensorstore as ts

    keys = ["..", ".", "a b%c", "A", "ü", "", "zarr.json", "%2E"]
    state = {"m": {k: torch.full((i + 1,), float(i)) for i, k in enumerate(keys)}}
    state["m"]["x"] = {"..": torch.full((9,), 9.0)}
    ckptlib.save(state, tmp_path / "ck")
    out = tmp_path / "out"
    with ckptlib.open(tmp_path / "ck") as view:
        summary = export_zarr3(view, str(out))
        names = {i.name for i in view.tensors()}
    assert summary["tensors"] == len(names) == len(keys) + 1
    found = {}
    for meta in out.rglob("zarr.json"):
        doc = json.loads(meta.read_text())
        if doc["node_type"] == "array":
            arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(meta.parent) + "/"}}).result()
            found[doc["attributes"]["ckptlib_path"]] = torch.from_numpy(arr.read().result())
    assert set(found) == names
    loaded = ckptlib.load(tmp_path / "ck")
    with ckptlib.open(tmp_path / "ck") as view:
        for name in names:
            assert torch.equal(found[name], view.read(name)), name
    assert torch.equal(loaded["m"]["x"][".."], found["/m/x/.."])


def test_safetensors_names_are_the_saved_keys_not_their_escaped_form(tmp_path: Path) -> None:
    # Keys that ckptlib escapes in tensor names ("0" as "~s0", "a/b" as "a~1b", "x~y" as "x~0y")
    # were exported as their escaped form, so load_state_dict and ckptlib.load(folder) saw keys
    # the state never had. They are now the keys themselves; keys that become one name are refused.
    from safetensors.torch import load_file

    sub = {"0": {"weight": torch.full((2,), 1.0)}, "a/b": torch.full((3,), 2.0), "x~y": torch.full((4,), 3.0),
           "~s": torch.full((5,), 4.0), 7: torch.full((6,), 5.0)}
    ckptlib.save({"model": sub}, tmp_path / "ck")
    with ckptlib.open(tmp_path / "ck") as view:
        export_safetensors(view, str(tmp_path / "st"), select="model")
    files = sorted((tmp_path / "st").glob("*.safetensors"))
    got = {k: v for f in files for k, v in load_file(str(f)).items()}
    want = {"0.weight": sub["0"]["weight"], "a/b": sub["a/b"], "x~y": sub["x~y"], "~s": sub["~s"], "7": sub[7]}
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    back = ckptlib.load(tmp_path / "st", select="model")["model"]
    assert set(back) == set(want) and all(torch.equal(back[k], v) for k, v in want.items())
    ckptlib.save({"model": {"0": torch.ones(1), 0: torch.zeros(1)}}, tmp_path / "clash")
    with ckptlib.open(tmp_path / "clash") as view, pytest.raises(ckptlib.UnsupportedValueError, match="collide"):
        export_safetensors(view, str(tmp_path / "st2"), select="model")
