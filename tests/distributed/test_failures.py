"""A rank dies (SIGKILL) or freezes (SIGSTOP) mid-save: survivors fail fast, nothing commits,
the previous checkpoint stays intact and a fresh job restores it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from ckptlib.crashpoints import PHASES

from . import launch
from .launch import results, run, start, wait

DEAD_AFTER = 5.0  # coordination deadline for these tests (the default is 30 s)
ENV = {"CKPTLIB_COORD_TIMEOUT": str(DEAD_AFTER)}


def test_phases_are_named():
    assert {"write", "before_commit", "manifest"} <= set(PHASES)


@pytest.mark.parametrize(("victim", "phase"), [(1, "write"), (1, "before_commit"), (0, "write")])
def test_sigkill_one_rank_mid_save(tmp_path, victim, phase):
    world = 3
    procs = start("fail", world, tmp_path, {"victim": victim, "phase": phase, "signal": "KILL"}, ENV)
    wait("fail", procs, tmp_path, 120)
    assert procs[victim].returncode == -signal.SIGKILL
    res = results("fail", world, tmp_path)
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        assert r is not None and "crash" not in r, r
        assert r["error"] == "CommitError", r
        assert str(victim) in r["failures"], r  # the coordinator (0) too: {0: "unreachable"}
        assert r["elapsed"] < 4 * DEAD_AFTER + 10, r
    assert not (tmp_path / "bad").exists()
    # The previous checkpoint still restores, in a fresh job.
    out = run("load", 3, tmp_path, {"name": "good", "dims": {}})
    assert all(r["bad"] == [] for r in out)


def test_sigstop_one_rank_mid_save_cannot_commit_later(tmp_path):
    world = 2
    procs = start("fail", world, tmp_path, {"victim": 1, "phase": "write", "signal": "STOP"}, ENV)
    survivor = procs[0]
    survivor.communicate(timeout=120)
    r0 = results("fail", world, tmp_path)[0]
    assert r0["error"] == "CommitError" and "1" in r0["failures"], r0
    assert r0["elapsed"] < 4 * DEAD_AFTER + 10
    assert not (tmp_path / "bad").exists()
    # Wake the frozen rank: it must fail too, never publish.
    os.kill(procs[1].pid, signal.SIGCONT)
    try:
        procs[1].communicate(timeout=60)
    except Exception:
        procs[1].kill()
        procs[1].communicate(timeout=10)
    time.sleep(0.5)
    assert not (tmp_path / "bad").exists()
    r1 = results("fail", world, tmp_path)[1]
    if r1 is not None:  # it may also have died on the broken job; it must never succeed
        assert r1.get("error") is not None, r1
    out = run("load", 2, tmp_path, {"name": "good", "dims": {}})
    assert all(r["bad"] == [] for r in out)


PUBLISH_WORKER = launch.WORKER.with_name("publish_worker.py")


def test_slow_publish_by_live_coordinator_commits_everywhere(tmp_path, monkeypatch):
    """The coordinator's manifest put takes 3x the coordination timeout while it is alive: the
    others wait for it (its heartbeat moves) and every rank reports the committed save."""
    monkeypatch.setattr(launch, "WORKER", PUBLISH_WORKER)
    res = run("publish", 2, tmp_path, {"delay": 3 * DEAD_AFTER}, env=ENV)
    assert [r["error"] for r in res] == [None, None], res
    assert all(r["elapsed"] > 3 * DEAD_AFTER for r in res), res  # they really waited for it
    out = run("load", 2, tmp_path, {"name": "ck", "dims": {}}, env=ENV)  # launch.WORKER: patched
    assert all(r["bad"] == [] for r in out), out


@pytest.mark.parametrize("sig", ["STOP", "KILL"])
def test_coordinator_frozen_or_killed_during_publish_fails_others_in_time(tmp_path, monkeypatch, sig):
    """The coordinator freezes (SIGSTOP) or dies (SIGKILL) right after writing its manifest:
    the other rank raises CommitError within about the coordination timeout of the signal."""
    monkeypatch.setattr(launch, "WORKER", PUBLISH_WORKER)
    log = tmp_path / "kills.jsonl"
    procs = start("publish", 2, tmp_path, {"signal": sig}, {**ENV, "CKPTLIB_TEST_KILL_LOG": str(log)})
    try:
        end = time.monotonic() + 120
        while results("publish", 2, tmp_path)[1] is None and procs[1].poll() is None:
            assert time.monotonic() < end, "rank 1 did not finish while the coordinator was frozen"
            time.sleep(0.2)
        r1 = results("publish", 2, tmp_path)[1]
        assert r1 is not None, procs[1].communicate(timeout=10)[0].decode(errors="replace")
        assert r1.get("error") == "CommitError", r1
        assert "rank 0" in r1["message"], r1
        signalled_at = json.loads(log.read_text().splitlines()[0])["time"]
        assert r1["time"] - signalled_at < DEAD_AFTER + 5, (r1, signalled_at)
        assert results("publish", 2, tmp_path)[0] is None  # the coordinator never got past it
        assert not (tmp_path / "ck").exists()
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=30)


def test_plain_tensors_that_differ_are_named_by_the_ranks_that_hold_them(tmp_path):
    """Plain tensors must be the same on every rank: where they differ, no rank commits, rank 0's
    error names the ranks, and each of those ranks' own error names the tensors (shape, dtype,
    only on one side, order), in format v1 and v2."""
    out = run("plain_differs", 4, tmp_path, {}, timeout=180)  # no early verdict needed: the default timeout
    for fmt in ("v1", "v2"):
        for r in out:
            kind, message = r[fmt]
            assert kind == "CommitError" and "3 ranks (1, 2, 3) hold a different set of plain" in message, (fmt, r)
            assert "the errors of ranks 1, 2 and 3 name them" in message, (fmt, r)
        assert os.listdir(tmp_path / fmt) == [], fmt  # nothing committed, no staging folder left
        assert "rank 1: its plain tensors differ from rank 0's: '/plain/b' is float32 [2, 3] here, float32 [2, 2] on " \
            "rank 0" in out[1][fmt][1], out[1]
        assert "rank 2: its plain tensors differ from rank 0's: '/plain/extra' only here (int64 [5])" in out[2][fmt][1]
        assert "rank 3: its plain tensors differ from rank 0's: the same tensors in another order (at position 0: " \
            "'/plain/c' here, '/plain/a' on rank 0)" in out[3][fmt][1], out[3]
        assert "its plain tensors differ" not in out[0][fmt][1], out[0]


@pytest.mark.parametrize("async_save", [True, False])
def test_state_one_rank_cannot_save_fails_every_rank_at_once(tmp_path, async_save):
    """A value ckptlib cannot save on one rank only: that rank raises UnsupportedValueError from
    save(), every other rank a CommitError naming it (no rank waits for it, and no rank's next
    save meets this one's), nothing is committed, and the next save works everywhere."""
    out = run("unsaveable", 2, tmp_path, {"victim": 1, "async": async_save}, timeout=90, env=ENV)
    for rank, r in enumerate(out):
        for key in ("manager", "one_shot"):
            kind, message = r[key]
            if rank == 1:
                assert kind == "UnsupportedValueError" and "builtins.set at /extra/@rank1" in message, r
            else:
                assert kind == "CommitError" and "rank 1: UnsupportedValueError: cannot save builtins.set" in message, r
        assert r["next"] is None and r["one_shot_next"] is None, r
        assert r["restored"] == 3 and not r["one_exists"], r
