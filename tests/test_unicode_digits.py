"""Keys and folder names made of non-ASCII digits. ``str.isdigit()`` is true for "²" and for
U+0661 (Arabic-Indic one), and ``int()`` refuses the first and reads the second as 1, so three places that asked
``isdigit()`` before ``int()`` crashed or misread (and a fourth, the table width from ``COLUMNS``): ``ckptlib inspect`` sorting a tensor named
``w1²`` (exit 2, "invalid literal for int()"), ``open(url).load("x/³")`` (a ValueError for a
key that is not saved, not the KeyError that names the path), and the node-folder listing of a
tier template (``ckptlib nodes``) meeting a folder ``node-²``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.tiers.inventory import node_folders


@pytest.fixture
def saved(tmp_path: Path) -> str:
    state = {"w1²": torch.ones(2), "x": {"²": torch.zeros(1), 1: torch.ones(1), "\u0661": torch.full((1,), 7.0)},
             "l": [torch.full((1,), 3.0)]}
    ckptlib.save(state, tmp_path / "c")
    return str(tmp_path / "c")


def test_inspect_sorts_names_with_superscript_digits(saved: str) -> None:
    r = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", saved, "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [t["name"] for t in json.loads(r.stdout)["tensors"]] == ["/l/0", "/w1²", "/x/1", "/x/\u0661", "/x/²"]


def test_view_paths_with_non_ascii_digits(saved: str) -> None:
    view = ckptlib.open(saved)
    assert torch.equal(view.load("x/²"), torch.zeros(1))
    assert torch.equal(view.load("x/\u0661"), torch.full((1,), 7.0))  # the str key, not the int key 1
    assert torch.equal(view.load("x/1"), torch.ones(1))
    assert torch.equal(view.load("l/0"), torch.full((1,), 3.0))
    for missing in ("x/³", "l/²", "l/\u0661", "x/2"):
        with pytest.raises(KeyError, match=f"/{missing}: not in the checkpoint"):
            view.load(missing)


def test_node_folders_with_a_superscript_digit(tmp_path: Path) -> None:
    for name in ("node-0", "node-1", "node-²", "node-x"):
        (tmp_path / name).mkdir()
    got = node_folders(str(tmp_path / "node-{node}"))
    assert got == [(0, str(tmp_path / "node-0")), (1, str(tmp_path / "node-1")),
                   (None, str(tmp_path / "node-x")), (None, str(tmp_path / "node-²"))]


def test_a_superscript_columns_variable_is_ignored(saved: str) -> None:
    """A piped command reads its table width from ``COLUMNS``; "²" used to end it in a traceback."""
    env = {**os.environ, "COLUMNS": "²"}
    r = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", saved], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "/w1²" in r.stdout and "Traceback" not in r.stderr
