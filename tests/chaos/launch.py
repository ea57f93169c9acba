"""Start multi-rank gloo jobs of tests/workers/chaos_worker.py and judge what happened.

Called from the chaos tests' pytest thread only. ``start``/``finish`` follow
tests/distributed/launch.py's with a per-rank environment (``rank_env``: e.g.
``CKPTLIB_TEST_KILL_AT`` for the victim only). Each rank runs in its own fresh process, taken
from a small pool of pre-started workers (``chaos_worker.py --warm``, which import torch while
the previous job runs and then serve exactly one rank of one job); the pool is refilled at
every start and drained at exit. :class:`Campaign` is the relaunch harness used
by every kill scenario: it runs the ``ctrain`` job (chaos_worker.py) in a fresh set of processes
on a new port, lets the test inject one fault per job (a hook in the victim's environment, or
a SIGKILL/SIGSTOP sent from here), waits for every process with a deadline, audits the
checkpoint folder and the workers' save logs, and relaunches. Each fault becomes one
:class:`~tests.chaos.record.Record`, completed when the next job has restored (its resume
outcome) and emitted then.

Checks after every job (each failure is counted in the record, then raised):

* no process outlives its deadline (``hang``);
* every step ``CheckpointManager.steps()`` calls committed loads with ``per_rank="all"`` and
  passes ``check_step(deep=True)`` (``steps_whole``/``steps_not_whole``), and no step folder is
  visible without being committed (``half_visible``);
* every save a rank started (its ``attempt`` line) is put in one bucket by what the folder
  shows (:func:`~tests.chaos.record.account_saves`): seen committed, committed but unreported,
  aborted (no step folder at all), or other (absent but retirable by ``keep_last``);
* no save a rank saw committed is missing, unless retention (``keep_last``) retired it
  because newer committed steps exist (``saves_lost``);
* the next job resumes from the newest committed step (``wrong_step``) and the SHA-256 of
  what it restored equals the hash logged when that step was saved (``partial``); with
  nothing committed, it must restore nothing (``nothing``, its own outcome);
* the final job ends with the reference digest, and leaves no ``*.tmp-*``/``*.del-*`` debris
  once it has saved (``debris_left``).

Every count says which check produced it (the ``HOW_*`` texts, ``Record.how``).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import launcher
from launcher import Outcome, kill_all

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.engine.scan import check_step
from ckptlib.format import layout

from .record import Record, SaveChecks, account_saves, emit

WORKER = Path(__file__).resolve().parents[1] / "workers" / "chaos_worker.py"
SCENARIO = "ctrain"
STEPS = 10
SAVE_EVERY = 2
KEEP_LAST = 2
COORD_TIMEOUT = 5.0
ENV = {"CKPTLIB_COORD_TIMEOUT": str(COORD_TIMEOUT)}
JOB_TIMEOUT = 150.0  # a whole job, torch import on a loaded 2-core machine included
# What a survivor may die of: the commit protocol's verdict or the broken gloo group.
SURVIVOR_ERRORS = re.compile(r"CommitError|CheckpointError|DistBackendError|RuntimeError|DistError")


POOL_SIZE = 3
_pool: list[subprocess.Popen] = []


def _spawn_warm() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), "--warm"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _refill() -> None:
    while len(_pool) < POOL_SIZE:
        _pool.append(_spawn_warm())


@atexit.register
def _drain_pool() -> None:
    """End of the pytest process: the idle pre-started workers read EOF and exit."""
    while _pool:
        p = _pool.pop()
        try:
            p.stdin.close()  # type: ignore[union-attr]
            p.stdin = None  # communicate() must not flush it
            p.communicate(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.communicate(timeout=30)


def _take(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A pre-started worker (chaos_worker.py --warm) told to run ``argv`` under ``env``."""
    req = (json.dumps({"argv": argv, "env": env}) + "\n").encode()
    while _pool:
        p = _pool.pop(0)
        if p.poll() is not None:
            p.communicate(timeout=30)
            continue
        try:
            p.stdin.write(req)  # type: ignore[union-attr]
            p.stdin.close()  # type: ignore[union-attr]
            p.stdin = None  # communicate() must not flush it
            return p
        except OSError:
            p.kill()
            p.communicate(timeout=30)
    p = _spawn_warm()
    p.stdin.write(req)  # type: ignore[union-attr]
    p.stdin.close()  # type: ignore[union-attr]
    p.stdin = None
    return p


def start(
    scenario: str,
    world: int,
    root: Path,
    args: dict | None = None,
    env: dict | None = None,
    rank_env: dict[int, dict] | None = None,
) -> list[subprocess.Popen]:
    """Start one rank per process (tests/launcher.py) from pre-started workers (which then
    run only this job), the pool refilled at once so the next job's imports overlap this job."""
    for rank in range(world):  # results of an earlier job in the same root
        (root / f"result-{scenario}-{rank}.json").unlink(missing_ok=True)

    def argv(rank: int, port: str) -> list[str]:
        return [scenario, str(rank), str(world), port, str(root), json.dumps(args or {})]

    procs = launcher.start(argv, world, env=env, rank_env=rank_env, spawn=_take)
    _refill()
    return procs


def finish(
    scenario: str, procs: list[subprocess.Popen], root: Path, timeout: float
) -> list[Outcome]:
    """Wait for every rank; kill them all and fail (a hang) if any still runs after ``timeout``."""
    return launcher.finish(scenario, procs, lambda r: root / f"result-{scenario}-{r}.json", timeout)


# ---------------------------------------------------------------- logs and folder state
def read_jsonl(path: Path) -> list[dict]:
    """Lines of a JSONL file; a torn last line (writer killed) is skipped."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def save_log(root: Path) -> list[dict]:
    events = []
    for p in sorted(root.glob("savelog-*.jsonl")):
        events.extend(read_jsonl(p))
    return events


def committed_steps(ckpt: Path) -> tuple[list[int], dict[int, str]]:
    """(committed steps per the public API that load, {step: error} for those that do not)."""
    good, bad, _ = audit(ckpt)
    return good, bad


@dataclass
class Audit:
    """What the folder shows after a job (:func:`audit`)."""

    visible: list[int] = field(default_factory=list)  # every step folder (not .tmp-/.del-)
    half_visible: list[int] = field(default_factory=list)  # visible, not committed
    whole: list[int] = field(default_factory=list)  # committed, deep check passed
    not_whole: dict[int, str] = field(default_factory=dict)  # committed, deep check failed


def audit(ckpt: Path) -> tuple[list[int], dict[int, str], Audit]:
    """The committed steps that load (``per_rank="all"``), those that do not, and a scan of the
    folder: visible step folders, the visible ones not committed, and a deep check
    (``check_step(deep=True)``: every chunk's checksum) of every committed one."""
    a = Audit()
    if not ckpt.exists():
        return [], {}, a
    with ckptlib.CheckpointManager(str(ckpt)) as mgr:
        infos = mgr.steps()
    good, bad = [], {}
    storage = open_storage(str(ckpt))
    try:
        for info in infos:
            if info.path == layout.step_dir(info.step):
                a.visible.append(info.step)
                if info.status != "committed":
                    a.half_visible.append(info.step)
            if info.status != "committed":
                continue
            deep = check_step(storage, info.path, info.step, deep=True)
            if deep.status == "committed":
                a.whole.append(info.step)
            else:
                a.not_whole[info.step] = deep.reason
            try:
                ckptlib.load(str(ckpt / info.path), per_rank="all")
                good.append(info.step)
            except ckptlib.CheckpointError as e:
                bad[info.step] = f"{type(e).__name__}: {e}"
    finally:
        storage.close()
    return sorted(good), bad, a


def debris(ckpt: Path) -> list[str]:
    if not ckpt.exists():
        return []
    return sorted(n for n in os.listdir(ckpt) if ".tmp-" in n or ".del-" in n)


def pcts(values: list[float]) -> tuple[float | None, float | None]:
    """(p50, p99) by nearest rank."""
    if not values:
        return None, None
    v = sorted(values)

    def at(q: float) -> float:
        return v[min(len(v) - 1, max(0, int(q * len(v) + 0.999999) - 1))]

    return at(0.50), at(0.99)


# ---------------------------------------------------------------- what each count comes from
SAVE_CHECKS = SaveChecks(
    attempted="the `attempt` line each rank logs just before `mgr.save()` (a step any rank started)",
    reported="the `committed` line a rank logs once the save's handle returned",
    storage="a listing of the folder after the job (`steps()`): committed there though no rank saw it "
    "= unreported; no step folder at all = aborted, unless `keep_last` newer committed steps could "
    "have retired it (then: other)",
)
HOW_LOST = "every step a rank saw commit, looked up after each job: missing, or failing `load(per_rank=\"all\")`, while not retired by `keep_last`"
HOW_WHOLE = "`check_step(deep=True)` (every chunk's checksum) of every committed step after each job"
HOW_HALF = "a scan of the folder after each job: step folders (not `.tmp-`/`.del-`) that are not committed"
HOW_DEBRIS = "`.tmp-`/`.del-` entries in the folder after the final clean job saved"
HOW_RESUME = ("the next job's `restored` lines: every rank resumed the newest committed step and the SHA-256 "
              "of what it restored equals the one logged when that step was saved (`nothing`: no step "
              "committed, none restored)")
HOW_KILLS = "the victim's exit status (-SIGKILL) or, for a hook, its kill-log line written just before the signal"
HOW_DEATH = "each survivor's `error_time` minus the death time the hook or the harness wrote just before the signal"


# ---------------------------------------------------------------- the relaunch harness
_REFERENCE: dict[tuple, tuple[str, dict, float]] = {}


def reference(tmp: Path, world: int = 2) -> tuple[str, dict[tuple[str, int], int], float]:
    """(digest, hook reaches per (phase, rank), training seconds) of an uninterrupted job with
    checkpointing. Run once per (pytest process, world) with ``CKPTLIB_TEST_HOOK_TRACE``."""
    key = (world,)
    if key not in _REFERENCE:
        root = tmp / f"reference-w{world}"
        root.mkdir(parents=True, exist_ok=True)
        trace = root / "trace.txt"
        args = {"steps": STEPS, "save_every": SAVE_EVERY, "keep_last": KEEP_LAST}
        env = {**ENV, "CKPTLIB_TEST_HOOK_TRACE": str(trace)}
        out = finish(SCENARIO, start(SCENARIO, world, root, args, env=env), root, JOB_TIMEOUT)
        for o in out:
            assert o.returncode == 0 and o.result and "crash" not in o.result, o.log
        digests = {o.result["digest"] for o in out if o.result}
        assert len(digests) == 1, digests
        counts: dict[tuple[str, int], int] = {}
        for line in trace.read_text().splitlines():
            phase, rank = line.split()
            counts[(phase, int(rank))] = counts.get((phase, int(rank)), 0) + 1
        train_s = max(o.result["train_s"] for o in out if o.result)
        _REFERENCE[key] = (digests.pop(), counts, train_s)
    return _REFERENCE[key]


@dataclass
class Fault:
    """One injected fault, as the harness saw it."""

    victim: int
    signal: int = signal.SIGKILL
    death_time: float | None = None  # time.time() just before the signal (None: missed)
    where: str = ""


@dataclass
class Campaign:
    """Relaunch harness for one seeded case: jobs in ``root``, each a fresh process set.

    Usage (pytest thread), per job: ``procs = c.launch(...)``, inject the fault (or pass a hook
    in ``rank_env``), ``c.collect(procs, ...)`` (waits, judges, audits); then ``c.final()``;
    ``c.close(exc)`` on the way out kills leftovers and emits records still pending.
    """

    scenario: str
    case: str
    seed: int
    root: Path
    world: int
    digest: str
    args: dict = field(default_factory=dict)
    job_no: int = 0
    newest: int = 0  # newest committed-and-loadable step after the last job
    pending: list[Record] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    kills: int = 0
    closing: bool = False  # the final clean job: its record also counts debris

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.ckpt = self.root / "ckpt"
        self.kill_log = self.root / "kills.jsonl"
        self.base = {
            "steps": STEPS,
            "save_every": SAVE_EVERY,
            "keep_last": KEEP_LAST,
            **self.args,
        }

    # -- running
    def launch(self, rank_env: dict[int, dict] | None = None, **extra) -> list[subprocess.Popen]:
        self.job_no += 1
        self._kill_lines = len(read_jsonl(self.kill_log))
        self._t_launch = time.monotonic()
        env = {**ENV, "CKPTLIB_TEST_KILL_LOG": str(self.kill_log)}
        args = {**self.base, **extra, "job": self.job_no}
        self._full_run = args["steps"] == STEPS  # only a full run must end at the reference
        self.procs = start(SCENARIO, self.world, self.root, args, env=env, rank_env=rank_env)
        return self.procs

    def wait_event(
        self, procs: list[subprocess.Popen], event: str, timeout: float = JOB_TIMEOUT
    ) -> bool:
        """Wait until every rank of the current job logged ``event`` (False: a rank exited or
        the deadline passed first)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            ranks = {
                e["rank"]
                for e in save_log(self.root)
                if e["job"] == self.job_no and e["event"] == event
            }
            if len(ranks) == self.world:
                return True
            if any(p.poll() is not None for p in procs):
                return False
            time.sleep(0.02)
        return False

    def signal_rank(self, procs: list[subprocess.Popen], fault: Fault) -> bool:
        """Send ``fault.signal`` to the victim now; False if it had already exited (a miss)."""
        p = procs[fault.victim]
        if p.poll() is not None:
            return False
        fault.death_time = time.time()
        try:
            p.send_signal(fault.signal)
        except ProcessLookupError:
            fault.death_time = None
            return False
        return True

    def hook_fault(self, victim: int, sig: int = signal.SIGKILL) -> Fault:
        """The fault a ``CKPTLIB_TEST_KILL_AT`` hook injected in the current job (from the kill log)."""
        f = Fault(victim, sig)
        for e in read_jsonl(self.kill_log)[self._kill_lines :]:  # lines of this job only
            if e["rank"] == victim:
                f.death_time = e["time"]
                f.where = f"{e['phase']}#{e['nth']}@rank{victim}"
        return f

    def collect(
        self,
        procs: list[subprocess.Popen],
        fault: Fault | None = None,
        *,
        hook_victim: int | None = None,
        hook_signal: int = signal.SIGKILL,
        timeout: float = JOB_TIMEOUT,
    ) -> list[Outcome]:
        """Wait for the job; judge its processes, restore, saves; audit the folder.

        ``fault``: what the test injected from here; ``hook_victim``: the rank that carried a
        ``CKPTLIB_TEST_KILL_AT`` hook (its kill-log line, if it fired, becomes the fault).
        """
        rec = Record(self.scenario, f"{self.case}-job{self.job_no}", self.seed)
        self.records.append(rec)
        expected = self.newest
        try:
            outcomes = finish(SCENARIO, procs, self.root, timeout)
        except AssertionError:
            if hook_victim is not None:
                fault = self.hook_fault(hook_victim, hook_signal)
            self.record_hang(rec, fault.where if fault else "")
            raise
        if hook_victim is not None:
            fault = self.hook_fault(hook_victim, hook_signal)
        rec.note = fault.where if fault else ""
        faulted = fault is not None and fault.death_time is not None
        self._judge_resume(expected, faulted)
        where = f"{self.case} job {self.job_no} {fault.where if fault else ''}"
        problems: list[str] = []
        for o in outcomes:
            if faulted and o.rank == fault.victim:
                if o.returncode != -fault.signal and fault.signal == signal.SIGKILL:
                    problems.append(f"victim exited {o.returncode}")
                continue
            if o.result is None:
                problems.append(
                    f"rank {o.rank} wrote no result (exit {o.returncode})\n{o.log[-2000:]}"
                )
            elif "crash" in o.result:
                # the exception's own line: the traceback's last, or the one above ckptlib's
                # notes (Python 3.11+ prints exception notes under it: "ckptlib: ... relaunch")
                last = [ln for ln in o.result["crash"].strip().splitlines() if not ln.startswith("ckptlib: ")][-1]
                if not faulted:
                    problems.append(f"rank {o.rank} crashed without a fault: {o.result['crash']}")
                elif not SURVIVOR_ERRORS.search(last):
                    problems.append(f"survivor rank {o.rank} failed with {last}")
                if faulted:
                    rec.death_to_error_s.append(round(o.result["error_time"] - fault.death_time, 4))
                    rec.death_errors.append(f"rank {o.rank}: {last[:200]}")  # read with the time it took
                    rec.checked(HOW_DEATH, "death_to_error_s")
            elif self._full_run and o.result["digest"] != self.digest:
                problems.append(f"rank {o.rank} finished with a digest other than the reference")
        if faulted:
            self.kills += 1
        rec.observe(HOW_KILLS, kills=int(faulted))
        try:
            self._account(rec)
        except AssertionError:
            emit(rec)  # counted, with ok=False and the reason in its note
            raise
        if problems:
            rec.ok = False
            rec.note = (rec.note + " " + "; ".join(problems))[:500]
        if faulted:
            self.pending.append(rec)  # emitted once the next job has restored
        else:
            emit(rec)
        assert not problems, f"{where}: " + "\n".join(problems)
        assert rec.saves_lost == 0, f"{where}: lost saves: {rec.note}"
        return outcomes

    def record_hang(self, rec: Record | None = None, where: str = "") -> None:
        """A process of the current job missed its deadline: count it as a ``hang`` (for the
        fault that preceded this job and for this job's own fault) and emit."""
        if rec is None:
            rec = Record(self.scenario, f"{self.case}-job{self.job_no}", self.seed)
            self.records.append(rec)
        self._resolve("hang")
        rec.observe(HOW_RESUME, resume="hang")
        rec.ok = False
        rec.note = f"{where} hang"
        try:
            self._account(rec)
        except AssertionError:
            pass  # the hang is the failure being reported
        emit(rec)

    def _account(self, rec: Record) -> None:
        """Saves of the current job from the logs, sorted by what the folder shows now (a
        listing, a deep check of every committed step, a load of each); lost/unloadable ones."""
        rec.duration_s = round(time.monotonic() - self._t_launch, 3)
        events = [e for e in save_log(self.root) if e["job"] == self.job_no]
        attempted = {e["step"] for e in events if e["event"] == "attempt"}
        seen = {e["step"] for e in events if e["event"] == "committed"}
        good, bad, found = audit(self.ckpt)
        committed = sorted(set(good) | set(bad))
        retirable = {s for s in attempted if len([c for c in committed if c > s]) >= KEEP_LAST}
        extra = account_saves(rec, SAVE_CHECKS, attempted, seen, committed, found.visible, retirable)
        if extra:  # e.g. committed on disk though no rank saw it commit (the 2PC window)
            rec.note += f" {extra}"
        lost = []
        for s in sorted(seen):
            if s in good:
                continue
            if len([g for g in good if g > s]) >= KEEP_LAST:
                continue  # retired by retention after newer steps committed
            lost.append(s)
        rec.observe(HOW_LOST, saves_lost=len(lost))
        rec.observe(HOW_WHOLE, steps_whole=len(found.whole), steps_not_whole=len(found.not_whole))
        rec.observe(HOW_HALF, half_visible=len(found.half_visible))
        if self.closing:
            rec.observe(HOW_DEBRIS, debris_left=len(debris(self.ckpt)))
        if lost or bad or found.not_whole or found.half_visible:
            rec.ok = False
            rec.note += (f" lost={lost} unloadable={bad} not whole={found.not_whole} "
                         f"half-visible={found.half_visible} on disk={good}")
        assert not bad, f"{self.case}: committed steps that do not load: {bad}"
        assert not found.not_whole, f"{self.case}: committed steps that fail the deep check: {found.not_whole}"
        assert not found.half_visible, f"{self.case}: visible steps that are not committed: {found.half_visible}"
        self.newest = good[-1] if good else 0

    def _judge_resume(self, expected: int, faulted: bool) -> None:
        """Resume outcome of the current job, which settles every pending record."""
        events = [e for e in save_log(self.root) if e["job"] == self.job_no]
        restored = [e for e in events if e["event"] == "restored"]
        if len({e["rank"] for e in restored}) < self.world:
            if not faulted:
                self._resolve("crash", "a rank exited before restoring")
            return  # killed before every rank restored: the next job settles it
        if expected == 0 and {e["step"] for e in restored} == {0}:
            self._resolve("nothing", "nothing committed, nothing restored")
            return
        starts = {e["step"] for e in restored}
        shas = {e["sha256"] for e in restored}
        logged = {
            e["sha256"]
            for e in save_log(self.root)
            if e["event"] == "attempt" and e["step"] in starts
        }
        if starts != {expected}:
            outcome = (
                "wrong_step" if starts <= set(committed_steps(self.ckpt)[0]) | {0} else "partial"
            )
        elif expected and (len(shas) != 1 or not shas <= logged or len(logged) != 1):
            outcome = "partial"
        else:
            outcome = "correct"
        self._resolve(outcome, f"resumed {sorted(starts)} expected {expected}")
        assert outcome == "correct", (
            f"{self.case} job {self.job_no}: resume {outcome}: starts {starts} expected {expected}"
        )

    def _resolve(self, outcome: str, detail: str = "") -> None:
        for rec in self.pending:
            rec.observe(HOW_RESUME, resume=outcome)
            if outcome not in ("correct", "nothing"):
                rec.ok = False
                rec.note = (rec.note + f" resume {outcome} {detail}")[:500]
            emit(rec)
        self.pending = []

    def final(self) -> list[Outcome]:
        """A clean job to the end: reference digest, newest step committed, no debris."""
        self.closing = self.newest < STEPS  # it saves: debris must be gone afterwards
        out = self.collect(self.launch(), None)
        for o in out:
            assert o.result and "crash" not in o.result and o.result["digest"] == self.digest, o.log
        assert self.newest == STEPS, (
            f"{self.case}: newest committed after the final job: {self.newest}"
        )
        if self.closing:
            left = debris(self.ckpt)
            assert left == [], f"{self.case}: debris after a successful save: {left}"
        return out

    def close(self, exc: BaseException | None) -> None:
        """Test teardown: kill what still runs (a failed check may leave a job behind), then
        emit the records still waiting for a resume."""
        left = [p for p in getattr(self, "procs", []) if p.poll() is None]
        if left:
            print(kill_all(self.procs))
        for rec in self.pending:
            rec.ok = False
            rec.note = (rec.note + f" {type(exc).__name__ if exc else 'unresolved'}")[:500]
            emit(rec)
        self.pending = []
