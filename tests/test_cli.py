"""The ``ckptlib`` command line: ls, inspect, verify, prune, --json, --storage-option, exit codes.

Commands run in-process through ``main([...])`` (stdout/stderr captured by capsys), and a few
as a real subprocess (``python -m ckptlib.cli.main``). Checkpoints are real ones, written by
``CheckpointManager`` / ``ckptlib.save`` and then damaged on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import flip_bit

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.cli import inspect as cli_inspect
from ckptlib.cli import output
from ckptlib.cli import target as cli_target
from ckptlib.cli.main import main, parse_storage_option
from ckptlib.engine.scan import read_manifest
from ckptlib.format import layout
from ckptlib.format import manifest as mf

BIG = (256, 128)  # float32, 128 KiB: stored as a chunk of its own (not packed)


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "big": torch.randn(BIG, generator=g),
        "small": torch.arange(3, dtype=torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64),
        "step": step,
        "note": "hello",
    }


def make_root(root: Path | str, steps: tuple[int, ...] = (1, 2, 3)) -> str:
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for s in steps:
            mgr.save(s, make_state(s), metadata={"epoch": s, "tag": "run-a"})
    return str(root)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


def step_path(root: str, step: int) -> str:
    return os.path.join(root, layout.step_dir(step))


def manifest_of(root: str, step: int) -> mf.Manifest:
    return read_manifest(open_storage(root), layout.step_dir(step))


def payload_path(root: str, step: int) -> tuple[str, str]:
    """(absolute path, path relative to the root) of the payload file holding ``/big``."""
    m = manifest_of(root, step)
    rel = f"{layout.step_dir(step)}/{m.files[m.tensors['/big'].chunks[0].file].path}"
    return os.path.join(root, rel), rel


def crash_debris(root: str, step: int, save_id: str, created: float | None) -> str:
    """A leftover ``.tmp-`` folder as a crashed save leaves it (marker optional)."""
    name = layout.tmp_dir(layout.step_dir(step), save_id)
    folder = Path(root, name)
    (folder / save_id).mkdir(parents=True)
    (folder / save_id / "r00000-0.bin").write_bytes(b"\0" * 100)
    if created is not None:
        (folder / layout.MARKER).write_text(json.dumps({"save_id": save_id, "created": created}))
    return name


# --------------------------------------------------------------------------- ls

def test_ls_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_root(tmp_path / "run")
    code, out, err = run(capsys, "ls", root)
    assert code == 0, err
    lines = [ln.split() for ln in out.splitlines()]
    assert lines[0][:5] == ["step", "status", "size", "ranks", "age"]
    for s in (1, 2, 3):
        row = next(r for r in lines if r and r[0] == str(s))
        assert row[1] == "committed"
        assert row[-2:] == ["ago"] or row[-1] == "ago"
    assert "\x1b[" not in out  # no colour codes when piped

    code, doc = run_json(capsys, "ls", root)
    assert code == 0
    assert doc["kind"] == "root"
    assert [r["step"] for r in doc["steps"]] == [1, 2, 3]
    for r in doc["steps"]:
        m = manifest_of(root, r["step"])
        assert r["status"] == "committed"
        assert r["bytes"] == m.payload_bytes > 0
        assert r["world_size"] == 1
        assert r["save_id"] == m.save_id
        assert r["created"] == pytest.approx(m.created)
        assert 0 <= r["age_seconds"] < 600
        assert r["path"] == layout.step_dir(r["step"])
        assert r["reason"] == ""
        assert r["num_tensors"] == 3


def test_ls_empty_existing_root_is_empty_listing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    code, out, _ = run(capsys, "ls", str(tmp_path / "empty"))
    assert code == 0
    assert "no checkpoints" in out
    code, doc = run_json(capsys, "ls", str(tmp_path / "empty"))
    assert code == 0
    assert doc["steps"] == []


@pytest.mark.parametrize(
    "argv",
    [["ls"], ["inspect"], ["verify"], ["verify", "--all"], ["prune", "--keep-last", "2"]],
    ids=lambda a: " ".join(a),
)
def test_missing_root_is_exit_2_with_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    missing = str(tmp_path / "no" / "such")
    code, out, err = run(capsys, argv[0], missing, *argv[1:])
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1, err  # one line
    assert err.startswith("ckptlib: no such folder")
    assert missing in err
    assert "step-* folders" in err
    assert "Traceback" not in err


def test_errors_in_json_mode_are_a_json_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "verify", str(tmp_path / "nope"), "--json")
    assert code == 2
    doc = json.loads(out)
    assert doc["exit_code"] == 2
    assert "no such folder" in doc["error"]
    assert "no such folder" in err


def test_a_file_is_not_a_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file.txt"
    f.write_text("x")
    code, _, err = run(capsys, "ls", str(f))
    assert code == 2
    assert "is a file, not a folder" in err


def test_usage_errors_are_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, )[0] == 2
    assert run(capsys, "ls")[0] == 2
    assert run(capsys, "frobnicate", str(tmp_path))[0] == 2
    assert run(capsys, "prune", str(tmp_path))[0] == 2  # --keep-last is required
    assert run(capsys, "prune", str(tmp_path), "--keep-last", "0")[0] == 2
    assert run(capsys, "verify", str(tmp_path), "--all", "--step", "1")[0] == 2
    assert run(capsys, "inspect", str(tmp_path), "--step", "-1")[0] == 2
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert ckptlib.__version__ in out
    assert run(capsys, "ls", "--help")[0] == 0


def test_unknown_protocol_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "ls", "nosuchproto://bucket/run")
    assert code == 2
    assert err.startswith("ckptlib: ")
    assert "Traceback" not in err


# --------------------------------------------------------------------------- inspect

def test_inspect_newest_step_matches_saved_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_root(tmp_path / "run")
    code, doc = run_json(capsys, "inspect", root)
    assert code == 0
    m = manifest_of(root, 3)
    assert doc["step"] == 3
    assert doc["status"] == "committed"
    assert doc["save_id"] == m.save_id
    assert doc["world_size"] == 1
    assert doc["commit"] == "rename"
    assert doc["library"].startswith("ckptlib")
    assert doc["payload_bytes"] == m.payload_bytes
    assert doc["num_files"] == len(m.files) == len(doc["files"])
    assert doc["metadata"] == {"epoch": 3, "tag": "run-a"}
    state = make_state(3)
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert set(tensors) == {"/big", "/small", "/ids"}
    for key in ("big", "small", "ids"):
        t, want = tensors["/" + key], state[key]
        assert t["dtype"] == str(want.dtype).removeprefix("torch.")
        assert t["shape"] == list(want.shape)
        assert t["bytes"] == want.numel() * want.element_size()
        assert t["sharded"] is False
        assert t["ratio"] is None
    assert tensors["/big"]["sharding"] == "whole"
    assert doc["tensor_bytes"] == sum(t["bytes"] for t in doc["tensors"])

    code, out, _ = run(capsys, "inspect", root)
    assert code == 0
    assert "epoch=3" in out
    for name, dtype, shape in [("/big", "float32", "(256, 128)"), ("/small", "bfloat16", "(3,)")]:
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert dtype in line
        assert shape in line


def test_inspect_step_n(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_root(tmp_path / "run")
    code, doc = run_json(capsys, "inspect", root, "--step", "1")
    assert code == 0
    assert doc["step"] == 1
    assert doc["metadata"]["epoch"] == 1
    code, _, err = run(capsys, "inspect", root, "--step", "7")
    assert code == 2
    assert "no step 7" in err


def test_inspect_single_checkpoint_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = tmp_path / "one"
    ckptlib.save({"a": torch.arange(10000), "b": torch.zeros(2, 2)}, url, compression="zstd",
                 metadata={"k": 1, "name": "x"})
    for target in (str(url), str(url / "manifest.json")):
        code, doc = run_json(capsys, "inspect", target)
        assert code == 0
        assert doc["kind"] == "checkpoint"
        assert doc["step"] is None
        assert doc["metadata"] == {"k": 1, "name": "x"}
        a = next(t for t in doc["tensors"] if t["name"] == "/a")
        assert (a["dtype"], a["shape"], a["bytes"]) == ("int64", [10000], 80000)
        assert a["stored_bytes"] < a["bytes"]
        assert a["ratio"] > 1
    code, out, _ = run(capsys, "inspect", str(url))
    assert code == 0
    assert "stored" in out and "ratio" in out
    assert run(capsys, "inspect", str(url), "--step", "1")[0] == 2

    # Compressed chunks and packs verify clean, every stored byte read.
    code, vdoc = run_json(capsys, "verify", str(url))
    assert code == 0, vdoc
    assert vdoc["steps"][0]["checked_bytes"] == doc["stored_bytes"]


def test_inspect_without_committed_step_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "inspect", str(tmp_path / "empty"))
    assert code == 2
    assert "no committed step" in err


def test_tensor_row_reports_sharding_across_ranks() -> None:
    files = [mf.FileEntry("ab12cd34/r00000-0.bin", 64), mf.FileEntry("ab12cd34/r00001-0.bin", 64)]
    t = mf.TensorEntry("float32", (8, 4), [
        mf.Chunk(0, 0, 64, "0" * 16, (0, 0), (4, 4)),
        mf.Chunk(1, 0, 64, "0" * 16, (4, 0), (4, 4)),
    ])
    m = mf.Manifest(step=5, save_id="ab12cd34", created=0.0, world_size=2, commit="rename",
                    files=files, tensors={"/w": t}, tree=None)
    row = cli_inspect.tensor_row("/w", t, m)
    assert row["sharded"] is True
    assert row["chunks"] == 2
    assert row["ranks"] == 2
    assert row["sharding"] == "sharded: 2 chunks, 2 ranks"
    assert row["bytes"] == row["stored_bytes"] == 128

    # One rank, but the tensor's only chunk starts away from the origin: still sharded.
    one = mf.TensorEntry("float32", (8, 4), [mf.Chunk(0, 0, 64, "0" * 16, (4, 0), (4, 4))])
    assert cli_inspect.tensor_row("/x", one, m)["sharded"] is True


# --------------------------------------------------------------------------- verify

def test_verify_good_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_root(tmp_path / "run")
    code, out, err = run(capsys, "verify", root)
    assert code == 0, out + err
    assert "OK" in out
    code, doc = run_json(capsys, "verify", root, "--all")
    assert code == 0
    assert doc["ok"] is True
    assert doc["exit_code"] == 0
    assert [r["step"] for r in doc["steps"]] == [1, 2, 3]
    assert all(r["ok"] and r["checked_bytes"] >= BIG[0] * BIG[1] * 4 for r in doc["steps"])
    code, doc = run_json(capsys, "verify", root, "--step", "2")
    assert code == 0
    assert [r["step"] for r in doc["steps"]] == [2]


def test_verify_progress_bar_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The progress bar (shown on terminals) runs and leaves the result intact."""
    root = make_root(tmp_path / "run", steps=(1, 2))
    monkeypatch.setattr(output.Output, "interactive", property(lambda self: True))
    code, out, err = run(capsys, "verify", root, "--all")
    assert code == 0, out + err
    assert "OK: 2 step(s) verified" in out


def test_verify_names_the_step_and_file_with_a_flipped_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_root(tmp_path / "run")
    path, rel = payload_path(root, 2)
    chunk = manifest_of(root, 2).tensors["/big"].chunks[0]
    flip_bit(path, chunk.start + 1000)

    code, out, _ = run(capsys, "verify", root, "--step", "2")
    assert code == 1
    assert "corrupt" in out
    assert "FAILED: step 2" in out
    assert rel in out.replace("\n", "")  # the file, relative to the root
    assert "checksum mismatch" in out

    code, doc = run_json(capsys, "verify", root, "--step", "2")
    assert code == 1
    assert doc["ok"] is False
    (row,) = doc["steps"]
    assert (row["step"], row["status"], row["ok"]) == (2, "corrupt", False)
    assert path in row["reason"]

    # The default checks only the newest committed step (3), which is fine.
    assert run(capsys, "verify", root)[0] == 0
    code, doc = run_json(capsys, "verify", root, "--all")
    assert code == 1
    assert {r["step"]: r["status"] for r in doc["steps"]} == {
        1: "committed", 2: "corrupt", 3: "committed"
    }
    # A quick scan cannot see a flipped byte: ls still calls it committed (sizes are right).
    _, doc = run_json(capsys, "ls", root)
    assert doc["steps"][1]["status"] == "committed"


def test_verify_detects_a_flipped_byte_in_a_packed_small_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Small tensors are packed together; a flipped byte there must fail verify too
    (loading detects it, so verify, which promises a deep check, must as well)."""
    root = make_root(tmp_path / "run", steps=(1,))
    m = manifest_of(root, 1)
    path, _ = payload_path(root, 1)
    small = m.tensors["/small"]
    if small.chunks:
        start = small.chunks[0].start
    else:
        start = m.packs[small.pieces[0].pack].start
    flip_bit(path, start)
    with ckptlib.CheckpointManager(root) as mgr, pytest.raises(ckptlib.CorruptCheckpointError):
        mgr.restore(make_state(0))
    code, doc = run_json(capsys, "verify", root)
    assert code == 1, doc
    assert doc["steps"][0]["status"] == "corrupt"


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_verify_checks_every_stored_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], compression: str | None
) -> None:
    """Flip each stored byte region in turn (chunks and packs): verify must fail every time."""
    url = tmp_path / "one"
    state = {"big": torch.randn(BIG), "a": torch.arange(100), "b": torch.ones(7, 3)}
    ckptlib.save(state, url, compression=compression)
    m = read_manifest(open_storage(url), "")
    regions = [(c.file, c.start, c.length) for t in m.tensors.values() for c in t.chunks]
    regions += [(p.file, p.start, p.length) for p in getattr(m, "packs", ())]
    assert len(regions) >= 2
    for file, start, length in regions:
        path = os.path.join(url, m.files[file].path)
        flip_bit(path, start + length // 2)
        code, doc = run_json(capsys, "verify", str(url))
        assert code == 1, (file, start, length)
        assert "mismatch" in doc["steps"][0]["reason"]
        flip_bit(path, start + length // 2)  # repair
    assert run(capsys, "verify", str(url))[0] == 0


def test_truncated_payload_shows_corrupt_in_ls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_root(tmp_path / "run")
    path, _ = payload_path(root, 3)
    size = os.path.getsize(path)
    os.truncate(path, size - 10)

    code, doc = run_json(capsys, "ls", root)
    assert code == 0  # ls reports; only verify fails
    row = doc["steps"][-1]
    assert (row["step"], row["status"]) == (3, "corrupt")
    on_disk = sum(f.stat().st_size for f in Path(step_path(root, 3)).rglob("*") if f.is_file())
    assert row["bytes"] == on_disk  # what the folder holds now, not what the manifest records
    assert row["prune"] == {"removes": False, "why": row["prune"]["why"]}
    assert "not superseded" in row["prune"]["why"]  # the newest step: evidence, left alone
    assert f"{size - 10} bytes, manifest records {size}" in row["reason"]
    code, out, _ = run(capsys, "ls", root)
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == ["3"])
    assert "corrupt" in line
    assert "manifest records" in line

    # The default verify falls back to the newest *committed* step; --step 3 fails.
    code, doc = run_json(capsys, "verify", root)
    assert (code, [r["step"] for r in doc["steps"]]) == (0, [2])
    code, doc = run_json(capsys, "verify", root, "--step", "3")
    assert code == 1
    assert doc["steps"][0]["status"] == "corrupt"
    # inspect can still show a damaged step's manifest, with its status.
    code, doc = run_json(capsys, "inspect", root, "--step", "3")
    assert (code, doc["status"]) == (0, "corrupt")


def test_verify_all_reports_a_crashed_saves_folder_as_debris_not_a_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_root(tmp_path / "run", steps=(1, 2))
    crash_debris(root, 3, "ab" * 16, time.time() - 7200)
    code, doc = run_json(capsys, "verify", root, "--all")
    assert code == 0  # a staging folder is not a checkpoint (tests/test_verify_live_root.py: real kills)
    row = doc["steps"][-1]
    assert (row["step"], row["status"]) == (3, "debris")
    assert "crashed" in row["reason"] and "ckptlib prune" in row["reason"]
    assert run(capsys, "verify", root)[0] == 0  # newest committed step (2) is fine


def test_verify_with_no_committed_step_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    crash_debris(str(root), 1, "cd" * 16, time.time())
    code, doc = run_json(capsys, "verify", str(root))
    assert code == 1  # nothing verified
    assert doc["steps"][0]["status"] == "in progress"
    code, out, _ = run(capsys, "verify", str(root), "--all")
    assert code == 1 and "FAILED: nothing verified" in out and "OK" not in out, out
    (tmp_path / "empty").mkdir()
    code, out, _ = run(capsys, "verify", str(tmp_path / "empty"))
    assert code == 1  # verified nothing: an empty folder is not "all good"
    assert "nothing verified" in out
    code, doc = run_json(capsys, "verify", str(tmp_path / "empty"))
    assert (code, doc["ok"], doc["steps"]) == (1, False, [])


def test_verify_on_the_parent_of_a_root_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ckptlib.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    assert run(capsys, "verify", str(tmp_path / "run"))[0] == 0
    code, out, _ = run(capsys, "verify", str(tmp_path))  # the wrong folder: the root's parent
    assert code == 1
    assert "nothing verified" in out


def test_verify_single_checkpoint_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = tmp_path / "one"
    ckptlib.save({"big": torch.randn(BIG)}, url)
    code, doc = run_json(capsys, "verify", str(url))
    assert code == 0
    assert doc["kind"] == "checkpoint"
    m = read_manifest(open_storage(url), "")
    flip_bit(os.path.join(url, m.files[0].path), m.tensors["/big"].chunks[0].start)
    code, doc = run_json(capsys, "verify", str(url))
    assert code == 1
    assert doc["steps"][0]["status"] == "corrupt"


def test_verify_unknown_step_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_root(tmp_path / "run", steps=(1,))
    code, _, err = run(capsys, "verify", root, "--step", "9")
    assert code == 2
    assert "no step 9" in err


# --------------------------------------------------------------------------- prune

def test_prune_dry_run_deletes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_root(tmp_path / "run", steps=(1, 2, 3, 4))
    debris = crash_debris(root, 9, "ef" * 16, time.time() - 7200)
    before = sorted(os.listdir(root))
    code, out, _ = run(capsys, "prune", root, "--keep-last", "1", "--dry-run")
    assert code == 0
    assert "would delete" in out
    line = next(ln for ln in out.splitlines() if debris in ln)
    assert "would remove" in line and "crashed save" in line
    assert sorted(os.listdir(root)) == before
    code, doc = run_json(capsys, "prune", root, "--keep-last", "1", "--dry-run")
    assert doc["dry_run"] is True
    assert doc["to_delete"] == [1, 2, 3]
    assert doc["deleted"] == []
    assert doc["debris_removed"] == []
    assert sorted(os.listdir(root)) == before


def test_prune_deletes_the_right_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_root(tmp_path / "run", steps=(1, 2, 3, 4, 5, 6))
    code, doc = run_json(capsys, "prune", root, "--keep-last", "2", "--keep-every", "2")
    assert code == 0
    assert doc["deleted"] == [1, 3]
    assert {s["step"]: s["keep"] for s in doc["steps"]} == {
        1: False, 2: True, 3: False, 4: True, 5: True, 6: True
    }
    _, doc = run_json(capsys, "ls", root)
    assert [r["step"] for r in doc["steps"]] == [2, 4, 5, 6]
    assert all(r["status"] == "committed" for r in doc["steps"])
    assert not [n for n in os.listdir(root) if ".del-" in n]

    code, out, _ = run(capsys, "prune", root, "--keep-last", "1")
    assert code == 0
    assert "deleted 3 step(s)" in out
    assert sorted(os.listdir(root)) == [layout.step_dir(6)]


def test_prune_never_deletes_newest_committed_or_damaged_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_root(tmp_path / "run", steps=(1, 2, 3))
    path, _ = payload_path(root, 3)
    os.truncate(path, 5)  # step 3 is corrupt: step 2 is the newest committed step
    code, doc = run_json(capsys, "prune", root, "--keep-last", "1")
    assert code == 0
    assert doc["deleted"] == [1]
    assert [s["step"] for s in doc["not_committed"]] == [3]
    assert os.path.isdir(step_path(root, 2))
    assert os.path.isdir(step_path(root, 3))  # damaged steps are left for a human to look at
    assert not os.path.exists(step_path(root, 1))


def test_prune_removes_crash_debris_but_not_young_or_foreign_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_root(tmp_path / "run", steps=(1,))
    old = crash_debris(root, 2, "a1" * 16, time.time() - 7200)
    young = crash_debris(root, 3, "b2" * 16, time.time())
    foreign = crash_debris(root, 4, "c3" * 16, None)  # no marker: not provably ours
    code, doc = run_json(capsys, "prune", root, "--keep-last", "3")
    assert code == 0
    assert doc["deleted"] == []
    assert doc["debris_removed"] == [old]
    assert {d["path"]: d["removable"] for d in doc["debris"]} == {
        old: True, young: False, foreign: False
    }
    assert sorted(os.listdir(root)) == sorted([layout.step_dir(1), young, foreign])
    # --debris-min-age 0 takes the young one too; the foreign one always stays.
    code, doc = run_json(capsys, "prune", root, "--keep-last", "3", "--debris-min-age", "0")
    assert doc["debris_removed"] == [young]
    assert sorted(os.listdir(root)) == sorted([layout.step_dir(1), foreign])


def test_prune_refuses_a_single_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckptlib.save({"x": torch.ones(2)}, tmp_path / "one")
    code, _, err = run(capsys, "prune", str(tmp_path / "one"), "--keep-last", "1")
    assert code == 2
    assert "single checkpoint" in err
    assert (tmp_path / "one" / "manifest.json").exists()


# --------------------------------------------------------------------------- options, backends

def test_storage_option_values_are_json_or_strings() -> None:
    assert parse_storage_option("anon=true") == ("anon", True)
    assert parse_storage_option("retries=3") == ("retries", 3)
    assert parse_storage_option("endpoint_url=http://127.0.0.1:9000") == (
        "endpoint_url", "http://127.0.0.1:9000"
    )
    assert parse_storage_option('client_kwargs={"region_name": "eu"}') == (
        "client_kwargs", {"region_name": "eu"}
    )
    assert parse_storage_option('key="123"') == ("key", "123")
    assert parse_storage_option("token=") == ("token", "")
    assert parse_storage_option("a=b=c") == ("a", "b=c")


def test_storage_options_reach_the_backend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    real = cli_target.open_storage

    def spy(url: str, storage_options: Any = None) -> Any:
        seen.append(storage_options)
        return real(url)  # what a backend makes of the options is not this test's business

    monkeypatch.setattr(cli_target, "open_storage", spy)
    (tmp_path / "r").mkdir()
    code, _, _ = run(capsys, "--storage-option", "anon=true", "ls", str(tmp_path / "r"),
                     "--storage-option", "retries=3", "--storage-option", "endpoint_url=http://h:1")
    assert code == 0
    assert seen == [{"anon": True, "retries": 3, "endpoint_url": "http://h:1"}]
    for bad in ("novalue", "=x"):
        assert run(capsys, "ls", str(tmp_path / "r"), "--storage-option", bad)[0] == 2


def test_memory_root(memory_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    make_root(memory_url, steps=(1, 2, 3))
    code, doc = run_json(capsys, "ls", memory_url)
    assert code == 0
    assert [(r["step"], r["status"]) for r in doc["steps"]] == [
        (1, "committed"), (2, "committed"), (3, "committed")
    ]
    code, doc = run_json(capsys, "inspect", memory_url)
    assert (code, doc["step"], doc["commit"]) == (0, 3, "conditional_put")
    assert run(capsys, "verify", memory_url, "--all")[0] == 0
    code, doc = run_json(capsys, "prune", memory_url, "--keep-last", "1")
    assert (code, doc["deleted"]) == (0, [1, 2])
    _, doc = run_json(capsys, "ls", memory_url)
    assert [r["step"] for r in doc["steps"]] == [3]


def test_prune_lists_object_store_debris_with_its_verdict(
    memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """On an object store, a save id's payloads beside the committed one are debris: listed by
    ``--dry-run`` (nothing removed), removed by a real run; the committed step stays whole."""
    make_root(memory_url, steps=(1,))
    storage = open_storage(memory_url)
    lost = f"{layout.step_dir(1)}/{'d4' * 16}"
    storage.put_atomic(f"{lost}/r00000-0.bin", b"payload of a save that lost")
    code, doc = run_json(capsys, "prune", memory_url, "--keep-last", "1", "--dry-run")
    assert code == 0
    assert [(d["path"], d["kind"], d["removable"]) for d in doc["debris"]] == [(lost, "prefix", True)]
    assert doc["debris_removed"] == [] and storage.size(f"{lost}/r00000-0.bin") is not None
    code, doc = run_json(capsys, "prune", memory_url, "--keep-last", "1")
    assert (code, doc["debris_removed"]) == (0, [lost])
    assert storage.size(f"{lost}/r00000-0.bin") is None
    assert run(capsys, "verify", memory_url)[0] == 0


# --------------------------------------------------------------------------- real process

def test_real_subprocess(tmp_path: Path) -> None:
    root = make_root(tmp_path / "run", steps=(1, 2))
    cmd = [sys.executable, "-m", "ckptlib.cli.main"]
    env = {**os.environ, "COLUMNS": "120"}

    p = subprocess.run([*cmd, "ls", root, "--json"], capture_output=True, text=True, env=env,
                       timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in json.loads(p.stdout)["steps"]] == [1, 2]

    path, _ = payload_path(root, 2)
    flip_bit(path, manifest_of(root, 2).tensors["/big"].chunks[0].start)
    p = subprocess.run([*cmd, "verify", root], capture_output=True, text=True, env=env,
                       timeout=120, check=False)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAILED: step 2" in p.stdout
    assert "\x1b[" not in p.stdout

    p = subprocess.run([*cmd, "inspect", str(tmp_path / "missing")], capture_output=True,
                       text=True, env=env, timeout=120, check=False)
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.startswith("ckptlib: no such folder")
    assert "Traceback" not in p.stderr

    # `python -m ckptlib` is the same command line
    p = subprocess.run([sys.executable, "-m", "ckptlib", "verify", root], capture_output=True, text=True, env=env,
                       timeout=120, check=False)
    assert p.returncode == 1 and "FAILED: step 2" in p.stdout, p.stdout + p.stderr


def test_inspect_sorts_tensor_names_naturally(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {f"layers.{i}.w": torch.zeros(2) for i in (10, 2, 1, 11, 3)}
    state.update({"a10b": torch.zeros(1), "a9b": torch.zeros(1)})
    ckptlib.save(state, tmp_path / "ckpt")
    code, doc = run_json(capsys, "inspect", str(tmp_path / "ckpt"))
    assert code == 0
    names = [t["name"] for t in doc["tensors"]]
    assert names == ["/a9b", "/a10b"] + [f"/layers.{i}.w" for i in (1, 2, 3, 10, 11)]
    assert cli_inspect.natural_key("layers.2.w") < cli_inspect.natural_key("layers.10.w")


def test_piped_rows_stay_on_one_line_without_padding(tmp_path: Path) -> None:
    # A long reason (here naming a file under a root whose path is over 200 characters) used to wrap at 200
    # columns when piped, and every line was padded with spaces to the full width.
    root = make_root(tmp_path / ("r" * 200) / "run", steps=(1, 2))
    path = Path(payload_path(root, 2)[0])
    path.write_bytes(path.read_bytes()[:-1])  # truncated: its reason names the file, long
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    p = subprocess.run([sys.executable, "-m", "ckptlib.cli.main", "ls", root], capture_output=True, text=True,
                       env=env, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    (bad,) = [line for line in lines if "corrupt" in line]
    assert len(bad) > 250 and "payload file size" in bad and "manifest records" in bad
    assert len(lines) == 4, lines  # header, two rows, summary: nothing wrapped
    assert all(line == line.rstrip() for line in lines)
    assert lines[-1].startswith("2 step(s), 1 committed; 1 not usable (")


def test_piped_inspect_of_many_tensors_is_not_rendered_row_by_row_by_rich(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `ckptlib inspect URL | less` of a 80,000-tensor checkpoint took over 2 minutes (rich renders
    # a table at milliseconds per row) where `--json` took 13 s; piped tables are now laid out
    # in linear time. Counted, not timed: rich's line splitting ran ~10 times per row.
    from rich.segment import Segment

    calls = 0
    split = Segment.split_and_crop_lines

    def counting(*a: Any, **k: Any) -> Any:
        nonlocal calls
        calls += 1
        return split(*a, **k)

    n = 3000
    ckptlib.save({f"layers.{i}.w": torch.full((2,), float(i)) for i in range(n)}, tmp_path / "ck")
    monkeypatch.setattr(Segment, "split_and_crop_lines", counting)
    code, out, _ = run(capsys, "inspect", str(tmp_path / "ck"))
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.startswith("/layers.")]
    assert [r[0] for r in rows] == [f"/layers.{i}.w" for i in range(n)]
    assert all(r[1:] == ["float32", "(2,)", "packed", "8", "B"] for r in rows)
    assert calls < 100, calls


@pytest.mark.parametrize("width", [output.PIPE_WIDTH, 59, 58])
def test_plain_table_lays_out_as_rich_does(width: int) -> None:
    from rich.console import Console
    from rich.text import Text

    t = output.table("name", "dtype", "bytes", right=("bytes",), fold=("name",))
    for cells in [("/a/b", "float32", "12 B"), ("/ü/🎉/中文", Text("x", style="red"), "1.5 KiB"), ("", "", ""),
                  ("  lead", "trail  ", "7"), ("/" + "w" * 40, "int8", "0 B")]:
        t.add_row(*cells)
    console = Console(width=width, markup=False, highlight=False, emoji=False)
    with console.capture() as captured:
        console.print(t)
    expected = "\n".join(line.rstrip() for line in captured.get().split("\n"))
    fast = output.plain_table(t, width)
    if width < 59:  # too wide (41 + 7 + 7 + 2 spaces twice): rich wraps the name column, so rich lays it out
        assert fast is None
    else:
        assert fast == expected
    for bad in ("a\nb", "tab\there", "esc\x1b[31m"):
        t2 = output.table("name")
        t2.add_row(bad)
        assert output.plain_table(t2, width) is None
