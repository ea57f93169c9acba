"""Saving decisions: interval formulas (hand-computed values), the online estimator with a fake
clock, ``CheckpointManager.should_save`` with N and "auto", and argument validation."""

from __future__ import annotations

import itertools
import json
import math
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.coord.coordinator import LocalCoordinator
from ckptlib.schedule import (
    HOUR,
    IntervalEstimator,
    SaveCost,
    SaveSchedule,
    daly_interval,
    expected_lost_work,
    first_order_goodput,
    optimal_interval,
    young_interval,
)

# ---------------------------------------------------------------- formulas (numbers by hand)


def test_young_hand_computed():
    # sqrt(2 * 50 * 10000) = sqrt(1e6) = 1000
    assert young_interval(50, 10_000) == pytest.approx(1000.0)
    assert young_interval(0, 10_000) == 0.0


def test_daly_hand_computed():
    # C/2M = 50/20000 = 1/400, sqrt = 1/20: 1000 * (1 + 1/60 + 1/3600) - 50 = 966.9444...
    assert daly_interval(50, 10_000) == pytest.approx(1000 + 1000 / 60 + 1000 / 3600 - 50)
    # C >= 2M: Daly's rule is "checkpoint every M"
    assert daly_interval(30_000, 10_000) == 10_000
    # C << M: Daly within 0.1 % of Young minus the cost
    assert daly_interval(1, 1e6) == pytest.approx(young_interval(1, 1e6) - 1, rel=1e-3)


def test_optimal_interval_never_lets_saves_queue():
    # durable 5000 s after start, stall 50: Daly says 967 but a save must not wait -> 4950
    assert optimal_interval(50, 5000, 10_000) == pytest.approx(4950.0)
    assert optimal_interval(50, 60, 10_000) == pytest.approx(daly_interval(50, 10_000))


def test_expected_lost_work_hand_computed():
    assert expected_lost_work(100, 0, 0) == pytest.approx(50.0)  # T/2
    # P = 110: 100^2/220 + 100 * 30/110
    assert expected_lost_work(100, 10, 30) == pytest.approx(10_000 / 220 + 3000 / 110)
    # L = 200 > T + C: P = 200, 100^2/400 + 100
    assert expected_lost_work(100, 10, 200) == pytest.approx(125.0)


def test_first_order_goodput_hand_computed():
    # T=1000, C=50, L=50, M=100000, R=500: P=1050, lost = 1e6/2100 + 1000*50/1050
    lost = 1e6 / 2100 + 50_000 / 1050
    want = (1000 / 1050) * (1 - 500 / 100_000) - lost / 100_000
    assert first_order_goodput(1000, 50, 50, 100_000, 500) == pytest.approx(want)
    # the optimum of the first-order goodput is Young's interval (L = C, R = 0)
    grid = [500 + 10 * i for i in range(100)]
    best = max(grid, key=lambda t: first_order_goodput(t, 50, 50, 10_000))
    assert abs(best - young_interval(50, 10_000)) <= 60


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: young_interval(-1, 10), "cost_s"),
        (lambda: young_interval(1, 0), "mtbf_s"),
        (lambda: daly_interval(1, math.inf), "mtbf_s"),
        (lambda: daly_interval(math.nan, 1), "cost_s"),
        (lambda: expected_lost_work(0, 1, 1), "interval_s"),
        (lambda: first_order_goodput(10, 1, 1, 100, -5), "restart_s"),
    ],
)
def test_formula_arguments_validated(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# ---------------------------------------------------------------- estimator and schedule


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_estimator_before_and_after_measurements():
    est = IntervalEstimator(10_000, min_steps=3, max_steps=10_000)
    assert est.propose() == 3  # nothing measured
    est.observe_step(2.0)
    assert est.propose() == 3  # no save measured yet
    est.observe_save(SaveCost(stall_s=50.0, durable_s=50.0))
    # Daly(50, 10000) = 966.94 s / 2 s per step -> 483 steps
    assert est.propose() == 483


def test_estimator_uses_durable_time_and_bounds():
    est = IntervalEstimator(10_000, min_steps=1, max_steps=None)
    est.observe_step(1.0)
    est.observe_save(SaveCost(stall_s=50.0, durable_s=3050.0))
    assert est.propose() == 3000  # must not queue: T >= L - C
    bounded = IntervalEstimator(10_000, min_steps=1, max_steps=100)
    bounded.observe_step(1.0)
    bounded.observe_save(SaveCost(50.0, 50.0))
    assert bounded.propose() == 100
    floor = IntervalEstimator(10_000, min_steps=2000)
    floor.observe_step(1.0)
    floor.observe_save(SaveCost(50.0, 50.0))
    assert floor.propose() == 2000


def test_estimator_window_follows_recent_saves():
    est = IntervalEstimator(10_000, window=2)
    est.observe_step(1.0)
    for stall in (200.0, 50.0, 50.0):  # the 200 s save leaves the window of 2
        est.observe_save(SaveCost(stall, stall))
    assert est.propose() == round(daly_interval(50, 10_000))


def test_auto_schedule_reevaluates_online_with_fake_clock():
    clock = FakeClock()
    est = IntervalEstimator(10_000, min_steps=2)
    sched = SaveSchedule(estimator=est, clock=clock)
    saves: list[int] = []
    stall = {0: 50.0}  # seconds the next save blocks the loop

    def run(steps: range, step_s: float, durable_after: float) -> None:
        for step in steps:
            clock.now += step_s  # one step of compute
            if sched.should_save(step):
                interval = sched.begin_save(durable_at.get("t"))  # one rank: agreed == proposed
                start = clock.now
                clock.now += stall[0]
                sched.saved(step, interval, start, stall[0])
                durable_at["t"] = start + durable_after
                saves.append(step)

    durable_at: dict[str, float] = {}
    run(range(1, 2000), 1.0, 50.0)
    # first two saves measure the cost (min_steps apart); then Daly(50, 1e4)/1 s = 967 steps
    assert saves[:3] == [3, 5, 5 + 967]
    # the save cost drops to 2 s: re-evaluated after the next save measures it
    stall[0] = 2.0
    before = len(saves)
    run(range(2000, 8000), 1.0, 2.0)
    new = saves[before:]
    gaps = [b - a for a, b in itertools.pairwise(new)]
    assert gaps[-1] == round(daly_interval(2.0, 10_000))  # 199 steps
    # mean over the window (5 saves) moves monotonically from the old cost to the new one
    assert gaps == sorted(gaps, reverse=True)


def test_step_time_excludes_stall():
    clock = FakeClock()
    sched = SaveSchedule(estimator=IntervalEstimator(HOUR), clock=clock)
    sched.should_save(0)
    clock.now += 1.0
    sched.should_save(1)
    sched.saved(1, 1, clock.now, 30.0)  # a 30 s stall inside step 2
    clock.now += 31.0
    sched.should_save(2)
    assert sched.estimator is not None and sched.estimator.step_s == pytest.approx(1.0)
    # save(3) first waited 20 s for save(1) to finish, then stalled 2 s: the wait is not its cost
    clock.now += 1.0
    sched.should_save(3)
    # save(1) (stall 30 s) durable 20 s from now, 52 s after it started: Daly(30, 3600) -> 445
    assert sched.begin_save(clock.now + 20) == 445
    sched.saved(3, 1, clock.now + 20, 2.0, queued_s=20.0)
    clock.now += 23.0
    sched.should_save(4)
    assert sched.estimator.step_s == pytest.approx(1.0)
    sched.begin_save(clock.now)
    assert sched.estimator.cost() == pytest.approx(((30 + 2) / 2, (52 + 3) / 2))


def test_fixed_schedule_multiples_and_no_double_save():
    sched = SaveSchedule(every=5)
    due = [s for s in range(0, 21) if sched.should_save(s)]
    assert due == [0, 5, 10, 15, 20]
    sched.saved(20, 5, 0.0, 0.0)
    assert not sched.should_save(20)  # already saved (e.g. the loop repeats a step)


# ---------------------------------------------------------------- the manager


def tiny_state() -> dict:
    return {"w": torch.arange(16, dtype=torch.float32), "step": 0}


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_should_save_every_n(tmp_path, async_save):
    with ckptlib.CheckpointManager(tmp_path, save_interval_steps=4, async_save=async_save) as mgr:
        for step in range(1, 14):
            if mgr.should_save(step):
                mgr.save(step, tiny_state())
        mgr.wait()
        assert [i.step for i in mgr.steps()] == [4, 8, 12]


def test_manager_auto_clamps_to_bounds(tmp_path):
    # A job that never fails (MTBF 1e6 h): Daly says "practically never" -> max bound.
    with ckptlib.CheckpointManager(
        tmp_path / "rare", save_interval="auto", mtbf_hours=1e6, save_interval_min_steps=2,
        save_interval_max_steps=5, async_save=False,
    ) as mgr:
        saved = [s for s in range(1, 25) if mgr.should_save(s) and mgr.save(s, tiny_state())]
    assert saved == [3, 5, 10, 15, 20]  # first two min_steps apart (measuring), then the max
    # A job failing every 4 ns (synchronous saves: durable when save() returns): save as
    # often as allowed -> min bound.
    with ckptlib.CheckpointManager(
        tmp_path / "often", save_interval="auto", mtbf_hours=1e-12, save_interval_min_steps=3,
        async_save=False,
    ) as mgr:
        saved = [s for s in range(1, 16) if mgr.should_save(s) and mgr.save(s, tiny_state())]
    assert saved == [4, 7, 10, 13]


class ForcedInterval(LocalCoordinator):
    """Stands in for rank 0 of a job: every rank adopts its interval, not its own proposal."""

    def __init__(self, interval: int) -> None:
        super().__init__()
        self.interval = interval
        self.proposals: list[int] = []

    def session(self, label, deadline):
        s = super().session(label, deadline)
        if label == "interval":  # the manager's one meeting of the auto interval: rank 0's answer

            def share(value=None, **kwargs):
                self.proposals.append(value["save_interval_steps"])
                return {"save_interval_steps": self.interval}

            s.share = share
        return s


def test_manager_auto_adopts_the_agreed_interval(tmp_path):
    coord = ForcedInterval(6)
    with ckptlib.CheckpointManager(
        tmp_path, save_interval="auto", mtbf_hours=1e6, save_interval_max_steps=1000,
        coordinator=coord, async_save=False,
    ) as mgr:
        saved = [s for s in range(1, 20) if mgr.should_save(s) and mgr.save(s, tiny_state())]
    assert saved == [2, 8, 14]
    assert coord.proposals[0] == 1 and coord.proposals[-1] == 1000  # measured -> max bound


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"save_interval_steps": 0}, "save_interval_steps must be an int >= 1"),
        ({"save_interval_steps": 2.5}, "save_interval_steps must be an int >= 1"),
        ({"save_interval": "often"}, "save_interval must be None or 'auto'"),
        ({"save_interval": "auto"}, "needs mtbf_hours="),
        ({"save_interval": "auto", "mtbf_hours": 0}, "mtbf_hours must be finite and > 0"),
        ({"save_interval": "auto", "mtbf_hours": "24"}, "mtbf_hours must be a number"),
        ({"save_interval_steps": 5, "save_interval": "auto", "mtbf_hours": 1}, "not both"),
        ({"mtbf_hours": 5}, "mtbf_hours is used only with save_interval='auto'"),
        ({"save_interval": "auto", "mtbf_hours": 1, "save_interval_min_steps": 0},
         "save_interval_min_steps must be an int >= 1"),
        ({"save_interval": "auto", "mtbf_hours": 1, "save_interval_min_steps": 10,
          "save_interval_max_steps": 5}, "save_interval_max_steps must be None or an int >= "),
    ],
)
def test_manager_arguments_validated(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ckptlib.CheckpointManager(tmp_path, **kwargs)


def auto_rank(rank: int, world: int, port: str, root: str) -> None:
    """One rank of :func:`test_ranks_with_different_proposals_save_the_same_steps`."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    # Rank 0 would save as often as allowed (every 2), the others as rarely as allowed (7).
    mgr = ckptlib.CheckpointManager(
        root, save_interval="auto", mtbf_hours=1e-12 if rank == 0 else 1e6, save_interval_min_steps=2,
        save_interval_max_steps=7, async_save=rank % 2 == 1,
    )
    due = []
    for step in range(1, 16):
        if mgr.should_save(step):
            mgr.save(step, {"w": ckptlib.Shard(torch.full((4,), float(step)), (4 * world,), (4 * rank,))})
            due.append(step)
    mgr.close()
    committed = [i.step for i in mgr.steps() if i.status == "committed"]
    Path(root, f"result-{rank}.json").write_text(json.dumps({"due": due, "committed": committed}))


def test_ranks_with_different_proposals_save_the_same_steps(tmp_path):
    import launcher

    procs = launcher.start(lambda rank, port: [__file__, "auto-rank", str(rank), "2", port, str(tmp_path)], 2)
    outcomes = launcher.finish("auto interval on 2 ranks", procs, lambda r: tmp_path / f"result-{r}.json", 180)
    for o in outcomes:
        assert o.returncode == 0 and o.result is not None, o.log
        # rank 0's proposal (every 2 steps) rules on both ranks: no mismatch, every save commits
        assert o.result["due"] == [3, 5, 7, 9, 11, 13, 15]
        assert o.result["committed"] == [3, 5, 7, 9, 11, 13, 15]


def test_should_save_without_a_policy_says_what_to_pass(tmp_path):
    with ckptlib.CheckpointManager(tmp_path) as mgr, pytest.raises(ValueError, match="save_interval_steps=N"):
        mgr.should_save(1)


if __name__ == "__main__" and sys.argv[1:2] == ["auto-rank"]:
    auto_rank(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])


@pytest.mark.parametrize("interval", [{"save_interval_steps": 4},
                                      {"save_interval": "auto", "mtbf_hours": 1e-12, "save_interval_min_steps": 3}])
def test_a_relaunch_loop_starting_at_the_restored_step_does_not_save_it_again(tmp_path, interval):
    """``for step in range(mgr.restore(state) or 0, ...)``: the first step is the one restored,
    already committed. should_save said True for it, and the save raised StepExistsError: the
    relaunched job died at its first step, and every relaunch after it."""
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False, **interval) as mgr:
        first = [s for s in range(0, 9) if mgr.should_save(s) and mgr.save(s, tiny_state())]
    restored = max(first)
    with ckptlib.CheckpointManager(root, async_save=False, **interval) as mgr:
        state = tiny_state()
        start = mgr.restore(state)
        assert start == restored
        assert not mgr.should_save(start)
        later = [s for s in range(start + 1, start + 9) if mgr.should_save(s) and mgr.save(s, tiny_state())]
    assert later and min(later) > restored
    with ckptlib.CheckpointManager(root) as mgr:
        assert [i.step for i in mgr.steps()][-len(later):] == later
