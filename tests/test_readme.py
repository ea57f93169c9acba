"""The README's five-minute start runs as written, against the source tree: twice, the first
run training 30 steps, the second none, and both restoring exactly the weights and optimizer
state the first run trained (``check_wheel.check_runs`` on the runs' probed output).

CI also runs it against the built wheel in a fresh venv (``tests/packaging/check_wheel.py``,
called by ``.ci/run``); this test keeps the README from rotting where that check is skipped.
The blocks are found by the same function the wheel check uses.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _check_wheel() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_wheel", REPO / "tests" / "packaging" / "check_wheel.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CHECK_WHEEL = _check_wheel()


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO))


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=240)


def _probed(start: int, trained: int, state: str, resumed: str) -> str:
    digests = json.dumps({"state": state, "resumed": resumed})
    return f"resumed at step {start}, trained {trained} steps\nquickstart-probe {digests}\n"


def test_check_runs_refuses_a_resume_that_retrains_or_restores_other_weights() -> None:
    first = _probed(0, 30, "a", "a")
    CHECK_WHEEL.check_runs(first, _probed(30, 0, "a", "a"))
    with pytest.raises(CHECK_WHEEL.CheckFailed, match="trained 30 steps; expected 30 and 0"):
        CHECK_WHEEL.check_runs(first, _probed(30, 30, "a", "a"))
    with pytest.raises(CHECK_WHEEL.CheckFailed, match="resumed at step 0"):
        CHECK_WHEEL.check_runs(first, _probed(0, 30, "a", "a"))
    with pytest.raises(CHECK_WHEEL.CheckFailed, match="second run's restore restored other weights"):
        CHECK_WHEEL.check_runs(first, _probed(30, 0, "a", "b"))
    with pytest.raises(CHECK_WHEEL.CheckFailed, match="no `resumed at step N"):
        CHECK_WHEEL.check_runs(first, "restored step 30\n")


def test_markers_missing_is_a_clear_error() -> None:
    with pytest.raises(CHECK_WHEEL.CheckFailed, match="quickstart:python:begin"):
        CHECK_WHEEL.readme_blocks("# ckptlib\n```python\nprint(1)\n```\n")


def test_quickstart_block_is_python_that_runs(tmp_path: Path) -> None:
    python, commands = CHECK_WHEEL.readme_blocks((REPO / "README.md").read_text())
    ast.parse(python, "README.md quickstart block")  # a syntax error names the line
    assert commands[0].startswith("ckptlib ls "), commands
    (tmp_path / "quickstart.py").write_text(python)

    # Each run through the probe: its own output plus digests of what it trained and restored.
    first = _run([sys.executable, "-c", CHECK_WHEEL.PROBE], tmp_path)
    assert first.returncode == 0, first.stderr
    # The README says a second run resumes from step 30 and trains no more.
    second = _run([sys.executable, "-c", CHECK_WHEEL.PROBE], tmp_path)
    assert second.returncode == 0, second.stderr
    CHECK_WHEEL.check_runs(first.stdout, second.stdout)  # steps trained, restored weights
    assert "on disk: [(20, 'committed'), (30, 'committed')]" in second.stdout

    outputs = {}
    for line in commands:  # `ckptlib ...` as the console script would run it
        cli = _run([sys.executable, "-m", "ckptlib.cli.main", *line.split()[1:]], tmp_path)
        assert cli.returncode == 0, f"{line}: {cli.stdout}\n{cli.stderr}"
        outputs[line.split()[1]] = cli.stdout
    assert outputs["ls"].count("committed") >= 2, outputs["ls"]  # steps 20 and 30
