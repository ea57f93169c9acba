"""A tier restore waits on another rank while that rank is alive, not for a fixed collective
timeout (issue 15, Build 3; tiers/restore.py): the whole restore -- topology, the exchange of
local steps, the resume loop, the write-back -- runs in one liveness session. One rank's local
verification, or its listing of the local steps at the restore's start, 3x the coordination
timeout slow still restores, bitwise; that rank frozen (SIGSTOP) there, the other raises within
about the timeout. Its write-back 3x slow completes (the node's manifest written back); frozen in
it, the other returns the step within about the timeout (the write-back logs a warning, never
raises).

Real jobs of 2 simulated nodes x 1 rank (tests/workers/tiers_worker.py, the shared launcher);
the slow or frozen read or listing is fault-injecting storage over the rank's node folder; the
write-back freeze is the ``write_back`` crash point with SIGSTOP.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest

from .test_fence import _kill
from .test_tiers import committed_steps, finish_job, flip, payload, run_job, start_job, step_files

T = 4.0  # the coordination timeout of these jobs (CKPTLIB_COORD_TIMEOUT)
ENV = {"CKPTLIB_COORD_TIMEOUT": str(T)}
LONG = 120.0  # the restore timeout of the frozen cases: a wait that used it would fail their bound


def _saved(tmp_path: Path) -> dict:
    args = {"url": str(tmp_path / "persist"), "local": str(tmp_path / "node{node}"), "persist_every": 100}
    run_job(tmp_path, [0, 1], {**args, "mode": "save", "steps": [1]})
    return args


@pytest.mark.parametrize("where", ["slow_verify", "slow_list"])
def test_slow_local_work_of_live_peer_restores(tmp_path: Path, where: str) -> None:
    """Rank 1's first local payload read (verifying its copies; ``slow_verify``) or its first
    listing of its node folder (the local steps, at the restore's start, before the resume
    loop; ``slow_list``) takes 3x the coordination timeout while its heartbeat moves: both
    ranks restore step 1 from the local tier, bitwise."""
    args = _saved(tmp_path)
    procs, res = start_job(tmp_path, [0, 1], {**args, "mode": "resume", where: 3 * T}, env=ENV)
    got = [o.result for o in finish_job(procs, res)]
    assert all(r is not None and "crash" not in r for r in got), got
    assert [(r["restored"], r["bitwise"]) for r in got] == [(1, True), (1, True)], got
    assert got[1]["elapsed"] > 3 * T  # the slow call really happened


@pytest.mark.parametrize("where", ["slow_verify", "slow_list"])
def test_frozen_peer_fails_the_tier_restore_in_time(tmp_path: Path, where: str) -> None:
    """Rank 1 SIGSTOPs itself in its local verification, or in its listing of the local steps
    at the restore's start: rank 0 raises a CommitError naming rank 1 within about the
    coordination timeout (far below the restore timeout), while rank 1 is still frozen."""
    args = _saved(tmp_path)
    procs, res = start_job(tmp_path, [0, 1], {**args, "mode": "resume", where: -1, "save_timeout": LONG}, env=ENV)
    try:
        out = finish_job(procs[:1], res, timeout=90)
        r0 = out[0].result
        assert r0 is not None and r0.get("error") == "CommitError", r0
        assert "rank 1" in r0["message"], r0
        stopped_at = float((res / "stopped-1.txt").read_text())
        assert T - 1 < r0["time"] - stopped_at < min(3 * T + 10, LONG / 2), (r0, stopped_at)  # loose on purpose
        assert procs[1].poll() is None  # still frozen: rank 0 did not wait for it to die
    finally:
        _kill(procs[1:])  # rank 0's output was read by finish_job


def test_slow_write_back_of_live_peer_completes(tmp_path: Path) -> None:
    """Node 1 lost: after the restore, rank 1 writes its files back from node 0's replicas, and
    its first file takes 3x the coordination timeout while its heartbeat moves. Rank 0 waits for
    it at the write-back's last meeting, so rank 1 (node 1's leader) learns every rank of its
    node got its files and writes the manifest: node 1 holds step 1 again, committed, byte for
    byte what the save left there."""
    args = _saved(tmp_path)
    saved = step_files(tmp_path / "node1", 1)
    shutil.rmtree(tmp_path / "node1")
    procs, res = start_job(tmp_path, [0, 1], {**args, "mode": "resume", "slow_write_back": 3 * T}, env=ENV)
    got = [o.result for o in finish_job(procs, res)]
    assert all(r is not None and "crash" not in r for r in got), got
    assert [(r["restored"], r["bitwise"]) for r in got] == [(1, True), (1, True)], got
    assert got[0]["elapsed"] > 3 * T  # rank 0 really waited for the slow write
    assert committed_steps(tmp_path / "node1") == [1]
    assert step_files(tmp_path / "node1", 1) == saved


def test_frozen_peer_in_write_back_lets_the_others_return(tmp_path: Path) -> None:
    """Rank 1's own copy of step 1 is corrupt, so after the restore it writes back the replica
    node 0 sent; it SIGSTOPs half-way (``write_back`` crash point). Rank 0 returns step 1,
    bitwise, within about the coordination timeout of the freeze (far below the restore
    timeout), logging a warning, while rank 1 is still frozen."""
    args = _saved(tmp_path)
    flip(payload(tmp_path / "node1", 1, 1))
    kills = tmp_path / "kills.jsonl"
    procs, res = start_job(tmp_path, [0, 1], {**args, "mode": "resume", "save_timeout": LONG}, env=ENV,
                           rank_env={1: {"CKPTLIB_TEST_KILL_AT": "write_back:1:STOP",
                                         "CKPTLIB_TEST_KILL_LOG": str(kills)}})
    try:
        result = res / "result-0.json"
        end = time.monotonic() + 90
        while not result.exists() and time.monotonic() < end:
            time.sleep(0.1)
        r0 = json.loads(result.read_text())  # rank 0 may not tear its process group down: not awaited
        assert "crash" not in r0 and (r0["restored"], r0["bitwise"]) == (1, True), r0
        (stop,) = [json.loads(line) for line in kills.read_text().splitlines()]
        finished = result.stat().st_mtime
        assert T - 1 < finished - stop["time"] < min(3 * T + 10, LONG / 2), (finished, stop)  # loose on purpose
        assert procs[1].poll() is None  # still frozen
    finally:
        logs = _end(procs)
    assert "write-back" in logs[0] and "did not finish together" in logs[0], logs[0]


def _end(procs: list) -> list[str]:
    """Wake and kill (by PID) every rank still running; what each printed."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
    return [p.communicate(timeout=30)[0].decode(errors="replace") for p in procs]
