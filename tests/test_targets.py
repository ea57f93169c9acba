"""Save targets: what ``ckptlib.save``, the manager's step folders and the DCP writer do with
what already exists at the target (ckptlib/engine/target.py, engine/commit.py).

Real folders throughout; "untouched" is checked byte for byte (contents, sizes, mtimes) and by
the parent's listing (nothing moved aside). "Refused before any payload" is checked by a spy on
the storage's ``open_write``/``open_write_in``: a payload file opened at all is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import launcher
import pytest
import torch
from backends.servers import S3_BUCKET
from helpers import assert_same, patch_creates

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.backends.posix import PosixStorage
from ckptlib.engine import commit, target
from ckptlib.errors import StepExistsError, TargetNotEmptyError
from ckptlib.format import layout

WORKER = Path(__file__).resolve().parent / "workers" / "targets_worker.py"


def snapshot(root: Path) -> dict[str, Any]:
    """Everything under ``root``: each file's bytes and mtime, each folder (not following links)."""
    out: dict[str, Any] = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = None
        for f in files:
            p = os.path.join(dirpath, f)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (Path(p).read_bytes(), st.st_mtime_ns, st.st_mode)
    return out


def user_files(folder: Path) -> None:
    """A folder of the user's: text, binary, a nested folder, a file named like ours inside it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "weights.pt").write_bytes(bytes(range(256)) * 4)
    (folder / "sub").mkdir()
    (folder / "sub" / "manifest.json").write_text('{"not": "ours"}')


@pytest.fixture
def payload_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths of every payload file opened for writing in this process."""
    opened: list[str] = []

    def spy(real: Any) -> Any:
        def create(self: PosixStorage, path: str) -> Any:
            if layout.is_payload_name(path.rsplit("/", 1)[-1]):
                opened.append(path)
            return real(self, path)
        return create

    patch_creates(monkeypatch, spy)
    return opened


STATE = {"w": torch.arange(6.0).reshape(2, 3), "step": 3}


# --------------------------------------------------------------------------- ckptlib.save


def test_empty_existing_folder_is_used(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()  # os.makedirs(..., exist_ok=True) / mkdtemp(): the usual DCP pattern
    ckptlib.save(STATE, ck)
    assert_same(ckptlib.load(ck), STATE)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # nothing moved aside, no debris


@pytest.mark.parametrize("overwrite", [False, True])
def test_foreign_folder_refused_untouched(tmp_path: Path, payload_spy: list[str], overwrite: bool) -> None:
    ck = tmp_path / "ck"
    user_files(ck)
    before, siblings = snapshot(ck), sorted(os.listdir(tmp_path))
    with pytest.raises(TargetNotEmptyError, match=r"not a ckptlib checkpoint \(notes.txt, sub, weights.pt\); "
                                                  r"nothing in it was moved or changed"):
        ckptlib.save(STATE, ck, overwrite=overwrite)
    assert snapshot(ck) == before
    assert sorted(os.listdir(tmp_path)) == siblings
    assert payload_spy == []


def test_folder_with_a_manifest_and_user_files_is_foreign(tmp_path: Path) -> None:
    """A ckptlib checkpoint the user added a file to is not ours to move: refused."""
    ck = tmp_path / "ck"
    ckptlib.save(STATE, ck)
    (ck / "README").write_text("mine")
    os.remove(ck / "manifest.json")  # damaged too: still not moved, because README is not ours
    before = snapshot(ck)
    with pytest.raises(TargetNotEmptyError, match=r"\(README\)"):
        ckptlib.save(STATE, ck)
    assert snapshot(ck) == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_run_root_refused_with_a_pointer_to_the_manager(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, STATE)
        mgr.save(2, STATE)
    before = snapshot(root)
    with pytest.raises(TargetNotEmptyError, match=r"run root holding steps 1, 2.*CheckpointManager"):
        ckptlib.save(STATE, root)
    assert snapshot(root) == before


def test_file_target_refused_untouched(tmp_path: Path, payload_spy: list[str]) -> None:
    f = tmp_path / "model.pt"
    f.write_bytes(b"\x00user bytes\xff")
    before = snapshot(tmp_path)
    with pytest.raises(TargetNotEmptyError, match=r"is a file"):
        ckptlib.save(STATE, f)
    assert snapshot(tmp_path) == before
    assert payload_spy == []


def test_committed_target_refused_before_any_payload(tmp_path: Path, payload_spy: list[str]) -> None:
    ck = tmp_path / "ck"
    ckptlib.save(STATE, ck)
    payload_spy.clear()
    before, siblings = snapshot(ck), sorted(os.listdir(tmp_path))
    with pytest.raises(StepExistsError, match=r"already holds a committed checkpoint.*overwrite=True"):
        ckptlib.save({"w": torch.zeros(2, 3), "step": 4}, ck)
    assert payload_spy == []  # refused in SaveSession.begin, not after the ranks wrote
    assert snapshot(ck) == before and sorted(os.listdir(tmp_path)) == siblings
    ckptlib.save({"w": torch.zeros(2, 3), "step": 4}, ck, overwrite=True)
    assert len(payload_spy) > 0
    assert_same(ckptlib.load(ck), {"w": torch.zeros(2, 3), "step": 4})
    assert sorted(os.listdir(tmp_path)) == siblings  # the replaced step is gone, no debris


@pytest.mark.parametrize("damage", ["no-manifest", "truncated-payload", "marker-only"])
def test_damaged_checkpoint_of_ours_is_moved_aside(tmp_path: Path, damage: str) -> None:
    ck = tmp_path / "ck"
    ckptlib.save({"old": torch.ones(5)}, ck)
    if damage == "no-manifest":
        os.remove(ck / "manifest.json")
    elif damage == "truncated-payload":
        payload = next(p for p in ck.rglob("*.bin"))
        payload.write_bytes(payload.read_bytes()[:-1])
    else:  # what a crash right after the staging marker leaves
        for p in ck.iterdir():
            if p.is_dir():
                shutil.rmtree(p)
            elif p.name != layout.MARKER:
                p.unlink()
    before = snapshot(ck)
    ckptlib.save(STATE, ck)
    assert_same(ckptlib.load(ck), STATE)
    aside = [n for n in os.listdir(tmp_path) if n.startswith("ck.corrupt-")]
    assert len(aside) == 1 and snapshot(tmp_path / aside[0]) == before  # evidence kept, intact


def test_judge_verdicts(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    (tmp_path / "empty").mkdir()
    user_files(tmp_path / "user")
    (tmp_path / "f").write_text("x")
    ckptlib.save(STATE, tmp_path / "ck")
    kinds = {n: target.judge(storage, n).kind for n in ("missing", "empty", "user", "f", "ck")}
    assert kinds == {"missing": "absent", "empty": "empty", "user": "foreign", "f": "file", "ck": "committed"}
    t = target.judge(storage, "user")
    assert t.foreign == ("notes.txt", "sub", "weights.pt") and t.count == 3


def test_object_store_targets(memory_url: str) -> None:
    """The same rules where there is no rename (memory backend: conditional put, like S3)."""
    storage = open_storage(memory_url)
    storage.put_atomic("user/notes.txt", b"my notes")
    with pytest.raises(TargetNotEmptyError, match=r"\(notes.txt\)"):
        ckptlib.save(STATE, f"{memory_url}/user")
    assert [e.name for e in storage.listdir("user")] == ["notes.txt"]
    assert storage.read("user/notes.txt") == b"my notes"
    ckptlib.save(STATE, f"{memory_url}/ck")
    with pytest.raises(StepExistsError):
        ckptlib.save({"w": torch.zeros(1)}, f"{memory_url}/ck")
    assert len([e for e in storage.listdir("ck") if e.is_dir]) == 1  # no second save-id folder
    assert_same(ckptlib.load(f"{memory_url}/ck"), STATE)


def test_s3_targets(seaweed: Any) -> None:
    """On a real S3 server (SeaweedFS): a foreign prefix is refused untouched, a committed one
    refused before a second save's payloads exist."""
    url = f"s3://{S3_BUCKET}/t-{uuid.uuid4().hex[:12]}"
    opts = seaweed.storage_options()
    storage = open_storage(url, opts)
    try:
        storage.put_atomic("user/notes.txt", b"my notes")
        with pytest.raises(TargetNotEmptyError, match=r"\(notes.txt\)"):
            ckptlib.save(STATE, f"{url}/user", storage_options=opts)
        assert [e.name for e in storage.listdir("user")] == ["notes.txt"]
        assert storage.read("user/notes.txt") == b"my notes"
        ckptlib.save(STATE, f"{url}/ck", storage_options=opts)
        before = sorted(e.name for e in storage.listdir("ck"))
        with pytest.raises(StepExistsError):
            ckptlib.save({"w": torch.zeros(1)}, f"{url}/ck", storage_options=opts)
        assert sorted(e.name for e in storage.listdir("ck")) == before
        assert_same(ckptlib.load(f"{url}/ck", storage_options=opts), STATE)
    finally:
        storage.close()


# --------------------------------------------------------------------------- the rename's own check


def _manifest_bytes(tmp_path: Path) -> bytes:
    ckptlib.save(STATE, tmp_path / "model")
    return (tmp_path / "model" / "manifest.json").read_bytes()


def test_folder_filled_during_the_save_is_left_alone(tmp_path: Path) -> None:
    """A foreign folder that appears at the target after begin(): the rename refuses it too."""
    storage = open_storage(str(tmp_path))
    data = _manifest_bytes(tmp_path)
    staging = commit.begin(storage, "ck", "ab" * 16)
    user_files(tmp_path / "ck")
    before = snapshot(tmp_path / "ck")
    with pytest.raises(TargetNotEmptyError):
        commit.publish(storage, staging, data)
    assert snapshot(tmp_path / "ck") == before
    assert not any(".corrupt-" in n or ".del-" in n for n in os.listdir(tmp_path))


def test_empty_folder_made_during_the_save_is_replaced(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    data = _manifest_bytes(tmp_path)
    staging = commit.begin(storage, "ck", "cd" * 16)
    (tmp_path / "ck").mkdir()
    commit.publish(storage, staging, data)
    assert (tmp_path / "ck" / "manifest.json").read_bytes() == data
    assert sorted(os.listdir(tmp_path)) == ["ck", "model"]


# --------------------------------------------------------------------------- manager and DCP


def test_manager_step_folder_with_user_files_refused(tmp_path: Path, payload_spy: list[str]) -> None:
    step_dir = tmp_path / layout.step_dir(5)
    user_files(step_dir)
    before = snapshot(tmp_path)
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(TargetNotEmptyError, match=r"step-000000000005 holds files"):
            mgr.save(5, STATE)
        assert payload_spy == []
        mgr.save(6, STATE)  # the manager keeps working, and its cleanup leaves the folder alone
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k.startswith(layout.step_dir(5))} == before


def test_manager_existing_step_refused_before_payload(tmp_path: Path, payload_spy: list[str]) -> None:
    with ckptlib.CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, STATE).wait()
        payload_spy.clear()
        h = mgr.save(1, {"w": torch.zeros(2, 3), "step": 9})
        with pytest.raises(StepExistsError):
            h.wait()
        assert payload_spy == []
        assert_same(ckptlib.load(tmp_path / layout.step_dir(1)), STATE)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_writer_targets(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptlib.integrations.dcp import CkptlibWriter

    empty = tmp_path / "empty"
    empty.mkdir()
    dcp.save({"w": torch.arange(4.0)}, storage_writer=CkptlibWriter(empty))
    assert (empty / "manifest.json").is_file()
    user = tmp_path / "user"
    user_files(user)
    before = snapshot(user)
    with pytest.raises(CheckpointException) as info:  # DCP wraps each rank's error
        dcp.save({"w": torch.arange(4.0)}, storage_writer=CkptlibWriter(user))
    assert [type(f[0]) for f in info.value.failures.values()] == [TargetNotEmptyError]
    assert snapshot(user) == before
    assert sorted(os.listdir(tmp_path)) == ["empty", "user"]


# --------------------------------------------------------------------------- two ranks


def test_two_ranks_refuse_together_before_any_payload(tmp_path: Path) -> None:
    """Every rank gets the same typed refusal, and no rank opened a payload file."""
    committed, user, empty = tmp_path / "committed", tmp_path / "user", tmp_path / "empty"
    ckptlib.save({"old": torch.ones(3)}, committed)
    user_files(user)
    empty.mkdir()
    before = {p.name: snapshot(p) for p in (committed, user)}
    targets = [[str(committed), False], [str(user), True], [str(empty), False]]

    def argv(rank: int, port: str) -> list[str]:
        return [str(WORKER), str(rank), "2", port, str(tmp_path), json.dumps({"targets": targets})]

    procs = launcher.start(argv, 2, env={"PYTHONPATH": os.pathsep.join(sys.path)})
    outcomes = launcher.finish("targets on 2 ranks", procs, lambda r: tmp_path / f"result-targets-{r}.json", 120)
    for o in outcomes:
        assert o.result is not None and "crash" not in o.result, o.log
        got = [(s["got"], s["payloads_opened"]) for s in o.result["saves"]]
        assert got[0] == ("StepExistsError", []), got
        assert got[1] == ("TargetNotEmptyError", []), got
        assert got[2][0] == "ok" and got[2][1], got  # the empty folder was used; payloads written
    assert {p.name: snapshot(p) for p in (committed, user)} == before
    loaded = ckptlib.load(empty)
    assert_same(loaded, {"w": torch.tensor([1.0] * 4 + [2.0] * 4), "step": 7})
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith("result-")) == ["committed", "empty", "user"]


def test_docs_saving_examples_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/saving.md's examples run as written and print what the text says they print."""
    import re
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # their mkdtemp() folders land here

    text = (Path(__file__).resolve().parents[1] / "docs" / "saving.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    for code in blocks:
        exec(compile(code, "docs/saving.md", "exec"), {})
    out = capsys.readouterr().out
    assert "already holds a committed checkpoint" in out and "(notes.txt); nothing in it was moved" in out
    assert "in the target but not in the checkpoint: /model/new_head" in out
    assert "['/model/new_head'] []" in out
