"""A restore judges steps newest first only as far as it needs (engine/resume.py, engine/
scan.py ``iter_steps``): requests counted per step folder by a storage wrapper over a root of
50 committed steps. The 2-rank fallback is in tests/distributed/test_lazy_resume.py."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import helpers
import pytest
import torch

import ckptlib
from ckptlib.backends import Storage, open_storage
from ckptlib.backends.base import ReadHandle
from ckptlib.coord.coordinator import LocalCoordinator
from ckptlib.engine import resume
from ckptlib.engine.scan import UnreadableStepError, scan
from ckptlib.errors import CorruptCheckpointError
from ckptlib.format import layout

STEPS = 50


class CountingStorage(helpers.CountingStorage):
    """Counts the requests (size, exists, open, read, list) under each top-level folder."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner, key=lambda path: path.split("/")[0])

    def folders(self) -> list[int]:
        """The step folders touched, newest first."""
        return sorted((s for p in self.calls if (s := layout.parse_step(p)) is not None), reverse=True)


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(64, dtype=torch.float32) * step, "b": torch.full((5,), float(step))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lazy") / "ck"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for step in range(1, STEPS + 1):
            mgr.save(step, state(step))
    return root


@pytest.fixture
def root(saved: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(saved, tmp_path / "ck"))


def restore(root: Path, **kw: object) -> tuple[int | None, dict[str, torch.Tensor], CountingStorage]:
    storage = CountingStorage(open_storage(str(root)))
    target = state(0)
    return resume.restore(storage, target, LocalCoordinator(), timeout=60, **kw), target, storage  # type: ignore[arg-type]


def payload(root: Path, step: int) -> Path:
    folder = root / layout.step_dir(step)
    return sorted(p for p in folder.rglob("r00000*") if p.is_file())[0]


def test_a_good_newest_step_is_the_only_one_judged(root: Path) -> None:
    assert len(scan(open_storage(str(root)))) == STEPS
    got, target, storage = restore(root)
    assert got == STEPS and torch.equal(target["w"], state(STEPS)["w"])
    assert storage.folders() == [STEPS]


def test_an_incomplete_newer_save_costs_no_request(root: Path) -> None:
    (root / f"{layout.step_dir(STEPS + 1)}.tmp-0123456789abcdef").mkdir()
    got, _, storage = restore(root)
    assert got == STEPS and storage.folders() == [STEPS]


def test_a_newest_step_without_manifest_judges_two(root: Path) -> None:
    (root / layout.step_dir(STEPS) / "manifest.json").unlink()
    got, target, storage = restore(root)
    assert got == STEPS - 1 and torch.equal(target["w"], state(STEPS - 1)["w"])
    assert storage.folders() == [STEPS, STEPS - 1]


def test_a_newest_step_damaged_inside_falls_back_judging_two(root: Path) -> None:
    p = payload(root, STEPS)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: the quick judge passes it, the load does not
    p.write_bytes(bytes(data))
    corrupt: list[int] = []
    got, target, storage = restore(root, corrupt=corrupt)
    assert got == STEPS - 1 and corrupt == [STEPS]
    assert torch.equal(target["w"], state(STEPS - 1)["w"]) and torch.equal(target["b"], state(STEPS - 1)["b"])
    assert storage.folders() == [STEPS, STEPS - 1]


def test_the_skipped_steps_are_listed(root: Path) -> None:
    for step in (STEPS, STEPS - 1):
        with open(payload(root, step), "r+b") as f:
            f.truncate(3)  # a size the manifest does not record: corrupt by the quick judge
    storage = CountingStorage(open_storage(str(root)))
    got = resume.resume_newest(LocalCoordinator(), lambda: resume.step_candidates(storage), lambda c: c.step,
                               timeout=60, where=str(root))
    assert got is not None and got.candidate.step == STEPS - 2
    assert [s.split(":")[0] for s in got.skipped] == [f"step {STEPS}", f"step {STEPS - 1}"]
    assert storage.folders() == [STEPS, STEPS - 1, STEPS - 2]


def test_a_plain_list_of_candidates_still_works(root: Path) -> None:
    storage = open_storage(str(root))
    got = resume.resume_newest(LocalCoordinator(), lambda: list(resume.step_candidates(storage)),
                               lambda c: c.step, timeout=60, where=str(root))
    assert got is not None and got.value == STEPS


def test_restore_of_a_named_step_and_nothing_usable(root: Path) -> None:
    got, target, _ = restore(root, step=7)
    assert got == 7 and torch.equal(target["w"], state(7)["w"])
    for step in range(1, STEPS + 1):
        os.truncate(payload(root, step), 3)
    with pytest.raises(CorruptCheckpointError, match="no usable checkpoint"):
        restore(root)


def test_a_named_step_judges_itself_and_the_newer_steps_up_to_a_committed_one(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ckptlib")
    got, target, storage = restore(root, step=7)
    assert got == 7 and torch.equal(target["w"], state(7)["w"])
    assert storage.folders() == [STEPS, 7]  # the newest, for the rollback warning, then step 7 alone
    assert f"newest {STEPS}" in caplog.text and f"resumes from step {STEPS}" in caplog.text, caplog.text
    # a newest step without its manifest is not the newest committed one: the warning names the next
    (root / layout.step_dir(STEPS) / "manifest.json").unlink()
    caplog.clear()
    got, _, storage = restore(root, step=7)
    assert got == 7 and storage.folders() == [STEPS, STEPS - 1, 7]
    assert f"resumes from step {STEPS - 1}" in caplog.text, caplog.text
    # the newest step itself: nothing newer, no warning
    caplog.clear()
    got, _, storage = restore(root, step=STEPS - 1)
    assert got == STEPS - 1 and storage.folders() == [STEPS, STEPS - 1] and "newer" not in caplog.text


def test_an_empty_root_restores_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert restore(tmp_path / "empty")[0] is None
    assert restore(tmp_path / "absent")[0] is None


class DeniedStorage(CountingStorage):
    """The manifests of ``denied`` step folders cannot be read (permission denied)."""

    def __init__(self, inner: Storage, denied: set[str]) -> None:
        super().__init__(inner)
        self.denied = denied

    def open_read(self, path: str) -> ReadHandle:
        if path.split("/")[0] in self.denied:
            raise PermissionError(errno.EACCES, "denied", path)
        return super().open_read(path)


def test_an_unreadable_step_stops_a_restore_that_reaches_it(root: Path) -> None:
    denied = DeniedStorage(open_storage(str(root)), {layout.step_dir(STEPS)})
    with pytest.raises(UnreadableStepError, match="permission denied"):
        resume.restore(denied, state(0), LocalCoordinator(), timeout=60)
    # under a damaged newest step too: never skipped for an older one
    os.truncate(payload(root, STEPS), 3)
    denied = DeniedStorage(open_storage(str(root)), {layout.step_dir(STEPS - 1)})
    with pytest.raises(UnreadableStepError, match="permission denied"):
        resume.restore(denied, state(0), LocalCoordinator(), timeout=60)
    # one older than the step that loads is never reached (ckptlib ls lists it)
    denied = DeniedStorage(open_storage(str(root)), {layout.step_dir(3)})
    assert resume.restore(denied, state(0), LocalCoordinator(), timeout=60) == STEPS - 1


def test_restore_of_an_older_step_is_not_stopped_by_an_unreadable_newer_one(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``restore(step=N)`` judges the newer steps only for its rollback warning: one whose
    manifest cannot be read (permission denied) failed the restore of a step it does not read.
    Now it is logged and passed over; the next newer committed step is still warned about."""
    denied = DeniedStorage(open_storage(str(root)), {layout.step_dir(STEPS)})
    target = state(0)
    with caplog.at_level(logging.WARNING, logger="ckptlib"):
        assert resume.restore(denied, target, LocalCoordinator(), step=3, timeout=60) == 3
    assert "a newer step than the one restored cannot be read" in caplog.text
    assert f"holds newer committed step(s), the newest {STEPS - 1}" in caplog.text
    assert torch.equal(target["w"], state(3)["w"])
