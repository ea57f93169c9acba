"""Render chaos results (tests/chaos/record.py JSONL) into docs/reliability.md.

usage: python -m tests.chaos.report RESULTS.jsonl DOC.md [--date D] [--scenario NAME] [--allow-dirty]

Replaces the text between ``<!-- chaos-report:begin -->`` and ``<!-- chaos-report:end -->`` in
DOC.md (appends the pair when missing) and leaves the hand-written prose around it alone. Any
scenario name is rendered (one row per scenario, in order of first appearance). A scenario
may also have a section of its own, between ``<!-- chaos-report:NAME:begin -->`` and
``<!-- chaos-report:NAME:end -->``. A full render (no ``--scenario``) re-renders the whole
report and every such section from this one results file; a section whose scenario recorded
nothing in it says so (its old figures are removed) and the exit status is 1.
``--scenario NAME`` renders only that scenario's records into its own section, and only when
every other generated section of the page is stamped with the same commit.

Every generated section is stamped ``commit <hash>``: the commit every record ran on. The
renderer refuses (exit 2, the document untouched) records of more than one commit, records of
a tree with uncommitted changes (``+dirty``; ``--allow-dirty`` renders them anyway, stamped
so, for trying a patched variant), a count without the check that produced it
(``Record.how``), and a case whose duration was not measured. Each column that some record
observed gets one line saying which check produced it, per scenario; a column no record of a
scenario observed renders as ``-``.

Exit status 1 when a must-be-zero count is not zero (the document is written first), 2 on bad
input. Run by ``make chaos`` after the suite; plain functions (:func:`render`,
:func:`validate`) for tests.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .record import COUNTS, GOOD_OUTCOMES, OBSERVED, RESUME_OUTCOMES, Record, read

BEGIN = "<!-- chaos-report:begin -->"
END = "<!-- chaos-report:end -->"
SECTION_RE = re.compile(r"<!-- chaos-report:(?:([\w-]+):)?begin -->(.*?)<!-- chaos-report:(?:[\w-]+:)?end -->", re.S)
STAMP_RE = re.compile(r"\bcommit `?([0-9a-f]{7,40}(?:\+[\w-]+)?|unknown)`?")
TOTAL = "**total**"
"""The name of the row that sums every scenario, in the tables that have one."""


def markers(scenario: str | None = None) -> tuple[str, str]:
    """The (begin, end) markers of the whole report, or of ``scenario``'s own section."""
    if scenario is None:
        return BEGIN, END
    return f"<!-- chaos-report:{scenario}:begin -->", f"<!-- chaos-report:{scenario}:end -->"


@dataclass(frozen=True)
class Column:
    key: str  # a Record field (or "hostile_neither", derived)
    header: str
    zero: str = ""  # the must-be-zero line's text; empty: may be anything


SAVES = (
    Column("saves_attempted", "saves attempted"),
    Column("saves_committed", "committed (reported)"),
    Column("saves_unreported", "committed (unreported)"),
    Column("saves_aborted", "aborted (verified absent)"),
    Column("saves_other", "other (noted)"),
    Column("saves_lost", "lost", "saves lost"),
    Column("steps_whole", "committed steps verified whole"),
    Column("steps_not_whole", "not whole", "committed steps that failed the deep check"),
    Column("half_visible", "half-visible", "half-visible steps"),
    Column("debris_left", "debris left after the next save", "debris left after the next save"),
)
FAULTS = (
    Column("kills", "kills / freezes"),
    Column("corruptions_injected", "corruptions injected"),
    Column("corruptions_detected", "detected"),
    Column("corruptions_undetected", "undetected", "corruptions undetected"),
    Column("s3_retries", "S3 retries"),
    Column("s3_giveups", "S3 give-ups"),
)
INPUTS = (
    Column("malicious_total", "hostile inputs"),
    Column("malicious_rejected", "rejected (typed error)"),
    Column("malicious_loaded", "loaded as declared (checked)"),
    Column("hostile_neither", "neither", "hostile inputs neither rejected nor loaded as declared"),
    Column("worst_rss_mb", "worst RSS MB"),
    Column("worst_time_s", "worst time s"),
)
SIMULATION = (
    Column("schedules", "seeded schedules"),
    Column("violations", "invariant violations", "simulated schedules that broke an invariant"),
)
ALL_COLUMNS = (*SAVES, *FAULTS, *INPUTS, *SIMULATION)
LABELS = {c.key: c.header for c in ALL_COLUMNS} | {
    "resume": "resume outcome",
    "death_to_error_s": "time from a death to the survivors' error",
    "saves_committed": "saves committed (reported)",
    "corruptions_detected": "corruptions detected",
    "steps_not_whole": "committed steps not whole",
}
FIXED_LEGEND = (
    "*runs*: one record per case (`tests/chaos/record.py`); *failed runs*: a check of the case "
    "raised (its note below says which); *wall s*: measured around each case (`time.monotonic()`)"
)


def _observed(rs: Sequence[Record], key: str) -> bool:
    src = "malicious_total" if key == "hostile_neither" else key
    return any(src in r.how for r in rs)


def _value(rs: Sequence[Record], key: str) -> str:
    """The cell of ``key`` over ``rs``: a sum (counts), the worst (RSS, time), ``-`` unobserved."""
    if not _observed(rs, key):
        return "-"
    if key == "hostile_neither":
        return str(_neither(rs))
    if key in ("worst_rss_mb", "worst_time_s"):
        vals = [getattr(r, key) for r in rs if getattr(r, key) is not None]
        return "-" if not vals else f"{max(vals):.{1 if key == 'worst_rss_mb' else 3}f}"
    return str(sum(getattr(r, key) for r in rs if key in r.how))


def _neither(rs: Sequence[Record]) -> int:
    return sum(r.malicious_total - r.malicious_rejected - r.malicious_loaded for r in rs if "malicious_total" in r.how)


def _by_scenario(records: Sequence[Record]) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = {}
    for r in records:
        out.setdefault(r.scenario, []).append(r)
    return out


def _pcts(values: list[float]) -> tuple[float, float]:
    """(p50, p99) by nearest rank."""
    v = sorted(values)

    def at(q: float) -> float:
        k = -(-q * len(v) // 1)  # ceil(q * n)
        return v[min(len(v) - 1, max(0, int(k) - 1))]

    return at(0.50), at(0.99)


# ---------------------------------------------------------------- checks


def commits(records: Sequence[Record]) -> list[str]:
    return sorted({r.commit for r in records})


def validate(records: Sequence[Record], allow_dirty: bool = False) -> list[str]:
    """Why these records cannot make one report (empty: they can)."""
    bad: list[str] = []
    seen = commits(records)
    if len(seen) > 1:
        counts = {c: sum(1 for r in records if r.commit == c) for c in seen}
        bad.append(f"records of {len(seen)} commits cannot make one report: {counts}")
    for c in seen:
        clean = re.fullmatch(r"[0-9a-f]{40}", c or "") is not None
        if not clean and not allow_dirty:
            bad.append(f"records of commit {c or '(none)'!r}: not a clean commit (--allow-dirty to try anyway)")
    for r in records:
        where = f"{r.scenario} {r.case}"
        unknown = set(r.how) - set(OBSERVED)
        if unknown:
            bad.append(f"{where}: checks for unknown columns {sorted(unknown)}")
        for key in COUNTS:
            if getattr(r, key) and key not in r.how:
                bad.append(f"{where}: {key} = {getattr(r, key)} without the check that produced it")
        for key in ("worst_rss_mb", "worst_time_s", "resume"):
            if getattr(r, key) is not None and key not in r.how:
                bad.append(f"{where}: {key} without the check that produced it")
        if r.death_to_error_s and "death_to_error_s" not in r.how:
            bad.append(f"{where}: death_to_error_s without the check that produced it")
        if r.resume is not None and r.resume not in RESUME_OUTCOMES:
            bad.append(f"{where}: unknown resume outcome {r.resume!r}")
        if r.duration_s is None:
            bad.append(f"{where}: duration not measured")
    return bad


def checks(records: Sequence[Record]) -> list[tuple[str, int, bool, str]]:
    """(what, count, passed, observed in) for every must-be-zero figure."""
    out: list[tuple[str, int, str]] = []
    for c in ALL_COLUMNS:
        if c.zero:
            rs = [r for r in records if _observed([r], c.key)]
            n = _neither(rs) if c.key == "hostile_neither" else sum(getattr(r, c.key) for r in rs)
            out.append((c.zero, n, f"{len(rs)} of {len(records)} runs"))
    judged = [r for r in records if r.resume is not None]
    for outcome in RESUME_OUTCOMES:
        if outcome not in GOOD_OUTCOMES:
            n = sum(1 for r in judged if r.resume == outcome)
            out.append((f"resume outcome `{outcome}`", n, f"{len(judged)} resumes"))
    out.append(("failed runs (a check raised)", sum(1 for r in records if not r.ok), f"{len(records)} runs"))
    return [(what, n, n == 0, where) for what, n, where in out]


# ---------------------------------------------------------------- rendering


def _table(rows: list[tuple[str, list[Record]]], cols: Sequence[Column], title: str) -> list[str]:
    shown = [(name, rs) for name, rs in rows if any(_observed(rs, c.key) for c in cols)]
    if not shown:
        return []
    lines = ["", f"### {title}", "", "| scenario | " + " | ".join(c.header for c in cols) + " |",
             "|" + "---|" * (len(cols) + 1)]
    for name, rs in shown:
        lines.append(f"| {name} | " + " | ".join(_value(rs, c.key) for c in cols) + " |")
    return lines


def legend(records: Sequence[Record]) -> list[str]:
    """One line per observed column: which check produced it, per scenario."""
    lines = ["", "### Which check produced each figure", "", f"- {FIXED_LEGEND}."]
    keys = [c.key for c in ALL_COLUMNS if c.key != "hostile_neither"] + ["resume", "death_to_error_s"]
    entries: list[tuple[list[str], dict[str, list[str]]]] = []  # (columns, check -> scenarios)
    for key in keys:
        hows: dict[str, list[str]] = {}
        for r in records:
            if key in r.how and r.scenario not in hows.setdefault(r.how[key], []):
                hows[r.how[key]].append(r.scenario)
        if not hows:
            continue
        if entries and entries[-1][1] == hows:  # the same checks as the column before: one line
            entries[-1][0].append(key)
        else:
            entries.append(([key], hows))
    for keys_, hows in entries:
        parts = [f"{', '.join(f'`{s}`' for s in names)}: {how.rstrip('.')}" for how, names in hows.items()]
        lines.append("- " + ", ".join(f"*{LABELS.get(k, k)}*" for k in keys_) + ": " + "; ".join(parts) + ".")
    return lines


def render(records: Sequence[Record], date: str | None = None) -> str:
    """The generated section (without the markers); ``records`` must pass :func:`validate`."""
    date = date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    groups = _by_scenario(records)
    seeds = sorted({r.seed for r in records if r.seed is not None})
    lines = [
        "",
        f"Generated by `tests/chaos/report.py` on {date} from {len(records)} runs of "
        f"commit {', '.join(commits(records))}; seed(s): {', '.join(map(str, seeds)) or 'none'}. "
        "A run is one recorded case (one job, one injected fault with its recovery, or one input). "
        "A `-` is a figure no check of that scenario observed.",
        "",
        "### Runs",
        "",
        "| scenario | runs | failed runs | resumes judged | wall s |",
        "|---|---|---|---|---|",
    ]
    rows = list(groups.items()) + ([(TOTAL, list(records))] if len(groups) > 1 else [])
    for name, rs in rows:
        judged = sum(1 for r in rs if r.resume is not None)
        wall = sum(r.duration_s or 0.0 for r in rs)
        lines.append(f"| {name} | {len(rs)} | {sum(1 for r in rs if not r.ok)} | {judged} | {wall:.0f} |")
    lines += _table(rows, SAVES, "Saves and what storage shows")
    resumed = [(name, rs) for name, rs in rows if any(r.resume is not None for r in rs)]
    if resumed:
        lines += ["", "### Resume outcomes", "", "| scenario | " + " | ".join(RESUME_OUTCOMES) + " |",
                  "|" + "---|" * (len(RESUME_OUTCOMES) + 1)]
        for name, rs in resumed:
            counts = [sum(1 for r in rs if r.resume == o) for o in RESUME_OUTCOMES]
            lines.append(f"| {name} | " + " | ".join(map(str, counts)) + " |")
    lines += _table(rows, FAULTS, "Faults injected")
    lines += _table(rows, INPUTS, "Hostile inputs")
    lines += _table(rows, SIMULATION, "The coordination protocol, simulated (seeded schedules, one fault each)")
    timed = [(name, [v for r in rs for v in r.death_to_error_s]) for name, rs in rows]
    timed = [(name, vals) for name, vals in timed if vals]
    if timed:
        lines += ["", "### Time from a rank's death (or freeze) to the survivors' error", "",
                  "| scenario | samples | p50 s | p99 s | max s |", "|---|---|---|---|---|"]
        for name, vals in timed:
            p50, p99 = _pcts(vals)
            lines.append(f"| {name} | {len(vals)} | {p50:.2f} | {p99:.2f} | {max(vals):.2f} |")
        lines += slowest_deaths([(name, rs) for name, rs in rows if name != TOTAL])
    lines += ["", "### Must be zero", ""]
    for what, n, ok, where in checks(records):
        if where.startswith("0 "):
            lines.append(f"- not checked: {what} (no run of this report observed it)")
        else:
            lines.append(f"- {'PASS' if ok else 'FAIL'}: {what} = {n} (observed in {where})")
    lines += legend(records)
    bad = [r for r in records if not r.ok]
    if bad:
        lines += ["", "Failed runs (first 20):", ""]
        for r in bad[:20]:
            note = " ".join(r.note.split())  # one line, whatever the note held
            lines.append(f"- `{r.scenario}` `{r.case}` seed {r.seed}: {note[:300]}")
    lines.append("")
    return "\n".join(lines)


def slowest_deaths(rows: Sequence[tuple[str, Sequence[Record]]]) -> list[str]:
    """Per scenario, the slowest survivor's error after a death: its case, seconds and the
    survivor's last error line (``Record.death_errors``), so that an outlier can be read after
    the run. Records without the lines (older results files) are skipped."""
    out: list[str] = []
    for name, rs in rows:
        slow = [(t, r.case, err) for r in rs if len(r.death_errors) == len(r.death_to_error_s)
                for t, err in zip(r.death_to_error_s, r.death_errors, strict=True)]
        if slow:
            t, case, err = max(slow, key=lambda x: x[0])
            err = " ".join(err.split()).replace("`", "'")
            out.append(f"- slowest in {name}: `{case}`, {t:.2f} s: `{err}`")
    return ["", *out] if out else []


def not_run(scenario: str, records: Sequence[Record], date: str | None) -> str:
    date = date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"\nRendered by `tests/chaos/report.py` on {date} from a run of commit "
            f"{', '.join(commits(records))} that recorded no `{scenario}` case: no figures for this "
            "scenario at this commit.\n")


def update(doc: str, section: str, scenario: str | None = None) -> str:
    """``doc`` with the text between the markers (of ``scenario``'s own section, when given)
    replaced; the markers are appended when missing."""
    begin, end = markers(scenario)
    if begin in doc and end in doc and doc.index(begin) < doc.index(end):
        head, rest = doc.split(begin, 1)
        _, tail = rest.split(end, 1)
        return f"{head}{begin}\n{section}\n{end}{tail}"
    return f"{doc.rstrip()}\n\n{begin}\n{section}\n{end}\n"


def sections(doc: str) -> list[str | None]:
    """The generated sections of ``doc``: None for the whole report, else the scenario name."""
    return [m.group(1) for m in SECTION_RE.finditer(doc)]


def stamps(doc: str, skip: str | None = None) -> set[str]:
    """Commits stamped in ``doc``'s generated sections (but ``skip``'s own)."""
    return {c for m in SECTION_RE.finditer(doc) if m.group(1) != skip or skip is None
            for c in STAMP_RE.findall(m.group(2))}


def update_all(
    doc: str, records: Sequence[Record], date: str | None, scenario: str | None = None
) -> tuple[str, list[str]]:
    """(``doc`` after a run, sections left without figures). ``scenario`` given: only its own
    section, from its records. Otherwise the whole report and every scenario section of
    ``doc``: from this run's records, or a line saying the run recorded none."""
    if scenario is not None:
        return update(doc, render([r for r in records if r.scenario == scenario], date), scenario), []
    doc = update(doc, render(records, date))
    groups = _by_scenario(records)
    missing = []
    for name in sections(doc):
        if name is None:
            continue
        if name in groups:
            doc = update(doc, render(groups[name], date), name)
        else:
            doc = update(doc, not_run(name, records, date), name)
            missing.append(name)
    return doc, missing


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.chaos.report", description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("doc")
    ap.add_argument("--date", default=None)
    ap.add_argument("--scenario", default=None, help="render only this scenario's records, into its own section")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="render records of a tree with uncommitted changes (stamped +dirty)")
    ns = ap.parse_args(argv)
    try:
        records = read(ns.results)
    except (OSError, ValueError, TypeError) as e:
        print(f"report: cannot read {ns.results}: {e}", file=sys.stderr)
        return 2
    if ns.scenario is not None:
        records = [r for r in records if r.scenario == ns.scenario]
    if not records:
        what = f" of scenario {ns.scenario!r}" if ns.scenario else ""
        print(f"report: {ns.results} holds no records{what}", file=sys.stderr)
        return 2
    problems = validate(records, ns.allow_dirty)
    try:
        with open(ns.doc) as f:
            doc = f.read()
    except FileNotFoundError:
        doc = ""  # a new page: the report alone
    if ns.scenario is not None:
        others = stamps(doc, skip=ns.scenario) - set(commits(records))
        if others:
            problems.append(f"the page's other figures are from commit(s) {sorted(others)}, these records from "
                            f"{commits(records)}: render the whole page from one run (make chaos)")
    if problems:
        print("report: refused, the document is unchanged:\n  " + "\n  ".join(problems[:20]), file=sys.stderr)
        return 2
    new, missing = update_all(doc, records, ns.date, ns.scenario)
    with open(ns.doc, "w") as f:
        f.write(new)
    failed = [what for what, _, ok, _ in checks(records) if not ok]
    failed += [f"no records of scenario {m!r} (its section says so)" for m in missing]
    print(f"report: {len(records)} runs of commit {', '.join(commits(records))} -> {ns.doc}; "
          + (f"FAIL: {', '.join(failed)}" if failed else "all PASS"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
