"""Lightning through ckptlib: a real Trainer with CkptlibCheckpointIO (sync, and async through
Lightning's AsyncCheckpointIO), SIGKILLed inside a save, resumed from newest_checkpoint: the
final weights are bitwise those of an uninterrupted run. Plus the plugin's own contract."""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import ckptlib
from ckptlib.integrations.lightning import CkptlibCheckpointIO, PickledValue, newest_checkpoint

WORKER = Path(__file__).resolve().parents[1] / "workers" / "lightning_worker.py"
EPOCHS = 4


def train(root: Path, io: str, kill_at: str | None = None) -> dict | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(ckptlib.__file__).parents[1]), *sys.path])}
    env.pop("CKPTLIB_TEST_KILL_AT", None)
    if kill_at:
        env["CKPTLIB_TEST_KILL_AT"] = kill_at
    p = subprocess.run([sys.executable, str(WORKER), str(root), io, str(EPOCHS)], env=env, capture_output=True,
                       timeout=300)
    if kill_at:
        assert p.returncode == -9, f"expected a SIGKILL at {kill_at}, got exit {p.returncode}:\n{p.stdout[-3000:]!r}"
        return None
    assert p.returncode == 0, p.stdout.decode(errors="replace")[-5000:] + p.stderr.decode(errors="replace")[-5000:]
    return json.loads((root / "result.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = train(tmp_path_factory.mktemp("lightning-ref"), "sync")
    assert out is not None and out["global_step"] == 6 * EPOCHS
    return out


@pytest.mark.parametrize("io, kill_at, resumed", [
    ("sync", "manifest:0::3", "epoch=1-step=12.ckpt"),  # the 3rd save's manifest written, never renamed
    ("async", "write:0::3", None),  # the 3rd save killed while its payload is written (worker thread)
])
def test_kill_during_save_then_resume_is_bitwise(tmp_path, reference, io, kill_at, resumed):
    train(tmp_path, io, kill_at)
    ckpt = tmp_path / "ckpt"
    debris = [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]
    assert debris, "the kill should have left the third save uncommitted"
    newest = newest_checkpoint(ckpt)
    assert newest is not None and ".tmp-" not in newest
    if resumed:
        assert newest.endswith(resumed)
    out = train(tmp_path, io)
    assert out is not None and out["resumed_from"] == newest
    assert out["global_step"] == reference["global_step"]
    assert out["weights"] == reference["weights"], "resumed training diverged from the uninterrupted run"


class Color(enum.Enum):
    RED = "red"


@dataclass
class Cfg:
    width: int
    path: Path


class Opaque:
    def __init__(self, v: int) -> None:
        self.v = v


def test_values_policy_and_remove(tmp_path):
    io = CkptlibCheckpointIO()
    ckpt = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 7, "epoch": 1,
            "hyper_parameters": {"color": Color.RED, "cfg": Cfg(3, Path("/x")), "tags": {"b", "a"}}}
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    back = io.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(back["state_dict"]["w"], torch.arange(4.0))
    assert back["hyper_parameters"] == {"color": "red", "cfg": {"width": 3, "path": "/x"}, "tags": ["a", "b"]}

    bad = {**ckpt, "hyper_parameters": {"obj": Opaque(5)}}
    with pytest.raises(ckptlib.UnsupportedValueError, match=r"/hyper_parameters/obj.*allow_pickle_for=\('hyper_parameters',\)"):
        io.save_checkpoint(bad, tmp_path / "b.ckpt")
    assert not (tmp_path / "b.ckpt").exists()

    CkptlibCheckpointIO(allow_pickle_for=("hyper_parameters",)).save_checkpoint(bad, tmp_path / "b.ckpt")
    opaque = io.load_checkpoint(tmp_path / "b.ckpt")["hyper_parameters"]["obj"]
    assert isinstance(opaque, PickledValue) and opaque.type_name.endswith("Opaque")  # never unpickled
    trusted = CkptlibCheckpointIO(unpickle=True).load_checkpoint(tmp_path / "b.ckpt")
    assert isinstance(trusted["hyper_parameters"]["obj"], Opaque) and trusted["hyper_parameters"]["obj"].v == 5

    assert newest_checkpoint(tmp_path) == f"{tmp_path}/b.ckpt"  # global_step 7 in both: the newer save wins
    io.remove_checkpoint(tmp_path / "b.ckpt")
    assert not (tmp_path / "b.ckpt").exists() and newest_checkpoint(tmp_path) == f"{tmp_path}/a.ckpt"
    io.remove_checkpoint(tmp_path / "gone.ckpt")  # missing: fine
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("user data")
    with pytest.raises(ckptlib.CheckpointError, match="not a ckptlib checkpoint"):
        io.remove_checkpoint(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "user data"
    with pytest.raises(TypeError, match="per-call storage_options"):
        io.save_checkpoint(ckpt, tmp_path / "c.ckpt", storage_options={"x": 1})


def test_integration_packages_import_no_framework():
    code = ("import sys, ckptlib.integrations.lightning as l, ckptlib.integrations.accelerate as a; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', "
            "'accelerate')))")
    env = {**os.environ, "PYTHONPATH": str(Path(ckptlib.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_newest_checkpoint_checks_the_files_of_the_newest_folders_only(tmp_path, monkeypatch):
    """``newest_checkpoint`` reads every folder's manifest (its global_step orders them), each
    once, and checks payload sizes newest first only as far as it goes: of 12 checkpoints whose
    newest is cut short, the files of two folders are checked, not of all 12."""
    from helpers import CountingStorage, payload_files

    from ckptlib.integrations.lightning import checkpoint_candidates
    from ckptlib.integrations.lightning import resume as lresume

    io = CkptlibCheckpointIO()
    for gs in range(1, 13):  # names that do not sort like the steps
        io.save_checkpoint({"state_dict": {"w": torch.full((4,), float(gs))}, "global_step": gs}, tmp_path / f"{13 - gs:02d}.ckpt")
    (victim,) = payload_files(tmp_path / "01.ckpt")  # global step 12
    os.truncate(victim, 3)
    opened: list[CountingStorage] = []
    real = lresume.open_storage

    def counting(url, options=None):
        opened.append(CountingStorage(real(url, options), kinds=("size",)))
        return opened[-1]

    monkeypatch.setattr(lresume, "open_storage", counting)
    assert newest_checkpoint(tmp_path) == f"{tmp_path}/02.ckpt"  # global step 11
    checked = {p.split("/")[0] for p in opened[0].calls if not p.endswith("manifest.json")}
    assert checked == {"01.ckpt", "02.ckpt"}, sorted(opened[0].calls)
    opened.clear()

    def reads(url, options=None):  # every read of the same run, by path
        opened.append(CountingStorage(real(url, options), kinds=("open_read", "read")))
        return opened[-1]

    monkeypatch.setattr(lresume, "open_storage", reads)
    assert newest_checkpoint(tmp_path) == f"{tmp_path}/02.ckpt"
    manifests = {p: n for p, n in opened[0].calls.items() if p.endswith("manifest.json")}
    assert len(manifests) == 12 and set(manifests.values()) == {1}, manifests  # each read once (twice before)
    cands = checkpoint_candidates(real(str(tmp_path)))  # the full list still judges every folder
    assert [(c.step, c.status) for c in cands][:2] == [(12, "corrupt"), (11, "committed")] and len(cands) == 12
