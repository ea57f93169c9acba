"""``scan()`` (``ckptlib ls``, retention, ``verify``, the read view) judges step folders on a
small pool (engine/scan.py): the same steps in the same order as one step at a time, the first
error in step order raised, and no pool thread left behind. Real files, a storage wrapper that
holds or fails chosen requests."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.backends import Storage, open_storage
from ckptlib.backends.base import ReadHandle
from ckptlib.engine.scan import UnreadableStepError, check_step, scan
from ckptlib.errors import StorageError
from ckptlib.format import layout
from ckptlib.testing.faults import FaultyStorage

STEPS = 30


class HookedStorage(FaultyStorage):
    """Calls ``hook(path)`` before every manifest open (it may wait, or raise)."""

    def __init__(self, inner: Storage, hook: Callable[[str], None]) -> None:
        super().__init__(inner, [])
        self.hook = hook
        self.supports_atomic_rename = False  # judged like an object store: on the pool (a local root is not)

    def open_read(self, path: str) -> ReadHandle:
        if path.endswith("manifest.json"):
            self.hook(path)
        return super().open_read(path)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scan") / "ck"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for step in range(1, STEPS + 1):
            mgr.save(step, {"w": torch.full((8,), float(step))})
    (root / layout.step_dir(7) / "manifest.json").unlink()  # incomplete
    payload = next(p for p in (root / layout.step_dir(12)).rglob("r00000*") if p.is_file())
    payload.write_bytes(b"short")  # corrupt: a size the manifest does not record
    (root / f"{layout.step_dir(STEPS + 1)}.tmp-0123456789abcdef").mkdir()  # a save in progress
    return root


def one_at_a_time(storage: Storage, root: Path) -> list[tuple[int, str, str]]:
    """What a scan must return: each folder judged alone, newest first."""
    want = [(s, check_step(storage, layout.step_dir(s), s).status, layout.step_dir(s)) for s in range(STEPS, 0, -1)]
    return [(STEPS + 1, "incomplete", f"{layout.step_dir(STEPS + 1)}.tmp-0123456789abcdef"), *want]


def test_steps_are_judged_together_and_listed_in_order(root: Path) -> None:
    meet = threading.Barrier(2, timeout=30)  # the two newest manifests' reads wait for each other:
    held = {layout.step_dir(STEPS), layout.step_dir(STEPS - 1)}  # one step at a time never gets past

    def hook(path: str) -> None:
        if path.split("/")[0] in held:
            meet.wait()

    infos = scan(HookedStorage(open_storage(str(root)), hook))
    assert [(i.step, i.status, i.path) for i in infos] == one_at_a_time(open_storage(str(root)), root)
    assert {i.step: i.status for i in infos}[7] == "incomplete" and {i.step: i.status for i in infos}[12] == "corrupt"
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptlib-scan")]


def test_a_local_root_is_judged_one_step_at_a_time(root: Path) -> None:
    """Retention scans after every save: on a local file system that starts no pool threads."""
    seen: set[str] = set()
    local = HookedStorage(open_storage(str(root)), lambda path: seen.add(threading.current_thread().name))
    local.supports_atomic_rename = True
    infos = scan(local)
    assert [(i.step, i.status, i.path) for i in infos] == one_at_a_time(open_storage(str(root)), root)
    assert seen == {threading.current_thread().name}


def test_the_oldest_failing_step_is_raised_even_when_a_newer_one_fails_first(root: Path) -> None:
    newer_failed = threading.Event()
    old, new = layout.step_dir(5), layout.step_dir(20)

    def hook(path: str) -> None:
        folder = path.split("/")[0]
        if folder == new:
            newer_failed.set()
            raise PermissionError(errno.EACCES, "denied", path)
        if folder == old:
            newer_failed.wait(timeout=30)  # fails after the newer step has, when judged together
            raise StorageError(f"cannot reach {path}")

    with pytest.raises(StorageError, match="cannot reach") as got:
        scan(HookedStorage(open_storage(str(root)), hook))
    assert not isinstance(got.value, UnreadableStepError)
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptlib-scan")]


def test_an_unreadable_step_stops_the_scan_unless_ls_lists_it(root: Path) -> None:
    def hook(path: str) -> None:
        if path.split("/")[0] in (layout.step_dir(9), layout.step_dir(25)):
            raise PermissionError(errno.EACCES, "denied", path)

    storage = HookedStorage(open_storage(str(root)), hook)
    with pytest.raises(UnreadableStepError, match=layout.step_dir(9)):
        scan(storage)
    listed = {i.step: i.status for i in scan(storage, unreadable=True)}
    assert listed[9] == listed[25] == "unreadable" and listed[STEPS] == "committed" and len(listed) == STEPS + 1


STALL = r'''
import sys, threading
import torch
import ckptlib
from ckptlib.backends import open_storage
from ckptlib.cli.main import main

url = "memory://ckptlib-stall-" + sys.argv[1]
with ckptlib.CheckpointManager(url, async_save=False) as mgr:
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.ones(4)})
storage = open_storage(url)
real, never = type(storage).open_read, threading.Event()

def stall(self, path):
    if path.endswith("manifest.json"):
        never.wait(3600)  # a remote that never answers
    return real(self, path)

type(storage).open_read = stall
print("exit", main(["ls", url, "--timeout", "0.5"]), flush=True)
'''


def test_ls_gives_up_on_a_stalled_step_and_the_process_exits(tmp_path: Path) -> None:
    """``--timeout`` abandons a scan stuck in its pool; the process still exits (no pool thread
    that interpreter exit would wait for)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", STALL, tmp_path.name], capture_output=True, text=True, timeout=300)
    assert "exit 2" in proc.stdout, proc.stderr
    assert "no answer from storage within 0.5 s" in proc.stderr
