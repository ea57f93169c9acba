"""Real-process crash test: SIGKILL a process that saves in a loop, at many random moments.

After every kill the root is checked with the public API only:

* the planner's newest step (``latest_step``) is what ``restore`` loads, and the restored
  state equals, bit for bit, the state the worker built for that step;
* every step that ``steps()`` reports as ``committed`` loads and matches its expected bytes
  (no partially written step is ever reported as committed);
* a step the worker saw committed (a synchronous ``save`` returned, or ``handle.wait()``
  returned) is never lost, and neither is a step that was restored before;
* debris of crashed saves does not accumulate: a successful save removes it.

The next worker continues from the restored step + 1, so retention and the cleanup of crashed
leftovers run against real debris.

``CKPTLIB_TEST_SEED`` picks the seed (printed in every failure); ``CKPTLIB_CHAOS_FULL=1``
(``make chaos``) raises the number of kills per variant from 20 to 200.
"""

from __future__ import annotations

import importlib.util
import os
import random
import selectors
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
from chaos.record import Record, SaveChecks, account_saves, emit
from helpers import assert_same

import ckptlib
from ckptlib.format.layout import step_dir

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "workers" / "save_loop.py"

SEED = int(os.environ.get("CKPTLIB_TEST_SEED", "1234"))
FULL = os.environ.get("CKPTLIB_CHAOS_FULL", "") not in ("", "0")
N_KILLS = 200 if FULL else 20
KEEP_LAST = 2
MAX_DELAY_S = 1.5
# A step the worker never reaches: the restore template holds different bytes than any save.
TEMPLATE_STEP = 10**9

START_TIMEOUT_S = 120.0  # import torch + ckptlib on a loaded 2-core machine
EXIT_TIMEOUT_S = 30.0

# What each count of a ``process_kill`` record comes from (docs/reliability.md prints these).
SAVE_CHECKS = SaveChecks(
    attempted="the `saving N` line the worker prints just before `mgr.save(N)` (a kill during start-up attempts none)",
    reported="the worker's `committed N` lines: a synchronous save returned, or the handle of an async one "
    "returned from `wait()` (every 3rd step, and any earlier one found done after a later `save()`)",
    storage="`steps()` of the root after the kill: committed there though not reported = unreported; no step "
    "folder at all = aborted, unless `keep_last` newer committed steps could have retired it (then: other)",
)
HOW_KILLS = "the worker's exit status, -SIGKILL, from the fork server's waitpid"
HOW_WHOLE = ("every step `steps()` calls committed, loaded with `ckptlib.load` (checksums verified) and "
             "compared bit for bit with the state recomputed for that step")
HOW_HALF = "`steps()` of the root after each kill: `step-N` folders that are not committed"
HOW_RESUME = ("`restore()` into a template holding other bytes: the newest committed step, loaded in place, "
              "bit for bit the state recomputed for that step (`nothing`: no step committed, restore() None)")
HOW_LOST = "the newest committed step after each kill is never older than a step the worker saw commit or one restored before"
HOW_DEBRIS = ("after a kill of a worker that saw a save commit: leftovers (names other than committed steps) "
              "of the previous kill still in the root")


def _load_worker_module():
    spec = importlib.util.spec_from_file_location("ckptlib_test_save_loop", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_state = _load_worker_module().build_state


# --------------------------------------------------------------------------------------------
# The worker processes


class WorkerDiedError(AssertionError):
    pass


class ForkServer:
    """``save_loop.py --fork-server``: imports torch once, then forks one saving worker per kill.

    Each worker is a real process in its own session; the test SIGKILLs that session. All
    reads have deadlines (non-blocking pipe + selector).
    """

    def __init__(self, root: Path, *, async_save: bool, log_path: Path) -> None:
        cmd = [sys.executable, str(WORKER), str(root), "--seed", str(SEED), "--fork-server"]
        cmd += ["--keep-last", str(KEEP_LAST)]
        if async_save:
            cmd.append("--async-save")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
        self.log_path = log_path
        with open(log_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._buf = b""
        self._eof = False
        self.lines: list[str] = []
        self.unreaped: set[int] = set()  # forked workers not yet reaped

    def _read(self, deadline: float) -> None:
        """Read what is available (waiting at most until ``deadline``) into ``lines``."""
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            return
        with selectors.DefaultSelector() as sel:
            sel.register(self._fd, selectors.EVENT_READ)
            if not sel.select(timeout):
                return
        try:
            chunk = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self._eof = True
            return
        *complete, self._buf = (self._buf + chunk).split(b"\n")
        self.lines.extend(line.decode("utf-8", "replace") for line in complete)

    def wait_line(self, prefix: str, timeout: float, since: int = 0) -> tuple[int, str]:
        """The first line at index >= ``since`` that starts with ``prefix``, and its index."""
        deadline = time.monotonic() + timeout
        i = since
        while True:
            while i < len(self.lines):
                if self.lines[i].startswith(prefix):
                    return i, self.lines[i]
                i += 1
            if self._eof:
                self.proc.wait(timeout=EXIT_TIMEOUT_S)
                raise WorkerDiedError(
                    f"fork server exited with {self.proc.returncode} before {prefix!r}\n"
                    f"{self.stderr_tail()}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no {prefix!r} line within {timeout} s")
            self._read(deadline)

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def stderr_tail(self, path: Path | None = None, limit: int = 4000) -> str:
        path = path or self.log_path
        try:
            text = path.read_text("utf-8", "replace")
        except OSError as exc:
            return f"(no stderr: {exc})"
        return f"stderr of {path.name}:\n" + (text[-limit:] or "(empty)")

    def start(self, start_step: int, err_path: Path) -> Worker:
        since = len(self.lines)
        self._send(f"fork {start_step} {err_path}")
        _, line = self.wait_line("forked ", START_TIMEOUT_S, since)
        worker = Worker(self, int(line.split()[1]), since, err_path)
        self.unreaped.add(worker.pid)
        self.wait_line(f"{worker.pid} started ", START_TIMEOUT_S, since)
        return worker

    def close(self) -> None:
        for pid in sorted(self.unreaped):  # after a failure: leave no saving process behind
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                since = len(self.lines)
                self._send(f"reap {pid}")
                self.wait_line(f"reaped {pid} ", EXIT_TIMEOUT_S, since)
            except (OSError, AssertionError, TimeoutError):
                pass  # the server is gone too; its children were killed all the same
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the server exits at EOF
            self.proc.wait(timeout=EXIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=EXIT_TIMEOUT_S)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@dataclass
class Worker:
    """One forked saving process, from ``started`` until it is killed and reaped."""

    server: ForkServer
    pid: int
    since: int  # index of the first server line that can belong to this worker
    err_path: Path
    exit_code: int | None = None
    lines: list[str] = field(default_factory=list)
    t0: float = 0.0  # time.monotonic() when the test asked for it (the record's duration)

    def kill_and_reap(self) -> int:
        """SIGKILL the worker's session, reap it; return its exit code (-9 when we killed it)."""
        if self.exit_code is not None:
            return self.exit_code
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it exited by itself; the server has not reaped it yet
        self.server._send(f"reap {self.pid}")
        end, line = self.server.wait_line(f"reaped {self.pid} ", EXIT_TIMEOUT_S, self.since)
        self.exit_code = int(line.split()[2])
        self.server.unreaped.discard(self.pid)
        # Every line the worker wrote was written before it died, so before the server's reply.
        mine = f"{self.pid} "
        self.lines = [
            x[len(mine) :] for x in self.server.lines[self.since : end] if x.startswith(mine)
        ]
        return self.exit_code

    def numbers(self, event: str) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith(event + " ")]


# --------------------------------------------------------------------------------------------
# Exact comparison


def _tensors(tree: Any, where: str = "state") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {where: tree}
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(_tensors(value, f"{where}[{key!r}]"))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            out.update(_tensors(value, f"{where}[{i}]"))
    return out


# --------------------------------------------------------------------------------------------
# Reading the root back


@dataclass
class Observation:
    """What the public API says about the root right after a kill."""

    listing: list[str]
    infos: list[Any]
    latest: int | None
    restored: int | None
    resume: str = ""  # the resume outcome (chaos.record.RESUME_OUTCOMES)
    committed: list[int] = field(default_factory=list)
    visible: list[int] = field(default_factory=list)  # step folders (committed or not)
    half_visible: list[int] = field(default_factory=list)  # visible, not committed
    not_whole: dict[int, str] = field(default_factory=dict)  # committed, not loading bit-exact
    debris: set[str] = field(default_factory=set)

    def summary(self) -> str:
        return ", ".join(f"{i.step}:{i.status}" for i in self.infos) or "-"

    def problems(self) -> list[str]:
        out = [f"step {s} is visible but {next(i.status for i in self.infos if i.step == s)}"
               for s in self.half_visible]
        out += [f"committed step {s} is not whole: {why}" for s, why in self.not_whole.items()]
        if self.resume not in ("correct", "nothing"):
            out.append(f"resume {self.resume}: restore() loaded {self.restored}, latest_step() is {self.latest}")
        return out


def _differs(actual: Any, expected: Any, where: str) -> str:
    """Empty if ``actual`` is bit for bit ``expected``, else what differs."""
    try:
        assert_same(actual, expected, where)
    except AssertionError as e:
        return str(e)[:300]
    return ""


def observe(root: Path) -> Observation:
    # The listing is taken before any manager touches the root.
    listing = sorted(os.listdir(root)) if root.exists() else []
    template = build_state(SEED, TEMPLATE_STEP)  # other bytes than any saved step
    before = _tensors(template)
    with ckptlib.CheckpointManager(str(root)) as mgr:
        infos = mgr.steps()
        latest = mgr.latest_step()
        restored = mgr.restore(template)
    for info in infos:
        assert info.status in ("committed", "incomplete", "corrupt"), f"{info}"
        assert (info.status == "committed") == (not info.reason), f"reason: {info}"
    committed = sorted(info.step for info in infos if info.status == "committed")
    assert len(set(committed)) == len(committed), f"a step is committed twice: {infos}"
    newest = committed[-1] if committed else None
    assert latest == newest, f"latest_step()={latest} but the newest committed is {newest}"
    obs = Observation(listing, infos, latest, restored, committed=committed)
    obs.visible = sorted(i.step for i in infos if i.path == step_dir(i.step))
    obs.half_visible = sorted(i.step for i in infos if i.path == step_dir(i.step) and i.status != "committed")

    expected = {step: build_state(SEED, step) for step in committed}
    if restored is None:
        obs.resume = "nothing" if latest is None else "wrong_step"
    elif restored != latest:
        obs.resume = "wrong_step"
    else:  # the bytes restored in place equal the state recomputed for that step
        after = _tensors(template)
        replaced = [name for name, tensor in before.items() if after[name] is not tensor]
        assert not replaced, f"restore(): {replaced} were replaced, not loaded in place"
        obs.resume = "partial" if _differs(template, expected[restored], f"restore() -> step {restored}") else "correct"

    # No partially written step is ever reported as committed: each one loads, bit-exact, as
    # a fresh structure (which also checks container and leaf types, e.g. tuple vs list).
    for info in infos:
        if info.status == "committed":
            try:
                fresh = ckptlib.load(str(root / info.path))
            except ckptlib.CheckpointError as e:
                obs.not_whole[info.step] = f"{type(e).__name__}: {e}"
                continue
            why = _differs(fresh, expected[info.step], f"load(step {info.step})")
            if why:
                obs.not_whole[info.step] = why

    committed_names = {info.path for info in infos if info.status == "committed"}
    obs.debris = {name for name in listing if name not in committed_names}
    return obs


# --------------------------------------------------------------------------------------------
# The test


@pytest.mark.chaos
@pytest.mark.timeout(3600 if FULL else 600)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_while_saving(tmp_path: Path, async_save: bool) -> None:
    root = tmp_path / "run"
    rng = random.Random(SEED * 2 + int(async_save))
    variant = "async" if async_save else "sync"
    repro = (
        f"CKPTLIB_TEST_SEED={SEED}{' CKPTLIB_CHAOS_FULL=1' if FULL else ''} "
        f"pytest 'tests/test_crash_kill.py::test_sigkill_while_saving[{variant}]'"
    )
    history: list[str] = []
    stats: Counter[str] = Counter()

    def fail(message: str) -> NoReturn:
        recent = "\n  ".join(history[-8:]) or "(none)"
        pytest.fail(
            f"seed={SEED} variant={variant}: {message}\n"
            f"recent kills (newest last):\n  {recent}\n"
            f"root now: {sorted(os.listdir(root)) if root.exists() else '(missing)'}\n"
            f"reproduce: {repro}",
            pytrace=False,
        )

    floor: int | None = None  # newest step that must never be lost again
    prev_debris: set[str] = set()
    start = 1
    seconds: Counter[str] = Counter()  # where the time goes, printed at the end (no assertions)

    def check(label: str, worker: Worker) -> Observation:
        """Everything that must hold after ``worker`` was killed; one chaos record per kill,
        emitted before a failed check raises (with ok=False). Each count is observed: see the
        ``HOW_*`` texts and chaos.record.account_saves."""
        rec = Record("process_kill", f"{variant}-{label.split(' (')[0]}", SEED)
        try:
            return _check(label, worker, rec)
        except BaseException as exc:
            rec.ok = False
            rec.note = (rec.note + " " + str(exc))[:300].strip()
            raise
        finally:
            rec.duration_s = round(time.monotonic() - worker.t0, 3)
            emit(rec)

    def _check(label: str, worker: Worker, rec: Record) -> Observation:
        nonlocal floor, prev_debris, start
        attempted = worker.numbers("saving")
        saved = worker.numbers("saved")
        committed_seen = worker.numbers("committed")
        rec.observe(HOW_KILLS, kills=int(worker.exit_code == -signal.SIGKILL))
        note = (
            f"{label} start={start} saved={saved[:1] + saved[-1:]} "
            f"committed_max={max(committed_seen, default=None)}"
        )
        t0 = time.monotonic()
        try:
            obs = observe(root)
        except AssertionError as exc:
            history.append(note)
            fail(f"after {label}: {exc}")
        seconds["observe"] += time.monotonic() - t0
        history.append(
            f"{note} -> latest={obs.latest} steps=[{obs.summary()}] debris={sorted(obs.debris)}"
        )
        retirable = {s for s in attempted if len([c for c in obs.committed if c > s]) >= KEEP_LAST}
        rec.note = account_saves(rec, SAVE_CHECKS, attempted, committed_seen, obs.committed, obs.visible, retirable)
        rec.observe(HOW_WHOLE, steps_whole=len(obs.committed) - len(obs.not_whole), steps_not_whole=len(obs.not_whole))
        rec.observe(HOW_HALF, half_visible=len(obs.half_visible))
        rec.observe(HOW_RESUME, resume=obs.resume)
        # A step reported committed, or restored before, is never lost.
        floor = max([*committed_seen, *([] if floor is None else [floor])], default=None)
        lost = floor is not None and (obs.latest is None or obs.latest < floor)
        rec.observe(HOW_LOST, saves_lost=int(lost))
        if committed_seen:
            rec.observe(HOW_DEBRIS, debris_left=len(prev_debris & obs.debris))
        if lost:
            fail(
                f"after {label}: step {floor} was committed (or restored) before, but the "
                f"newest committed step is now {obs.latest}; steps(): {obs.infos}"
            )
        if obs.problems():
            fail(f"after {label}: " + "; ".join(obs.problems()))
        # Debris of an earlier crash is gone once a later save has succeeded.
        if committed_seen and prev_debris & obs.debris:
            fail(
                f"after {label}: leftovers of an earlier crash survived the successful save "
                f"of step {max(committed_seen)}: {sorted(prev_debris & obs.debris)}"
            )
        # Retention: once step c is known committed (its retention has run), at most KEEP_LAST
        # committed steps <= c remain, plus at most one newer commit whose retention a kill
        # interrupted. (Without a successful save, such extra steps may pile up until one.)
        if committed_seen:
            c = max(committed_seen)
            kept = [s for s in obs.committed if s <= c]
            if len(kept) > KEEP_LAST or len(obs.committed) > KEEP_LAST + 1:
                fail(
                    f"after {label}: keep_last={KEEP_LAST}, step {c} was committed, but the "
                    f"committed steps are {obs.committed}"
                )
        stats["kills"] += 1
        stats["kills before any save returned"] += not saved
        stats["kills leaving new debris"] += bool(obs.debris - prev_debris)
        stats["saves returned"] += len(saved)
        stats.update(f"status {info.status}" for info in obs.infos)
        prev_debris = obs.debris
        if obs.restored is not None:
            floor = obs.restored if floor is None else max(floor, obs.restored)
            start = obs.restored + 1
        else:
            start = 1
        return obs

    server = ForkServer(root, async_save=async_save, log_path=tmp_path / "fork-server.err")

    def run_worker(label: str, index: int, *, until: str | None, delay: float) -> Worker:
        """Start a worker at ``start``; kill it after ``delay`` s, or once a line ``until``.
        A worker that died by itself, or never started, is recorded (ok=False) and fails."""
        t0 = time.monotonic()
        problem = ""
        try:
            worker = server.start(start, tmp_path / f"worker-{index}.err")
            worker.t0 = t0
            seconds["start"] += time.monotonic() - t0
            if until is not None:
                server.wait_line(f"{worker.pid} {until} ", START_TIMEOUT_S, worker.since)
            time.sleep(delay)
            seconds["run before kill"] += delay
            code = worker.kill_and_reap()
        except (WorkerDiedError, TimeoutError) as exc:
            problem = f"{label}: {exc}"
        else:
            if code != -signal.SIGKILL:
                problem = (f"{label}: the worker exited with {code} before it was killed\n"
                           f"{server.stderr_tail(worker.err_path)}")
        if problem:
            rec = Record("process_kill", f"{variant}-{label.split(' (')[0]}", SEED, ok=False, note=problem[:300])
            rec.duration_s = round(time.monotonic() - t0, 3)
            emit(rec)
            fail(problem)
        return worker

    try:
        for i in range(N_KILLS):
            if rng.random() < 0.25:
                delay = rng.uniform(0.0, 0.1)  # manager start-up or the first save
            else:
                delay = rng.uniform(0.0, MAX_DELAY_S)
            label = f"kill #{i} (delay {delay:.3f}s)"
            check(label, run_worker(label, i, until=None, delay=delay))

        # Finally one run that is killed only after a save is known to be committed: it
        # recovers whatever the random kills left, and its save cleans up their debris.
        label = "final kill (after a commit)"
        obs = check(label, run_worker(label, N_KILLS, until="committed", delay=0.0))
    finally:
        server.close()

    timing = {k: round(v, 1) for k, v in seconds.items()}
    print(f"seed={SEED} variant={variant} {dict(stats)} seconds: {timing} final: {obs.listing}")
