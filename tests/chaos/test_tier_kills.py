"""SIGKILL at every tier phase (crash points in ckptlib/crashpoints.py), real processes.

A job of 2 simulated nodes x 1 rank saves steps 1, 2, 3 (step 2 drained: persist_every=2,
local_keep_last=2); one rank is killed the first time it reaches the phase at step ``nth``.
Then a fresh job resumes, and one more job saves step 4. Checked: the restored step is one that
was wholly durable (never older than the newest step any rank saw committed, never one whose
save did not finish its writes), its bytes are exactly those saved; no tier shows a step that
is not wholly there (a scan of every tier after the kill and after the next save: no
half-visible drain, no half-published or half-retired local step), and every committed copy on
every tier passes a deep check (``ckptlib verify --local --tier all --all``: every checksum);
after the next save every local folder is free of debris of the killed save.
``CKPTLIB_CHAOS_FULL=1`` runs the whole matrix; CI a seeded sample.

Every case is recorded (tests/chaos/record.py, scenario ``tier_kill``) before its assertions,
each count with the check that produced it (the ``HOW_*`` texts): saves attempted (logged by
the worker before ``save()``), committed (a rank's ``wait()`` returned), unreported/aborted
(what the tier scan shows), the resume outcome, committed saves lost, half-visible steps,
copies verified whole, debris left.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from distributed.test_tiers import finish_job, flip, payload, start_job
from test_cli_tiers import cli

from ckptlib.backends import open_storage
from ckptlib.backends.posix import SPARE_DIR
from ckptlib.crashpoints import TIER_PHASES
from ckptlib.engine.scan import scan
from ckptlib.format import layout

from .conftest import SEED, sampled
from .record import Record, SaveChecks, account_saves, recording

LOCAL_KEEP_LAST = 2  # the worker's default

SAVE_CHECKS = SaveChecks(
    attempted="the step each rank appends to `attempted-<rank>.txt` just before `mgr.save()` "
    "(tests/workers/tiers_worker.py): a step any rank started",
    reported="the step a rank appends to `committed-<rank>.txt` once its `wait()` returned",
    storage="a scan of every tier after the job (`scan_tiers`): committed on some tier though no rank "
    "saw it = unreported; no step folder on any tier = aborted, unless `local_keep_last` newer steps "
    "could have retired it (then: other)",
)
HOW_KILLS = "the victim's exit status (-SIGKILL) with no result written"
HOW_HALF = ("a scan of every tier after the kill and after the next save: persistent `step-N` folders that "
            "`engine.scan.scan` does not call committed; node-folder `step-N` folders without a valid manifest, "
            "or lacking one of their own rank's files or a peer's replica that the manifest names (distinct "
            "tier and step)")
HOW_WHOLE = ("`ckptlib verify PERSIST --local TEMPLATE --tier all --all --json` after the kill and after the "
             "next save: every committed copy (the persistent step; each node's own files and replicas), every "
             "chunk's checksum")
HOW_RESUME = ("a fresh 2-rank job's `restore()`: every rank the same step, one the case allows and never older "
              "than a step any rank saw commit, its bytes `torch.equal` to the state recomputed for that step")
HOW_LOST = "steps some rank saw commit that are newer than the step the fresh job resumed"
HOW_DEBRIS = "phase cases: `.tmp-`/`.del-` entries in each node folder after the next save"

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
# The same phases with the local tier in memory (tmpfs, no fsync): the memory-tier write and the
# pipelined replica stream (its replicated files rebuilt by the peer from its own memory).
# Local retention on a memory tier recycles the deleted step's pages for the next save: a kill
# before the deletion, and one in the middle of it (its 2nd reach: the payload files already moved
# to the spares, the ``.del-`` folder and its marker still there).
IN_MEMORY = ("local_write", "replica_transfer", "local_commit", "local_retention")
MEMORY_CASES = [(p, r, n, a, True) for p, r, n, a in CASES if p in IN_MEMORY] + [("local_retention", 0, 2, {3}, True)]
MEMORY_IDS = [f"{i}-memory" for (p, r, n, _a), i in zip(CASES, IDS, strict=True) if p in IN_MEMORY] + [
    "local_retention-r0-n2-memory"]


def test_every_tier_phase_has_a_case() -> None:
    """A new tier crash point must be added to CASES (as test_phase_kills does for saves); the
    restore's ``write_back`` has its own case (test_kill_during_write_back)."""
    assert {c[0] for c in CASES} | {"write_back"} == set(TIER_PHASES)


@dataclass
class Tiers:
    """What every tier shows (:func:`scan_tiers`), as (tier, step): tier ``persistent`` or a
    node folder's name."""

    visible: set[tuple[str, int]] = field(default_factory=set)  # step folders (not staging)
    committed: set[tuple[str, int]] = field(default_factory=set)
    half_visible: set[tuple[str, int]] = field(default_factory=set)
    whole: set[tuple[str, int]] = field(default_factory=set)  # committed, deep check passed
    not_whole: dict[tuple[str, int], str] = field(default_factory=dict)
    stale: set[tuple[str, int]] = field(default_factory=set)  # a node's copy of another save

    @staticmethod
    def steps(keys: set[tuple[str, int]]) -> set[int]:
        return {s for _, s in keys}


def scan_tiers(tmp_path: Path, persist: Path) -> Tiers:
    """A scan of every tier with public means: the persistent root's ``engine.scan.scan``, each
    node folder's listing (every visible step must hold what :func:`not_held` expects), and
    ``ckptlib verify PERSIST --local TEMPLATE --tier all --all``, which deep-checks every
    committed copy (persistent steps, each node's own files and replicas)."""
    t = Tiers()
    if persist.exists():
        for i in scan(open_storage(str(persist))):
            if i.path == layout.step_dir(i.step):
                t.visible.add(("persistent", i.step))
                (t.committed if i.status == "committed" else t.half_visible).add(("persistent", i.step))
    for node in sorted(p for p in tmp_path.glob("node*") if p.is_dir()):
        for p in node.iterdir():
            s = layout.parse_step(p.name)
            if p.is_dir() and s is not None:
                t.visible.add((node.name, s))
                if not_held(node, p):
                    t.half_visible.add((node.name, s))
    if not t.visible:
        return t
    _code, text = cli("verify", str(persist), "--local", str(tmp_path / "node{node}"), "--tier", "all", "--all",
                      "--json")
    doc = json.loads(text)
    for row in doc["steps"]:
        key = ("persistent", row["step"])
        if key in t.committed:
            if row["ok"]:
                t.whole.add(key)
            else:
                t.not_whole[key] = row["reason"]
    listed = set()
    for n in doc["nodes"]:
        for st in n["steps"]:
            key = (Path(n["path"]).name, st["step"])
            listed.add(key)
            missing = [c["name"] for c in st["copies"] if c["status"] == "missing"]
            if st["status"] == "unreadable" or missing:  # visible, not wholly there
                t.half_visible.add(key)
                continue
            t.committed.add(key)
            if st["status"] == "other save":
                t.stale.add(key)
            elif st["ok"]:
                t.whole.add(key)
            else:
                t.not_whole[key] = st["reason"]
    t.half_visible |= {k for k in t.visible if k[0] != "persistent" and k not in listed}  # no valid manifest
    return t


RANK_RE = re.compile(r"(?:^|/)r(\d{5})[^/]*\.bin$")


def not_held(node: Path, step: Path) -> list[str]:
    """Files a node's visible step folder lacks (docs/tiers.md's layout, this job's topology:
    node N runs rank N): its own rank's payload and index files in the step folder, every other
    rank's under ``replicas/``. A step folder without a readable manifest lacks it."""
    try:
        body = json.loads((step / "manifest.json").read_bytes())["body"]
    except (OSError, ValueError, KeyError):
        return ["manifest.json"]
    own = int(node.name.removeprefix("node"))
    names = [f[0] for f in body["files"]] + [ix[0] for ix in body.get("indexes", [])]
    lacking = []
    for name in names:
        m = RANK_RE.search(name)
        where = step / name if m is None or int(m.group(1)) == own else step / "replicas" / name
        if not where.is_file():
            lacking.append(str(where.relative_to(step)))
    return lacking


def _logged(res: Path, what: str) -> set[int]:
    return {int(line) for f in res.glob(f"{what}-*.txt") for line in f.read_text().split()}


def account(rec: Record, res: Path, tiers: Tiers) -> str:
    """The saves of the job whose results are in ``res``, by what ``tiers`` shows after it."""
    on = Tiers.steps(tiers.committed)
    retirable = {s for s in on | _logged(res, "attempted") if len([c for c in on if c > s]) >= LOCAL_KEEP_LAST}
    return account_saves(rec, SAVE_CHECKS, _logged(res, "attempted"), _logged(res, "committed"), on,
                         Tiers.steps(tiers.visible), retirable)


def save_job(tmp_path: Path, args: dict, steps: list[int]) -> Path:
    """A clean saving job (every rank must finish); its results folder."""
    procs, res = start_job(tmp_path, [0, 1], {**args, "mode": "save", "steps": steps})
    for o in finish_job(procs, res):
        assert o.result is not None and "crash" not in o.result, f"rank {o.rank}:\n{o.log}"
    return res


def judge_resume(tmp_path: Path, args: dict, allowed: set[int], seen: set[int]) -> tuple[str, int | None, list]:
    """(outcome, step, outcomes) of a fresh job's restore."""
    outcomes = finish_job(*start_job(tmp_path, [0, 1], {**args, "mode": "resume"}))
    got = [o.result for o in outcomes]
    if any(r is None or "crash" in r for r in got):
        return "crash", None, outcomes
    steps = {r["restored"] for r in got if r is not None}
    step = steps.pop() if len(steps) == 1 else None
    if step is None and not seen and not allowed:
        return "nothing", None, outcomes
    if step is None or step not in allowed or step < max(seen, default=0):
        return "wrong_step", step, outcomes
    if not all(r is not None and r["bitwise"] for r in got):
        return "partial", step, outcomes
    return "correct", step, outcomes


def _describe(t: Tiers) -> str:
    return (f"half-visible {sorted(t.half_visible)} not whole {t.not_whole} stale {sorted(t.stale)} "
            f"committed {sorted(t.committed)}")


@pytest.fixture
def memory_nodes(tmp_path: Path):
    """``tmp_path/node0`` and ``node1`` as links to folders under /dev/shm (a memory tier), removed after."""
    import shutil
    import uuid

    shm = Path("/dev/shm") / f"ckptlib-chaos-{uuid.uuid4().hex[:10]}"
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    for n in ("node0", "node1"):
        (shm / n).mkdir(parents=True)
        (tmp_path / n).symlink_to(shm / n)
    try:
        yield shm
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize(("phase", "victim", "nth", "allowed", "memory"),
                         sampled([(*c, False) for c in CASES], IDS, 2, "tier-kills")
                         + sampled(MEMORY_CASES, MEMORY_IDS, 1, "tier-kills-memory"))
def test_kill_at_tier_phase(tmp_path: Path, phase: str, victim: int, nth: int, allowed: set[int], memory: bool,
                            request: pytest.FixtureRequest) -> None:
    if memory:
        request.getfixturevalue("memory_nodes")
    persist = tmp_path / "persist"
    args = {"url": str(persist), "local": str(tmp_path / "node{node}"), "persist_every": 2, "big": memory}
    env = {"CKPTLIB_COORD_TIMEOUT": "5"}
    with recording("tier_kill", f"{phase}-r{victim}-n{nth}" + ("-memory" if memory else ""), SEED) as rec:
        procs, res = start_job(tmp_path, [0, 1], {**args, "mode": "save", "steps": [1, 2, 3]}, env=env,
                               rank_env={victim: {"CKPTLIB_TEST_KILL_AT": f"{phase}:{victim}::{nth}"}})
        outcomes = finish_job(procs, res)
        killed = outcomes[victim].result is None and outcomes[victim].returncode == -signal.SIGKILL
        rec.observe(HOW_KILLS, kills=int(killed))
        after_kill = scan_tiers(tmp_path, persist)
        notes = [account(rec, res, after_kill)]
        seen = _logged(res, "committed")
        assert killed, f"rank {victim} was not killed at {phase}:\n{outcomes[victim].log}"
        if memory and phase == "local_retention" and nth == 2:  # really in the middle of the deletion
            node = tmp_path / f"node{victim}"
            assert [p for p in node.iterdir() if ".del-" in p.name], sorted(p.name for p in node.iterdir())
            assert list((node / SPARE_DIR).iterdir()), "nothing was recycled before the kill"
        outcome, step, resume = judge_resume(tmp_path, args, allowed, seen)
        rec.observe(HOW_RESUME, resume=outcome)
        rec.observe(HOW_LOST, saves_lost=sum(1 for s in seen if step is None or s > step))
        # The next save commits and clears what the killed save left in the local folders.
        res4 = save_job(tmp_path, args, [4])
        after_save = scan_tiers(tmp_path, persist)
        notes.append(account(rec, res4, after_save))
        rec.observe(HOW_HALF, half_visible=len(after_kill.half_visible | after_save.half_visible))
        rec.observe(HOW_WHOLE, steps_whole=len(after_kill.whole) + len(after_save.whole),
                    steps_not_whole=len(after_kill.not_whole) + len(after_save.not_whole))
        left = {node: [p.name for p in (tmp_path / node).iterdir() if ".tmp-" in p.name or ".del-" in p.name]
                for node in ("node0", "node1")}
        rec.observe(HOW_DEBRIS, debris_left=sum(map(len, left.values())))
        rec.note = " ".join([f"resumed step {step}, seen committed {sorted(seen)}", *filter(None, notes)])
        assert not after_kill.half_visible and not after_kill.not_whole, f"after the kill: {_describe(after_kill)}"
        assert rec.resume == "correct", (phase, step, allowed, [o.result for o in resume], [o.log for o in resume])
        assert not after_save.half_visible and not after_save.not_whole, f"after step 4: {_describe(after_save)}"
        assert not rec.debris_left, left


def _partials(tmp_path: Path) -> list[Path]:
    return sorted(p for node in ("node0", "node1") for p in (tmp_path / node).rglob("*.partial"))


HOW_WB_DEBRIS = "the write-back case: `*.partial` files in either node folder after the next save"
HOW_WB_CORRUPT = ("one byte of rank 1's own copy flipped by the test; detected when the fresh job restores step 1 "
                  "bit for bit and the copy equals its replica after the next save")


def test_kill_during_write_back(tmp_path: Path) -> None:
    """Rank 1's own copy of step 1 is corrupt, so its restore writes it back from the replica
    node 0 sent; SIGKILL half-way leaves a temporary file in the committed step folder. A fresh
    job still restores step 1 bitwise; ``ckptlib prune --local --dry-run`` lists the file as
    removable debris; the next save removes it (and the write-back repaired the copy). Every
    tier is scanned after the kill (no half-visible step) and after the next save (every
    committed copy deep-checked: the damaged one is then repaired)."""
    persist = tmp_path / "persist"
    args = {"url": str(persist), "local": str(tmp_path / "node{node}"), "persist_every": 100}
    env = {"CKPTLIB_COORD_TIMEOUT": "5"}
    with recording("tier_kill", "write_back-r1-n1", SEED) as rec:
        res1 = save_job(tmp_path, args, [1])
        notes = [account(rec, res1, scan_tiers(tmp_path, persist))]
        flip(payload(tmp_path / "node1", 1, 1))
        procs, res = start_job(tmp_path, [0, 1], {**args, "mode": "resume"}, env=env,
                               rank_env={1: {"CKPTLIB_TEST_KILL_AT": "write_back:1"}})
        outcomes = finish_job(procs, res)
        killed = outcomes[1].result is None and outcomes[1].returncode == -signal.SIGKILL
        rec.observe(HOW_KILLS, kills=int(killed))
        assert killed, outcomes[1].log
        after_kill = scan_tiers(tmp_path, persist)
        left = _partials(tmp_path)
        assert left and all(p.parent.parent.name == "step-000000000001" for p in left), left
        outcome, step, resume = judge_resume(tmp_path, args, {1}, _logged(res1, "committed"))
        rec.observe(HOW_RESUME, resume=outcome)
        rec.observe(HOW_LOST, saves_lost=int(step != 1))
        _code, text = cli("prune", str(persist), "--local", args["local"], "--tier", "local", "--local-keep-last",
                          "2", "--dry-run", "--json", "--debris-min-age", "0")
        debris = [d for n in json.loads(text)["local"]["nodes"] for d in n["debris"]]
        res2 = save_job(tmp_path, args, [2])
        after_save = scan_tiers(tmp_path, persist)
        notes.append(account(rec, res2, after_save))
        repaired = payload(tmp_path / "node1", 1, 1).read_bytes() == payload(tmp_path / "node0", 1, 1,
                                                                               replica=True).read_bytes()
        rec.observe(HOW_WB_CORRUPT, corruptions_injected=1, corruptions_detected=int(outcome == "correct" and repaired),
                    corruptions_undetected=int(outcome == "partial"))
        rec.observe(HOW_WB_DEBRIS, debris_left=len(_partials(tmp_path)))
        # after the kill the damaged copy is still there (its deep check fails, as it must):
        # half-visible steps are counted there, whole copies after the repair only
        rec.observe(HOW_HALF, half_visible=len(after_kill.half_visible | after_save.half_visible))
        rec.observe(HOW_WHOLE, steps_whole=len(after_save.whole), steps_not_whole=len(after_save.not_whole))
        rec.note = " ".join([f"write-back temp files left by the kill: {len(left)}; damaged after the kill: "
                             f"{sorted(after_kill.not_whole)}", *filter(None, notes)])
        assert outcome == "correct", [o.result for o in resume]
        assert ("node1", 1) in after_kill.not_whole, f"the injected damage was not seen: {_describe(after_kill)}"
        assert not after_kill.half_visible and not after_save.half_visible, (_describe(after_kill),
                                                                            _describe(after_save))
        assert not after_save.not_whole, _describe(after_save)
        assert {d["path"].rsplit("/", 1)[-1] for d in debris if d["removable"]} >= {p.name for p in left}, debris
        assert not rec.debris_left, _partials(tmp_path)
        assert repaired
