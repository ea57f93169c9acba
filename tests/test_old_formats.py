"""Checkpoints written by earlier releases load with today's code, bit for bit.

The fixtures in tests/old_formats/*.tar.gz were written by the commits that
tests/old_formats/make.py names (FIXTURES: format v1 before the packed table, format v2 as first
released, format v2 with index files of their own and a local tier), by real processes (1 and
2 ranks: Shard and DTensor pieces, per-rank values, non-tensor values, zstd, async saves). Each
is read here by ``restore``, ``ckptlib.load``, ``ckptlib.open`` and every CLI command; every
tensor is compared byte for byte with :func:`make.expected`.
"""

from __future__ import annotations

import json
import math
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlib
from ckptlib.cli.main import main as cli_main

HERE = Path(__file__).parent / "old_formats"
sys.path.insert(0, str(HERE))
import make  # noqa: E402

NAMES = sorted(make.FIXTURES)


def _unpack(name: str, dest: Path) -> Path:
    with tarfile.open(HERE / f"{name}.tar.gz") as tar:
        tar.extractall(dest, filter="data")
    return dest


def _same(want: Any, got: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(want.reshape(-1).view(torch.uint8), got.reshape(-1).contiguous().view(torch.uint8)) \
            if want.dtype != torch.bool else torch.equal(want, got), path
    elif isinstance(want, dict):
        assert set(want) == set(got), path
        for k in want:
            _same(want[k], got[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(want) is type(got) and len(want) == len(got), path
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            _same(a, b, f"{path}/{i}")
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), path
    else:
        assert type(want) is type(got) and want == got, f"{path}: {got!r} != {want!r}"


def _world(name: str) -> int:
    return int(name.rpartition("-w")[2])


def _target(world: int) -> dict[str, Any]:
    """A state of zeros shaped like the fixture's (sharded tensors whole: a 2-rank save loaded on one)."""
    zero = {k: torch.zeros_like(v) for k, v in make.expected(0, world)["model"].items()}
    st: dict[str, Any] = {"model": zero, "plain": {k: torch.zeros_like(v) for k, v in make.expected(0, 1)["plain"].items()},
                          "vals": None, "rng": None}
    if world > 1:
        st["sharded"] = {k: torch.zeros_like(v) for k, v in make.expected(0, world)["sharded"].items()}
    return st


@pytest.mark.parametrize("name", NAMES)
def test_old_checkpoints_restore_and_load_bitwise(name: str, tmp_path: Path) -> None:
    root = _unpack(name, tmp_path)
    world = _world(name)
    per_rank = {"per_rank": "rank0"} if world > 1 else {}
    want = make.expected(0, world)
    with ckptlib.CheckpointManager(root / "run") as m:
        assert [(i.step, i.status) for i in m.steps()] == [(10, "committed"), (20, "committed")]
        st = _target(world)
        assert m.restore(st, **per_rank) == 20
    _same(want, {k: v for k, v in st.items() if k != "rng"})
    assert st["rng"] == ("rank", 0, b"\x00" * 3)
    got = ckptlib.load(root / "oneshot", **per_rank)
    _same(want, {k: v for k, v in got.items() if k != "rng"})
    everyone = ckptlib.load(root / "oneshot", per_rank="all")["rng"]
    assert everyone == [("rank", r, bytes([r]) * 3) for r in range(world)]
    assert ckptlib.load_metadata(root / "run" / "step-000000000010") == {"run": "old"}
    with ckptlib.open(root / "run") as ck:
        assert ck.step == 20
        assert torch.equal(ck.read("/model/w", index=(slice(3, 70), slice(5, 9))).view(torch.uint8),
                           want["model"]["w"][3:70, 5:9].contiguous().view(torch.uint8))
        if world > 1:
            cols = want["sharded"]["cols"]
            assert torch.equal(ck.read("/sharded/cols", index=(slice(None), slice(10, 20))).view(torch.uint8),
                               cols[:, 10:20].contiguous().view(torch.uint8))
        _same(want["plain"], ck.load(select="plain"))


@pytest.mark.parametrize("name", NAMES)
def test_old_checkpoints_through_every_cli_command(name: str, tmp_path: Path, capsys) -> None:
    root = _unpack(name, tmp_path)
    run = str(root / "run")
    want = make.expected(0, _world(name))
    assert cli_main(["ls", run]) == 0
    assert cli_main(["verify", "--all", run]) == 0
    assert cli_main(["verify", str(root / "oneshot")]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", "--json", run]) == 0
    doc = json.loads(capsys.readouterr().out)
    shapes = {t["name"]: (t["dtype"], tuple(t["shape"])) for t in doc["tensors"]}
    for key, t in want["plain"].items():
        assert shapes[f"/plain/{key}"] == (str(t.dtype).removeprefix("torch."), tuple(t.shape))
    assert cli_main(["diff", run, run, "--step-a", "10", "--step-b", "20"]) == 0
    assert "identical" in capsys.readouterr().out
    out = tmp_path / "st"
    assert cli_main(["export", run, "--to", "safetensors", str(out), "--select", "/plain"]) == 0
    from safetensors.torch import load_file

    exported: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_file(f))
    _same(want["plain"], exported)
    assert cli_main(["prune", run, "--keep-last", "1"]) == 0
    assert sorted(p.name for p in Path(run).iterdir()) == ["step-000000000020"]
    assert cli_main(["verify", run]) == 0


def test_old_tiered_run_restores_from_its_local_tier(tmp_path: Path) -> None:
    """The v2 release with index files of their own: step 3 only on the local tier, step 2 on both."""
    root = _unpack("v2-92458a9-w2", tmp_path)
    want = make.expected(0, 2)
    assert cli_main(["verify", "--all", str(root / "tiered"), "--local", str(root / "local")]) == 0
    with ckptlib.CheckpointManager(root / "tiered", local=str(root / "local")) as m:
        st = _target(2)
        assert m.restore(st, per_rank="rank0") == 3
    _same(want, {k: v for k, v in st.items() if k != "rng"})


@pytest.mark.parametrize("name", ["v1-14c93c8-w2", "v2-92458a9-w2", "v2-09bb324-w1"])
def test_old_checkpoints_restore_on_two_real_ranks(name: str, tmp_path: Path) -> None:
    """Two gloo processes restore into Shard pieces split another way and a DTensor sharded along
    the other dimension (a 1-rank fixture: every rank takes the whole state)."""
    import launcher

    root = _unpack(name, tmp_path)
    worker = HERE / "restore_rank.py"

    def argv(rank: int, port: str) -> list[str]:
        return [str(worker), str(root), str(rank), "2", str(_world(name)), str(tmp_path / f"result-{rank}.json")]

    outcomes = launcher.finish(f"restore {name}", launcher.start(argv, 2), lambda r: tmp_path / f"result-{r}.json",
                               timeout=240)
    for o in outcomes:
        assert o.result == {"step": 20, "bad": []}, f"rank {o.rank}: {o.result}\n{o.log}"
