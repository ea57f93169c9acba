"""tests/chaos/report.py on synthetic results files (no processes, not a chaos test)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from .record import Record, SaveChecks, account_saves, emit, read
from .report import BEGIN, END, checks, main, markers, render, update, validate

C1 = "1" * 40
C2 = "2" * 40
ATTEMPT = "attempt events logged before save()"
SEEN = "committed events after wait()"


def _write(path: Path, records: list[Record], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTLIB_CHAOS_RECORD", str(path))
    for r in records:
        emit(r)


def _rec(scenario: str, case: str, seed: int | None = 7, **how: dict[str, object]) -> Record:
    """A record of commit C1 measured for 1 s; ``how``: {check: {column: value}}."""
    r = Record(scenario, case, seed, commit=C1, duration_s=1.0)
    for check, values in how.items():
        r.observe(check, **values)
    return r


def _good() -> list[Record]:
    return [
        _rec("phase_kill", "a", a={"saves_attempted": 5}, b={"saves_committed": 3, "saves_aborted": 2},
             c={"resume": "correct", "death_to_error_s": [0.5, 1.5]}),
        _rec("phase_kill", "b", a={"saves_attempted": 4}, b={"saves_committed": 4},
             c={"resume": "nothing", "death_to_error_s": [2.5]}),
        _rec("storage_enospc", "c", s3={"s3_retries": 3, "s3_giveups": 1},
             dmg={"corruptions_injected": 2, "corruptions_detected": 2}),
        _rec("malicious", "d", None, typed={"malicious_total": 10, "malicious_rejected": 8, "malicious_loaded": 2},
             rss={"worst_rss_mb": 12.5, "worst_time_s": 0.25}),
    ]


def _rows(text: str, title: str) -> dict[str, list[str]]:
    """The cells of each row of the table under ``### title``."""
    block = text.split(f"### {title}\n", 1)[1].strip().split("\n\n", 1)[0]
    out = {}
    for line in block.splitlines()[2:]:  # after the header and the separator
        cells = [c.strip() for c in line.split("|")[1:-1]]
        out[cells[0]] = cells[1:]
    return out


def test_all_pass_and_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res, doc = tmp_path / "r.jsonl", tmp_path / "doc.md"
    _write(res, _good(), monkeypatch)
    assert [asdict(r) for r in read(str(res))] == [asdict(r) for r in _good()]
    doc.write_text(f"# Title\n\nprose before\n\n{BEGIN}\nold figures\n{END}\n\nprose after\n")
    assert main([str(res), str(doc), "--date", "2026-01-02"]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\nprose before\n") and text.endswith(f"{END}\n\nprose after\n")
    assert "old figures" not in text and "2026-01-02" in text and "seed(s): 7" in text
    assert f"commit {C1};" in text
    saves = _rows(text, "Saves and what storage shows")
    # attempted, committed, unreported, aborted, other, lost: unobserved ones are "-", not 0
    assert saves["phase_kill"][:6] == ["9", "7", "-", "2", "-", "-"]
    assert "storage_enospc" not in saves and "malicious" not in saves  # nothing of the table observed
    assert _rows(text, "Resume outcomes")["phase_kill"][:2] == ["1", "1"]  # correct, nothing
    assert _rows(text, "Hostile inputs")["malicious"] == ["10", "8", "2", "0", "12.5", "0.250"]
    assert _rows(text, "Runs")["**total**"] == ["4", "0", "2", "4"]
    assert "| phase_kill | 3 | 1.50 | 2.50 | 2.50 |" in text  # p50 of [0.5, 1.5, 2.5] is 1.5
    assert "FAIL" not in text
    assert text.count("PASS:") + text.count("not checked:") == len(checks(_good()))
    assert "- not checked: half-visible steps (no run of this report observed it)" in text
    # One line per observed column saying which check produced it, per scenario.
    assert "- *saves attempted*: `phase_kill`: a." in text
    assert "- *saves committed (reported)*, *aborted (verified absent)*: `phase_kill`: b." in text
    assert "- *S3 retries*, *S3 give-ups*: `storage_enospc`: s3." in text  # same check: one line
    assert "- *resume outcome*, *time from a death to the survivors' error*: `phase_kill`: c." in text
    assert "*lost*" not in text  # observed nowhere: no line


def test_failures_are_flagged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x = _rec("random_kill", "x", 9, a={"saves_lost": 1, "resume": "wrong_step"}, b={"half_visible": 2})
    x.ok, x.note = False, "boom\n  trace"
    bad = [
        *_good(),
        x,
        _rec("random_kill", "y", 9, a={"resume": "hang"}),
        _rec("fuzz", "z", 9, a={"corruptions_injected": 1, "corruptions_undetected": 1},
             b={"malicious_total": 3, "malicious_rejected": 1, "malicious_loaded": 1}),
    ]
    res, doc = tmp_path / "r.jsonl", tmp_path / "doc.md"
    _write(res, bad, monkeypatch)
    doc.write_text("# no markers yet\n")
    assert main([str(res), str(doc), "--date", "d"]) == 1
    text = doc.read_text()
    assert text.startswith("# no markers yet\n") and BEGIN in text and text.rstrip().endswith(END)
    for line in (
        "FAIL: saves lost = 1 (observed in 1 of 7 runs)",
        "FAIL: half-visible steps = 2",
        "FAIL: resume outcome `wrong_step` = 1",
        "FAIL: resume outcome `hang` = 1",
        "PASS: resume outcome `partial` = 0",
        "FAIL: corruptions undetected = 1",
        "FAIL: hostile inputs neither rejected nor loaded as declared = 1",
        "FAIL: failed runs (a check raised) = 1",
    ):
        assert line in text, line
    assert "`random_kill` `x` seed 9: boom trace\n" in text  # notes rendered on one line
    # Re-rendering replaces the section instead of appending another one.
    assert main([str(res), str(doc), "--date", "d"]) == 1
    assert doc.read_text().count(BEGIN) == 1


def test_refusals_leave_the_document_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("x")
    other = _rec("phase_kill", "other commit", a={"saves_attempted": 1})
    other.commit = C2
    unobserved = _rec("phase_kill", "guessed")
    unobserved.saves_aborted = 3  # a count without the check that produced it
    unmeasured = _rec("phase_kill", "no clock")
    unmeasured.duration_s = None
    dirty = _rec("phase_kill", "dirty")
    dirty.commit = C1 + "+dirty"
    assert "records of 2 commits" in validate([*_good(), other])[0]
    assert validate([unobserved]) == ["phase_kill guessed: saves_aborted = 3 without the check that produced it"]
    assert validate([unmeasured]) == ["phase_kill no clock: duration not measured"]
    assert "not a clean commit" in validate([dirty])[0] and validate([dirty], allow_dirty=True) == []
    for i, recs in enumerate(([*_good(), other], [unobserved], [unmeasured], [dirty])):
        res = tmp_path / f"r{i}.jsonl"
        _write(res, recs, monkeypatch)
        assert main([str(res), str(doc)]) == 2 and doc.read_text() == "x"
    assert main([str(tmp_path / "r3.jsonl"), str(doc), "--allow-dirty"]) == 0
    assert f"commit {C1}+dirty" in doc.read_text()


def test_slowest_death_names_the_survivors_error() -> None:
    """The slowest survivor of each scenario is named with its case and its last error line;
    records of older results files (times, no lines) are left out of that line."""
    slow = _rec("phase_kill", "restore-1", c={"death_to_error_s": [0.2, 97.98]})
    slow.death_errors = ["rank 1: CommitError: rank 0 died", "rank 2: StoreError: `get` timed out\nafter 5 s"]
    quick = _rec("phase_kill", "save-3", c={"death_to_error_s": [0.1]})
    quick.death_errors = ["rank 0: CommitError: rank 1 died"]
    old = _rec("phase_kill", "older", c={"death_to_error_s": [120.0]})  # no lines: skipped
    text = render([slow, quick, old], "d")
    assert "| phase_kill | 4 |" in text and "| 120.00 |" in text  # the table still counts every time
    assert "- slowest in phase_kill: `restore-1`, 97.98 s: `rank 2: StoreError: 'get' timed out after 5 s`" in text
    assert "older" not in text.split("### Time from", 1)[1].split("### Must be zero", 1)[0]
    assert "slowest in" not in render([old], "d")
    other = _rec("sigstop", "freeze", c={"death_to_error_s": [10.0]})
    other.death_errors = ["rank 2: RuntimeError: timed out"]
    both = render([slow, other], "d")  # two scenarios: a total row in the table, not among the slowest
    assert "| **total** | 3 |" in both and "- slowest in sigstop: `freeze`, 10.00 s" in both
    assert "slowest in **total**" not in both


def test_update_and_bad_input(tmp_path: Path) -> None:
    assert update(f"a\n{BEGIN}\nx\n{END}\nb", "S") == f"a\n{BEGIN}\nS\n{END}\nb"
    # runs table only: nothing observed, no resume outcome, no deaths
    text = render([Record("s", "c", commit=C1, duration_s=0.5)], "d")
    assert text.count("| s |") == 1 and "### Saves" not in text and "### Resume" not in text
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    doc = tmp_path / "d.md"
    doc.write_text("x")
    assert main([str(empty), str(doc)]) == 2 and doc.read_text() == "x"
    garbage = tmp_path / "g.jsonl"
    garbage.write_text("{not json\n")
    assert main([str(garbage), str(doc)]) == 2
    foreign = tmp_path / "f.jsonl"
    foreign.write_text('{"scenario": "s", "case": "c", "saves_guessed": 3}\n')
    assert main([str(foreign), str(doc)]) == 2


def test_sections_from_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = [_rec("tier_kill", f"k{i}", 5, kill={"kills": 1}, att={"saves_attempted": 4, "saves_committed": 3},
                 scan={"half_visible": 0, "debris_left": 0}, res={"resume": "correct"}) for i in range(3)]
    res, doc = tmp_path / "r.jsonl", tmp_path / "doc.md"
    _write(res, _good() + tier, monkeypatch)
    tb, te = markers("tier_kill")
    sb, se = markers("sigstop")
    doc.write_text(f"# T\n\n{BEGIN}\nold all\n{END}\n\n## Tiers\n\n{tb}\nold tiers\n{te}\n\n{sb}\nold stops\n{se}\n")
    # One scenario's matrix alone: only its own section changes (the page holds no other stamp).
    assert main([str(res), str(doc), "--date", "d1", "--scenario", "tier_kill"]) == 0
    text = doc.read_text()
    assert "old all" in text and "old tiers" not in text
    section = text.split(tb, 1)[1].split(te, 1)[0]
    assert "from 3 runs of commit " + C1 in section and "| phase_kill |" not in section
    assert "PASS: debris left after the next save = 0" in section and "PASS: half-visible steps = 0" in section
    # A full run re-renders every section; one whose scenario did not run loses its old
    # figures and fails the render.
    assert main([str(res), str(doc), "--date", "d2"]) == 1
    text = doc.read_text()
    assert "old all" not in text and "old stops" not in text and text.count(tb) == 1
    assert "recorded no `sigstop` case" in text.split(sb, 1)[1]
    assert "on d2 from 3 runs" in text.split(tb, 1)[1].split(te, 1)[0]
    # A section of another commit cannot join a page stamped with this one.
    later = [_rec("tier_kill", "k", 5, kill={"kills": 1})]
    later[0].commit = C2
    _write(tmp_path / "later.jsonl", later, monkeypatch)
    before = doc.read_text()
    assert main([str(tmp_path / "later.jsonl"), str(doc), "--scenario", "tier_kill"]) == 2
    assert doc.read_text() == before
    assert main([str(res), str(doc), "--scenario", "nope"]) == 2


def test_account_saves_buckets() -> None:
    rec = Record("s", "c")
    how = SaveChecks("logged before save()", "logged after wait()", "storage listing after the job")
    note = account_saves(rec, how, attempted=[2, 4, 6, 8, 10],
                         reported=[2, 4], on_storage=[4, 6], visible=[4, 6, 10], retirable=[8])
    assert (rec.saves_attempted, rec.saves_committed, rec.saves_unreported, rec.saves_aborted,
            rec.saves_other) == (5, 2, 1, 0, 2)
    assert "committed-unreported=[6]" in note and "maybe retired by retention=[8]" in note
    assert "visible but not committed=[10]" in note
    account_saves(rec, how, attempted=[12], reported=[], on_storage=[], visible=[])
    assert rec.saves_attempted == 6 and rec.saves_aborted == 1
    assert rec.how["saves_aborted"] == "storage listing after the job"
    assert rec.how["saves_attempted"] == "logged before save()"
