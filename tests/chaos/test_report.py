"""tests/chaos/report.py on synthetic results files (no processes, not a chaos test)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from .record import Record, emit, read
from .report import BEGIN, END, checks, main, markers, render, update


def _write(path: Path, records: list[Record], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTLIB_CHAOS_RECORD", str(path))
    for r in records:
        emit(r)


def _good() -> list[Record]:
    return [
        Record(
            "phase_kill",
            "a",
            7,
            saves_attempted=5,
            saves_committed=3,
            saves_aborted=2,
            resume="correct",
            death_to_error_s=[0.5, 1.5],
        ),
        Record(
            "phase_kill",
            "b",
            7,
            saves_attempted=4,
            saves_committed=4,
            resume="correct",
            death_to_error_s=[2.5],
        ),
        Record(
            "storage_enospc",
            "c",
            7,
            s3_retries=3,
            s3_giveups=1,
            corruptions_injected=2,
            corruptions_detected=2,
        ),
        Record(
            "malicious",
            "d",
            None,
            malicious_total=10,
            malicious_rejected=10,
            worst_rss_mb=12.5,
            worst_time_s=0.25,
        ),
    ]


def test_all_pass_and_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res, doc = tmp_path / "r.jsonl", tmp_path / "doc.md"
    _write(res, _good(), monkeypatch)
    assert [asdict(r) for r in read(str(res))] == [asdict(r) for r in _good()]
    doc.write_text(f"# Title\n\nprose before\n\n{BEGIN}\nold figures\n{END}\n\nprose after\n")
    assert main([str(res), str(doc), "--date", "2026-01-02"]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\nprose before\n") and text.endswith(f"{END}\n\nprose after\n")
    assert "old figures" not in text and "2026-01-02" in text and "seed(s): 7" in text
    rows: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), line)  # first table: runs and saves
    cells = [c.strip() for c in rows["phase_kill"].split("|")[1:-1]]
    # runs, resumes checked, attempted, committed, aborted, lost
    assert cells[1:7] == ["2", "2", "9", "7", "2", "0"]
    assert "| storage_enospc |" in text and "| malicious |" in text and "10 / 10" in text
    assert "| **total** | 4 |" in text
    # death-to-error: p50 of [0.5, 1.5, 2.5] is 1.5, p99 is 2.5
    assert "| phase_kill | 3 | 1.50 | 2.50 | 2.50 |" in text
    assert "FAIL" not in text and text.count("PASS:") == len(checks(_good()))


def test_failures_are_flagged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = [
        *_good(),
        Record(
            "random_kill", "x", 9, saves_lost=1, resume="wrong_step", ok=False, note="boom\n  trace"
        ),
        Record("random_kill", "y", 9, resume="hang"),
        Record(
            "fuzz",
            "z",
            9,
            corruptions_injected=1,
            corruptions_undetected=1,
            malicious_total=2,
            malicious_rejected=1,
        ),
    ]
    res, doc = tmp_path / "r.jsonl", tmp_path / "doc.md"
    _write(res, bad, monkeypatch)
    doc.write_text("# no markers yet\n")
    assert main([str(res), str(doc), "--date", "d"]) == 1
    text = doc.read_text()
    assert text.startswith("# no markers yet\n") and BEGIN in text and text.rstrip().endswith(END)
    for line in (
        "FAIL: saves lost = 1",
        "FAIL: resume outcome `wrong_step` = 1",
        "FAIL: resume outcome `hang` = 1",
        "PASS: resume outcome `partial` = 0",
        "FAIL: corruptions undetected = 1",
        "FAIL: malicious inputs not rejected = 1",
        "FAIL: failed runs (a check raised) = 1",
    ):
        assert line in text, line
    assert "`random_kill` `x` seed 9: boom trace\n" in text  # notes rendered on one line
    # Re-rendering replaces the section instead of appending another one.
    assert main([str(res), str(doc), "--date", "d"]) == 1
    assert doc.read_text().count(BEGIN) == 1


def test_update_and_bad_input(tmp_path: Path) -> None:
    assert update(f"a\n{BEGIN}\nx\n{END}\nb", "S") == f"a\n{BEGIN}\nS\n{END}\nb"
    # runs table only: no resume outcome, no deaths
    assert render([Record("s", "c")], "d").count("| s |") == 1
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    doc = tmp_path / "d.md"
    doc.write_text("x")
    assert main([str(empty), str(doc)]) == 2 and doc.read_text() == "x"
    garbage = tmp_path / "g.jsonl"
    garbage.write_text("{not json\n")
    assert main([str(garbage), str(doc)]) == 2


def test_tier_kill_counts_and_scenario_sections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = [Record("tier_kill", f"k{i}", 5, kills=1, saves_attempted=4, saves_committed=3, resume="correct")
            for i in range(3)]
    res, doc = tmp_path / "r.jsonl", tmp_path / "doc.md"
    _write(res, _good() + tier, monkeypatch)
    tb, te = markers("tier_kill")
    doc.write_text(f"# T\n\n{BEGIN}\nold all\n{END}\n\n## Tiers\n\n{tb}\nold tiers\n{te}\n")
    # One scenario's matrix alone: only its own section changes.
    assert main([str(res), str(doc), "--date", "d1", "--scenario", "tier_kill"]) == 0
    text = doc.read_text()
    assert "old all" in text and "old tiers" not in text
    section = text.split(tb, 1)[1].split(te, 1)[0]
    assert "from 3 runs; seed(s): 5" in section and "| phase_kill |" not in section
    assert "| tier_kill | 3 | 3 | 0 | 0 | 0 |" in section  # kills, resumes, lost, debris, half-visible
    assert "PASS: debris left after the next save = 0" in section and "PASS: half-visible drains = 0" in section
    # A full run refreshes both.
    assert main([str(res), str(doc), "--date", "d2"]) == 0
    text = doc.read_text()
    assert "old all" not in text and text.count("d2") == 2 and text.count(tb) == 1
    # Debris or a half-visible drain fails the report.
    _write(res, [Record("tier_kill", "bad", 5, kills=1, debris_left=2, half_visible=1)], monkeypatch)
    assert main([str(res), str(doc), "--scenario", "tier_kill"]) == 1
    text = doc.read_text()
    assert "FAIL: debris left after the next save = 2" in text and "FAIL: half-visible drains = 1" in text
    assert main([str(res), str(doc), "--scenario", "nope"]) == 2
