"""A 2-rank restore judges steps lazily and still falls back together over a newest step that
only the load finds damaged (engine/resume.py: the candidates shared in batches)."""

from __future__ import annotations

from .launch import run


def test_two_ranks_fall_back_over_a_damaged_newest_step(tmp_path):
    out = run("lazy_fallback", 2, tmp_path, {"steps": 6})
    assert [r["restored"] for r in out] == [5, 5], out
    assert all(r["bitwise"] for r in out), out
    # the coordinator judged step 6 (committed by its sizes, damaged when loaded) and step 5, not steps 1-4
    assert out[0]["judged"] == ["step-000000000006", "step-000000000005"], out
    assert out[1]["judged"] == [], out  # the other rank lists nothing: it gets the coordinator's batches
