"""Debris rules of ``ckptlib.engine.retire`` on rename-capable (POSIX) storage."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from ckptlib.backends import open_storage
from ckptlib.engine import retire
from ckptlib.format import layout


def _fake(storage, name: str, *, marker: bool, extra: str | None = None) -> None:
    sid = uuid.uuid4().hex
    storage.put_atomic(f"{name}/manifest.json", b"{}")
    storage.put_atomic(f"{name}/{sid}/r00000-0.bin", b"payload")
    if marker:
        storage.put_atomic(f"{name}/{layout.MARKER}", b"{}")
    if extra:
        storage.put_atomic(f"{name}/{extra}", b"not ours")


def test_marker_less_debris_of_ours_is_removed_foreign_is_kept(tmp_path):
    s = open_storage(tmp_path / "root")
    with_marker = layout.del_dir("step-000000000001", uuid.uuid4().hex)
    half_deleted = layout.del_dir("step-000000000002", uuid.uuid4().hex)
    crashed_tmp = layout.tmp_dir("step-000000000003", uuid.uuid4().hex)
    foreign = layout.del_dir("step-000000000004", uuid.uuid4().hex)
    _fake(s, with_marker, marker=True)
    _fake(s, half_deleted, marker=False)  # a crash mid-deletion took the marker first
    _fake(s, crashed_tmp, marker=False)
    _fake(s, foreign, marker=False, extra="notes.txt")
    removed = retire.clean_debris(s)
    assert sorted(removed) == sorted([with_marker, half_deleted, crashed_tmp])
    assert [e.name for e in s.listdir("")] == [foreign]


def _record_deletions(storage, root: Path, monkeypatch) -> list[set[str]]:
    """Spy on ``delete``/``delete_tree``: for each outermost call, the files it removed.
    Listings put the marker first, so a rule that does not single it out fails."""
    calls: list[set[str]] = []
    depth = [0]

    def files() -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    def spying(real):
        def spy(path: str) -> None:
            before = files()
            depth[0] += 1
            try:
                real(path)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                calls.append(before - files())
        return spy

    real_listdir = storage.listdir

    def marker_first(path: str = ""):  # the rule must hold whatever order a listing has
        return sorted(real_listdir(path), key=lambda e: e.name != layout.MARKER)

    monkeypatch.setattr(storage, "listdir", marker_first)
    monkeypatch.setattr(storage, "delete", spying(storage.delete))
    monkeypatch.setattr(storage, "delete_tree", spying(storage.delete_tree))
    return calls


def _assert_marker_removed_alone_and_last(calls: list[set[str]]) -> None:
    removed = [c for c in calls if c]
    assert len(removed) >= 2, removed  # payloads and manifest went before the marker
    last = removed[-1]
    assert len(last) == 1 and next(iter(last)).endswith("/" + layout.MARKER), removed
    assert not any(f.endswith("/" + layout.MARKER) for c in removed[:-1] for f in c), removed


def test_delete_step_removes_marker_last(tmp_path, monkeypatch):
    root = tmp_path / "root"
    s = open_storage(root)
    _fake(s, "step-000000000005", marker=True)
    calls = _record_deletions(s, root, monkeypatch)
    retire.delete_step(s, "step-000000000005")
    _assert_marker_removed_alone_and_last(calls)
    assert s.listdir("") == []


def test_debris_cleanup_removes_marker_last(tmp_path, monkeypatch):
    root = tmp_path / "root"
    s = open_storage(root)
    crashed = layout.tmp_dir("step-000000000006", uuid.uuid4().hex)
    _fake(s, crashed, marker=True)
    calls = _record_deletions(s, root, monkeypatch)
    assert retire.clean_debris(s) == [crashed]
    _assert_marker_removed_alone_and_last(calls)
    assert s.listdir("") == []


def test_one_rule_set_judged_from_inside_and_outside_the_job(tmp_path):
    """The manager (knows its saves in flight) and ``ckptlib prune`` (does not) share
    ``find_debris``; from outside, only a marked ``.tmp-`` folder older than ``min_age`` goes."""
    s = open_storage(tmp_path / "root")
    now = time.time()
    folders = {}
    for step, created in ((1, now - 7200), (2, now), (3, None)):
        sid = uuid.uuid4().hex
        name = layout.tmp_dir(layout.step_dir(step), sid)
        s.put_atomic(f"{name}/{sid}/r00000-0.bin", b"payload")
        if created is not None:
            s.put_atomic(f"{name}/{layout.MARKER}", json.dumps({"created": created}).encode())
        folders[step] = (name, sid)
    old, young, unmarked = (folders[i][0] for i in (1, 2, 3))
    outside = {d.path: d.removable for d in retire.find_debris(s, None, min_age=3600, now=now)}
    assert outside == {old: True, young: False, unmarked: False}
    inside = retire.find_debris(s, {folders[2][1]}, now=now)
    assert {d.path: d.removable for d in inside} == {old: True, young: False, unmarked: True}
    assert [d.why for d in inside if d.path == young] == ["a save in flight in this job"]
    assert retire.remove_debris(s, inside) == [old, unmarked]
    assert [e.name for e in s.listdir("")] == [young]


def _steps(tmp_path, n: int):
    """A root with committed steps 1..n (real saves), its storage and the scan."""
    import torch

    import ckptlib
    from ckptlib.engine.scan import scan

    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for step in range(1, n + 1):
            mgr.save(step, {"w": torch.full((64, 32), float(step))})
    s = open_storage(root)
    return root, s, sorted(scan(s), key=lambda i: i.step)


def _flip(root: Path, step: int) -> None:
    folder = root / layout.step_dir(step)
    payload = next(p for p in folder.rglob("*.bin"))
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 1
    payload.write_bytes(bytes(data))


def test_jobs_never_remove_damaged_or_quarantined_folders(tmp_path):
    """Only ``ckptlib prune`` (``active_ids=None`` and ``steps=``) judges damaged step folders
    and ``.corrupt-`` ones; a job's cleanup after each commit leaves them as evidence."""
    root, s, infos = _steps(tmp_path, 3)
    quarantined = f"{layout.step_dir(1)}.corrupt-{'ab' * 16}"
    s.rename(layout.step_dir(1), quarantined)
    infos = [i for i in infos if i.step != 1]
    assert retire.clean_debris(s, {"cd" * 16}) == []
    assert retire.find_debris(s, None) == []  # no steps given: not judged
    found = retire.find_debris(s, None, steps=infos)
    assert [(d.path, d.kind, d.removable) for d in found] == [(quarantined, "quarantined", True)]
    assert retire.tree_bytes(s, quarantined) == sum(
        p.stat().st_size for p in (root / quarantined).rglob("*") if p.is_file()
    )
    assert retire.remove_debris(s, found) == [quarantined]
    assert not (root / quarantined).exists()
    assert retire.tree_bytes(s, quarantined) is None


def test_verified_retention_never_counts_a_corrupt_step_as_kept(tmp_path):
    from ckptlib.plan import retention

    root, s, infos = _steps(tmp_path, 5)
    _flip(root, 5)
    _flip(root, 3)
    checked = []

    def keep(steps):
        return retention.decide(steps, 2, None)

    decisions, judged = retire.verified_retention(s, infos, keep, deep=True,
                                                  on_check=lambda i: checked.append(i.step))
    assert sorted(d.step for d in decisions if d.keep) == [2, 4]
    assert checked == [5, 4, 3, 2]  # newest first, each once
    assert {i.step: i.status for i in judged} == {1: "committed", 2: "committed", 3: "corrupt",
                                                  4: "committed", 5: "corrupt"}
    # Without deep checks the policy sees only what a quick check sees.
    decisions, judged = retire.verified_retention(s, infos, keep, deep=False)
    assert sorted(d.step for d in decisions if d.keep) == [4, 5]
    assert judged == infos
    # Damaged step 3 is superseded by good step 4; step 5 is newer than any good step: evidence.
    _, judged = retire.verified_retention(s, infos, keep, deep=True)
    verdict = {d.path: d.removable for d in retire.find_debris(s, None, steps=judged)}
    assert verdict == {layout.step_dir(3): True, layout.step_dir(5): False}


def test_a_step_of_a_newer_format_is_never_removed_as_damaged(tmp_path):
    """A manifest this ckptlib cannot read because a newer one wrote it is not damage."""
    root, s, _ = _steps(tmp_path, 3)
    manifest = root / layout.step_dir(1) / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["format_version"] = 99
    manifest.write_text(json.dumps(doc))
    _flip(root, 2)
    from ckptlib.engine.scan import scan

    judged = sorted(scan(s, deep=True), key=lambda i: i.step)
    assert [i.status for i in judged] == ["corrupt", "corrupt", "committed"]
    found = {d.path: d for d in retire.find_debris(s, None, steps=judged)}
    assert found[layout.step_dir(2)].removable  # damaged and superseded by step 3
    newer = found[layout.step_dir(1)]
    assert not newer.removable and "newer format" in newer.why


def test_tree_bytes_stops_at_the_entry_limit_for_folders_too(tmp_path, monkeypatch):
    """``ls``/``prune`` size each debris folder; a debris tree of empty folders (or a symlink
    that loops back up) was walked without end, as only files counted against the limit."""
    monkeypatch.setattr(retire, "MAX_TREE_FILES", 50)
    s = open_storage(str(tmp_path))
    for i in range(30):  # 60 folders, no files
        (tmp_path / "deb" / f"a{i}" / "b").mkdir(parents=True)
    assert retire.tree_bytes(s, "deb") is None
    (tmp_path / "small" / "x").mkdir(parents=True)
    (tmp_path / "small" / "x" / "f").write_bytes(b"12345")
    assert retire.tree_bytes(s, "small") == 5
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "f").write_bytes(b"abc")
    (tmp_path / "loop" / "up").symlink_to(tmp_path / "loop")
    assert retire.tree_bytes(s, "loop") in (None, 3)  # a link is not followed, or the walk ends at the limit
