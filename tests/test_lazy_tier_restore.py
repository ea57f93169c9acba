"""A tier restore judges the persistent root's steps newest first only as far as it needs
(tiers/restore.py ``candidates``): requests to the persistent root counted per step folder by a
storage wrapper, over a run of 30 steps drained to it and the newest two kept locally. The
candidates' merge of the two tiers (which copy a step is, its ``extra``) is checked step by step."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_lazy_resume import CountingStorage

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import LocalCoordinator
from ckptlib.engine.scan import read_manifest
from ckptlib.format import layout
from ckptlib.tiers import restore as tier_restore
from ckptlib.tiers.inventory import local_save_id, local_steps
from ckptlib.tiers.local import LocalTier

STEPS = 30


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(16, dtype=torch.float32) * step}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    top = tmp_path_factory.mktemp("lazy-tiers")
    with ckptlib.CheckpointManager(top / "p", local=str(top / "n{node}"), local_keep_last=2, async_save=False) as mgr:
        for step in range(1, STEPS + 1):
            mgr.save(step, state(step))
        mgr.wait()
    return top


@pytest.fixture
def top(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "run"))


def restore(top: Path, **kw: object) -> tuple[int | None, dict[str, torch.Tensor], CountingStorage]:
    persistent = CountingStorage(open_storage(str(top / "p")))
    target = state(0)
    got = tier_restore.restore(LocalTier(open_storage(str(top / "n0")), 0), persistent, target,
                               LocalCoordinator(), timeout=60, **kw)  # type: ignore[arg-type]
    return got, target, persistent


def test_the_newest_step_on_both_tiers_judges_one_persistent_step(top: Path) -> None:
    assert sorted(local_steps(open_storage(str(top / "n0")))) == [STEPS - 1, STEPS]
    got, target, persistent = restore(top)
    assert got == STEPS and torch.equal(target["w"], state(STEPS)["w"])
    assert persistent.folders() == [STEPS]


def test_a_newest_step_only_local_judges_no_persistent_step(top: Path) -> None:
    shutil.rmtree(top / "p" / layout.step_dir(STEPS))  # not drained yet
    got, target, persistent = restore(top)
    assert got == STEPS and torch.equal(target["w"], state(STEPS)["w"])
    assert persistent.folders() == []


def test_a_named_step_judges_that_step_alone(top: Path) -> None:
    got, target, persistent = restore(top, step=5)  # on the persistent tier only
    assert got == 5 and torch.equal(target["w"], state(5)["w"])
    assert persistent.folders() == [5]


def test_candidates_merge_the_tiers_as_before(top: Path) -> None:
    p, n0 = top / "p", top / "n0"
    (p / layout.step_dir(STEPS) / "manifest.json").unlink()  # incomplete there: the local copy stands
    shutil.rmtree(p / layout.step_dir(STEPS - 1))  # local only
    with open(sorted((p / layout.step_dir(3)).rglob("r00000*"))[0], "r+b") as f:
        f.truncate(3)  # corrupt, on the persistent tier only
    (p / f"{layout.step_dir(STEPS + 1)}.tmp-0123456789abcdef").mkdir()  # a crashed save
    held = {n: sid for n, sid in local_steps(open_storage(str(n0))).items()}
    other = {STEPS - 1: "another-save", 2: "ffff"}  # a second rank's node: its own save of STEPS - 1
    tier = LocalTier(open_storage(str(n0)), 0)
    cands = list(tier_restore.candidates(tier, open_storage(str(p)), [held, other, dict(held)]))
    by_step = {c.step: c for c in cands}
    assert [c.step for c in cands] == list(range(STEPS + 1, 0, -1))
    assert by_step[STEPS + 1].status == "incomplete" and by_step[STEPS + 1].extra is None
    assert (by_step[STEPS].status, by_step[STEPS].extra) == ("committed", {"save_id": held[STEPS], "persistent": None})
    assert by_step[STEPS - 1].extra == {"save_id": held[STEPS - 1], "persistent": None}  # held by two ranks of three
    assert by_step[3].status == "corrupt" and by_step[3].extra is None
    m = read_manifest(open_storage(str(p)), layout.step_dir(2))  # persistent and local (rank 1): persistent wins
    assert by_step[2].extra == {"save_id": local_save_id(m), "persistent": m.save_id}
    assert Counter(c.status for c in cands) == Counter({"committed": STEPS - 1, "incomplete": 1, "corrupt": 1})
    counted = CountingStorage(open_storage(str(p)))
    assert list(tier_restore.candidates(tier, counted, [held], step=STEPS)) == [by_step[STEPS]]
    assert counted.folders() == [STEPS]


def test_latest_step_with_tiers_judges_only_the_newest_persistent_step(top: Path) -> None:
    """``latest_step()`` with a local tier scanned every persistent step (``steps()``); now the
    newest committed one is found newest first, and the node's local steps count too."""
    tier = LocalTier(open_storage(str(top / "n0")), 0)
    persistent = CountingStorage(open_storage(str(top / "p")))
    assert tier_restore.newest_step(tier, persistent) == STEPS
    assert persistent.folders() == [STEPS]
    shutil.rmtree(top / "p" / layout.step_dir(STEPS))  # not drained yet: the local copy counts
    persistent = CountingStorage(open_storage(str(top / "p")))
    assert tier_restore.newest_step(tier, persistent) == STEPS
    assert persistent.folders() == [STEPS - 1]
