"""Deterministic data-parallel training: interrupted on 2 ranks, resumed on 2 and on 4 ranks,
ends with exactly the weights (and optimizer state) of an uninterrupted run."""

from __future__ import annotations

import shutil

from .launch import results, run, start, wait


def test_interrupted_training_resumes_on_2_and_4_ranks(tmp_path):
    (tmp_path / "ref").mkdir()
    ref = run("train", 2, tmp_path / "ref", {"steps": 12})
    ref_digest = ref[0]["digest"]
    assert all(r["digest"] == ref_digest for r in ref)

    crashed = tmp_path / "crashed"
    crashed.mkdir()
    procs = start("train", 2, crashed, {"steps": 12, "save_every": 3, "die_at": 8},
                  env={"CKPTLIB_COORD_TIMEOUT": "5"})
    wait("train", procs, crashed, 180)
    assert procs[1].returncode != 0  # the victim was SIGKILLed after step 8
    survivor = results("train", 2, crashed)[0]
    # rank 0 trains on into step 9, whose all-reduce fails on the dead peer: it records a crash
    assert survivor is not None and "crash" in survivor, survivor

    for world in (2, 4):
        root = tmp_path / f"resume{world}"
        shutil.copytree(crashed, root)
        for f in root.glob("result-*.json"):
            f.unlink()
        res = run("train", world, root, {"steps": 12, "save_every": 3})
        assert {r["start"] for r in res} == {6}, res  # newest committed step before the kill
        assert all(r["digest"] == ref_digest for r in res), (world, res)
