"""Kill one rank of a real gloo training job at each named phase of a checkpoint, at a later save.

Each case is seeded: it picks a world size (2; 2 or 3 under ``CKPTLIB_CHAOS_FULL``), a victim
rank among those that reach the phase, and ``nth``, which reach of the phase to die at,
uniformly over every reach in an uninterrupted job -- so most kills land in a later save,
after earlier steps committed. The job is ``chaos_worker.py ctrain`` (10 steps, async saves
every 2 steps, ``keep_last=2``, ``CKPTLIB_COORD_TIMEOUT=5``); the victim's environment alone
holds ``CKPTLIB_TEST_KILL_AT=<phase>:<victim>::<nth>`` and it SIGKILLs itself there. The
relaunch harness (:class:`tests.chaos.launch.Campaign`) then checks the survivors failed (or
finished with the reference result, when the death came after their last collective),
audits the folder and the save logs, and resumes in a fresh job on a new port, which must
pick the newest committed step, restore exactly the bytes logged when it was saved, and end
with the weights of an uninterrupted run.

``restore`` runs only when resuming: a clean job saves steps 2..6 first, then the victim dies
while the next job loads step 6.

The reaches per (phase, rank) come from a traced reference job (``CKPTLIB_TEST_HOOK_TRACE``),
which also checks :data:`REACHED_BY`. By default a seeded sample of ``CI_SAMPLE`` cases runs
(``CKPTLIB_TEST_SEED``, default 1234); ``CKPTLIB_CHAOS_FULL=1`` runs ``PER_PHASE`` seeds of
every phase (times ``CKPTLIB_CHAOS_SCALE``). See docs/reliability.md.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from ckptlib.crashpoints import SAVE_PHASES as PHASES

from .launch import STEPS, Campaign, reference

SEED = int(os.environ.get("CKPTLIB_TEST_SEED", "1234"))
FULL = os.environ.get("CKPTLIB_CHAOS_FULL", "") not in ("", "0")
SCALE = int(os.environ.get("CKPTLIB_CHAOS_SCALE", "1"))
CI_SAMPLE = 2
PER_PHASE = 3 * SCALE
PRE_STEPS = 6  # the clean job that saves before a `restore` kill

# Which ranks reach each phase in this job. A phase missing here fails test_phases_classified;
# the traced reference job must agree (test_reaches_match).
REACHED_BY: dict[str, str] = {
    "snapshot": "all",
    "write": "all",
    "before_commit": "all",
    "manifest": "coordinator",
    "retention": "coordinator",  # first reached when step 6 retires step 2
    "cleanup": "coordinator",
    "restore": "all",  # only when resuming
}

ALL_CASES = [(phase, k) for phase in PHASES for k in range(PER_PHASE)]
SAMPLE = set(random.Random(SEED).sample(ALL_CASES, min(CI_SAMPLE, len(ALL_CASES))))


def _params() -> list:
    out = []
    for phase, k in ALL_CASES:
        marks = []
        if not FULL and (phase, k) not in SAMPLE:
            marks.append(
                pytest.mark.skip(reason=f"not in the CI sample (seed {SEED}); CKPTLIB_CHAOS_FULL=1")
            )
        out.append(pytest.param(phase, k, id=f"{phase}-{k}", marks=marks))
    return out


def ranks_reaching(phase: str, world: int) -> list[int]:
    return [0] if REACHED_BY[phase] == "coordinator" else list(range(world))


@pytest.mark.chaos
def test_phases_classified() -> None:
    """Every crash point has a known reach (a new phase must be added to the matrix)."""
    assert set(REACHED_BY) == set(PHASES)


@pytest.mark.chaos
def test_reaches_match(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The traced uninterrupted job reaches each save phase on exactly the ranks listed."""
    _, counts, _ = reference(tmp_path_factory.getbasetemp(), 2)
    for phase in PHASES:
        if phase == "restore":
            continue
        got = sorted(r for (p, r) in counts if p == phase)
        assert got == ranks_reaching(phase, 2), (phase, counts)
    assert counts[("snapshot", 0)] == STEPS // 2  # one per save


@pytest.mark.chaos
@pytest.mark.parametrize(("phase", "k"), _params())
def test_kill_one_rank_at_phase(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, phase: str, k: int
) -> None:
    rng = random.Random(f"phase-{SEED}-{phase}-{k}")
    world = rng.choice([2, 3]) if FULL else 2
    digest, counts, _ = reference(tmp_path_factory.getbasetemp(), world)
    victim = rng.choice(ranks_reaching(phase, world))
    nth = 1 if phase == "restore" else rng.randint(1, counts[(phase, victim)])
    case = f"seed{SEED}-{phase}-{k}-w{world}-rank{victim}-nth{nth}"
    c = Campaign("phase_kill", case, SEED, tmp_path, world, digest)
    exc: BaseException | None = None
    try:
        if phase == "restore":  # something to restore from
            c.collect(c.launch(steps=PRE_STEPS), None)
            assert c.newest == PRE_STEPS, case
        env = {victim: {"CKPTLIB_TEST_KILL_AT": f"{phase}:{victim}::{nth}"}}
        c.collect(c.launch(rank_env=env), hook_victim=victim)
        assert c.kills == 1, f"{case}: the hook never fired"
        c.final()
        print(f"{case}: {c.records[-2].note}")
    except BaseException as e:
        exc = e
        raise
    finally:
        c.close(exc)
