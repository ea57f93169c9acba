"""End-to-end test of the README demo: examples/train_gpt_resume.py.

The demo trains a tiny GPT three times in separate processes (reference, SIGKILLed, resumed)
and checks that the resumed run ends bitwise identical to the uninterrupted one. Here it runs
with small settings and the machine-readable OUT/summary.json is checked as well as the exit
status and the PASS line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "train_gpt_resume.py"

pytestmark = pytest.mark.chaos  # real processes, really killed


def run_demo(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def demo_failed(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit status {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


@pytest.mark.parametrize(
    ("kill_at", "mid_save"),
    [
        pytest.param(15, False, id="kill-between-saves"),
        pytest.param(12, True, id="kill-while-saving"),
    ],
)
def test_demo_resume_is_bitwise_exact(tmp_path: Path, kill_at: int, mid_save: bool) -> None:
    steps, save_every = 20, 4
    out = tmp_path / "demo"
    proc = run_demo(
        out,
        "--steps", str(steps),
        "--save-every", str(save_every),
        "--kill-at", str(kill_at),
        "--seed", "3",
    )  # fmt: skip
    assert proc.returncode == 0, demo_failed(proc)
    assert "PASS:" in proc.stdout, demo_failed(proc)

    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["result"] == "PASS"
    assert summary["killed_after_step"] == kill_at

    # Final weights, AdamW state, scheduler and RNG matched the uninterrupted run exactly.
    assert summary["max_abs_diff"] == 0
    assert summary["mismatches"] == []
    assert summary["sha256_mismatches"] == []
    assert summary["tensors_compared"] > 0
    assert summary["loss_curve_matches"] is True

    # It resumed from the newest step that was committed when the process died ...
    resumed = summary["resumed_from"]
    committed = summary["committed_after_kill"]
    assert resumed is not None
    assert resumed in committed
    assert resumed == max(committed)
    assert resumed % save_every == 0
    assert summary["steps_redone"] == kill_at - resumed
    if mid_save:
        # ... which is the save cut off by the kill if it got committed in time, else the one
        # before it; never anything older.
        assert kill_at - save_every <= resumed <= kill_at
    else:
        assert 0 < resumed < kill_at

    assert summary["cli_ls_exit_status"] == 0


def test_demo_refuses_to_clear_a_foreign_folder(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    proc = run_demo(out, "--steps", "4", "--save-every", "2", "--kill-at", "3")
    assert proc.returncode != 0
    assert "not created by this demo" in proc.stderr
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
