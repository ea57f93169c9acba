"""Results of chaos scenarios, one JSON line per case, for the generated reliability report.

Every chaos test builds a :class:`Record` for the case it ran and calls :func:`emit` *before*
its assertions (a failing case is counted too, with ``ok=False`` when it raised). Records go
to the file named by ``CKPTLIB_CHAOS_RECORD``; unset (plain ``pytest``), nothing is written.
``make chaos`` sets it and then renders ``docs/reliability.md`` with ``tests/chaos/report.py``.

A figure is only as good as the check behind it, so a record says, per count it fills, which
check produced it: :meth:`Record.observe` sets counts together with that check's description
(``how``, one entry per column). A count left unobserved renders as ``-``, never as 0, and the
renderer refuses a record that holds a count without its check. The descriptions are module
constants of the test that observes (the same text for every record of a scenario), so that
the report can print one line per column saying which check produced it.

Every record carries the commit it ran on (:func:`current_commit`: the git HEAD of the tree
``ckptlib`` is imported from, ``+dirty`` when that tree's ``ckptlib/`` or ``tests/`` has
uncommitted changes); the renderer refuses to put records of different commits in one report.

Writers are test processes only (pytest's main thread); each line is appended with one
``write`` call on an ``O_APPEND`` file, so concurrent pytest processes do not interleave lines.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

ENV = "CKPTLIB_CHAOS_RECORD"

# Resume outcomes. "correct": the restored bytes equal the ones logged when that step was
# saved; "nothing": nothing was committed, and the resume restored nothing (its own outcome,
# not counted as correct). Every other one must stay at 0 in the report.
RESUME_OUTCOMES = ("correct", "nothing", "wrong_step", "partial", "hang", "crash")
GOOD_OUTCOMES = ("correct", "nothing")

# Counts a record may fill; each needs an entry in ``Record.how`` (the check that produced it).
COUNTS = (
    "saves_attempted",
    "saves_committed",
    "saves_unreported",
    "saves_aborted",
    "saves_other",
    "saves_lost",
    "steps_whole",
    "steps_not_whole",
    "half_visible",
    "debris_left",
    "corruptions_injected",
    "corruptions_detected",
    "corruptions_undetected",
    "malicious_total",
    "malicious_rejected",
    "malicious_loaded",
    "kills",
    "s3_retries",
    "s3_giveups",
    "schedules",
    "violations",
)
OBSERVED = (*COUNTS, "resume", "worst_rss_mb", "worst_time_s", "death_to_error_s")
"""Every key ``Record.how`` may hold."""


@dataclass
class Record:
    scenario: str  # e.g. "phase_kill", "random_kill", "sigstop", "storage_enospc", "malicious"
    case: str  # the test id / case within the scenario
    seed: int | None = None
    commit: str = ""  # filled by emit(): current_commit()
    saves_attempted: int = 0  # saves the workers started (each logged before calling save())
    saves_committed: int = 0  # attempted saves a worker saw commit (its handle said so)
    saves_unreported: int = 0  # attempted, no worker saw it commit, yet committed on storage
    saves_aborted: int = 0  # attempted, not reported committed, verified absent on storage
    saves_other: int = 0  # attempted, in none of the above (the note says what: e.g. retired or refused)
    saves_lost: int = 0  # reported committed at some point, later missing or unloadable: must be 0
    steps_whole: int = 0  # committed steps (per tier copy) a deep check (every checksum) passed
    steps_not_whole: int = 0  # committed steps a deep check failed: must be 0
    resume: str | None = None  # one of RESUME_OUTCOMES, None when the case does not resume
    corruptions_injected: int = 0
    corruptions_detected: int = 0
    corruptions_undetected: int = 0  # must be 0
    malicious_total: int = 0
    malicious_rejected: int = 0  # refused with a typed ckptlib error
    malicious_loaded: int = 0  # loaded, and equal to what its (edited) manifest declares: checked
    worst_rss_mb: float | None = None  # malicious inputs: peak RSS of the loading process
    worst_time_s: float | None = None  # malicious inputs: slowest load
    s3_retries: int = 0
    s3_giveups: int = 0
    death_to_error_s: list[float] = field(default_factory=list)  # a rank's death -> peers' error
    death_errors: list[str] = field(default_factory=list)  # each survivor's last error line, as above
    kills: int = 0  # processes SIGKILLed (or SIGSTOPped) by the case's fault, seen dead
    schedules: int = 0  # seeded simulation schedules run (tests/coord/test_simulation.py)
    violations: int = 0  # invariant violations the schedules found: must be 0
    debris_left: int = 0  # .tmp-/.del- folders left after the next save: must be 0
    half_visible: int = 0  # steps visible on a tier but not committed (a half-published save): must be 0
    duration_s: float | None = None  # measured wall time of the case; None: not measured
    ok: bool = True
    note: str = ""
    how: dict[str, str] = field(default_factory=dict)  # column -> the check that produced it

    def observe(self, how: str, **values: object) -> None:
        """Set each count in ``values`` and record ``how`` (the check that produced it)."""
        for name, value in values.items():
            if name not in OBSERVED:
                raise KeyError(f"{name!r} is not an observable column of a chaos record")
            setattr(self, name, value)
            self.how[name] = how

    def checked(self, how: str, *names: str) -> None:
        """Record ``how`` for columns filled incrementally (``rec.x += 1``)."""
        self.observe(how, **{n: getattr(self, n) for n in names})


@dataclass(frozen=True)
class SaveChecks:
    """How a scenario observes its saves (descriptions for ``Record.how``)."""

    attempted: str  # how the saves a worker started are known (logged before save())
    reported: str  # how a worker saw one commit
    storage: str  # the storage check that sorts the rest: unreported, aborted (absent), other


def account_saves(
    rec: Record,
    how: SaveChecks,
    attempted: Collection[int],
    reported: Collection[int],
    on_storage: Collection[int],
    visible: Collection[int],
    retirable: Collection[int] = (),
) -> str:
    """Put every attempted save of one job in exactly one bucket, from what storage shows now.

    ``reported``: steps a worker saw commit; ``on_storage``: steps committed on storage now (on
    any tier); ``visible``: every step folder storage shows (committed or not, never staging
    ``.tmp-`` folders); ``retirable``: steps retention may have deleted after they committed
    (an absent one of those cannot be told from an aborted one: bucket ``other``). Adds to the
    record's counts (several jobs may add to one record) and returns a note for the others.
    """
    att = set(attempted)
    committed = att & set(reported)
    unreported = (att - committed) & set(on_storage)
    rest = att - committed - unreported
    absent = {s for s in rest if s not in set(visible)}
    aborted = {s for s in absent if s not in set(retirable)}
    other = rest - aborted
    rec.observe(how.attempted, saves_attempted=rec.saves_attempted + len(att))
    rec.observe(how.reported, saves_committed=rec.saves_committed + len(committed))
    rec.observe(
        how.storage,
        saves_unreported=rec.saves_unreported + len(unreported),
        saves_aborted=rec.saves_aborted + len(aborted),
        saves_other=rec.saves_other + len(other),
    )
    parts = []
    if unreported:
        parts.append(f"committed-unreported={sorted(unreported)}")
    if other & absent:
        parts.append(f"absent, maybe retired by retention={sorted(other & absent)}")
    if other - absent:
        parts.append(f"visible but not committed={sorted(other - absent)}")
    return " ".join(parts)


@functools.cache
def current_commit() -> str:
    """The git HEAD of the tree ``ckptlib`` is imported from, ``+dirty`` if that tree's
    ``ckptlib/`` or ``tests/`` differs from it, ``+foreign-tests`` if these tests live in
    another tree, ``unknown`` outside a git checkout."""
    import ckptlib

    lib = Path(ckptlib.__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(lib), *args], capture_output=True, text=True, check=True, timeout=60
        ).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel")).resolve()
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--", str(top / "ckptlib"), str(top / "tests"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if Path(__file__).resolve().parents[2] != top:
        return f"{head}+foreign-tests"
    return head + ("+dirty" if dirty else "")


def emit(record: Record) -> None:
    """Append ``record`` to ``$CKPTLIB_CHAOS_RECORD`` (no-op when the variable is unset)."""
    path = os.environ.get(ENV)
    if not path:
        return
    if not record.commit:
        record.commit = current_commit()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    line = (json.dumps(asdict(record), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@contextlib.contextmanager
def recording(scenario: str, case: str, seed: int | None = None) -> Iterator[Record]:
    """``with recording(...) as rec:`` fill ``rec`` in the body; emitted on exit with its
    measured duration, ok=False if it raised."""
    rec = Record(scenario=scenario, case=case, seed=seed)
    t0 = time.monotonic()
    try:
        yield rec
    except BaseException as exc:
        rec.ok = False
        rec.note = (rec.note + f" {type(exc).__name__}: {exc}")[:500].strip()
        raise
    finally:
        rec.duration_s = round(time.monotonic() - t0, 3)
        emit(rec)


_FIELDS = {f.name for f in fields(Record)}


def read(path: str) -> list[Record]:
    """All records of a results file, in order (used by report.py); an unknown field (a
    results file of another version) is a ValueError."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if not isinstance(d, dict):
                raise ValueError(f"line {n}: not a JSON object")
            unknown = set(d) - _FIELDS
            if unknown:
                raise ValueError(f"line {n}: unknown fields {sorted(unknown)}")
            out.append(Record(**d))
    return out
