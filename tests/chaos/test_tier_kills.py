"""SIGKILL at every tier phase (crash points in ckptlib/crashpoints.py), real processes.

A job of 2 simulated nodes x 1 rank saves steps 1, 2, 3 (step 2 drained: persist_every=2,
local_keep_last=2); one rank is killed the first time it reaches the phase at step ``nth``.
Then a fresh job resumes. Checked: the restored step is one that was wholly durable (never
older than the newest step every rank saw committed, never one whose save did not finish its
writes), its bytes are exactly those saved; the persistent tier shows no step that is not
wholly there (no half-visible drain); after a further save every local folder is free of
debris of the killed save. ``CKPTLIB_CHAOS_FULL=1`` runs the whole matrix; CI a seeded sample.
Every case is recorded (tests/chaos/record.py, scenario ``tier_kill``: the kill, the saves some
rank saw committed, the resume outcome, committed saves lost, debris left, half-visible drains)
before its assertions, for the report in docs/reliability.md.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from distributed.test_tiers import finish_job, flip, payload, run_job, start_job
from test_cli_tiers import cli

from ckptlib.backends import open_storage
from ckptlib.crashpoints import TIER_PHASES
from ckptlib.engine.scan import scan

from .conftest import SEED, sampled
from .record import recording

pytestmark = pytest.mark.chaos

# phase, victim rank, nth reach, restorable steps afterwards
CASES = [
    ("local_write", 0, 3, {2}),  # step 3 never wrote everything: 2
    ("local_write", 1, 3, {2}),
    ("replica_transfer", 1, 3, {2}),  # a half-received replica is never a source
    ("replica_transfer", 0, 3, {2}),
    ("local_commit", 0, 3, {2}),  # the coordinator before its node's commit of step 3
    ("local_commit", 1, 3, {3}),  # node 1 before its commit: node 0 committed, rank 1's bytes in its replica
    ("drain_upload", 0, 1, {2, 3}),  # the drain of step 2: steps stay local, nothing half-visible
    ("drain_upload", 1, 1, {2, 3}),
    ("drain_commit", 0, 1, {2, 3}),
    ("local_retention", 0, 1, {3}),  # after step 3 committed on every node
    ("local_retention", 1, 1, {3}),
]
IDS = [f"{p}-r{r}-n{n}" for p, r, n, _ in CASES]


def test_every_tier_phase_has_a_case() -> None:
    """A new tier crash point must be added to CASES (as test_phase_kills does for saves); the
    restore's ``write_back`` has its own case (test_kill_during_write_back)."""
    assert {c[0] for c in CASES} | {"write_back"} == set(TIER_PHASES)


@pytest.mark.parametrize(("phase", "victim", "nth", "allowed"), sampled(CASES, IDS, 2, "tier-kills"))
def test_kill_at_tier_phase(tmp_path: Path, phase: str, victim: int, nth: int, allowed: set[int]) -> None:
    persist = tmp_path / "persist"
    args = {"url": str(persist), "local": str(tmp_path / "node{node}"), "persist_every": 2}
    env = {"CKPTLIB_COORD_TIMEOUT": "5"}
    with recording("tier_kill", f"{phase}-r{victim}-n{nth}", SEED) as rec:
        procs, res = start_job(tmp_path, [0, 1], {**args, "mode": "save", "steps": [1, 2, 3]}, env=env,
                               rank_env={victim: {"CKPTLIB_TEST_KILL_AT": f"{phase}:{victim}::{nth}"}})
        outcomes = finish_job(procs, res)
        killed = outcomes[victim].result is None and outcomes[victim].returncode == -signal.SIGKILL
        rec.kills = int(killed)
        # Saves some rank saw committed (h.wait() returned), and the one the kill interrupted.
        seen = {int(line) for f in res.glob("committed-*.txt") for line in f.read_text().split()}
        rec.saves_attempted = len(seen) + (len(seen) < 3)
        rec.saves_committed = len(seen)
        assert killed, f"rank {victim} was not killed at {phase}:\n{outcomes[victim].log}"
        # No drain half-visible: whatever the persistent tier shows as a step is whole.
        bad = []
        if persist.exists():
            bad = [i for i in scan(open_storage(str(persist)))
                   if not (i.status == "committed" or (i.status == "incomplete" and ".tmp-" in i.path))]
        rec.half_visible = len(bad)
        resume = finish_job(*start_job(tmp_path, [0, 1], {**args, "mode": "resume"}))
        got = [o.result for o in resume]
        step: int | None = None
        if any(r is None or "crash" in r for r in got):
            rec.resume = "crash"
        else:
            steps = {r["restored"] for r in got if r is not None}
            step = steps.pop() if len(steps) == 1 else None
            if step is None or step not in allowed or step < max(seen, default=0):
                rec.resume = "wrong_step"
            elif not all(r is not None and r["bitwise"] for r in got):
                rec.resume = "partial"
            else:
                rec.resume = "correct"
        rec.saves_lost = sum(1 for s in seen if step is None or s > step)
        # The next save commits and clears what the killed save left in the local folders.
        run_job(tmp_path, [0, 1], {**args, "mode": "save", "steps": [4]})
        rec.saves_attempted += 1
        rec.saves_committed += 1
        rec.saves_aborted = rec.saves_attempted - rec.saves_committed
        left = {node: [p.name for p in (tmp_path / node).iterdir() if ".tmp-" in p.name or ".del-" in p.name]
                for node in ("node0", "node1")}
        rec.debris_left = sum(map(len, left.values()))
        rec.note = f"resumed step {step}, seen committed {sorted(seen)}"
        assert not bad, [(i.step, i.status, i.reason) for i in bad]
        assert rec.resume == "correct", (phase, step, allowed, got, [o.log for o in resume])
        assert not rec.debris_left, left


def _partials(tmp_path: Path) -> list[Path]:
    return sorted(p for node in ("node0", "node1") for p in (tmp_path / node).rglob("*.partial"))


def test_kill_during_write_back(tmp_path: Path) -> None:
    """Rank 1's own copy of step 1 is corrupt, so its restore writes it back from the replica
    node 0 sent; SIGKILL half-way leaves a temporary file in the committed step folder. A fresh
    job still restores step 1 bitwise; ``ckptlib prune --local --dry-run`` lists the file as
    removable debris; the next save removes it (and the write-back repaired the copy)."""
    persist = tmp_path / "persist"
    args = {"url": str(persist), "local": str(tmp_path / "node{node}"), "persist_every": 100}
    env = {"CKPTLIB_COORD_TIMEOUT": "5"}
    with recording("tier_kill", "write_back-r1-n1", SEED) as rec:
        run_job(tmp_path, [0, 1], {**args, "mode": "save", "steps": [1]})
        rec.saves_attempted = rec.saves_committed = 1
        flip(payload(tmp_path / "node1", 1, 1))
        procs, res = start_job(tmp_path, [0, 1], {**args, "mode": "resume"}, env=env,
                               rank_env={1: {"CKPTLIB_TEST_KILL_AT": "write_back:1"}})
        outcomes = finish_job(procs, res)
        killed = outcomes[1].result is None and outcomes[1].returncode == -signal.SIGKILL
        rec.kills = int(killed)
        assert killed, outcomes[1].log
        left = _partials(tmp_path)
        assert left and all(p.parent.parent.name == "step-000000000001" for p in left), left
        got = [o.result for o in finish_job(*start_job(tmp_path, [0, 1], {**args, "mode": "resume"}))]
        ok = all(r is not None and r.get("restored") == 1 and r["bitwise"] for r in got)
        rec.resume = "correct" if ok else "crash" if any(r is None or "crash" in r for r in got) else "partial"
        rec.saves_lost = int(not ok)
        _code, text = cli("prune", str(persist), "--local", args["local"], "--tier", "local", "--local-keep-last",
                          "2", "--dry-run", "--json", "--debris-min-age", "0")
        debris = [d for n in json.loads(text)["local"]["nodes"] for d in n["debris"]]
        run_job(tmp_path, [0, 1], {**args, "mode": "save", "steps": [2]})
        rec.saves_attempted += 1
        rec.saves_committed += 1
        rec.debris_left = len(_partials(tmp_path))
        rec.half_visible = 0
        rec.note = f"write-back temp files left by the kill: {len(left)}"
        assert ok, got
        assert {d["path"].rsplit("/", 1)[-1] for d in debris if d["removable"]} >= {p.name for p in left}, debris
        assert not rec.debris_left, _partials(tmp_path)
        assert payload(tmp_path / "node1", 1, 1).read_bytes() == payload(tmp_path / "node0", 1, 1, replica=True
                                                                        ).read_bytes()
