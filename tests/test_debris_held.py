"""A save in flight holds its staging folder (``Storage.hold``: a ``flock`` on POSIX), so the
debris clean-up of another job on the same root, or ``ckptlib prune --debris-min-age 0``, never
deletes it: it was removed as "crashed save" (its marker proves it ckptlib's), and that job's
commit then failed. Once the holding process is dead (SIGKILL), the same folder is debris and
the next save's clean-up removes it. Real processes, real kills, real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.cli.main import main
from ckptlib.format import layout

REPO = Path(__file__).resolve().parent.parent
JOB_A = """
import sys, torch, ckptlib
step = int(sys.argv[2])
with ckptlib.CheckpointManager(sys.argv[1], async_save=False) as mgr:
    mgr.save(step, {"w": torch.arange(4096, dtype=torch.float32) * step, "step": step})
print("committed", step, flush=True)
"""


def _start_a(root: Path, step: int) -> tuple[subprocess.Popen[str], str]:
    """Job A's process, stopped (SIGSTOP) with its save's bytes written, before its commit; and
    the name of that save's ``.tmp-`` folder."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTLIB_TEST_KILL_AT": "before_commit:0:STOP"}
    proc = subprocess.Popen([sys.executable, "-c", JOB_A, str(root), str(step)], env=env,
                            stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                tmp = [p.name for p in root.iterdir() if p.name.startswith(layout.step_dir(step) + ".tmp-")]
                assert len(tmp) == 1, tmp
                return proc, tmp[0]
        assert proc.poll() is None, "job A ended before its crash point"
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    raise AssertionError("job A never reached its crash point")


def _b_saves(root: Path, step: int) -> None:
    """Job B (this process): one committed save, whose clean-up then judges the root's debris."""
    with ckptlib.CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(step, {"w": torch.full((64,), float(step))})


def test_a_save_in_flight_in_another_job_survives_its_cleanup_and_commits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    proc, tmp = _start_a(root, 3)
    try:
        _b_saves(root, 7)  # B's clean-up runs after its commit: A's folder is held
        assert (root / tmp).is_dir(), "another job's save in flight was deleted as debris"

        capsys.readouterr()  # an operator's prune from outside, with no age margin
        assert main(["prune", str(root), "--keep-last", "5", "--debris-min-age", "0", "--json"]) == 0
        out = capsys.readouterr().out
        assert (root / tmp).is_dir(), out
        capsys.readouterr()
        assert main(["verify", str(root), "--all", "--json", "--debris-min-age", "0"]) == 0
        rows = {r["path"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
        assert rows[tmp]["status"] == "in progress", rows[tmp]

        os.kill(proc.pid, signal.SIGCONT)  # A goes on: its commit finds its folder and succeeds
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0 and "committed 3" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert not (root / tmp).exists()
    restored = ckptlib.load(str(root / layout.step_dir(3)))
    assert torch.equal(restored["w"], torch.arange(4096, dtype=torch.float32) * 3)
    assert restored["step"] == 3


def test_a_killed_jobs_save_is_debris_for_the_next_cleanup(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    proc, tmp = _start_a(root, 3)
    os.kill(proc.pid, signal.SIGKILL)  # the kernel drops its hold
    proc.communicate(timeout=60)
    assert (root / tmp).is_dir() and not open_storage(str(root)).held(tmp)
    _b_saves(root, 7)
    assert not (root / tmp).exists(), "a dead save's folder was kept"
    assert torch.equal(ckptlib.load(str(root / layout.step_dir(7)))["w"], torch.full((64,), 7.0))


def test_hold_ends_with_the_save_in_this_process(tmp_path: Path) -> None:
    """The coordinator's hold is given up at the commit and at an abort: nothing stays held
    (a held folder of this process would be kept from its own clean-up), and no descriptor
    is left open."""
    root = tmp_path / "run"
    fds = len(os.listdir("/proc/self/fd"))
    with ckptlib.CheckpointManager(str(root), async_save=False) as mgr:
        for s in range(1, 4):
            mgr.save(s, {"w": torch.full((8,), float(s))})
    assert len(os.listdir("/proc/self/fd")) == fds
    storage = open_storage(str(root))
    hold = storage.hold(layout.step_dir(3))
    assert hold is not None and storage.held(layout.step_dir(3))
    hold.close()
    hold.close()  # idempotent
    assert not storage.held(layout.step_dir(3))
