"""Corruption at rest: bit flips and truncations in committed steps of a real training job.

A real job (``chaos_storage_worker.py``, async saves every 2 steps, no retention) leaves
steps 2, 4, 6 and 8 and logs the hash of every leaf it saved. Each case copies that root,
damages the newest step, an older one, both, or every step -- flipping 1 or 8 seeded bits, or
truncating to a seeded length, in a payload file or in ``manifest.json`` -- and checks:

* ``CheckpointManager.restore`` returns the newest step that was not damaged, its leaves hash
  to exactly what the job logged when it saved that step, and every damaged step it passed
  over is named in a logged warning with its reason; with every step damaged it raises
  ``CorruptCheckpointError`` instead of loading anything;
* ``ckptlib verify --all --json`` fails (exit 1) on exactly the damaged steps.

Counting, per damaged file: *detected* when a load of that step (``restore(step=N)``)
raises ``CorruptCheckpointError``, or returns leaves byte-identical to the logged hashes (a
flip that hit bytes no value depends on: harmless, and counted as detected, with a note);
*undetected* when it returns any other bytes without an error, or when ``verify`` calls a
step good whose load is not byte-identical. Undetected must be 0.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest

import ckptlib
from ckptlib.cli.main import main as cli_main
from ckptlib.format import layout

from .conftest import FULL, SEED, Harness, reference_hashes, rng, sampled, worker_module
from .record import recording

pytestmark = pytest.mark.chaos

STEPS = 8
EVERY = 2
SAVED = [2, 4, 6, 8]
TARGETS = ("newest", "older", "newest+older", "all")
FILES = ("payload", "manifest")
MUTATIONS = ("flip1", "flip8", "truncate")
COMPRESSIONS = ("none", "zstd") if FULL else ("none",)
CASES = [
    (c, t, f, m, s)
    for c in COMPRESSIONS
    for t in TARGETS
    for f in FILES
    for m in MUTATIONS
    for s in range(3 if FULL else 1)
]
IDS = [f"{c}-{t}-{f}-{m}-s{s}" for c, t, f, m, s in CASES]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Harness]:
    """One real training job per compression setting; its committed steps are the corpus."""
    out = {}
    for comp in COMPRESSIONS:
        d = tmp_path_factory.mktemp(f"corruption-source-{comp}")
        h = Harness(d, str(d / "ckpt"))
        run = h.run(
            "src",
            steps=STEPS,
            save_every=EVERY,
            keep_last=None,
            compression=None if comp == "none" else comp,
        )
        assert run.returncode == 0, run.log[-3000:]
        assert h.committed() == SAVED, h.committed()
        out[comp] = h
    return out


def damage(path: Path, mutation: str, r) -> str:
    """Damage one file in place; returns a description."""
    data = bytearray(path.read_bytes())
    if mutation == "truncate":
        keep = r.randrange(0, len(data))
        path.write_bytes(bytes(data[:keep]))
        return f"{path.name}: truncated {len(data)} -> {keep}"
    flips = 1 if mutation == "flip1" else 8
    where = []
    for _ in range(flips):
        pos, bit = r.randrange(len(data)), r.randrange(8)
        data[pos] ^= 1 << bit
        where.append(f"{pos}.{bit}")
    path.write_bytes(bytes(data))
    return f"{path.name}: flipped bits {','.join(where)}"


def restored_hashes(url: str, step: int | None) -> tuple[int | None, dict[str, str]]:
    w = worker_module()
    state, _, _ = w.build(0)
    with ckptlib.CheckpointManager(url) as mgr:
        got = mgr.restore(state, step=step)
    return got, w.leaf_hashes(state)


HOW_DAMAGE = ("per damaged step: detected = loading exactly that step raises `CorruptCheckpointError` (or returns "
              "leaves byte-identical to the logged hashes: harmless damage); undetected = any other bytes without an "
              "error, or `ckptlib verify --all` calling a harmfully damaged step good")
HOW_RESUME = ("`restore()` of the damaged root: the newest step without harmful damage, its leaf hashes equal to "
              "those logged when it was saved (all damaged: `CorruptCheckpointError`, counted correct)")


@pytest.mark.parametrize("comp,target,kind,mutation,seed", sampled(CASES, IDS, 6, "corruption"))
def test_corruption_detected(
    sources: dict[str, Harness],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    comp: str,
    target: str,
    kind: str,
    mutation: str,
    seed: int,
) -> None:
    src = sources[comp]
    r = rng("corruption", comp, target, kind, mutation, seed)
    root = tmp_path / "ckpt"
    shutil.copytree(src.dir / "ckpt", root)
    older = r.choice(SAVED[:-1])
    victims = {
        "newest": [SAVED[-1]],
        "older": [older],
        "newest+older": [older, SAVED[-1]],
        "all": list(SAVED),
    }[target]
    logged = {s: src.saved_hashes(s) for s in SAVED}
    ref = reference_hashes(STEPS)
    assert all(logged[s] == ref[s] for s in SAVED), (
        "the job saved something other than the reference"
    )

    with recording("corruption", f"{comp}-{target}-{kind}-{mutation}-s{seed}", SEED) as rec:
        notes = []
        for s in victims:
            folder = root / layout.step_dir(s)
            files = (
                sorted(folder.rglob("*.bin")) if kind == "payload" else [folder / "manifest.json"]
            )
            notes.append(f"step {s} " + damage(r.choice(files), mutation, r))
        rec.observe(HOW_DAMAGE, corruptions_injected=len(victims))
        rec.note = "; ".join(notes)

        # Per damaged step: a load of exactly that step must fail, or be byte-identical.
        harmful = []
        for s in victims:
            try:
                got, hashes = restored_hashes(str(root), s)
            except ckptlib.CorruptCheckpointError:
                rec.corruptions_detected += 1
                harmful.append(s)
                continue
            if got == s and hashes == logged[s]:
                rec.corruptions_detected += 1  # harmless: no value depends on the damaged bytes
                rec.note += f"; step {s}: damage harmless (byte-identical load)"
            else:
                rec.corruptions_undetected += 1
                harmful.append(s)

        # verify names exactly the damaged steps (harmless damage may be named or not).
        out = io.StringIO()
        with redirect_stdout(out):
            code = cli_main(["verify", str(root), "--all", "--json"])
        report = json.loads(out.getvalue())
        flagged = {row["step"] for row in report["steps"] if not row["ok"]}
        for s in harmful:
            if s not in flagged:
                rec.corruptions_undetected += 1
                rec.note += f"; verify called damaged step {s} good"
        rec.checked(HOW_DAMAGE, "corruptions_detected", "corruptions_undetected")
        assert flagged <= set(victims), f"verify flagged undamaged steps: {flagged - set(victims)}"
        assert code == (1 if flagged else 0), (code, report)
        assert rec.corruptions_undetected == 0, rec.note

        # Resume: the newest step that is not (harmfully) damaged, with the logged bytes.
        good = [s for s in SAVED if s not in harmful]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ckptlib"):
            if not good:
                rec.observe(HOW_RESUME, resume="crash")
                with pytest.raises(ckptlib.CorruptCheckpointError):
                    restored_hashes(str(root), None)
                rec.observe(HOW_RESUME, resume="correct")
            else:
                rec.observe(HOW_RESUME, resume="wrong_step")
                got, hashes = restored_hashes(str(root), None)
                assert got == max(good), f"restored step {got}, expected {max(good)}"
                rec.observe(HOW_RESUME, resume="partial")
                assert hashes == logged[got], "restored bytes differ from what was saved"
                rec.observe(HOW_RESUME, resume="correct")
        text = caplog.text
        for s in harmful:
            if good and s < max(good):
                continue  # older than the step resumed: never reached
            assert f"step {s}" in text, f"skipping damaged step {s} was not logged:\n{text}"
