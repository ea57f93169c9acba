"""ckptlib.RNGState: Python, NumPy and torch generators captured at save and restored at
restore -- in one process, and per rank with 2 real processes (each rank gets its own back)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import launcher
import numpy as np
import pytest
import torch

import ckptlib
from ckptlib import rng

WORKER = Path(__file__).resolve().parent / "workers" / "rng_worker.py"


def draws() -> tuple[list[float], list[float], list[float]]:
    return ([random.random() for _ in range(5)] + [random.gauss(0, 1)],
            [*np.random.rand(5).tolist(), float(np.random.randn())],
            torch.rand(5).tolist() + torch.randn(3).tolist())


@pytest.mark.parametrize("async_save", [False, True])
def test_restore_replays_the_same_numbers(tmp_path, async_save):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    draws()
    state = {"w": torch.ones(2), "rng": ckptlib.RNGState()}
    with ckptlib.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(3, state).wait(timeout=60)
        after_save = draws()
        random.seed(99), np.random.seed(99), torch.manual_seed(99)
        assert draws() != after_save  # the generators really moved on
        assert mgr.restore(state) == 3
        assert draws() == after_save


def test_fresh_load_and_load_into(tmp_path):
    torch.manual_seed(5)
    ckptlib.save({"rng": ckptlib.RNGState()}, tmp_path / "c")
    expected = draws()
    plain = ckptlib.load(tmp_path / "c")  # without a target: the stored tree, this rank's value
    saved = plain["rng"][rng.KEY]
    assert len(saved["python"]["internal"]) == 625 and len(saved["numpy"]["key"]) == 624
    assert saved["torch"].dtype == torch.uint8 and saved["cuda"] == []
    ckptlib.load(tmp_path / "c", into={"rng": ckptlib.RNGState()})
    assert draws() == expected


def test_corrupt_values_are_refused_before_touching_generators():
    good = rng.capture()
    random.seed(4)
    before = random.getstate()
    for bad in (
        {**good, "python": {**good["python"], "internal": ["x"] * 625}},
        {**good, "numpy": {**good["numpy"], "key": [1, 2]}},
        {**good, "torch": [1, 2, 3]},
        {k: v for k, v in good.items() if k != "cuda"},
    ):
        with pytest.raises(ckptlib.CorruptCheckpointError, match="RNG state is not valid"):
            rng.apply(bad)
        assert random.getstate() == before
    with pytest.raises(ckptlib.CorruptCheckpointError, match="must be a dict"):
        ckptlib.RNGState().load_state_dict({rng.KEY: 3})


def test_two_ranks_each_get_their_own_generators_back(tmp_path):
    def run(phase: str) -> list[dict]:
        procs = launcher.start(lambda r, port: [str(WORKER), phase, str(r), "2", port, str(tmp_path)], 2)
        outs = launcher.finish(f"rng {phase}", procs, lambda r: tmp_path / f"result-{phase}-{r}.json", 120)
        for o in outs:
            assert o.result is not None and "crash" not in o.result, f"rank {o.rank}:\n{o.result}\n{o.log}"
        return [json.loads((tmp_path / f"result-{phase}-{r}.json").read_text()) for r in range(2)]

    saved = run("save")
    assert saved[0]["draws"] != saved[1]["draws"]  # ranks really hold different states
    restored = run("restore")  # fresh processes, seeded differently, then restored
    for r in range(2):
        assert restored[r]["restored"] == 1
        assert restored[r]["draws"] == saved[r]["draws"], f"rank {r} did not get its own RNG state back"
