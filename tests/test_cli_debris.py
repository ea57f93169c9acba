"""``ckptlib ls`` shows every leftover with its size and ``prune``'s verdict; ``prune`` removes
what is provably not in use; ``prune --verify`` keeps the newest N *good* steps.

Real checkpoints (``CheckpointManager``), damaged on disk the way crashes and bad disks do:
a flipped payload bit, a folder a later save moved aside (``step-N.corrupt-<id>``), a step folder
without manifest, a crashed save's ``.tmp-`` folder, an interrupted deletion's ``.del-`` folder.
"""

from __future__ import annotations

import json
import os
import shutil
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
from ckptlib.cli.main import main
from ckptlib.engine.scan import read_manifest
from ckptlib.format import layout

OLD = time.time() - 7200


def make_root(root: Path, steps: tuple[int, ...]) -> str:
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for s in steps:
            mgr.save(s, {"w": torch.full((128, 64), float(s)), "b": torch.arange(s + 1), "step": s})
    return str(root)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def run_text(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def age(path: Path, when: float = OLD) -> None:
    for p in [path, *path.rglob("*")]:
        os.utime(p, (when, when))


def flip_payload(root: str, step: int) -> None:
    folder = layout.step_dir(step)
    m = read_manifest(open_storage(root), folder)
    t = m.tensors["/w"]
    start, length = (t.chunks[0].start, t.chunks[0].length) if t.chunks else (m.packs[0].start, m.packs[0].length)
    file = t.chunks[0].file if t.chunks else m.packs[0].file
    flip_bit(Path(root, folder, m.files[file].path), start + length // 2)


def leftovers(root: str) -> dict[str, Path]:
    """Every kind of leftover beside steps 1-3, as crashes leave them."""
    r = Path(root)
    sid = "ab" * 16
    out = {
        "quarantined": r / f"{layout.step_dir(2)}.corrupt-{'cd' * 16}",
        "tmp": r / layout.tmp_dir(layout.step_dir(4), sid),
        "del": r / layout.del_dir(layout.step_dir(1), "ef" * 16),
        "ours": r / layout.step_dir(7),
        "foreign": r / layout.step_dir(8),
    }
    shutil.copytree(r / layout.step_dir(2), out["quarantined"])  # what commit moves aside
    shutil.copytree(r / layout.step_dir(2), out["del"])
    (out["tmp"] / sid).mkdir(parents=True)
    (out["tmp"] / sid / "r00000-0.bin").write_bytes(b"\0" * 3000)
    (out["tmp"] / layout.MARKER).write_text(json.dumps({"save_id": sid, "created": OLD}))
    shutil.copytree(r / layout.step_dir(3), out["ours"])  # ours, manifest lost
    (out["ours"] / "manifest.json").unlink()
    out["foreign"].mkdir()
    (out["foreign"] / "notes.txt").write_text("a user's file: never ours to delete")
    for p in out.values():
        age(p)
    return out


def test_ls_lists_every_leftover_with_size_and_prune_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_root(tmp_path / "run", (1, 2, 3))
    junk = leftovers(root)
    code, doc = run_json(capsys, "ls", root)
    assert code == 0
    rows = {r["path"]: r for r in doc["steps"]}
    for kind, path in junk.items():
        row = rows[path.name]
        assert row["bytes"] == du(path), kind  # the size on disk now
    assert rows[junk["quarantined"].name]["status"] == "quarantined"
    assert rows[junk["ours"].name]["status"] == "incomplete"
    verdicts = {kind: rows[p.name]["prune"]["removes"] for kind, p in junk.items()}
    assert verdicts == {"quarantined": True, "tmp": True, "del": True, "ours": True, "foreign": False}
    for s in (1, 2, 3):
        assert (rows[layout.step_dir(s)]["status"], rows[layout.step_dir(s)]["prune"]) == ("committed", None)
    # Rows are ordered by step; the human table carries the same verdicts and the sizes.
    assert [r["step"] for r in doc["steps"]] == sorted(r["step"] for r in doc["steps"])
    code, out = run_text(capsys, "ls", root)
    line = next(ln for ln in out.splitlines() if junk["foreign"].name in ln or ln.split()[:1] == ["8"])
    assert "prune leaves it" in line and "not provably ours" in line
    assert "5 not usable" in out and "4 of them removable by prune" in out


def test_prune_removes_what_is_provably_not_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_root(tmp_path / "run", (1, 2, 3))
    junk = leftovers(root)
    code, doc = run_json(capsys, "prune", root, "--keep-last", "3", "--dry-run")
    assert code == 0 and doc["debris_removed"] == [] and all(p.exists() for p in junk.values())
    sizes = {d["path"]: d["bytes"] for d in doc["debris"]}
    assert sizes == {p.name: du(p) for k, p in junk.items()}
    assert doc["bytes_freed"] == sum(du(p) for k, p in junk.items() if k != "foreign")

    code, doc = run_json(capsys, "prune", root, "--keep-last", "3")
    assert code == 0
    assert sorted(doc["debris_removed"]) == sorted(p.name for k, p in junk.items() if k != "foreign")
    assert sorted(os.listdir(root)) == sorted([layout.step_dir(s) for s in (1, 2, 3)] + [junk["foreign"].name])
    assert (junk["foreign"] / "notes.txt").exists()
    _, doc = run_json(capsys, "verify", root, "--all")  # the steps themselves are untouched
    assert [(r["step"], r["ok"]) for r in doc["steps"]] == [(1, True), (2, True), (3, True), (8, False)]


def test_young_leftovers_and_unsuperseded_damage_are_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_root(tmp_path / "run", (1, 2, 3))
    junk = leftovers(root)
    age(junk["ours"], time.time())  # written to just now: maybe a copy in progress
    flip_payload(root, 3)  # a damaged newest step is evidence, whatever the policy
    shutil.copytree(Path(root, layout.step_dir(3)), Path(root, f"{layout.step_dir(3)}.corrupt-{'aa' * 16}"))
    code, doc = run_json(capsys, "prune", root, "--keep-last", "1", "--verify")
    assert code == 0
    verdict = {d["path"]: (d["kind"], d["removable"]) for d in doc["debris"]}
    assert verdict[junk["ours"].name] == ("step", False)
    assert verdict[layout.step_dir(3)] == ("damaged", False)
    assert verdict[f"{layout.step_dir(3)}.corrupt-{'aa' * 16}"] == ("quarantined", False)
    assert junk["ours"].exists() and Path(root, layout.step_dir(3)).exists()
    assert [f["step"] for f in doc["failed_verify"]] == [3]
    assert [(p["step"], p["keep"]) for p in doc["steps"]] == [(1, False), (2, True)]


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "soon"])
def test_a_debris_age_that_is_not_a_finite_number_of_seconds_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    # nan and -1 used to act as 0: a typo removed young .tmp- folders, maybe saves still writing.
    root = make_root(tmp_path / "run", (1, 2))
    tmp = Path(root, layout.tmp_dir(layout.step_dir(3), "ab" * 16))
    tmp.mkdir()
    (tmp / "r00000-0.bin").write_bytes(b"\0" * 100)
    assert main(["prune", root, "--keep-last", "1", "--debris-min-age", value]) == 2
    assert "--debris-min-age" in capsys.readouterr().err
    assert tmp.exists() and Path(root, layout.step_dir(1)).exists()


def test_prune_verify_keeps_the_newest_good_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bug report: ``--keep-last 2`` kept a step with a flipped bit as one of the two and
    deleted the good older ones. With ``--verify`` the two kept are two good ones, and the
    damaged step, superseded by a newer good one, is removed."""
    root = make_root(tmp_path / "run", (1, 2, 3, 4, 5))
    flip_payload(root, 4)
    # Without --verify only sizes are checked: step 4 looks committed (documented).
    code, doc = run_json(capsys, "prune", root, "--keep-last", "2", "--dry-run")
    assert [p["step"] for p in doc["steps"] if p["keep"]] == [4, 5]

    code, out = run_text(capsys, "prune", root, "--keep-last", "2", "--verify", "--dry-run")
    assert code == 0 and "step 4 failed verification and was not kept" in out
    code, doc = run_json(capsys, "prune", root, "--keep-last", "2", "--verify")
    assert code == 0
    assert [(p["step"], p["keep"]) for p in doc["steps"]] == [(1, False), (2, False), (3, True), (5, True)]
    assert [f["step"] for f in doc["failed_verify"]] == [4]
    assert "checksum mismatch" in doc["failed_verify"][0]["reason"]
    assert (doc["deleted"], doc["debris_removed"]) == ([1, 2], [layout.step_dir(4)])
    assert sorted(os.listdir(root)) == [layout.step_dir(3), layout.step_dir(5)]
    code, doc = run_json(capsys, "verify", root, "--all")
    assert (code, [r["step"] for r in doc["steps"] if r["ok"]]) == (0, [3, 5])
    state = ckptlib.load(Path(root, layout.step_dir(3)))
    assert torch.equal(state["w"], torch.full((128, 64), 3.0))  # the bytes kept are the good ones


def test_object_store_leftovers_in_ls(memory_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """On an object store a manifest-less step folder may be a save in progress: listed with
    its size and left alone while young; stray payload prefixes are removable at once."""
    make_root(memory_url, (1, 2))  # type: ignore[arg-type]
    s = open_storage(memory_url)
    s.put_atomic(f"{layout.step_dir(3)}/{'ab' * 16}/r00000-0.bin", b"x" * 1234)
    lost = f"{layout.step_dir(2)}/{'cd' * 16}"
    s.put_atomic(f"{lost}/r00000-0.bin", b"y" * 99)
    code, doc = run_json(capsys, "ls", memory_url)
    assert code == 0
    rows = {r["path"]: r for r in doc["steps"]}
    assert (rows[layout.step_dir(3)]["status"], rows[layout.step_dir(3)]["bytes"]) == ("incomplete", 1234)
    assert rows[layout.step_dir(3)]["prune"]["removes"] is False
    assert (rows[lost]["status"], rows[lost]["bytes"], rows[lost]["prune"]["removes"]) == ("debris", 99, True)


def test_object_store_damaged_step_waits_for_its_grace(memory_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """No rename on object stores: a superseded damaged step is removed only once nothing was
    written under it for the grace period (a save of that step could be rewriting it)."""
    make_root(memory_url, (1, 2, 3))  # type: ignore[arg-type]
    s = open_storage(memory_url)
    m = read_manifest(s, layout.step_dir(1))
    payload = f"{layout.step_dir(1)}/{m.files[0].path}"
    s.put_atomic(payload, s.read(payload)[:-7])  # truncated: step 1 is damaged
    code, doc = run_json(capsys, "prune", memory_url, "--keep-last", "3")
    assert code == 0
    [d] = [d for d in doc["debris"] if d["path"] == layout.step_dir(1)]
    assert (d["kind"], d["removable"]) == ("damaged", False) and "written to" in d["why"]
    assert s.size(payload) is not None
    code, doc = run_json(capsys, "prune", memory_url, "--keep-last", "3", "--debris-min-age", "0")
    assert (code, doc["debris_removed"]) == (0, [layout.step_dir(1)])
    assert s.size(payload) is None and not s.exists(layout.step_dir(1))
    code, doc = run_json(capsys, "ls", memory_url)
    assert [(r["step"], r["status"]) for r in doc["steps"]] == [(2, "committed"), (3, "committed")]


def _unprivileged(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` where file permissions apply: as root (these tests' user), without the
    capabilities that let root read any file (setpriv), so chmod 000 really denies."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: chmod does not stop root")
        drop = "-dac_override,-dac_read_search"
        argv = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *argv]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def unreadable_step_2(tmp_path: Path):
    """A root of steps 1-3 and a crashed save's old .tmp- folder; step 2's folder is mode 000."""
    root = make_root(tmp_path / "run", (1, 2, 3))
    crash_dir = Path(root, layout.step_dir(4) + ".tmp-" + "ab" * 16)
    crash_dir.mkdir()
    (crash_dir / layout.MARKER).write_text(json.dumps({"save_id": "ab" * 16, "created": OLD}))
    locked = Path(root, layout.step_dir(2))
    locked.chmod(0)
    try:
        yield root
    finally:
        locked.chmod(0o755)


def test_an_unreadable_step_stops_verify_and_prune_and_says_what_to_do(unreadable_step_2: str) -> None:
    root = unreadable_step_2
    for argv in (["verify", root], ["prune", root, "--keep-last", "1"], ["inspect", root]):
        p = _unprivileged([sys.executable, "-m", "ckptlib", *argv])
        assert p.returncode == 2, (argv, p.stdout, p.stderr)
        assert f"cannot read {root}/{layout.step_dir(1 + 1)}/manifest.json: permission denied" in p.stderr, p.stderr
        assert "fix its permissions" in p.stderr and "Traceback" not in p.stderr
    assert Path(root, layout.step_dir(1)).exists() and Path(root, layout.step_dir(4) + ".tmp-" + "ab" * 16).exists()


def test_ls_lists_an_unreadable_step_as_such_and_goes_on(unreadable_step_2: str) -> None:
    # ls shows step 2 with the reason, lists the others, says prune would stop, and exits 2
    # (an access error) after the listing.
    root = unreadable_step_2
    p = _unprivileged([sys.executable, "-m", "ckptlib", "ls", root, "--json"])
    assert p.returncode == 2, (p.stdout, p.stderr)
    rows = {r["path"]: r for r in json.loads(p.stdout)["steps"]}
    assert [rows[layout.step_dir(s)]["status"] for s in (1, 2, 3)] == ["committed", "unreadable", "committed"]
    assert "permission denied" in rows[layout.step_dir(2)]["reason"]
    assert all(r["prune"] is None or not r["prune"]["removes"] for r in rows.values())  # prune would stop
    p = _unprivileged([sys.executable, "-m", "ckptlib", "ls", root])
    assert p.returncode == 2 and "unreadable" in p.stdout and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    assert "fix its permissions" in p.stderr
    # restore never skips it: it might be the newest good step. Restores judge newest first, as
    # far as they must: with step 3 damaged, step 2 is next, and it stops the restore.
    next(f for f in Path(root, layout.step_dir(3)).rglob("*.bin") if f.is_file()).write_bytes(b"short")
    p = _unprivileged([sys.executable, "-c", RESTORE, root])
    assert "CheckpointError" in p.stdout and "permission denied" in p.stdout, (p.stdout, p.stderr)


RESTORE = """
import sys, torch, ckptlib
try:
    with ckptlib.CheckpointManager(sys.argv[1]) as mgr:
        print("restored", mgr.restore({"w": torch.zeros(128, 64), "b": torch.zeros(4), "step": 0}))
except ckptlib.CheckpointError as e:
    print("CheckpointError", e)
"""


def test_verify_notes_a_newer_step_that_is_unusable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_root(tmp_path / "run", (1, 2))
    m = read_manifest(open_storage(root), layout.step_dir(2))
    payload = Path(root, layout.step_dir(2), m.files[0].path)
    payload.write_bytes(payload.read_bytes()[:-1])
    code = main(["verify", root, "--json"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert code == 0 and [r["step"] for r in doc["steps"]] == [1]  # what a resume loads: good
    assert [(n["step"], n["status"]) for n in doc["newer_unusable"]] == [(2, "corrupt")]
    assert "note: step 2, newer than the step verified, is corrupt" in captured.err
    assert main(["verify", root, "--step", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["newer_unusable"] == []
