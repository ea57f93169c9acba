"""``ckptlib ls``/``verify``/``prune``/``--help``/``--version`` never import torch.

Each command runs as a real subprocess through the real entry point
(``python -X importtime -m ckptlib.cli.main ...``) and the modules it imported are read from
the ``-X importtime`` report on stderr. The checkpoints are real, zstd-compressed (so deep
``verify`` checks zstd frames) and one of them has a flipped bit (so a failing check runs too).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import flip_bit

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.engine.scan import read_manifest
from ckptlib.format import layout

REPO = Path(__file__).resolve().parents[1]


def imported_modules(*argv: str) -> tuple[int, set[str], str]:
    """(exit status, modules imported, stdout) of ``python -X importtime ARGV``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True,
                          env=env, timeout=120)
    mods = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
            if line.startswith("import time:")}
    assert "ckptlib" in mods, proc.stderr[-2000:]  # the report was read
    return proc.returncode, mods, proc.stdout


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("imports") / "run"
    with ckptlib.CheckpointManager(path, async_save=False, compression="zstd") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((256, 128), float(step)), "b": torch.arange(7), "n": step})
    folder = layout.step_dir(2)
    m = read_manifest(open_storage(path), folder)
    chunk = m.tensors["/w"].chunks[0]
    flip_bit(path / folder / m.files[chunk.file].path, chunk.start + chunk.length // 2)
    return str(path)


@pytest.fixture(scope="module")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiered run in one process: root ``p``, node folder ``n0``."""
    path = tmp_path_factory.mktemp("tiers")
    with ckptlib.CheckpointManager(path / "p", local=str(path / "n{node}"), persist_every=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((64, 8), float(step)), "n": step})
    return str(path)


CASES = {
    "ls": (["ls", "{root}"], 0),
    "ls --json": (["ls", "{root}", "--json"], 0),
    "verify": (["verify", "{root}"], 0),
    "verify --all": (["verify", "{root}", "--all"], 1),  # step 2 is corrupt: the check ran
    "prune --dry-run": (["prune", "{root}", "--keep-last", "1", "--dry-run"], 0),
    "prune --verify --dry-run": (["prune", "{root}", "--keep-last", "2", "--verify", "--dry-run"], 0),
    "ls --local": (["ls", "{tiers}/p", "--local", "{tiers}/n{{node}}"], 0),
    "verify --local --all": (["verify", "{tiers}/p", "--local", "{tiers}/n{{node}}", "--all"], 0),
    "prune --local --dry-run": (["prune", "{tiers}/p", "--local", "{tiers}/n{{node}}", "--keep-last", "1",
                                 "--local-keep-last", "1", "--dry-run"], 0),
    "--help": (["--help"], 0),
    "ls --help": (["ls", "--help"], 0),
    "--version": (["--version"], 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_command_does_not_import_torch(root: str, tiers: str, case: str) -> None:
    argv, want = CASES[case]
    code, mods, out = imported_modules("-m", "ckptlib.cli.main", *(a.format(root=root, tiers=tiers) for a in argv))
    assert code == want, out
    assert out  # it printed its result
    assert "torch" not in mods, f"`ckptlib {case}` imported torch"


def test_import_ckptlib_is_lazy_and_names_resolve() -> None:
    code, mods, out = imported_modules("-c", "import ckptlib; print(set(ckptlib.__all__) <= set(dir(ckptlib)))")
    assert code == 0 and out.strip() == "True", out
    assert "torch" not in mods
    # The control: the same report does show torch once a torch-using name is touched.
    code, mods, out = imported_modules("-c", "import ckptlib; print(ckptlib.CheckpointManager.__name__)")
    assert (code, out.strip()) == (0, "CheckpointManager") and "torch" in mods


def test_lazy_names_are_the_real_objects() -> None:
    from ckptlib.api import save
    from ckptlib.manager import CheckpointManager
    from ckptlib.read.view import open_view

    assert (ckptlib.save, ckptlib.CheckpointManager, ckptlib.open) == (save, CheckpointManager, open_view)
    assert all(getattr(ckptlib, name) is not None for name in ckptlib.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ckptlib.nope  # noqa: B018
