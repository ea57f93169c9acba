"""The hostile-checkpoint corpus, loaded in subprocesses under a memory and a CPU limit.

Builds every entry of :mod:`chaos.corpus` into a tmp folder (module fixture), then runs
``tests/chaos/load_one.py`` -- one process for all ordinary entries, loading them one after
the other, and one process of its own for each ``isolated`` entry (zstd bombs, huge manifests)
so that its peak RSS is its own -- at most :data:`PARALLEL` processes at a time. Every entry
must print its line within :data:`ENTRY_DEADLINE_S` seconds of the previous one, or the process
is killed and the entry counts as a hang.

What every entry must show is :func:`chaos.corpus.judge` (``tests/test_safe_loading.py`` runs
the same check in-process, without limits); here the process's peak RSS must also stay under
the address-space cap. The counts and the worst memory and time go to the chaos record
(``tests/chaos/record.py``) for the report.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from .corpus import AS_LIMIT_MB, ENTRIES, build_all, judge
from .record import recording

pytestmark = [pytest.mark.chaos]

REPO = Path(__file__).resolve().parents[2]
LOAD_ONE = Path(__file__).resolve().parent / "load_one.py"
CPU_LIMIT_S = 120
ENTRY_DEADLINE_S = float(CPU_LIMIT_S)
"""Wall-clock seconds an entry may take (all five entry points) before it counts as a hang: as
long as its CPU-time cap, since on a busy 2-core machine wall time runs well past CPU time (a
real hang never answers at all; the report records each entry's actual time)."""
READY_DEADLINE_S = 90.0
"""Interpreter start and ``import torch`` on a loaded 2-core CI machine."""
PARALLEL = 3


def run_batch(
    roots: list[Path], as_mb: int = AS_LIMIT_MB
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Run load_one.py on ``roots``; return (ready line, {entry: line}, problem or "")."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(LOAD_ONE),
            "--as-mb",
            str(as_mb),
            "--cpu-s",
            str(CPU_LIMIT_S),
            *map(str, roots),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()
    err: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    readers = [
        threading.Thread(target=pump, daemon=True),
        threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True),
    ]
    for t in readers:
        t.start()
    ready: dict[str, Any] = {}
    results: dict[str, Any] = {}
    problem = ""
    pending = [r.name for r in roots]
    t0 = time.monotonic()
    try:
        deadline = READY_DEADLINE_S
        while pending:
            try:
                line = lines.get(timeout=deadline)
            except queue.Empty:
                problem = f"hang: no result for {pending[0]!r} within {deadline:.0f}s"
                break
            if line is None:
                problem = (
                    f"process ended (exit {proc.wait(timeout=30)}) before {pending[0]!r} finished"
                )
                break
            d = json.loads(line)
            if d.get("ready"):
                ready = d
            else:
                results[d["entry"]] = d
                pending.remove(d["entry"])
            deadline = ENTRY_DEADLINE_S
    finally:
        if proc.poll() is None and problem:
            proc.kill()  # our own child, by its handle
        proc.wait(timeout=60)
        for t in readers:
            t.join(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    ready["wall_s"] = round(time.monotonic() - t0, 1)
    if problem:
        problem += f"; stderr tail: {''.join(err)[-1500:]}"
    return ready, results, problem


HOW_LOADS = ("each input loaded by `tests/chaos/load_one.py` in a subprocess under the memory and CPU caps: "
             "rejected = `ckptlib.load` raised a `CheckpointError` (and the entry's judge passed); loaded = it "
             "returned a state bit for bit equal to the folder decoded from docs/format.md by the test's own "
             "decoder (tests/chaos/declared.py)")
HOW_PEAKS = "the loading subprocess's peak RSS (`getrusage` ru_maxrss) and the slowest entry point's wall time"


def count_loads(results: dict[str, Any], passed: set[str]) -> tuple[int, int]:
    """(rejected, loaded) among the entries in ``passed`` (those with nothing wrong): rejected
    with a typed ckptlib error, or loaded exactly as their manifest declares."""
    rejected = loaded = 0
    for name in passed:
        load = results[name]["ops"]["load"]
        if load["outcome"] == "error" and load["ckptlib"]:
            rejected += 1
        elif load["outcome"] == "ok" and load.get("declared"):
            loaded += 1
    return rejected, loaded


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_all(tmp_path_factory.mktemp("corpus"))


def test_corpus_shape() -> None:
    """At least 60 named entries covering every class of hostile input the issue lists."""
    assert len(ENTRIES) >= 60
    assert len({e.name for e in ENTRIES}) == len(ENTRIES)
    cats = {e.category for e in ENTRIES}
    for needed in (
        "traversal",
        "symlink",
        "fifo",
        "giant-shape",
        "overlap",
        "zstd-bomb",
        "nesting",
        "huge-manifest",
        "dtype",
        "duplicate-keys",
        "checksum",
    ):
        assert needed in cats, needed
    assert all(e.description and e.expect for e in ENTRIES)


def test_corpus_builds_real_files(corpus: dict[str, Path]) -> None:
    """The folders hold what the descriptions promise: symlinks, FIFOs, sparse giants."""
    import stat

    step = "step-000000000007"
    assert any(p.is_symlink() for p in (corpus["symlink-payload"] / step).rglob("*"))
    assert (corpus["symlink-manifest"] / step / "manifest.json").is_symlink()
    assert stat.S_ISFIFO((corpus["fifo-manifest"] / step / "manifest.json").lstat().st_mode)
    assert any(stat.S_ISFIFO(p.lstat().st_mode) for p in (corpus["fifo-payload"] / step).rglob("*"))
    over = (corpus["manifest-over-limit"] / step / "manifest.json").stat()
    assert over.st_size > 1 << 30 and over.st_blocks * 512 < 1 << 20  # sparse: nothing to read
    assert (corpus["path-dotdot"] / "outside.bin").is_file()  # a valid copy where ".." points


@pytest.mark.timeout(600)
def test_malicious_corpus_is_rejected(corpus: dict[str, Path]) -> None:
    ordinary = [corpus[e.name] for e in ENTRIES if not e.isolated]
    alone_entries = [e for e in ENTRIES if e.isolated]
    with recording("malicious", "corpus") as rec:
        with ThreadPoolExecutor(PARALLEL) as pool:
            jobs = [pool.submit(run_batch, ordinary)]
            jobs += [
                pool.submit(run_batch, [corpus[e.name]], e.as_mb or AS_LIMIT_MB)
                for e in alone_entries
            ]
            runs = [j.result() for j in jobs]
        results: dict[str, Any] = {}
        problems: dict[str, list[str]] = {}
        for _, res, problem in runs:
            results.update(res)
            if problem:
                problems.setdefault("<process>", []).append(problem)
        for e in ENTRIES:
            if e.name not in results:
                problems.setdefault(e.name, []).append("no result (hang or crash)")
                continue
            bad = judge(e, results[e.name])
            if bad:
                problems[e.name] = bad
        rejected, loaded = count_loads(results, {e.name for e in ENTRIES if e.name in results} - set(problems))
        rec.observe(HOW_LOADS, malicious_total=len(ENTRIES), malicious_rejected=rejected, malicious_loaded=loaded)
        rec.observe(
            HOW_PEAKS,
            worst_rss_mb=max((r["rss_peak_mb"] for r in results.values()), default=None),
            worst_time_s=max((o["s"] for r in results.values() for o in r["ops"].values()), default=None),
        )
        alone = {
            e.name: results[e.name]["rss_peak_mb"]
            for e in ENTRIES
            if e.isolated and e.name in results
        }
        walls = [r[0].get("wall_s") for r in runs]
        caps = {e.name: e.as_mb for e in alone_entries if e.as_mb}
        rec.note = (
            f"AS cap {AS_LIMIT_MB} MB (own caps: {caps}); peak RSS of isolated entries (MB): "
            f"{alone}; process wall s: {walls}"
        )
        assert not problems, json.dumps(problems, indent=1)
