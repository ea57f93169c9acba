"""The manager's one persist thread (ckptlib/engine/persist_worker.py): every async save of a
manager runs on the same thread, no thread is started per save, a failed save does not lose the
thread, a manager dropped without close leaves no thread and a forked child cannot save through its
parent's manager; each save's bytes come back."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time

import pytest
import torch
from helpers import assert_same, patch_creates

import ckptlib
from ckptlib.engine.persist_worker import PersistWorker
from ckptlib.errors import CommitTimeoutError


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g), "step": step}


def loaded(root, step: int) -> dict:
    out = {"w": torch.zeros(64, 32), "b": torch.zeros(7), "step": 0}
    assert ckptlib.CheckpointManager(root).restore(out, step=step) == step
    return out


def persist_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("ckptlib-persist", "ckptlib-save-"))]


def test_saves_share_one_thread_and_start_none(tmp_path, monkeypatch):
    writers: list[tuple[int, str]] = []
    def spy(real):
        def create(self, path):
            writers.append((threading.get_ident(), threading.current_thread().name))
            return real(self, path)
        return create

    patch_creates(monkeypatch, spy)
    with ckptlib.CheckpointManager(tmp_path, keep_last=10) as mgr:
        mgr.save(1, state_of(1)).wait(timeout=60)
        started: list[str] = []
        real_start = threading.Thread.start

        def counted(self):
            started.append(self.name)
            return real_start(self)

        monkeypatch.setattr(threading.Thread, "start", counted)
        for step in range(2, 7):
            mgr.save(step, state_of(step)).wait(timeout=60)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert started == [], started  # five saves, no thread started
        assert len({ident for ident, _ in writers}) == 1  # all six on one thread
        assert {name for _, name in writers} == {f"ckptlib-save-{s}" for s in range(1, 7)}  # named per save
        assert [t.name for t in persist_threads()] == ["ckptlib-persist"]  # idle between saves
    assert persist_threads() == []  # close ended it
    for step in range(1, 7):
        assert_same(loaded(tmp_path, step), state_of(step))


def test_failed_save_keeps_the_thread_and_the_next_commits(tmp_path, monkeypatch):
    def full(real):
        def create(self, path):
            raise OSError(28, "No space left on device")
        return create

    with ckptlib.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state_of(1)).wait(timeout=60)
        before = persist_threads()
        patch_creates(monkeypatch, full)
        with pytest.raises(ckptlib.CommitError, match="No space left"):
            mgr.save(2, state_of(2)).wait(timeout=60)
        monkeypatch.undo()
        mgr.save(3, state_of(3)).wait(timeout=60)
        assert persist_threads() == before  # the same thread went on
    assert [i.step for i in mgr.steps() if i.status == "committed"] == [1, 3]
    assert_same(loaded(tmp_path, 3), state_of(3))


def test_manager_dropped_without_close_leaves_no_thread(tmp_path):
    mgr = ckptlib.CheckpointManager(tmp_path)
    mgr.save(1, state_of(1)).wait(timeout=60)
    thread = persist_threads()
    assert len(thread) == 1
    del mgr  # never closed: its idle persist thread must not outlive it
    deadline = time.monotonic() + 30
    while thread[0].is_alive() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not thread[0].is_alive()
    assert_same(loaded(tmp_path, 1), state_of(1))


def test_a_save_after_close_and_reopen_runs_on_a_new_thread(tmp_path):
    w = PersistWorker()
    seen: list[int] = []
    w.submit(lambda: seen.append(threading.get_ident()), (), "ckptlib-save-1")
    w.join(30)
    first = w._thread
    w.stop(30)
    assert first is not None and not first.is_alive()
    w.submit(lambda: seen.append(threading.get_ident()), (), "ckptlib-save-2")
    w.join(30)
    assert len(seen) == 2 and w._thread is not first and w._thread is not None and w._thread.is_alive()
    w.stop(30)


def child_result(pid: int, read_end: int) -> dict:
    """The forked child's report (JSON through the pipe), once it exited 0 (killed past 120 s)."""
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    with os.fdopen(read_end) as f:
        report = f.read()
    assert os.waitstatus_to_exitcode(status) == 0, report
    return json.loads(report)


@pytest.mark.parametrize("tier", [False, True])
def test_a_forked_child_cannot_save_or_restore_through_the_parents_manager(tmp_path, tier, request):
    # A child's save() through its inherited manager ran: with a memory tier its staging came from
    # the parent's mapped files, and its drains never started (the drain thread is the parent's).
    # Now every call that would use the manager refuses at once; close() in the child is harmless.
    local = str(request.getfixturevalue("shm_node")) if tier else None
    mgr = ckptlib.CheckpointManager(tmp_path / "ckpt", local=local)
    mgr.save(1, state_of(1)).wait(timeout=60)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report each call's outcome, then close
        report: dict = {}
        try:
            os.close(read_end)
            calls = {"save": lambda: mgr.save(2, state_of(2)), "restore": lambda: mgr.restore(state_of(0)),
                     "wait": mgr.wait, "latest_step": mgr.latest_step}
            for name, call in calls.items():
                try:
                    call()
                    report[name] = "returned"
                except BaseException as e:
                    report[name] = f"{type(e).__name__}: {e}"
            mgr.close()
            report["close"] = "returned"
        finally:
            os.write(write_end, json.dumps(report).encode())
            os._exit(0)
    os.close(write_end)
    report = child_result(pid, read_end)
    for name in ("save", "restore", "wait", "latest_step"):
        assert report[name].startswith("CheckpointError:") and "Build a new CheckpointManager" in report[name], report
    assert report["close"] == "returned", report
    mgr.save(3, state_of(3)).wait(timeout=60)  # the parent's manager goes on, its staging untouched
    mgr.close()
    assert [i.step for i in ckptlib.CheckpointManager(tmp_path / "ckpt", local=local).steps()
            if i.status == "committed"] == [1, 3]
    assert_same(loaded(tmp_path / "ckpt", 3), state_of(3))


def test_a_forked_child_waiting_on_the_parents_save_handle_is_refused(tmp_path, monkeypatch):
    # A handle of a save in flight at the fork is never finished in the child (the save runs in
    # the parent): its wait() blocked until its limit (save_timeout + 30 s), then said "still
    # running". Now it refuses at once; the parent's save commits as before.
    from ckptlib.engine import save as save_flow

    gate = threading.Event()
    real = save_flow.persist

    def held(*args, **kwargs):  # the save is still in flight when the process forks
        assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_flow, "persist", held)
    mgr = ckptlib.CheckpointManager(tmp_path)
    h = mgr.save(1, state_of(1))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        report = "not raised"
        try:
            os.close(read_end)
            h.wait(timeout=5)
        except BaseException as e:
            report = f"{type(e).__name__}: {e}"
        finally:
            os.write(write_end, json.dumps({"wait": report}).encode())
            os._exit(0)
    os.close(write_end)
    report = child_result(pid, read_end)["wait"]
    gate.set()
    assert report.startswith("CheckpointError:") and "forked" in report, report
    h.wait(timeout=60)
    mgr.close()
    assert_same(loaded(tmp_path, 1), state_of(1))


def test_worker_join_is_bounded_and_a_raising_job_does_not_end_the_thread():
    w = PersistWorker()
    gate = threading.Event()
    ran: list[int] = []
    w.submit(gate.wait, (30,), "ckptlib-save-1")
    assert w.busy()
    with pytest.raises(CommitTimeoutError, match="still running"):
        w.join(0.1)
    gate.set()
    w.join(30)
    assert not w.busy()
    first = w._thread

    def boom() -> None:
        raise SystemExit("escaped the job")

    w.submit(boom, (), "ckptlib-save-2")
    w.join(30)
    w.submit(lambda: ran.append(threading.get_ident()), (), "ckptlib-save-3")
    w.join(30)
    assert first is not None and ran == [first.ident] and w._thread is first
    w.stop(30)
    assert not first.is_alive()



EXIT_SCRIPT = """
import sys, threading, time, torch, ckptlib
from ckptlib.engine import save as save_flow

real = save_flow.persist


def late(*args, **kwargs):  # the write starts only once main() is over and the interpreter exits
    while not threading._SHUTTING_DOWN:
        time.sleep(0.01)
    time.sleep(0.3)
    return real(*args, **kwargs)


save_flow.persist = late
MANAGERS = []


def main():
    g = torch.Generator().manual_seed(5)
    state = {"a": torch.randn(40, 1024, 256, generator=g), "b": torch.randn(40, 1024, 256, generator=g)}
    MANAGERS.append(ckptlib.CheckpointManager(sys.argv[1]))  # kept until exit, never closed
    MANAGERS[0].save(5, state)  # never waited for
    if sys.argv[2] == "raise":
        raise RuntimeError("the training script's own bug")


main()
"""


@pytest.mark.parametrize("end", ["return", "raise"])
def test_a_save_in_flight_when_main_ends_commits_at_exit(tmp_path, end):
    # The interpreter-exit drain ran from atexit, after concurrent.futures had begun refusing new
    # work: a save still writing when main() returned or raised failed ("cannot schedule new
    # futures after interpreter shutdown") and left no step, with nothing reported.
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(EXIT_SCRIPT)
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script), str(root), end], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == (0 if end == "return" else 1), proc.stderr
    assert "cannot schedule" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr
    g = torch.Generator().manual_seed(5)
    want = {"a": torch.randn(40, 1024, 256, generator=g), "b": torch.randn(40, 1024, 256, generator=g)}
    got = {"a": torch.zeros(40, 1024, 256), "b": torch.zeros(40, 1024, 256)}
    with ckptlib.CheckpointManager(root) as mgr:
        assert mgr.restore(got) == 5
    assert_same(got, want)


FORK_SCRIPT = """
import json, os, sys, time, torch, ckptlib
from ckptlib.engine import save as save_flow
from ckptlib.tiers import drain as drain_flow

root, local = sys.argv[1], sys.argv[2] or None
real_persist, real_drain = save_flow.persist, drain_flow.drain_step


def slow_persist(*args, **kwargs):  # the save is still in flight when the process forks
    time.sleep(3)
    return real_persist(*args, **kwargs)


def slow_drain(*args, **kwargs):  # the drain is still pending when the process forks
    time.sleep(3)
    return real_drain(*args, **kwargs)


save_flow.persist, drain_flow.drain_step = slow_persist, slow_drain


def state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "step": step}


def fork_and_exit_child():
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # the child ends as a script does: unwinding the frames that hold the manager
    start = time.monotonic()
    os.waitpid(pid, 0)
    print(json.dumps({"child_exit_s": time.monotonic() - start}), flush=True)


def train_plain():  # a manager never closed: the drain runs when it is dropped, or at exit
    mgr = ckptlib.CheckpointManager(root)
    for step in (1, 2, 3):
        mgr.save(step, state(step))
        if step == 2:
            fork_and_exit_child()
    mgr.wait()


def train_tiered():  # a with block: close() runs in the child too, with a drain pending
    with ckptlib.CheckpointManager(root, local=local) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step)).wait()
            if step == 2:
                fork_and_exit_child()


train_tiered() if local else train_plain()
"""


@pytest.mark.parametrize("tier", [False, True])
def test_a_forked_child_exits_at_once_and_leaves_the_parents_saves_alone(tmp_path, tier, request):
    # A child forked while a save (or a drain) was in flight waited for it, which only the parent
    # runs: at exit, when its copy of the manager was dropped, or in close() (a with block
    # unwound by sys.exit), for save_timeout (600 s), and the parent waiting for it with it.
    import json
    import subprocess
    import sys

    local = str(request.getfixturevalue("shm_node")) if tier else ""
    script = tmp_path / "train.py"
    script.write_text(FORK_SCRIPT)
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(root), local], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the child it forked
        proc.communicate()
        pytest.fail("the forked child (or its parent waiting for it) hung")
    assert proc.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["child_exit_s"] < 60, out
    with ckptlib.CheckpointManager(root) as mgr:
        assert [(i.step, i.status) for i in mgr.steps()] == [(s, "committed") for s in (1, 2, 3)]
    for step in (1, 2, 3):
        g = torch.Generator().manual_seed(step)
        got = {"w": torch.zeros(256, 64), "step": 0}
        assert ckptlib.CheckpointManager(root).restore(got, step=step) == step
        assert_same(got, {"w": torch.randn(256, 64, generator=g), "step": step})


def test_managers_dropped_without_close_are_not_kept_for_the_exit_drain(tmp_path):
    """Each manager registers its exit drain; one garbage-collected without ``close()`` was kept
    in that registry for the life of the process (one entry per manager ever made)."""
    import ckptlib
    from ckptlib.engine import persist_worker

    before = len(persist_worker._AT_EXIT)
    for i in range(5):
        mgr = ckptlib.CheckpointManager(tmp_path / f"r{i}", async_save=False)
        mgr.save(1, {"w": torch.ones(4)})
        del mgr
        gc.collect()
    assert len(persist_worker._AT_EXIT) <= before + 1
