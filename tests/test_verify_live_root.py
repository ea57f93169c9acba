"""``ckptlib verify --all`` on a root while a job saves (a cron job verifying a live run), and
after that job was SIGKILLed mid-save: the save's ``.tmp-`` folder is not a checkpoint, so it is
reported as ``in progress`` (young) or ``debris`` (its save started longer than
``--debris-min-age`` ago: ``ckptlib prune`` removes it), never as a failed step. The committed
steps are still deep-checked, and a damaged one still fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import flip_bit

from ckptlib.backends import open_storage
from ckptlib.cli.main import main
from ckptlib.engine.scan import read_manifest
from ckptlib.format import layout

REPO = Path(__file__).resolve().parent.parent
WORKER = """
import sys, torch, ckptlib
with ckptlib.CheckpointManager(sys.argv[1], async_save=False) as mgr:
    for s in (1, 2):
        mgr.save(s, {"w": torch.full((256, 64), float(s)), "step": s})
        print("committed", s, flush=True)
"""


def _verify(capsys: pytest.CaptureFixture[str], root: Path, *extra: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["verify", str(root), "--all", "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def _wait_stopped(pid: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.05)
    raise AssertionError("the worker never reached its crash point")


def test_verify_all_reports_a_running_save_as_in_progress_and_a_dead_ones_folder_as_debris(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTLIB_TEST_KILL_AT": "before_commit:0:STOP:2"}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(root)], env=env, stdout=subprocess.DEVNULL)
    try:
        _wait_stopped(proc.pid, time.monotonic() + 180)  # step 1 committed; step 2's bytes written, not committed
        (tmp,) = [p.name for p in root.iterdir() if ".tmp-" in p.name]

        code, doc = _verify(capsys, root)
        rows = {r["path"]: r for r in doc["steps"]}
        assert rows[layout.step_dir(1)]["status"] == "committed"
        assert rows[tmp]["status"] == "in progress", rows[tmp]
        assert code == 0 and doc["ok"], doc

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        code, doc = _verify(capsys, root, "--debris-min-age", "0")  # the dead save's folder, old enough
        row = {r["path"]: r for r in doc["steps"]}[tmp]
        assert row["status"] == "debris" and "ckptlib prune" in row["reason"], row
        assert code == 0, doc

        capsys.readouterr()
        assert main(["verify", str(root), "--all", "--debris-min-age", "0"]) == 0
        text = capsys.readouterr().out
        assert "debris" in text and "FAILED" not in text, text

        m = read_manifest(open_storage(str(root)), layout.step_dir(1))  # a damaged step still fails
        flip_bit(root / layout.step_dir(1) / m.files[0].path, m.files[0].size // 2)
        code, doc = _verify(capsys, root, "--debris-min-age", "0")
        assert code == 1 and {r["path"]: r["status"] for r in doc["steps"]}[layout.step_dir(1)] == "corrupt"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
