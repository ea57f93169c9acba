"""A feature whose optional package is missing raises ``ckptlib.MissingDependencyError`` naming
``pip install "ckptlib[EXTRA]"`` (an extra pyproject.toml declares), never a bare
``ModuleNotFoundError`` from deep inside, and never at ``import ckptlib`` time.

Each case runs in a real subprocess whose import system hides the optional package (the
development venv has them all installed), as on a core-only install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib
import torch

import ckptlib

REPO = Path(__file__).resolve().parents[1]

HIDE = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Hide())
import ckptlib
"""


def run_hidden(hidden: set[str], body: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` (after ``import ckptlib``) with the packages ``hidden`` not importable."""
    code = HIDE.format(hidden=hidden) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=env, timeout=120)


def catching(body: str) -> str:
    """``body`` wrapped so that the subprocess prints what its ``MissingDependencyError`` says
    (``EXTRA``, ``PACKAGE``, ``MESSAGE`` lines), or ``NO ERROR``."""
    return f"""
try:
{textwrap.indent(textwrap.dedent(body), " " * 4)}
except ckptlib.MissingDependencyError as e:
    assert isinstance(e, ImportError) and isinstance(e, ckptlib.CheckpointError)
    print("EXTRA", e.extra)
    print("PACKAGE", e.package)
    print("MESSAGE", e)
else:
    print("NO ERROR")
"""


def extras() -> set[str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("ckpt") / "step")
    ckptlib.save({"w": torch.arange(6.0).reshape(2, 3)}, url)
    return url


CASES = {
    "s3": ({"s3fs"}, """
        import torch
        ckptlib.save({"a": torch.ones(2)}, "s3://bucket/run")
    """),
    "zarr": ({"tensorstore"}, """
        with ckptlib.open(sys.argv[1]) as ckpt:
            ckpt.array("/w")
    """),
    "megatron": ({"megatron"}, """
        import ckptlib.integrations.megatron
    """),
    "lightning": ({"lightning"}, """
        from ckptlib.integrations.lightning import CkptlibCheckpointIO
    """),
}


@pytest.mark.parametrize("extra", sorted(CASES))
def test_missing_extra_names_the_install_command(extra: str, step: str) -> None:
    assert extra in extras()
    hidden, body = CASES[extra]
    proc = run_hidden(hidden, catching(body), step)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"EXTRA {extra}\n" in proc.stdout, proc.stdout
    assert f'pip install "ckptlib[{extra}]"' in proc.stdout, proc.stdout


def test_cli_export_zarr3_names_the_extra(step: str, tmp_path: Path) -> None:
    proc = run_hidden({"tensorstore"}, """
        from ckptlib.cli.main import main
        sys.exit(main(["export", sys.argv[1], "--to", "zarr3", sys.argv[2]]))
    """, step, str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert 'pip install "ckptlib[zarr]"' in proc.stderr, proc.stderr
    assert "storage backend" not in proc.stderr and "Traceback" not in proc.stderr


def test_import_ckptlib_needs_no_extra() -> None:
    proc = run_hidden({"s3fs", "tensorstore", "megatron", "lightning", "deepspeed", "accelerate"},
                      "print(len(ckptlib.__all__))")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_fsspec_scheme_without_its_package_names_it(tmp_path: Path) -> None:
    """``gs://`` needs gcsfs, which ckptlib has no extra for: the error names the package to install
    (it was fsspec's bare ImportError, not a ckptlib error); the CLI says the same, exit 2."""
    body = catching("""
        import torch
        ckptlib.save({"a": torch.ones(2)}, "gs://bucket/run/step")
    """)
    proc = run_hidden({"gcsfs"}, body + textwrap.dedent("""
        from ckptlib.cli.main import main
        sys.exit(main(["ls", "gs://bucket/run"]))
    """), str(tmp_path))
    assert "PACKAGE gcsfs\n" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "pip install gcsfs" in proc.stdout, proc.stdout
    assert proc.returncode == 2 and "pip install gcsfs" in proc.stderr, proc.stderr[-3000:]
