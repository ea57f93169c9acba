"""Kills while a memory tier adopts its snapshot as the payload file (ckptlib/engine/mapped_arena.py).

One rank, one node, local tier under /dev/shm, a state with an 8 MiB shard (tests/workers/tiers_worker.py,
``big``): every save's snapshot lands in a mapped arena file that the save renames into its staging
folder. The rank is SIGKILLed at a phase of its 2nd (or 3rd) save; a fresh process then restores the
newest committed step bit for bit, every committed copy passes ``ckptlib verify``, and the next save
commits and leaves neither a staging folder nor the dead process's arena file behind."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from distributed.test_tiers import finish_job, start_job

from ckptlib.engine.mapped_arena import ARENA_DIR

from .conftest import SEED
from .record import recording
from .test_tier_kills import HOW_HALF, HOW_KILLS, HOW_WHOLE, scan_tiers

pytestmark = pytest.mark.chaos

CASES = [("snapshot", 2), ("write", 1), ("write", 2), ("write", 3), ("write", 4), ("local_write", 2),
         ("local_commit", 2), ("local_retention", 1), ("local_retention", 2)]
"""``write`` is reached twice per save: checksummed but not adopted (odd), then adopted (even)."""
HOW_RESUME = ("a fresh 1-rank job's `restore()`: at least the newest step the killed job saw commit (or nothing, "
              "or a committed step, when it saw none), its bytes `torch.equal` to the state recomputed for that step")
HOW_DEBRIS = ("`.tmp-`/`.del-` entries in the node folder and files in its `.ckptlib-arena/` after the next "
              "save (the dead process's arena included)")


def _job(tmp_path: Path, args: dict, kill: str | None = None) -> list:
    env = {0: {"CKPTLIB_TEST_KILL_AT": kill}} if kill else None
    return finish_job(*start_job(tmp_path, [0], args, rank_env=env))


@pytest.mark.parametrize(("phase", "nth"), CASES, ids=[f"{p}-n{n}" for p, n in CASES])
def test_kill_while_the_memory_tier_adopts_its_snapshot(tmp_path: Path, shm_node: Path, phase: str, nth: int) -> None:
    persist = tmp_path / "persist"
    args = {"url": str(persist), "local": str(tmp_path / "node{node}"), "persist_every": 2, "big": True}
    with recording("memory_arena_kill", f"{phase}-n{nth}", SEED) as rec:
        (o,) = _job(tmp_path, {**args, "mode": "save", "steps": [1, 2, 3]}, kill=f"{phase}:0::{nth}")
        killed = o.result is None and o.returncode == -signal.SIGKILL
        rec.observe(HOW_KILLS, kills=int(killed))
        assert killed, f"not killed at {phase}:\n{o.log}"
        log = next(tmp_path.glob("job-*")) / "committed-0.txt"
        committed = [int(s) for s in log.read_text().split()] if log.exists() else []
        left_arenas = list((shm_node / ARENA_DIR).iterdir()) if (shm_node / ARENA_DIR).exists() else []
        if phase == "write":
            assert bool(left_arenas) == (nth % 2 == 1), left_arenas  # killed holding its arena, or after adopting it
        after_kill = scan_tiers(tmp_path, persist)

        (r,) = _job(tmp_path, {**args, "mode": "resume"})
        assert r.result is not None and "crash" not in r.result, r.log
        got = r.result["restored"]
        if committed:  # the newest step the killed job saw committed, or the one it was saving
            good = got is not None and got >= max(committed) and r.result["bitwise"]
        else:  # killed in its first save: nothing, or that save if it committed before the kill
            good = got is None or r.result["bitwise"]
        rec.observe(HOW_RESUME, resume=("nothing" if got is None else "correct") if good else "partial")
        assert good, (r.result, committed)

        (s,) = _job(tmp_path, {**args, "mode": "save", "steps": [4]})
        assert s.result is not None and "crash" not in s.result, s.log
        after = scan_tiers(tmp_path, persist)
        rec.observe(HOW_HALF, half_visible=len(after_kill.half_visible | after.half_visible))
        rec.observe(HOW_WHOLE, steps_whole=len(after_kill.whole) + len(after.whole),
                    steps_not_whole=len(after_kill.not_whole) + len(after.not_whole))
        left = [p.name for p in shm_node.iterdir() if ".tmp-" in p.name or ".del-" in p.name]
        arenas = sorted(p.name for p in (shm_node / ARENA_DIR).iterdir()) if (shm_node / ARENA_DIR).exists() else []
        rec.observe(HOW_DEBRIS, debris_left=len(left) + len(arenas))
        rec.note = f"saw committed {committed}, resumed {got}"
        assert not after_kill.half_visible and not after_kill.not_whole, (after_kill.half_visible, after_kill.not_whole)
        assert not after.half_visible and not after.not_whole
        assert not left, left
        assert not arenas, arenas  # the dead process's arena went; the clean job's own went with its close()
