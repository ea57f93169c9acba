"""Results of chaos scenarios, one JSON line per case, for the generated reliability report.

Every chaos test builds a :class:`Record` for the case it ran and calls :func:`emit` *before*
its assertions (a failing case is counted too, with ``ok=False`` when it raised). Records go
to the file named by ``CKPTLIB_CHAOS_RECORD``; unset (plain ``pytest``), nothing is written.
``make chaos`` sets it and then renders ``docs/reliability.md`` with ``tests/chaos/report.py``.

Writers are test processes only (pytest's main thread); each line is appended with one
``write`` call on an ``O_APPEND`` file, so concurrent pytest processes do not interleave lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

ENV = "CKPTLIB_CHAOS_RECORD"

# Resume outcomes; every one but "correct" must stay at 0 in the report.
RESUME_OUTCOMES = ("correct", "wrong_step", "partial", "hang", "crash")


@dataclass
class Record:
    scenario: str  # e.g. "phase_kill", "random_kill", "sigstop", "storage_enospc", "malicious"
    case: str  # the test id / case within the scenario
    seed: int | None = None
    saves_attempted: int = 0
    saves_committed: int = 0
    saves_aborted: int = 0  # failed or killed saves that left nothing reported as committed
    saves_lost: int = 0  # reported committed at some point, later missing or unloadable: must be 0
    resume: str | None = None  # one of RESUME_OUTCOMES, None when the case does not resume
    corruptions_injected: int = 0
    corruptions_detected: int = 0
    corruptions_undetected: int = 0  # must be 0
    malicious_total: int = 0
    malicious_rejected: int = 0
    worst_rss_mb: float | None = None  # malicious inputs: peak RSS of the loading process
    worst_time_s: float | None = None  # malicious inputs: slowest rejection
    s3_retries: int = 0
    s3_giveups: int = 0
    death_to_error_s: list[float] = field(default_factory=list)  # a rank's death -> peers' error
    kills: int = 0  # processes SIGKILLed by the case's fault (tier kills)
    debris_left: int = 0  # .tmp-/.del- folders left in local folders after the next save: must be 0
    half_visible: int = 0  # persistent-tier steps visible but not whole (a half-published drain): must be 0
    duration_s: float = 0.0
    ok: bool = True
    note: str = ""


def emit(record: Record) -> None:
    """Append ``record`` to ``$CKPTLIB_CHAOS_RECORD`` (no-op when the variable is unset)."""
    path = os.environ.get(ENV)
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    line = (json.dumps(asdict(record), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@contextlib.contextmanager
def recording(scenario: str, case: str, seed: int | None = None) -> Iterator[Record]:
    """``with recording(...) as rec:`` fill ``rec`` in the body; emitted on exit, ok=False if it raised."""
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


def read(path: str) -> list[Record]:
    """All records of a results file, in order (used by report.py)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(Record(**json.loads(line)))
    return out
