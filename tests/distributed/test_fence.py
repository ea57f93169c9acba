"""What every rank reports about a save is what storage holds, whatever the coordinator does
while it publishes (slow, frozen then woken, killed right after its commit point).

Real 2-rank gloo jobs (tests/workers/publish_worker.py ``fence``) on POSIX and on the real
SeaweedFS server: the rename fence and the create-only-put fence (engine/commit.py ``fence``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import launcher
import pytest
import torch
from backends.conftest import s3_root

import ckptlib
from ckptlib import crashpoints
from ckptlib.backends import open_storage
from ckptlib.cli.main import main as cli
from ckptlib.engine import commit, retire
from ckptlib.engine.scan import scan
from ckptlib.errors import CorruptCheckpointError
from ckptlib.format import fence as fence_format

from . import launch
from .launch import start

T = 4.0  # the coordination timeout of these jobs (CKPTLIB_COORD_TIMEOUT)
ENV = {"CKPTLIB_COORD_TIMEOUT": str(T)}
WORKER = launch.WORKER.with_name("publish_worker.py")
STEP = 7
SLOW_OP = {"posix": "sync_dir", "s3": "put_if_absent"}  # the fsync / the manifest's put


@pytest.fixture(params=["posix", "s3"])
def where(request, tmp_path, monkeypatch):
    """``(backend, url, storage options)`` of a fresh checkpoint root."""
    monkeypatch.setattr(launch, "WORKER", WORKER)
    if request.param == "posix":
        return "posix", str(tmp_path / "ckpt"), None
    url, opts = s3_root(request.getfixturevalue("seaweed"))
    return "s3", url, opts


def _steps(url: str, opts: dict | None) -> dict[int, str]:
    """step -> status, of the ``step-N`` folder (``committed`` wins over leftovers)."""
    storage = open_storage(url, opts)
    out: dict[int, str] = {}
    for info in scan(storage):
        if out.get(info.step) != "committed":
            out[info.step] = info.status
    return out


def _poll(path: Path, procs, rank: int, timeout: float) -> dict:
    end = time.monotonic() + timeout
    while not path.exists():
        if procs[rank].poll() is not None and not path.exists():
            out = procs[rank].communicate(timeout=10)[0].decode(errors="replace")
            raise AssertionError(f"rank {rank} exited ({procs[rank].returncode}) without {path.name}:\n{out}")
        if time.monotonic() >= end:  # a hang: every rank's stacks and output in the failure
            raise launcher.Hang(f"no {path.name} within {timeout:.0f}s; every rank's output:\n{launcher.kill_all(procs)}")
        time.sleep(0.1)
    return json.loads(path.read_text())


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.communicate(timeout=30)


def test_slow_publish_of_live_coordinator_commits(where, tmp_path):
    """(a) Rank 0's fsync (POSIX) or manifest put (S3) at publish takes 3x the coordination
    timeout while its heartbeat moves: the save commits and both ranks report it committed."""
    kind, url, opts = where
    args = {"mode": "slow", "url": url, "options": opts, "step": STEP, "delay": 3 * T, "slow_op": SLOW_OP[kind]}
    procs = start("fence", 2, tmp_path, args, ENV)
    try:
        res = [_poll(tmp_path / f"result-fence-{r}.json", procs, r, 180) for r in range(2)]
    finally:
        _kill(procs)
    assert [r.get("error") for r in res] == [None, None], res
    assert all(r["elapsed"] > 3 * T for r in res), res  # they really waited for it
    assert _steps(url, opts) == {STEP: "committed"}


def test_frozen_coordinator_woken_late_cannot_commit(where, tmp_path, capsys):
    """(b) Rank 0 is SIGSTOPped in its publish: rank 1 raises within about the timeout and
    fences the save; woken (SIGCONT), rank 0 must not commit: it raises too, and ``ckptlib ls``
    shows the step not committed. Then a save of the same step and of the next one commit and
    leave no debris."""
    kind, url, opts = where
    log = tmp_path / "kills.jsonl"
    env = {**ENV, "CKPTLIB_TEST_KILL_LOG": str(log)}
    procs = start("fence", 2, tmp_path, {"mode": "stop", "url": url, "options": opts, "step": STEP}, env)
    try:
        r1 = _poll(tmp_path / "part-first-1.json", procs, 1, 180)
        assert r1["error"] == "CommitError", r1
        assert "rank 0" in r1["message"] and "fenced" in r1["message"], r1
        stopped_at = json.loads(log.read_text().splitlines()[0])["time"]
        assert r1["time"] - stopped_at < 3 * T + 10, (r1, stopped_at)  # bounded; loose on purpose
        assert procs[0].poll() is None and not (tmp_path / "part-first-0.json").exists()
        assert _steps(url, opts).get(STEP) != "committed"

        os.kill(procs[0].pid, signal.SIGCONT)
        r0 = _poll(tmp_path / "part-first-0.json", procs, 0, 120)
        assert r0["error"] == "CommitError", r0
        assert "fenced" in r0["message"], r0
        status = _steps(url, opts)
        assert status == {STEP: "incomplete"}, status  # the fence is debris, never corrupt
        if kind == "posix":  # what users see: the CLI's listing says the same
            capsys.readouterr()
            assert cli(["ls", url, "--json"]) == 0
            rows = json.loads(capsys.readouterr().out)["steps"]
            assert [(r["step"], r["status"]) for r in rows] == [(STEP, "incomplete")], rows
        (tmp_path / "go").write_text("")
        res = [_poll(tmp_path / f"result-fence-{r}.json", procs, r, 180) for r in range(2)]
    finally:
        _kill(procs)
    for r in res:
        assert r["again"]["error"] is None and r["later"]["error"] is None, r
    assert res[0]["steps"] == [[STEP + 1, "committed", f"step-{STEP + 1:012d}"],
                               [STEP, "committed", f"step-{STEP:012d}"]], res[0]
    assert res[0]["debris"] == [], res[0]
    storage = open_storage(url, opts)
    assert retire.find_debris(storage, None) == []
    assert [i.status for i in scan(storage, deep=True)] == ["committed", "committed"]  # checksums too


def test_coordinator_killed_right_after_commit_reports_committed(where, tmp_path):
    """(c) Rank 0 is SIGKILLed right after its commit point, before telling anyone: rank 1
    cannot reach it, settles on storage, finds the save committed and reports it committed."""
    _kind, url, opts = where
    log = tmp_path / "kills.jsonl"
    env = {**ENV, "CKPTLIB_TEST_KILL_LOG": str(log)}
    procs = start("fence", 2, tmp_path, {"mode": "kill", "url": url, "options": opts, "step": STEP}, env)
    try:
        r1 = _poll(tmp_path / "result-fence-1.json", procs, 1, 180)
        procs[0].wait(30)
        assert procs[0].returncode == -signal.SIGKILL
    finally:
        _kill(procs)
    assert json.loads(log.read_text().splitlines()[0])["phase"] == "committed"
    assert r1["error"] is None, r1
    assert _steps(url, opts) == {STEP: "committed"}


# -- the same rule in one process: a fence placed at each point of the coordinator's publish


def _state() -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32), "step": 3}


@pytest.mark.parametrize("kind", ["posix", "memory"])
@pytest.mark.parametrize("when", ["before_publish", "at_manifest", "after_commit"])
def test_fence_decides_once(kind, when, tmp_path, memory_url, monkeypatch):
    """A rank's fence and the coordinator's commit race for one commit point: a fence placed
    before the commit makes the commit fail (the step is left incomplete, removable debris; a
    retry of the step commits and cleans it); placed after, it finds the save committed."""
    url = str(tmp_path / "ckpt") if kind == "posix" else memory_url
    verdicts: list[str] = []

    def place_fence(storage, staging) -> None:
        verdicts.append(commit.fence(storage, staging.final, staging.save_id, 1, "test gave up"))

    real_publish, real_point = commit.publish, crashpoints.point
    if when == "before_publish":
        def publish(storage, staging, manifest, **kw):
            place_fence(storage, staging)
            real_publish(storage, staging, manifest, **kw)
        monkeypatch.setattr(commit, "publish", publish)
    elif when == "at_manifest":
        def publish(storage, staging, manifest, **kw):  # the crash point inside the publish
            monkeypatch.setattr(crashpoints, "point", lambda phase, rank=0: place_fence(storage, staging))
            real_publish(storage, staging, manifest, **kw)
        monkeypatch.setattr(commit, "publish", publish)
    with ckptlib.CheckpointManager(url, async_save=False) as mgr:
        if when == "after_commit":
            mgr.save(3, _state())
            info = scan(mgr.storage)[0]
            assert commit.fence(mgr.storage, info.path, info.save_id, 1, "late") == commit.COMMITTED
            assert [(i.step, i.status) for i in scan(mgr.storage)] == [(3, "committed")]
            return
        with pytest.raises(ckptlib.CommitError, match="fenced"):
            mgr.save(3, _state())
        assert verdicts == [commit.FENCED]
        infos = scan(mgr.storage)
        assert [(i.step, i.status) for i in infos] == [(3, "incomplete")], infos
        assert "fenced" in infos[0].reason
        debris = retire.find_debris(mgr.storage, None)
        assert [d.kind for d in debris] == ["abort"] and debris[0].removable, debris
        # A second rank giving up on the same save finds the fence: not committed.
        assert commit.fence(mgr.storage, "step-000000000003", debris[0].save_id, 2, "x") == commit.FENCED
        monkeypatch.setattr(commit, "publish", real_publish)
        monkeypatch.setattr(crashpoints, "point", real_point)
        mgr.save(3, _state())  # the retry of the step commits and removes the fence
        assert [(i.step, i.status) for i in scan(mgr.storage, deep=True)] == [(3, "committed")]
        assert retire.find_debris(mgr.storage, None) == []
    back = ckptlib.load(f"{url}/step-000000000003")
    assert torch.equal(back["w"], _state()["w"])


@pytest.mark.parametrize("data", [
    fence_format.MAGIC + b"1}",  # not JSON
    fence_format.MAGIC + b'1,"save_id":"zz","rank":1,"reason":"","time":0}',  # bad save id
    fence_format.MAGIC + b'2,"save_id":"' + b"a" * 32 + b'","rank":1,"reason":"","time":0}',  # version
    fence_format.MAGIC + b" " * fence_format.MAX_RECORD_BYTES + b"1}",  # oversized
])
def test_damaged_abort_record_is_corrupt_not_a_fence(data, memory_url):
    """Bytes that start like an abort record but are not one: a typed error, and the scanner
    calls the step corrupt (evidence), not a failed save."""
    with pytest.raises(CorruptCheckpointError):
        fence_format.parse_abort(data, "x")
    storage = open_storage(memory_url)
    storage.put_atomic("step-000000000001/manifest.json", data)
    assert [(i.step, i.status) for i in scan(storage)] == [(1, "corrupt")]
    assert retire.find_debris(storage, None) == []  # corrupt: never removed by cleanup


def test_second_fence_while_coordinator_recreates_its_folder(tmp_path):
    """POSIX: after one rank's fence, the coordinator's manifest put recreates the tmp folder
    (without the marker); a second rank giving up then still reads "fenced", and the
    coordinator's publish fails on the missing marker."""
    storage = open_storage(str(tmp_path / "ckpt"))
    storage.makedirs("")
    final, save_id = "step-000000000004", "ab" * 16
    st = commit.begin(storage, final, save_id)
    assert commit.fence(storage, final, save_id, 1, "first") == commit.FENCED
    storage.put_atomic(f"{st.work}/manifest.json", b"{}")  # what a late publish's first write does
    assert commit.fence(storage, final, save_id, 2, "second") == commit.FENCED
    with pytest.raises(ckptlib.CommitError, match="fenced"):
        commit.publish(storage, st, b"{}")
    assert not (tmp_path / "ckpt" / final).exists()
