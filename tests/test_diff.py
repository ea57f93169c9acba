"""``ckptlib diff``: what changed between two steps or checkpoints, exit 0 identical / 1 differ /
2 error, JSON output; and the library comparison behind it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_read_view import flip_chunk_bit

import ckptlib
from ckptlib.cli.main import main as cli
from ckptlib.read.compare import compare


def run_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    code = cli([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    base = {"w": torch.arange(12.0).reshape(3, 4), "f8": torch.ones(4).to(torch.float8_e4m3fn),
            "i": torch.arange(5), "gone": torch.zeros(2), "lr": 0.1}
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, base)
        mgr.save(2, base)  # identical tensors
        later = dict(base)
        later["w"] = base["w"].clone()
        later["w"][1, 2] += 0.25
        later["w"][2, 3] = -100.0  # |11 - (-100)| = 111
        later["f8"] = torch.full((4,), 2.0).to(torch.float8_e4m3fn)
        later["i"] = torch.arange(6)
        del later["gone"]
        later["new"] = torch.ones(1, dtype=torch.bfloat16)
        mgr.save(3, later)
    return root


def test_identical_steps_exit_0(run_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_json(["diff", str(run_root), str(run_root), "--step-a", "1", "--step-b", "2"], capsys)
    assert code == 0 and doc["identical"] is True and doc["same"] == 4 and doc["exit_code"] == 0
    assert cli(["diff", str(run_root), str(run_root), "--step-a", "1", "--step-b", "2"]) == 0


def test_changes_are_reported_exit_1(run_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_json(["diff", str(run_root), str(run_root), "--step-a", "1"], capsys)  # B: newest (3)
    assert code == 1 and doc["identical"] is False and (doc["step_a"], doc["step_b"]) == (1, 3)
    assert doc["only_a"] == ["/gone"] and doc["only_b"] == ["/new"]
    rows = {r["name"]: r for r in doc["changed"]}
    assert set(rows) == {"/w", "/f8", "/i"}
    assert rows["/w"]["kind"] == "values" and rows["/w"]["changed"] == 2 and rows["/w"]["elements"] == 12
    assert math.isclose(rows["/w"]["max_abs_diff"], 111.0)
    assert rows["/f8"]["max_abs_diff"] == 1.0 and rows["/f8"]["changed"] == 4
    assert rows["/i"]["kind"] == "shape" and rows["/i"]["shape_b"] == [6]
    assert doc["same"] == 0
    code = cli(["diff", str(run_root), str(run_root), "--step-a", "1"])
    out = capsys.readouterr().out
    assert code == 1 and "only in A" in out and "/gone" in out and "111" in out


def test_dtype_change_and_library_api(tmp_path: Path) -> None:
    ckptlib.save({"w": torch.zeros(3)}, tmp_path / "a")
    ckptlib.save({"w": torch.zeros(3, dtype=torch.float64)}, tmp_path / "b")
    with ckptlib.open(tmp_path / "a") as a, ckptlib.open(tmp_path / "b") as b:
        result = compare(a, b)
        assert compare(a, a)["identical"]
    assert [(r["name"], r["kind"]) for r in result["changed"]] == [("/w", "dtype")]


def test_errors_exit_2(run_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["diff", str(run_root), str(tmp_path / "missing")]) == 2
    assert cli(["diff", str(run_root), str(run_root), "--step-a", "99"]) == 2
    assert cli(["diff", str(run_root)]) == 2  # usage
    big = {"w": torch.arange(64 * 4096, dtype=torch.float32).reshape(64, 4096)}
    ckptlib.save(big, tmp_path / "x")
    ckptlib.save(big, tmp_path / "y")
    assert cli(["diff", str(tmp_path / "x"), str(tmp_path / "y")]) == 0
    flip_chunk_bit(tmp_path / "y", "/w", 0)
    capsys.readouterr()
    assert cli(["diff", str(tmp_path / "x"), str(tmp_path / "y")]) == 2  # corrupt: an error, not "differs"
    assert "checksum mismatch" in capsys.readouterr().err


def test_empty_tensors_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Tensors with no rows (or no columns) are compared, not an error."""
    empty = {"rows": torch.zeros(0, 4), "flat": torch.zeros(0), "cols": torch.zeros(3, 0, dtype=torch.int64)}
    ckptlib.save({"model": empty}, tmp_path / "a")
    ckptlib.save({"model": {**empty, "rows": torch.zeros(0, 5)}}, tmp_path / "b")
    code, doc = run_json(["diff", str(tmp_path / "a"), str(tmp_path / "a")], capsys)
    assert code == 0 and doc["identical"] is True and doc["same"] == 3
    code, doc = run_json(["diff", str(tmp_path / "a"), str(tmp_path / "b")], capsys)
    assert code == 1 and [(r["name"], r["kind"]) for r in doc["changed"]] == [("/model/rows", "shape")]
    assert doc["same"] == 2
