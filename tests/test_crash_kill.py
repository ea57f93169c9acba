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
import math
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

import ckptlib

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
DRAIN_TIMEOUT_S = 10.0


def _load_worker_module():
    spec = importlib.util.spec_from_file_location("ckptlib_test_save_loop", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_state = _load_worker_module().build_state


# --------------------------------------------------------------------------------------------
# The worker process


class WorkerDiedError(AssertionError):
    pass


class Worker:
    """One ``save_loop.py`` process in its own session, with non-blocking line reads."""

    def __init__(self, root: Path, *, async_save: bool, log_path: Path) -> None:
        cmd = [sys.executable, str(WORKER), str(root), "--seed", str(SEED)]
        cmd += ["--keep-last", str(KEEP_LAST)]
        if async_save:
            cmd.append("--async-save")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
        env["PYTHONUNBUFFERED"] = "1"
        self.log_path = log_path
        with open(log_path, "wb") as err:
            # A session of its own: the kill takes the worker and anything it started, like a
            # crashing node would, and never reaches the standby worker or pytest.
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
        self._scanned = 0
        self.lines: list[str] = []

    # -- reading

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

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            while self._scanned < len(self.lines):
                line = self.lines[self._scanned]
                self._scanned += 1
                if line.startswith(prefix):
                    return line
            if self._eof:
                self.proc.wait(timeout=EXIT_TIMEOUT_S)
                raise WorkerDiedError(
                    f"worker exited with {self.proc.returncode} before printing {prefix!r}\n"
                    f"{self.stderr_tail()}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no {prefix!r} from the worker within {timeout} s")
            self._read(deadline)

    def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self._eof:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"worker stdout still open {timeout} s after the kill")
            self._read(deadline)

    def numbers(self, prefix: str) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith(prefix + " ")]

    def stderr_tail(self, limit: int = 4000) -> str:
        try:
            text = self.log_path.read_text("utf-8", "replace")
        except OSError as exc:
            return f"(no stderr: {exc})"
        return "worker stderr:\n" + (text[-limit:] or "(empty)")

    # -- control

    def go(self, start: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"go {start}\n".encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL the worker's whole session, then reap it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=EXIT_TIMEOUT_S)

    def close(self) -> None:
        try:
            self.kill()
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:
                        pass


# --------------------------------------------------------------------------------------------
# Exact comparison


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(actual: Any, expected: Any, where: str = "state") -> None:
    """Exact equality: same container types, keys, dtypes, shapes and bytes (NaN-safe)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        if not torch.equal(_bits(actual), _bits(expected)):
            raise AssertionError(f"{where}: tensor bytes differ")
    elif isinstance(expected, dict):
        assert type(actual) is dict, f"{where}: got {type(actual).__name__}, expected dict"
        assert set(actual) == set(expected), f"{where}: keys {set(actual)} != {set(expected)}"
        for key, value in expected.items():
            assert_same(actual[key], value, f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected), (
            f"{where}: got {type(actual).__name__}, expected {type(expected).__name__}"
        )
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert type(actual) is float, f"{where}: got {type(actual).__name__}, expected float"
        assert actual.hex() == expected.hex() or (math.isnan(actual) and math.isnan(expected)), (
            f"{where}: {actual!r} != {expected!r}"
        )
    else:
        assert type(actual) is type(expected), (
            f"{where}: got {type(actual).__name__}, expected {type(expected).__name__}"
        )
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


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
    committed: list[int] = field(default_factory=list)
    debris: set[str] = field(default_factory=set)

    def summary(self) -> str:
        return ", ".join(f"{i.step}:{i.status}" for i in self.infos) or "-"


def _restore_into_template(mgr: ckptlib.CheckpointManager, step: int | None) -> int | None:
    """``restore`` into a template holding other bytes; check it loaded ``step`` in place."""
    template = build_state(SEED, TEMPLATE_STEP)
    before = _tensors(template)
    where = "restore()" if step is None else f"restore(step={step})"
    got = mgr.restore(template) if step is None else mgr.restore(template, step=step)
    if got is not None:
        assert_same(template, build_state(SEED, got), f"{where} -> step {got}")
        after = _tensors(template)
        for name, tensor in before.items():
            assert after[name] is tensor, f"{where}: {name} was replaced, not loaded in place"
    return got


def observe(root: Path) -> Observation:
    # The listing is taken before any manager touches the root.
    listing = sorted(os.listdir(root)) if root.exists() else []
    with ckptlib.CheckpointManager(str(root)) as mgr:
        infos = mgr.steps()
        latest = mgr.latest_step()
        for info in infos:
            assert info.status in ("committed", "incomplete", "corrupt"), f"{info}"
            assert (info.status == "committed") == (not info.reason), f"reason: {info}"
        committed = sorted(info.step for info in infos if info.status == "committed")
        assert len(set(committed)) == len(committed), f"a step is committed twice: {infos}"
        newest = committed[-1] if committed else None
        assert latest == newest, f"latest_step()={latest} but the newest committed is {newest}"

        restored = _restore_into_template(mgr, None)
        assert restored == latest, f"restore() loaded {restored}, latest_step() is {latest}"

        # No partially written step is ever reported as committed: each one loads, bit-exact,
        # both in place and as a fresh structure (which also checks container and leaf types).
        for info in infos:
            if info.status != "committed":
                continue
            assert _restore_into_template(mgr, info.step) == info.step
            fresh = ckptlib.load(str(root / info.path))
            assert_same(fresh, build_state(SEED, info.step), f"load(step={info.step})")

    committed_names = {info.path for info in infos if info.status == "committed"}
    debris = {name for name in listing if name not in committed_names}
    return Observation(listing, infos, latest, restored, committed, debris)


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
    workers: list[Worker] = []

    def spawn() -> Worker:
        log_path = tmp_path / f"worker-{len(workers)}.err"
        workers.append(Worker(root, async_save=async_save, log_path=log_path))
        return workers[-1]

    def check(label: str, worker: Worker) -> Observation:
        """Everything that must hold after ``worker`` was killed."""
        nonlocal floor, prev_debris, start
        saved = worker.numbers("saved")
        committed_seen = worker.numbers("committed")
        note = (
            f"{label} start={start} saved={saved[:1] + saved[-1:]} "
            f"committed_max={max(committed_seen, default=None)}"
        )
        try:
            obs = observe(root)
        except AssertionError as exc:
            history.append(note)
            fail(f"after {label}: {exc}")
        history.append(
            f"{note} -> latest={obs.latest} steps=[{obs.summary()}] debris={sorted(obs.debris)}"
        )
        # A step reported committed, or restored before, is never lost.
        floor = max([*committed_seen, *([] if floor is None else [floor])], default=None)
        if floor is not None and (obs.latest is None or obs.latest < floor):
            fail(
                f"after {label}: step {floor} was committed (or restored) before, but the "
                f"newest committed step is now {obs.latest}; steps(): {obs.infos}"
            )
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

    try:
        standby = spawn()
        for i in range(N_KILLS):
            worker = standby
            if rng.random() < 0.25:
                delay = rng.uniform(0.0, 0.1)  # manager start-up or the first save
            else:
                delay = rng.uniform(0.0, MAX_DELAY_S)
            try:
                worker.go(start)
                worker.wait_for("started", START_TIMEOUT_S)
                # The next worker pays for `import torch` now; it does not touch root before `go`.
                standby = spawn()
                time.sleep(delay)
                if worker.proc.poll() is not None:
                    worker.drain()
                    fail(
                        f"kill #{i}: worker exited with {worker.proc.returncode} before the kill"
                        f"\n{worker.stderr_tail()}"
                    )
                worker.kill()
                worker.drain()
            except (WorkerDiedError, TimeoutError) as exc:
                fail(f"kill #{i}: {exc}\n{worker.stderr_tail()}")
            worker.close()
            check(f"kill #{i} (delay {delay:.3f}s)", worker)

        # Finally one run that is killed only after a save is known to be committed: the run
        # recovers whatever the random kills left, and its save cleans up their debris.
        worker = standby
        try:
            worker.go(start)
            worker.wait_for("committed", START_TIMEOUT_S)
            worker.kill()
            worker.drain()
        except (WorkerDiedError, TimeoutError) as exc:
            fail(f"final run: {exc}\n{worker.stderr_tail()}")
        worker.close()
        obs = check("final kill (after a commit)", worker)
    finally:
        for worker in workers:
            worker.close()

    print(f"seed={SEED} variant={variant} {dict(stats)} final root: {obs.listing}")
