"""Async saves: snapshot isolation, overlap mode, streaming budget, errors, lifetimes, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
from helpers import assert_same, disk_full, patch_creates
from torch.optim.optimizer import _global_optimizer_pre_hooks

import ckptlib
from ckptlib.engine import save as save_mod
from ckptlib.engine import snapshot as snap_mod
from ckptlib.engine import staging_cuda
from ckptlib.format import layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- helpers
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 256)
        self.b = torch.nn.Linear(256, 32)
        self.register_buffer("running", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x)))
        with torch.no_grad():
            self.running.mul_(0.9).add_(y.mean(0), alpha=0.1)  # mutated by forward
        return y


def make_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    small = {f"t{i}": torch.randn(i % 7 + 1) for i in range(50)}
    return {"model": model, "optim": opt, "cpu_buf": torch.randn(1000, 33), "small": small, "step": seed}


def train_step(model: Net, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def all_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the state, cloned (module state, optimizer state, plain tensors)."""
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for pid, st in state["optim"].state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{pid}.{k}"] = v.clone()
    out["cpu_buf"] = state["cpu_buf"].clone()
    out.update({f"small.{k}": v.clone() for k, v in state["small"].items()})
    return out


def mutate_all(state: dict[str, Any]) -> None:
    """Change every tensor in place (as far-fetched as it gets: add 1000 everywhere)."""
    with torch.no_grad():
        for v in state["model"].state_dict().values():
            v.add_(1000)
        for st in state["optim"].state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.add_(1000)
        state["cpu_buf"].add_(1000)
        for v in state["small"].values():
            v.add_(1000)


def restored(root, step: int | None = None) -> dict[str, torch.Tensor]:
    target = make_state(99)
    got = ckptlib.CheckpointManager(root).restore(target, step=step)
    assert got is not None
    return all_tensors(target)


class SlowCopy:
    """Holds every staging copy after the first ``fast`` ones until ``delay`` seconds after
    the first held copy started (a timer opens the gate), so a test can act while the
    snapshot is provably unfinished."""

    def __init__(self, monkeypatch, delay: float, fast: int = 0) -> None:
        self.fast = fast
        self.calls = 0
        self.gate = threading.Event()
        self._timer: threading.Timer | None = None
        real = snap_mod.copy_round

        def slow(dsts, srcs, deadline, ready=None):
            self.calls += 1
            if self.calls > self.fast:
                if self._timer is None:
                    self._timer = threading.Timer(delay, self.gate.set)
                    self._timer.start()
                self.gate.wait(30)
            real(dsts, srcs, deadline, ready)

        monkeypatch.setattr(snap_mod, "copy_round", slow)


def ckpt_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ckptlib-")]


# --------------------------------------------------------------------------- isolation
@pytest.mark.parametrize("budget", [None, 64 << 10], ids=["fits", "streams"])
def test_mutating_every_tensor_right_after_save(tmp_path, budget):
    state = make_state(1)
    before = all_tensors(state)
    mgr = ckptlib.CheckpointManager(tmp_path, staging_budget=budget)
    h = mgr.save(1, state)
    mutate_all(state)  # save() returned: the training loop owns its state again
    train_step(state["model"], state["optim"])
    h.wait(timeout=60)
    if budget is not None:  # streamed: staging memory bounded, payload written round by round
        assert mgr._stager.nbytes <= budget
        names = [f for _, _, fs in os.walk(tmp_path / layout.step_dir(1)) for f in fs]
        assert any("p1-" in f for f in names), names
    mgr.close()
    assert_same(restored(tmp_path), before)


def test_streaming_splits_big_tensors_into_rounds(tmp_path):
    big = torch.arange(100_000, dtype=torch.float32).reshape(1000, 100)  # 400 KB
    state = {"big": big, "odd": torch.arange(7, dtype=torch.int16), "s": torch.tensor(3.5)}
    expect = {k: v.clone() for k, v in state.items()}
    with ckptlib.CheckpointManager(tmp_path, staging_budget=64 << 10) as mgr:
        h = mgr.save(5, state)
        assert h._snapshot is not None and h._snapshot.nrounds > 6
        big.zero_()
        h.wait(timeout=60)
        assert mgr._stager.nbytes <= 64 << 10
    out = ckptlib.load(tmp_path / layout.step_dir(5))
    for k, v in expect.items():
        assert torch.equal(out[k], v), k


def test_budget_smaller_than_one_row_is_refused(tmp_path):
    mgr = ckptlib.CheckpointManager(tmp_path, staging_budget=1024)
    with pytest.raises(ValueError, match="staging budget too small"):
        mgr.save(1, {"wide": torch.zeros(2, 4096)})
    mgr.close()


def test_staging_buffers_are_reused_across_saves(tmp_path):
    state = make_state(1)
    with ckptlib.CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, state).wait(timeout=60)
        arena = mgr._stager._arena
        ptr = arena.data_ptr()
        train_step(state["model"], state["optim"])
        mgr.save(2, state).wait(timeout=60)
        assert mgr._stager._arena.data_ptr() == ptr
        state["extra"] = torch.zeros(10)  # a new layout: replanned, same arena if it fits
        mgr.save(3, state).wait(timeout=60)
        assert mgr._stager._arena is not None


# --------------------------------------------------------------------------- overlap mode
def test_overlap_step_waits_for_snapshot(tmp_path, monkeypatch):
    state = make_state(1)
    before = all_tensors(state)
    slow = SlowCopy(monkeypatch, delay=0.6, fast=1)  # sync round fast, deferred round slow
    mgr = ckptlib.CheckpointManager(tmp_path, overlap=True)
    h = mgr.save(1, state)
    assert not h.snapshot_done()  # the copy of params/optimizer state is still running
    assert len(_global_optimizer_pre_hooks) == 1
    # Everything that is not a parameter or optimizer state was copied before save() returned.
    with torch.no_grad():
        state["cpu_buf"].add_(1000)
        state["model"].running.add_(1000)
        for v in state["small"].values():
            v.add_(1000)
    model, opt = state["model"], state["optim"]
    model(torch.randn(8, 64)).square().mean().backward()  # forward+backward overlap the copy
    assert not slow.gate.is_set() and not h.snapshot_done()
    opt.step()  # the pre-hook waits for the copy before AdamW mutates params and moments
    assert slow.gate.is_set() and h.snapshot_done()
    assert mgr.snapshot_wait_seconds > 0
    mutate_all(state)
    h.wait(timeout=60)
    mgr.wait()
    assert len(_global_optimizer_pre_hooks) == 0  # removed on the training thread
    mgr.close()
    assert slow.calls >= 2
    assert_same(restored(tmp_path), before)


def test_overlap_hook_fires_for_optimizer_from_other_code_path(tmp_path, monkeypatch):
    state = make_state(2)
    before = all_tensors(state)
    SlowCopy(monkeypatch, delay=0.6, fast=1)
    other = torch.optim.SGD(state["model"].parameters(), lr=10.0)  # not in the state
    mgr = ckptlib.CheckpointManager(tmp_path, overlap=True)
    h = mgr.save(1, state)
    assert not h.snapshot_done()
    state["model"](torch.randn(8, 64)).sum().backward()
    other.step()
    assert h.snapshot_done()
    mutate_all(state)
    mgr.close()
    assert_same(restored(tmp_path), before)


def test_overlap_custom_loop_uses_wait_for_snapshot(tmp_path, monkeypatch):
    state = make_state(3)
    before = all_tensors(state)
    SlowCopy(monkeypatch, delay=0.6, fast=1)
    mgr = ckptlib.CheckpointManager(tmp_path, overlap=True)
    h = mgr.save(1, state)
    assert not h.snapshot_done()
    mgr.wait_for_snapshot(timeout=30)
    assert h.snapshot_done() and len(_global_optimizer_pre_hooks) == 0
    mutate_all(state)
    mgr.close()
    assert_same(restored(tmp_path), before)


def test_overlap_snapshot_deadline_abandons_the_save_not_training(tmp_path, monkeypatch):
    state = make_state(4)
    SlowCopy(monkeypatch, delay=1.0, fast=1)
    mgr = ckptlib.CheckpointManager(tmp_path, overlap=True)
    h = mgr.save(1, state)
    t0 = time.monotonic()
    mgr.wait_for_snapshot(timeout=0.05)
    assert time.monotonic() - t0 < 0.9
    with pytest.raises(ckptlib.CommitError, match="timed out waiting for the snapshot"):
        h.wait(timeout=60)
    mgr.close()
    assert mgr.latest_step() is None


# --------------------------------------------------------------------------- errors
def test_snapshot_failure_raised_by_save_once(tmp_path, monkeypatch):
    def broken(dsts, srcs, deadline, ready=None):
        raise RuntimeError("copy engine exploded")

    mgr = ckptlib.CheckpointManager(tmp_path)
    monkeypatch.setattr(snap_mod, "copy_round", broken)
    with pytest.raises(RuntimeError, match="exploded"):
        mgr.save(1, make_state())
    monkeypatch.undo()
    mgr.wait()  # already raised by save(): not again
    mgr.save(2, make_state()).wait(timeout=60)
    mgr.close()
    assert [i.step for i in mgr.steps()] == [2]
    assert ckpt_threads() == []


def test_unsupported_metadata_raised_by_async_save_itself(tmp_path):
    mgr = ckptlib.CheckpointManager(tmp_path)
    with pytest.raises(ckptlib.UnsupportedValueError, match=r"builtins\.set at /tags"):
        mgr.save(1, make_state(), metadata={"tags": {"a", "b"}})  # not later, from wait()
    mgr.wait()
    mgr.save(2, make_state(), metadata={"tags": ["a", "b"]}).wait(timeout=60)
    mgr.close()
    assert [i.step for i in mgr.steps()] == [2] and os.listdir(tmp_path) == [layout.step_dir(2)]


def test_background_snapshot_failure_surfaces_once_at_wait(tmp_path, monkeypatch):
    real = snap_mod.copy_round
    calls = {"n": 0}

    def second_fails(dsts, srcs, deadline, ready=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("DMA error")
        real(dsts, srcs, deadline, ready)

    mgr = ckptlib.CheckpointManager(tmp_path, overlap=True)
    monkeypatch.setattr(snap_mod, "copy_round", second_fails)
    mgr.save(1, make_state())
    with pytest.raises(ckptlib.CommitError, match="DMA error"):
        mgr.wait()
    mgr.wait()
    mgr.close()
    assert mgr.latest_step() is None and os.listdir(tmp_path) == []


def test_writer_failure_while_streaming_surfaces_once(tmp_path, monkeypatch):
    mgr = ckptlib.CheckpointManager(tmp_path, staging_budget=64 << 10)
    patch_creates(monkeypatch, disk_full)
    h = mgr.save(1, make_state())  # returns: staging stops when the writer gives up
    monkeypatch.undo()
    with pytest.raises(ckptlib.CommitError, match="No space left") as raised:
        mgr.save(2, make_state())
    # Raised once already, by save(2): the handle of step 1 says it did not commit, and why.
    assert h.error is raised.value
    with pytest.raises(ckptlib.CheckpointError, match="step 1 was not committed") as again:
        h.wait(timeout=60)
    assert again.value.__cause__ is raised.value
    mgr.save(3, make_state()).wait(timeout=60)
    mgr.close()
    assert [i.step for i in mgr.steps()] == [3]


# --------------------------------------------------------------------------- in-flight policy
def slow_writes(monkeypatch, delay: float) -> None:
    def slow(real):
        def create(self, path):
            time.sleep(delay)
            return real(self, path)
        return create

    patch_creates(monkeypatch, slow)


def test_in_flight_wait_policy_serializes_saves(tmp_path, monkeypatch):
    slow_writes(monkeypatch, 0.3)
    state = make_state(1)
    mgr = ckptlib.CheckpointManager(tmp_path, in_flight="wait")
    h1 = mgr.save(1, state)
    assert not h1.done()
    h2 = mgr.save(2, state)  # waits for step 1 before reusing the staging buffers
    assert h1.done() and not h2.skipped
    mgr.close()
    assert [i.step for i in mgr.steps()] == [1, 2]


def test_in_flight_skip_policy_warns(tmp_path, monkeypatch):
    slow_writes(monkeypatch, 0.3)
    mgr = ckptlib.CheckpointManager(tmp_path, in_flight="skip")
    h1 = mgr.save(1, make_state())
    with pytest.warns(RuntimeWarning, match="skipping save of step 2"):
        h2 = mgr.save(2, make_state())
    assert h2.skipped and h2.done()
    h2.wait(timeout=1)
    mgr.close()
    assert h1.done() and [i.step for i in mgr.steps()] == [1]


# --------------------------------------------------------------------------- lifetimes
def test_close_with_save_in_flight_commits_and_releases(tmp_path, monkeypatch):
    slow_writes(monkeypatch, 0.4)
    state = make_state(5)
    before = all_tensors(state)
    mgr = ckptlib.CheckpointManager(tmp_path)
    h = mgr.save(7, state)
    assert not h.done() and ckpt_threads()
    mgr.close()
    assert h.done() and ckpt_threads() == [] and mgr._stager.nbytes == 0
    monkeypatch.undo()
    assert_same(restored(tmp_path, 7), before)


CTRL_C_IN_CLOSE = textwrap.dedent(
    """
    import os, signal, sys, threading, time, torch
    sys.path.insert(0, sys.argv[3])
    import ckptlib
    from ckptlib.backends.posix import PosixStorage
    real = PosixStorage.open_write_in
    def slow(self, path):  # each payload file takes a while: the save is in flight for seconds
        time.sleep(0.5)
        return real(self, path)
    PosixStorage.open_write_in = slow
    mgr = ckptlib.CheckpointManager(sys.argv[1])
    h = mgr.save(7, {"w": torch.full((1 << 20,), 7.0)})
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        mgr.close()  # Ctrl-C lands here
    except KeyboardInterrupt:
        print("interrupted", h.done(), flush=True)
        if sys.argv[2] == "exit":
            raise  # the process ends: the exit drain commits the save
    mgr.close()  # again: waits for the save, then releases
    print("closed", h.done(), h.error, mgr._stager.nbytes, flush=True)
    """
)


@pytest.mark.parametrize("then", ["close", "exit"])
def test_ctrl_c_in_close_keeps_the_save_in_flight(tmp_path, then):
    """Ctrl-C while close() waits for a save in flight: close() raises KeyboardInterrupt but the
    manager stays open, so the save still commits, by close() called again (which then frees the
    staging arena) or by the drain at interpreter exit, as after Ctrl-C anywhere else."""
    script = tmp_path / "worker.py"
    script.write_text(CTRL_C_IN_CLOSE)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), then, ROOT],
                       capture_output=True, text=True, timeout=120)
    assert "interrupted False" in p.stdout, p.stdout + p.stderr
    if then == "close":
        assert p.returncode == 0 and "closed True None 0" in p.stdout, p.stdout + p.stderr
    else:
        assert p.returncode != 0 and "KeyboardInterrupt" in p.stderr
    assert os.listdir(tmp_path / "ck") == [layout.step_dir(7)]
    assert torch.equal(ckptlib.load(tmp_path / "ck" / layout.step_dir(7))["w"], torch.full((1 << 20,), 7.0))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_fifty_saves_keep_rss_and_threads_flat(tmp_path):
    state = {"w": torch.randn(4 << 20), "b": [torch.randn(100) for _ in range(50)]}  # 16 MiB
    baseline_threads = threading.active_count()
    with ckptlib.CheckpointManager(tmp_path, keep_last=1) as mgr:
        rss = []
        for step in range(50):
            state["w"][0] = step
            mgr.save(step, state)
            if step in (9, 49):
                mgr.wait()
                rss.append(_rss())
        mgr.wait()
        assert threading.active_count() <= baseline_threads + 1  # the manager's one persist thread
    assert threading.active_count() <= baseline_threads  # close ended it
    grown = rss[1] - rss[0]
    assert grown < 24 << 20, f"RSS grew by {grown / 2**20:.1f} MiB over 40 saves"
    assert [i.step for i in ckptlib.CheckpointManager(tmp_path).steps()] == [49]


# --------------------------------------------------------------------------- CUDA logic on CPU
class FakeEvent:
    def __init__(self) -> None:
        self.polls = 0
        self.ready_after = 3
        self.recorded_on = None

    def record(self, stream) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        self.polls += 1
        return self.polls > self.ready_after


class FakeStream:
    def __init__(self, device=None) -> None:
        self.device = device
        self.waited: list[Any] = []

    def wait_stream(self, other) -> None:
        self.waited.append(other)

    def wait_event(self, event) -> None:
        self.waited.append(event)


class FakeCuda:
    def __init__(self) -> None:
        self.current = FakeStream()
        self.entered: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.Stream = FakeStream

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    def stream(self, s):
        cuda = self

        class Ctx:
            def __enter__(self):
                cuda.entered.append(s)

            def __exit__(self, *exc):
                return False

        return Ctx()

    def Event(self) -> FakeEvent:
        e = FakeEvent()
        self.events.append(e)
        return e


def test_cuda_copy_protocol_with_fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(staging_cuda, "cuda", fake)
    monkeypatch.setattr(staging_cuda, "_streams", {})
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: recorded.append(s), raising=False)
    srcs = [torch.arange(10.0), torch.ones(3, 3)]
    dsts = [torch.empty(10), torch.empty(3, 3)]
    pending = staging_cuda.copy_async(dsts, srcs, torch.device("cpu"))
    side = staging_cuda.side_stream(torch.device("cpu"))
    assert side.waited == [fake.current]  # ordered after the producing kernels
    assert fake.entered == [side] and recorded == [side, side]
    assert fake.events[0].recorded_on is side
    sleeps = []
    pending.wait(time.monotonic() + 10, sleep=sleeps.append)
    assert len(sleeps) == 3 and pending.done()
    assert torch.equal(dsts[0], srcs[0]) and torch.equal(dsts[1], srcs[1])
    # the same side stream is reused; a copy that never completes times out
    p2 = staging_cuda.copy_async(dsts, srcs, torch.device("cpu"))
    assert staging_cuda.side_stream(torch.device("cpu")) is side
    p2.event.ready_after = 10**9
    with pytest.raises(ckptlib.CommitTimeoutError, match="timed out"):
        p2.wait(time.monotonic() + 0.05)
    # overlap mode: the training thread marks its stream; the copy thread waits on that event
    ready = staging_cuda.mark_ready([torch.device("cpu")])
    ev = ready[torch.device("cpu")]
    assert ev.recorded_on is fake.current
    staging_cuda.copy_async(dsts, srcs, torch.device("cpu"), ev)
    assert side.waited[-1] is ev


def test_copy_round_routes_non_cpu_sources_to_cuda_path(monkeypatch):
    calls = []

    class Done:
        def wait(self, deadline):
            calls.append("wait")

    def fake_copy_async(dsts, srcs, device, ready=None):
        calls.append(("copy", device, len(srcs), ready))
        return Done()

    monkeypatch.setattr(staging_cuda, "copy_async", fake_copy_async)
    meta = torch.empty(4, device="meta")
    cpu = torch.arange(4.0)
    d1, d2 = torch.empty(4), torch.empty(4)
    snap_mod.copy_round([d1, d2], [meta, cpu], time.monotonic() + 5, {torch.device("meta"): "ev"})
    assert calls == [("copy", torch.device("meta"), 1, "ev"), "wait"]
    assert torch.equal(d2, cpu)


# --------------------------------------------------------------------------- SIGTERM
WORKER = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, sys.argv[3])
    import ckptlib
    root, mode = sys.argv[1], sys.argv[2]
    w = torch.zeros(100_000)
    mgr = ckptlib.CheckpointManager(root)
    mgr.save_on_signal(lambda: (int(w[0]), {"w": w, "step": int(w[0])}),
                       deadline=float(sys.argv[4]), save_in_handler=(mode == "handler"))
    step = 0
    while True:
        step += 1
        w.fill_(step)
        if step == 3:
            mgr.save(step, {"w": w, "step": step}).wait(timeout=60)
            print("ready", flush=True)
        if mode == "flag":
            mgr.maybe_save_on_preemption(step, {"w": w, "step": step})
        time.sleep(0.005)
    """
)


def run_worker(tmp_path, mode: str, deadline: float = 30.0) -> tuple[int, float]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = tmp_path / "ckpt"
    p = subprocess.Popen(
        [sys.executable, str(script), str(root), mode, ROOT, str(deadline)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == "ready", p.stderr.read() if p.stderr else ""
        time.sleep(0.2)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
        assert p.returncode is not None
        if p.returncode not in (0, 1):
            print(err)
        return p.returncode, took
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)


@pytest.mark.parametrize("mode", ["flag", "handler"])
def test_sigterm_writes_final_checkpoint_and_exits_cleanly(tmp_path, mode):
    code, _ = run_worker(tmp_path, mode)
    assert code == 0
    mgr = ckptlib.CheckpointManager(tmp_path / "ckpt")
    steps = [i.step for i in mgr.steps() if i.status == "committed"]
    final = steps[-1]
    assert final > 3 and steps[0] == 3
    out = ckptlib.load(tmp_path / "ckpt" / layout.step_dir(final))
    assert out["step"] == final
    assert torch.equal(out["w"], torch.full((100_000,), float(final)))


def test_sigterm_deadline_watchdog_exits_with_failure_code(tmp_path):
    # "none" never checks the flag and does not save in the handler: the watchdog ends it.
    code, took = run_worker(tmp_path, "none", deadline=1.0)
    assert code == 1 and took < 20


RESTORE_WORKER = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, sys.argv[2])
    import ckptlib
    from ckptlib.engine import load
    w = torch.zeros(100_000)
    step = 0
    mgr = ckptlib.CheckpointManager(sys.argv[1])
    mgr.save_on_signal(lambda: (step, {"w": w, "step": step}), deadline=30, save_in_handler=True)
    real = load.load_checkpoint
    def slow(*args, **kwargs):  # the signal lands while the restore reads
        print("loading", flush=True)
        time.sleep(1.0)
        return real(*args, **kwargs)
    load.load_checkpoint = slow
    step = mgr.restore({"w": w, "step": step})
    print("restore returned", flush=True)  # the handler ends the process before this
    """
)


def test_sigterm_during_restore_with_save_in_handler_saves_no_torn_state(tmp_path):
    root = tmp_path / "ckpt"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for step in (3, 5):
            mgr.save(step, {"w": torch.full((100_000,), float(step)), "step": step})
    script = tmp_path / "restore_worker.py"
    script.write_text(RESTORE_WORKER)
    p = subprocess.Popen([sys.executable, str(script), str(root), ROOT], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "loading"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
    assert p.returncode == 0, err
    assert "restore returned" not in out
    assert [(i.step, i.status) for i in ckptlib.CheckpointManager(root).steps()] == [(3, "committed"), (5, "committed")]
    out_state = ckptlib.load(root / layout.step_dir(5))
    assert out_state["step"] == 5 and torch.equal(out_state["w"], torch.full((100_000,), 5.0))


def test_overlap_with_streaming_budget(tmp_path, monkeypatch):
    state = make_state(6)
    before = all_tensors(state)
    SlowCopy(monkeypatch, delay=0.05, fast=0)
    with ckptlib.CheckpointManager(tmp_path, overlap=True, staging_budget=32 << 10) as mgr:
        h = mgr.save(1, state)
        with torch.no_grad():
            state["cpu_buf"].add_(1000)  # staged before save() returned
        train_step(state["model"], state["optim"])  # waits for the streamed copy
        assert h.snapshot_done()
        mutate_all(state)
        h.wait(timeout=60)
        assert mgr._stager.nbytes <= 32 << 10
    assert_same(restored(tmp_path), before)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs per-thread nice (Linux)")
def test_persist_thread_runs_at_lower_priority(tmp_path, monkeypatch):
    seen = []
    def spy(real):
        def create(self, path):
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return real(self, path)
        return create

    patch_creates(monkeypatch, spy)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ckptlib.CheckpointManager(tmp_path, persist_nice=5) as mgr:
        for step in (1, 2, 3):  # one persist thread for all three: lowered once, not once per save
            mgr.save(step, make_state()).wait(timeout=60)
    assert len(seen) >= 3 and all(p == min(19, mine + 5) for p in seen), seen  # writer threads inherit it
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_signal_inside_save_defers_handler_save_until_save_returns(tmp_path, monkeypatch):
    state = {"w": torch.arange(1000.0), "step": 1}
    mgr = ckptlib.CheckpointManager(tmp_path)
    previous = signal.getsignal(signal.SIGTERM)
    mgr.save_on_signal(lambda: (2, {"w": state["w"], "step": 2}), deadline=60, save_in_handler=True)
    real = snap_mod.copy_round
    fired = []

    def copy_and_signal(dsts, srcs, deadline, ready=None):
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # handled on this (main) thread, mid-save
        real(dsts, srcs, deadline, ready)

    monkeypatch.setattr(snap_mod, "copy_round", copy_and_signal)
    with pytest.raises(SystemExit) as exc:
        mgr.save(1, state)
    assert exc.value.code == 0 and mgr.preempted and mgr._closed
    assert [i.step for i in ckptlib.CheckpointManager(tmp_path).steps()] == [1, 2]
    assert signal.getsignal(signal.SIGTERM) == previous  # handlers restored by close()


@pytest.mark.parametrize("budget", [None, 64 << 10], ids=["fits", "streams"])
def test_async_saves_on_object_store_commit_mode(memory_url, budget):
    state = make_state(7)
    before = all_tensors(state)
    with ckptlib.CheckpointManager(memory_url, staging_budget=budget, keep_last=1) as mgr:
        h = mgr.save(1, state)
        mutate_all(state)
        h.wait(timeout=60)
        target = make_state(99)
        assert mgr.restore(target) == 1
    assert_same(all_tensors(target), before)


def test_a_wait_that_runs_out_says_the_save_goes_on(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``handle.wait(timeout)`` / ``mgr.wait(timeout)`` that run out raise ``CommitTimeoutError``
    while the save goes on and then commits: the message must say so (it read like a failed
    save), and a later wait reports the commit."""
    mgr = ckptlib.CheckpointManager(tmp_path)
    gate = threading.Event()
    real = mgr.storage.open_write

    def held(path: str) -> Any:
        assert gate.wait(60), "test gate never opened"
        return real(path)

    monkeypatch.setattr(mgr.storage, "open_write", held)
    want = {"w": torch.arange(1000.0)}
    h = mgr.save(1, want)
    with pytest.raises(ckptlib.CommitTimeoutError, match=r"goes on and may still commit") as e:
        h.wait(timeout=0.05)
    assert "0.05s" in str(e.value)
    with pytest.raises(ckptlib.CommitTimeoutError, match=r"goes on and may still commit"):
        mgr.wait(timeout=0.05)
    gate.set()
    h.wait()
    mgr.close()
    out = {"w": torch.zeros(1000)}
    assert ckptlib.CheckpointManager(tmp_path).restore(out) == 1
    assert_same(out, want)


@pytest.mark.parametrize("call", ["close", "wait"])
@pytest.mark.parametrize("during", ["copy", "flatten"])
def test_close_or_wait_from_a_signal_handler_inside_save_refuses_at_once(tmp_path, monkeypatch, call, during):
    # A handler that called close() (or wait()) while save() was copying the state on the same
    # thread waited for that copy, which could not go on: a hang until snapshot_timeout, then the
    # save failed ("timed out waiting for the snapshot"). One that landed earlier, while save()
    # flattened the state, was not caught at all: close() closed the manager under the save, which
    # went on regardless on a new persist thread that close() never stopped, and wait() returned
    # as if nothing was in flight.
    mgr = ckptlib.CheckpointManager(tmp_path, snapshot_timeout=20.0)
    seen: list[tuple[BaseException | None, float]] = []

    def handler(signum, frame):
        start = time.monotonic()
        try:
            getattr(mgr, call)()
            seen.append((None, time.monotonic() - start))
        except BaseException as e:
            seen.append((e, time.monotonic() - start))

    module, name = (snap_mod, "copy_round") if during == "copy" else (save_mod, "flatten")
    real = getattr(module, name)

    def signalled(*args, **kwargs):  # the signal lands inside save(), on the training thread
        if not seen:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real(*args, **kwargs)

    old = signal.signal(signal.SIGUSR1, handler)
    monkeypatch.setattr(module, name, signalled)
    state = {"w": torch.randn(256, 64), "b": torch.randn(9)}
    try:
        mgr.save(1, state).wait(timeout=60)
    finally:
        signal.signal(signal.SIGUSR1, old)
    [(error, took)] = seen
    assert isinstance(error, ckptlib.CheckpointError) and "inside save()" in str(error), error
    assert took < 10, took
    later = {"w": torch.randn(256, 64), "b": torch.randn(9)}
    mgr.save(2, later).wait(timeout=60)  # the manager was not closed under the save: it goes on
    mgr.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(("ckptlib-persist", "ckptlib-save-"))]
    for step, want in ((1, state), (2, later)):
        got = {"w": torch.zeros(256, 64), "b": torch.zeros(9)}
        assert ckptlib.CheckpointManager(tmp_path).restore(got, step=step) == step
        assert_same(got, want)
