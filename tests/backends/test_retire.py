"""Debris rules of ``ckptlib.engine.retire`` on rename-capable (POSIX) storage."""

from __future__ import annotations

import uuid

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


def test_delete_step_removes_marker_last(tmp_path, monkeypatch):
    s = open_storage(tmp_path / "root")
    _fake(s, "step-000000000005", marker=True)
    seen = []
    real_delete = s.delete

    def spy(path: str) -> None:
        seen.append(path.rsplit("/", 1)[-1])
        real_delete(path)

    monkeypatch.setattr(s, "delete", spy)
    retire.delete_step(s, "step-000000000005")
    assert layout.MARKER not in seen  # never deleted on its own before the rest
    assert s.listdir("") == []
