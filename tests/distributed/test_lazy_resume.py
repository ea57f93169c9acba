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


def test_each_rank_of_a_restore_asks_the_size_only_of_what_the_coordinator_judges(tmp_path):
    """The coordinator judges the step (every payload file's size); the other ranks no longer ask
    for every file's size again (4 ranks: 4 requests each, N² at N ranks: 16.8 million at 4,096),
    their readers check the size of each file they open."""
    out = run("restore_sizes", 4, tmp_path)
    assert [r["restored"] for r in out] == [2] * 4 and all(r["bitwise"] for r in out), out
    files = out[0]["files"]
    assert len(files) == 4, files  # one payload file per rank
    assert sorted(out[0]["sizes"]) == files, out[0]  # its judge of step 2
    assert [r["sizes"] for r in out[1:]] == [[], [], []], out


def test_a_file_cut_after_the_judge_is_found_by_the_rank_that_reads_it(tmp_path):
    """Step 2 passes the coordinator's size check, then rank 1's payload file loses a byte: rank
    1's reader finds it when it opens the file, and every rank falls back to step 1 together."""
    out = run("restore_sizes", 4, tmp_path, {"cut": True})
    assert [r["restored"] for r in out] == [1] * 4 and all(r["bitwise"] for r in out), out
