"""``ckptlib export``: zarr3 (read back with tensorstore and zarr-python) and safetensors (read
back with the safetensors package) equal the source state bit for bit for every dtype (compared
with the tensors that were saved, never with ckptlib's own reading of the checkpoint); sharded
pieces are consolidated; a corrupt chunk stops the export; memory stays bounded (measured)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
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
    assert not [p for p in (tmp_path / "s").iterdir() if p.suffix == ".safetensors"]  # no partial file kept
    assert cli(["export", str(tmp_path / "ck"), "--to", "safetensors", str(tmp_path / "s")]) == 2  # no --select


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
