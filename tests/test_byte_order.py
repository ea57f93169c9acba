"""Tensor bytes are stored little-endian (docs/format.md, section 2). A big-endian host would
write or read every multi-byte value byte-swapped, silently: there, the first save or load is
refused with a typed error instead. The host here is little-endian, so the test pretends."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import ckptlib


def test_a_big_endian_host_is_refused_not_misread(tmp_path: Path) -> None:
    ckptlib.save({"w": torch.arange(4, dtype=torch.float32)}, tmp_path / "ck")  # written little-endian
    code = textwrap.dedent(f"""
        import sys
        sys.byteorder = "big"  # before ckptlib maps its dtypes (first save or load)
        import torch, ckptlib
        for what, call in (("load", lambda: ckptlib.load({str(tmp_path / "ck")!r})),
                           ("save", lambda: ckptlib.save({{"w": torch.ones(2)}}, {str(tmp_path / "new")!r}))):
            try:
                call()
            except ckptlib.CheckpointError as e:
                print(what, "refused:", e)
            else:
                print(what, "went through")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("refused:" in line and "big-endian" in line for line in lines), out.stdout
    assert not (tmp_path / "new").exists()
