"""The README's five-minute start runs as written, against the source tree.

CI also runs it against the built wheel in a fresh venv (``tests/packaging/check_wheel.py``,
called by ``.ci/run``); this test keeps the README from rotting where that check is skipped.
The blocks are found by the same function the wheel check uses.
"""

from __future__ import annotations

import ast
import importlib.util
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


def test_markers_missing_is_a_clear_error() -> None:
    with pytest.raises(CHECK_WHEEL.CheckFailed, match="quickstart:python:begin"):
        CHECK_WHEEL.readme_blocks("# ckptlib\n```python\nprint(1)\n```\n")


def test_quickstart_block_is_python_that_runs(tmp_path: Path) -> None:
    python, commands = CHECK_WHEEL.readme_blocks((REPO / "README.md").read_text())
    ast.parse(python, "README.md quickstart block")  # a syntax error names the line
    assert commands[0].startswith("ckptlib ls "), commands
    (tmp_path / "quickstart.py").write_text(python)

    first = _run([sys.executable, "quickstart.py"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert "restored step 30" in first.stdout
    # The README says a second run resumes from step 30 and trains no more.
    second = _run([sys.executable, "quickstart.py"], tmp_path)
    assert second.returncode == 0, second.stderr
    assert "restored step 30" in second.stdout
    assert "on disk: [(20, 'committed'), (30, 'committed')]" in second.stdout

    outputs = {}
    for line in commands:  # `ckptlib ...` as the console script would run it
        cli = _run([sys.executable, "-m", "ckptlib.cli.main", *line.split()[1:]], tmp_path)
        assert cli.returncode == 0, f"{line}: {cli.stdout}\n{cli.stderr}"
        outputs[line.split()[1]] = cli.stdout
    assert outputs["ls"].count("committed") >= 2, outputs["ls"]  # steps 20 and 30
