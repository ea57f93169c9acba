"""``overwrite=True`` on an object store never loses the step it replaces (engine/commit.py
``_publish_claimed``): a save that fails at any point of its publish leaves exactly one of
{the old step, the new step} committed, loadable byte for byte; ``ckptlib ls`` says the same;
the next save, or ``ckptlib prune``, leaves no debris.

Kills are real (SIGKILL of a child process at a crash point) on the real SeaweedFS server; the
memory backend lives in one process, so there a crash point raises a ``BaseException`` that
only ``finally`` blocks see (the save's own abort runs, as after a failure). Fences and storage
errors: in one process, on both. The 2-rank version with a frozen coordinator:
tests/distributed/test_overwrite_fence.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from backends.conftest import s3_root

import ckptlib
from ckptlib import crashpoints
from ckptlib.backends import open_storage
from ckptlib.cli.main import main as cli
from ckptlib.engine import commit, retire
from ckptlib.engine import save as save_flow
from ckptlib.engine import scan as scan_module
from ckptlib.engine.scan import read_manifest, scan
from ckptlib.errors import CommitError
from ckptlib.format import fence as fence_format
from ckptlib.format import layout
from ckptlib.testing.faults import Fault, FaultyStorage

REPO = Path(__file__).resolve().parent.parent
STEP = layout.step_dir(1)
POINTS = ["manifest", "claimed", "replaced"]
"""The coordinator's publish on an object store with overwrite: before its claim, after the
claim with the old manifest in place, after the new manifest replaced it (claim not removed)."""
NEW_WINS = {"manifest": False, "claimed": False, "replaced": True}

CHILD = """
import json, sys, torch
from ckptlib.backends import open_storage
from ckptlib.engine import save as save_flow
url, opts = sys.argv[1], json.loads(sys.argv[2])
flat = save_flow.prepare({"w": torch.arange(3000, dtype=torch.float32) * 2, "tag": "new"}, 0)
save_flow.persist(open_storage(url, opts), sys.argv[3], flat, step=1,
                  options=save_flow.SaveOptions(overwrite=True))
"""


def _old() -> dict[str, Any]:
    return {"w": torch.arange(3000, dtype=torch.float32), "tag": "old"}


def _new() -> dict[str, Any]:
    return {"w": torch.arange(3000, dtype=torch.float32) * 2, "tag": "new"}


def _cli_options(opts: dict | None) -> list[str]:
    out: list[str] = []
    for k, v in (opts or {}).items():
        out += ["--storage-option", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    return out


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    assert cli([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


class Crash(BaseException):
    """A crash in this process: no ``except`` of ckptlib's catches it."""


def _check_one_committed(url: str, opts: dict | None, old_id: str, new_wins: bool,
                         capsys: pytest.CaptureFixture[str], clean: str = "save") -> None:
    """Exactly one of old/new is committed and loads byte for byte; ``ls`` agrees; ``clean``
    (``prune``: ``ckptlib prune``; ``save``: the next save's cleanup) removes the debris."""
    storage = open_storage(url, opts)
    infos = scan(storage)
    assert [(i.step, i.status) for i in infos] == [(1, "committed")], infos
    assert (infos[0].save_id != old_id) == new_wins, (infos[0].save_id, old_id)
    want = _new() if new_wins else _old()
    back = ckptlib.load(f"{url}/{STEP}", storage_options=opts)
    assert back["tag"] == want["tag"] and torch.equal(back["w"], want["w"])
    rows = _cli(capsys, "ls", url, *_cli_options(opts))["steps"]
    assert [(r["step"], r["status"]) for r in rows if r["status"] != "debris"] == [(1, "committed")], rows
    debris = retire.find_debris(storage, None)
    assert all(d.removable for d in debris), debris
    prune = ["prune", url, "--keep-last", "5", *_cli_options(opts)]
    if clean == "prune":
        assert sorted(_cli(capsys, *prune)["debris_removed"]) == sorted(d.name for d in debris)
        assert retire.find_debris(storage, None) == []
    with ckptlib.CheckpointManager(url, storage_options=opts, async_save=False) as mgr:
        mgr.save(2, _old())  # its cleanup removes what the failed publish left in step 1
    assert retire.find_debris(storage, None) == []
    assert _cli(capsys, *prune)["debris_removed"] == []
    assert sorted(e.name for e in storage.listdir(STEP)) == sorted([infos[0].save_id, "manifest.json"])
    assert [layout.is_payload_name(e.name) for e in storage.listdir(f"{STEP}/{infos[0].save_id}")] == [True]
    back = ckptlib.load(f"{url}/{STEP}", storage_options=opts)
    assert back["tag"] == want["tag"] and torch.equal(back["w"], want["w"])
    assert [(i.step, i.status) for i in scan(storage, deep=True)] == [(2, "committed"), (1, "committed")]


def _save(state: dict[str, Any], url: str, opts: dict | None = None, *, overwrite: bool = False) -> None:
    """Save ``state`` as step 1 under the run root ``url`` (what a manager's save does)."""
    save_flow.persist(open_storage(url, opts), STEP, save_flow.prepare(state, 0), step=1,
                      options=save_flow.SaveOptions(overwrite=overwrite))


def _save_old(url: str, opts: dict | None) -> str:
    _save(_old(), url, opts)
    return scan(open_storage(url, opts))[0].save_id


@pytest.mark.parametrize("point", POINTS)
def test_overwrite_killed_at_each_point_seaweedfs(point, seaweed, capsys):
    """A real process saving step 1 again with ``overwrite=True`` is SIGKILLed at each point of
    its publish on a real SeaweedFS server."""
    url, opts = s3_root(seaweed)
    old_id = _save_old(url, opts)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "CKPTLIB_TEST_KILL_AT": f"{point}:0"}
    proc = subprocess.run([sys.executable, "-c", CHILD, url, json.dumps(opts), STEP], env=env,
                          capture_output=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode(errors="replace")[-3000:]
    storage = open_storage(url, opts)
    left = {d.kind for d in retire.find_debris(storage, None)}
    assert left == ({"prefix", "claim"} if NEW_WINS[point] else {"prefix"}), left
    _check_one_committed(url, opts, old_id, NEW_WINS[point], capsys, "prune")


@pytest.mark.parametrize("point", POINTS)
def test_overwrite_crashed_at_each_point_memory(point, memory_url, monkeypatch, capsys):
    """The same crash points on the memory backend, in this process."""
    old_id = _save_old(memory_url, None)

    def crash_at(phase: str, rank: int = 0) -> None:
        if phase == point:
            raise Crash(phase)

    monkeypatch.setattr(crashpoints, "point", crash_at)
    with pytest.raises(Crash):
        _save(_new(), memory_url, overwrite=True)
    monkeypatch.undo()
    _check_one_committed(memory_url, None, old_id, NEW_WINS[point], capsys)


@pytest.mark.parametrize("kind", ["memory", "s3"])
@pytest.mark.parametrize("point", POINTS)
def test_fence_at_each_point_decides_once(kind, point, memory_url, request, monkeypatch, capsys):
    """A rank fencing the overwrite save at each point of the coordinator's publish: before the
    claim it wins (the coordinator raises "fenced", the old step stands); after it, it finds the
    claim, puts the new manifest in place itself if needed and reports committed (the
    coordinator's publish succeeds too)."""
    if kind == "s3":
        url, opts = s3_root(request.getfixturevalue("seaweed"))
    else:
        url, opts = memory_url, None
    old_id = _save_old(url, opts)
    verdicts: list[str] = []
    real_publish = commit.publish

    def publish(storage, staging, manifest, **kw):
        def fence_at(phase: str, rank: int = 0) -> None:
            if phase == point:
                verdicts.append(commit.fence(storage, staging.final, staging.save_id, 1, "test gave up"))
        monkeypatch.setattr(crashpoints, "point", fence_at)
        real_publish(storage, staging, manifest, **kw)

    monkeypatch.setattr(commit, "publish", publish)
    if point == "manifest":
        with pytest.raises(CommitError, match="fenced"):
            _save(_new(), url, opts, overwrite=True)
        assert verdicts == [commit.FENCED]
    else:
        _save(_new(), url, opts, overwrite=True)
        assert verdicts == [commit.COMMITTED]
    monkeypatch.undo()
    _check_one_committed(url, opts, old_id, point != "manifest", capsys)


def test_claim_rolled_forward_by_fence_when_coordinator_died(memory_url, monkeypatch):
    """The coordinator died right after its claim (the old manifest still in place): a rank
    that gives up finds the claim, puts the new manifest in place and reports committed; a
    second rank finds it committed too."""
    old_id = _save_old(memory_url, None)

    def crash_at(phase: str, rank: int = 0) -> None:
        if phase == "claimed":
            raise Crash(phase)

    monkeypatch.setattr(crashpoints, "point", crash_at)
    with pytest.raises(Crash):
        _save(_new(), memory_url, overwrite=True)
    monkeypatch.undo()
    storage = open_storage(memory_url)
    assert scan(storage)[0].save_id == old_id  # the old step stands until someone rolls forward
    new_id = next(e.name for e in storage.listdir(STEP) if e.is_dir and e.name != old_id)
    assert commit.fence(storage, STEP, new_id, 1, "gave up") == commit.COMMITTED
    assert scan(storage)[0].save_id == new_id
    assert commit.fence(storage, STEP, new_id, 2, "gave up") == commit.COMMITTED
    back = ckptlib.load(f"{memory_url}/{STEP}")
    assert back["tag"] == "new" and torch.equal(back["w"], _new()["w"])
    retire.clean_debris(storage)
    assert retire.find_debris(storage, None) == []
    assert sorted(e.name for e in storage.listdir(STEP)) == sorted([new_id, "manifest.json"])


def test_storage_error_on_the_replacing_put(memory_url):
    """The coordinator's put of the new manifest fails after its claim: it raises, the old step
    stays committed, and the claim now holds an abort record, so a rank giving up later reports
    failure too."""
    old_id = _save_old(memory_url, None)
    faulty = FaultyStorage(open_storage(memory_url), [Fault("put_atomic", f"{STEP}/manifest.json", calls=None)])
    flat = save_flow.prepare(_new(), 0)
    with pytest.raises(CommitError, match="not replaced"):
        save_flow.persist(faulty, STEP, flat, step=1, options=save_flow.SaveOptions(overwrite=True))
    storage = open_storage(memory_url)
    infos = scan(storage)
    assert [(i.step, i.status, i.save_id) for i in infos] == [(1, "committed", old_id)]
    claims = [d for d in retire.find_debris(storage, None) if d.kind == "prefix"]
    assert len(claims) == 1
    sid = claims[0].save_id
    record = fence_format.parse_abort(storage.read(layout.claim_path(STEP, sid)))
    assert record is not None and record.save_id == sid
    assert commit.fence(storage, STEP, sid, 1, "late") == commit.FENCED
    assert scan(storage)[0].save_id == old_id
    back = ckptlib.load(f"{memory_url}/{STEP}")
    assert back["tag"] == "old" and torch.equal(back["w"], _old()["w"])


def test_posix_overwrite_puts_the_old_step_back_when_the_rename_fails(tmp_path):
    """POSIX (rename commit): the old step is moved aside only at the rename; when the rename
    of the new folder then fails, the old step is put back and stays committed."""
    url = str(tmp_path / "root")
    old_id = _save_old(url, None)
    # The 1st rename of the tmp folder finds step-1 there (moved aside then); the 2nd fails.
    faulty = FaultyStorage(open_storage(url), [Fault("rename", f"{STEP}.tmp-*", calls=(2,))])
    with pytest.raises(CommitError, match="injected fault"):
        save_flow.persist(faulty, STEP, save_flow.prepare(_new(), 0), step=1,
                          options=save_flow.SaveOptions(overwrite=True))
    faulty.injector.verify()
    moved = [path for op, path in faulty.injector.calls if op == "rename"]  # the sources
    assert len(moved) == 4 and moved[1] == STEP and moved[3].startswith(f"{STEP}.del-"), moved
    storage = open_storage(url)
    assert [(i.step, i.status, i.save_id) for i in scan(storage)] == [(1, "committed", old_id)]
    assert sorted(p.name for p in Path(url).iterdir()) == [STEP]  # nothing aside, no tmp left
    back = ckptlib.load(f"{url}/{STEP}")
    assert back["tag"] == "old" and torch.equal(back["w"], _old()["w"])


CHILD_POSIX = """
import os, signal, sys, torch
from ckptlib.backends import open_storage
from ckptlib.engine import save as save_flow
from ckptlib.testing.faults import FaultyStorage

class DieAfterMovingAside(FaultyStorage):
    def rename(self, src, dst):
        super().rename(src, dst)
        if ".del-" in dst:
            os.kill(os.getpid(), signal.SIGKILL)

flat = save_flow.prepare({"w": torch.arange(3000, dtype=torch.float32) * 2, "tag": "new"}, 0)
save_flow.persist(DieAfterMovingAside(open_storage(sys.argv[1]), []), sys.argv[2], flat, step=1,
                  options=save_flow.SaveOptions(overwrite=True))
"""


def test_posix_overwrite_killed_between_its_renames_keeps_the_old_step(tmp_path):
    """POSIX: a process SIGKILLed after moving the committed step aside and before renaming its
    own folder into place: the cleanup puts the old step back (it never deletes it)."""
    url = str(tmp_path / "root")
    old_id = _save_old(url, None)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHILD_POSIX, url, STEP], env=env, capture_output=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode(errors="replace")[-3000:]
    storage = open_storage(url)
    assert not storage.exists(STEP)
    debris = retire.find_debris(storage, None)
    assert sorted((d.kind, d.removable) for d in debris) == [("aside", True), ("tmp", True)], debris
    retire.remove_debris(storage, debris)
    assert [(i.step, i.status, i.save_id) for i in scan(storage, deep=True)] == [(1, "committed", old_id)]
    assert retire.find_debris(storage, None) == []
    back = ckptlib.load(f"{url}/{STEP}")
    assert back["tag"] == "old" and torch.equal(back["w"], _old()["w"])


def test_posix_fence_puts_back_the_step_a_frozen_overwrite_moved_aside(tmp_path):
    """POSIX: the coordinator froze between moving the committed step aside and its rename; a
    rank that gives up fences the save and puts the old step back; the woken coordinator's
    publish then fails as fenced and the old step stands."""
    url = str(tmp_path / "root")
    old_id = _save_old(url, None)
    storage = open_storage(url)
    st = commit.begin(storage, STEP, "cd" * 16, overwrite=True)
    storage.rename(STEP, layout.del_dir(STEP, st.save_id))  # what _clear_target does, then "froze"
    assert commit.fence(storage, STEP, st.save_id, 1, "gave up") == commit.FENCED
    assert [(i.step, i.status, i.save_id) for i in scan(storage)] == [(1, "committed", old_id)]
    assert storage.exists(f"{STEP}.abort-{st.save_id}") and not storage.exists(layout.del_dir(STEP, st.save_id))
    with pytest.raises(CommitError, match="fenced"):
        commit.publish(storage, st, b"{}", overwrite=True)
    assert [(i.step, i.status, i.save_id) for i in scan(storage) if i.status == "committed"] == [
        (1, "committed", old_id)]


@pytest.mark.parametrize("data", [
    b"not json at all",
    b'{"format": 1}',  # JSON, not a manifest
    fence_format.MAGIC + b"1}",  # starts like an abort record, is not one
    b" " * 4097,  # over the manifest limit (lowered to 4 KiB here): refused by its size
])
def test_hostile_claim_is_a_typed_error(data, memory_url, monkeypatch):
    """Claim bytes are untrusted: a rank fencing a save whose claim holds garbage raises
    ``CommitError`` (it cannot tell the outcome) and changes nothing; the step stands."""
    old_id = _save_old(memory_url, None)
    storage = open_storage(memory_url)
    sid = "ef" * 16
    storage.put_atomic(layout.claim_path(STEP, sid), data)
    monkeypatch.setattr(scan_module, "MAX_MANIFEST_BYTES", 4096)
    with pytest.raises(CommitError, match="claim"):
        commit.fence(storage, STEP, sid, 1, "gave up")
    assert [(i.step, i.status, i.save_id) for i in scan(storage)] == [(1, "committed", old_id)]
    assert [d.kind for d in retire.find_debris(storage, None)] == ["prefix"]  # removable with its folder


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_one_shot_overwrites_leave_one_copy(kind, memory_url, request):
    """``ckptlib.save(..., overwrite=True)`` of the same folder, again and again (what the
    Lightning plugin does to ``last.ckpt``): the committed save's payloads replace the old
    ones, with no manager to clean up after it. Each overwrite used to leave the replaced
    save's whole payload prefix behind (one model-sized copy per save, on a real S3 server)."""
    if kind == "s3":
        url, opts = s3_root(request.getfixturevalue("seaweed"))
    else:
        url, opts = memory_url, None
    folder = f"{url}/last.ckpt"
    for i in range(3):
        ckptlib.save({"w": torch.arange(3000, dtype=torch.float32) + i, "i": i}, folder, storage_options=opts,
                     overwrite=True)
        storage = open_storage(folder, opts)
        ids = [e.name for e in storage.listdir("") if e.is_dir]
        assert ids == [read_manifest(storage, "", pieces=False).save_id], (i, ids)  # the new save's prefix only
        back = ckptlib.load(folder, storage_options=opts)
        assert back["i"] == i and torch.equal(back["w"], torch.arange(3000, dtype=torch.float32) + i)

