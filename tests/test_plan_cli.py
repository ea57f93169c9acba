"""``ckptlib plan`` and the simulator behind it: output and --json, bad inputs (exit 2 with a
message naming the option), determinism, and agreement with the Young/Daly closed forms."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptlib.cli.main import main
from ckptlib.schedule import expected_lost_work, first_order_goodput, young_interval
from ckptlib.simulate import Cluster, Scenario, advise, simulate

ROOT = Path(__file__).resolve().parents[1]


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------- the simulator


# Regimes where the first-order model holds (period << MTBF): no queueing, queueing (L > T + C),
# large restart cost.
FIRST_ORDER = [(1000, 50, 50, 1e5, 500), (1000, 50, 400, 1e5, 500), (2000, 1, 1, 3e4, 600),
               (300, 5, 600, 1e5, 300)]
TOLERANCE = 0.005  # absolute goodput; the closed form is first order in P/M


@pytest.mark.parametrize("t, c, lat, m, r", FIRST_ORDER)
def test_simulator_agrees_with_closed_form(t, c, lat, m, r):
    res = simulate(Scenario(t, c, lat, m, r), failures=20_000, seed=7)
    assert res.goodput == pytest.approx(first_order_goodput(t, c, lat, m, r), abs=TOLERANCE)
    assert res.lost_per_failure_s == pytest.approx(expected_lost_work(t, c, lat), rel=0.03)
    # every wall second is accounted for exactly once
    total = res.goodput + res.stall_fraction + res.lost_fraction + res.restart_fraction
    assert total == pytest.approx(1.0, abs=1e-9)
    assert 19_000 < res.failures < 21_000  # horizon = 20000 MTBFs


def test_simulated_optimum_is_young_daly():
    c, m = 50.0, 1e5
    best = young_interval(c, m)
    good = {f: simulate(Scenario(best * f, c, c, m, 0.0), failures=20_000, seed=3).goodput
            for f in (0.5, 1.0, 2.0)}
    assert good[1.0] > good[0.5] and good[1.0] > good[2.0]


def test_replay_of_given_failures_hand_computed():
    # T=10, C=1, L=1 -> saves at 10 and 21 (durable at 11, 22). Failure at 25: 23 s of compute
    # done, restored to 20 (3 lost), restart 5 s -> 30; then 20 s more: 10 + 9 compute -> 39.
    sc = Scenario(10, 1, 1, 100, 5)
    res = simulate(sc, horizon_s=50, failure_times=[25.0])
    assert (res.goodput, res.lost_fraction, res.stall_fraction, res.restart_fraction) == \
        pytest.approx((39 / 50, 3 / 50, 3 / 50, 5 / 50))
    # a second failure during the restart starts it over: training again at 32, 17 more -> 37
    res = simulate(sc, horizon_s=50, failure_times=[27.0, 25.0])
    assert res.failures == 2 and res.lost_per_failure_s == pytest.approx(3.0)
    assert res.goodput == pytest.approx(37 / 50)
    # a failure after the restart is not lost: at 40 (10 s into the stretch, save 1 not yet
    # durable) back to 20 again, training from 45 -> 25 at the end
    res = simulate(sc, horizon_s=50, failure_times=[25.0, 40.0])
    assert res.failures == 2 and res.goodput == pytest.approx(25 / 50)
    assert res.lost_fraction == pytest.approx((3 + 10) / 50)


def test_simulator_is_deterministic_for_a_seed():
    sc = Scenario(600, 2, 30, 3600 * 10, 300, tiered=True, persist_every=3, persist_s=500,
                  local_loss=0.2, restart_persistent_s=700)
    a, b = simulate(sc, failures=500, seed=11), simulate(sc, failures=500, seed=11)
    assert a == b
    assert simulate(sc, failures=500, seed=12) != a
    assert 0 < a.persistent_restores < a.failures


def test_tiered_local_loss_costs_more_than_none():
    base = dict(interval_s=600, stall_s=2, durable_s=30, mtbf_s=36_000, restart_s=300, tiered=True,
                persist_every=10, persist_s=500, restart_persistent_s=700)
    safe = simulate(Scenario(**base, local_loss=0.0), failures=5000, seed=1)
    lossy = simulate(Scenario(**base, local_loss=0.5), failures=5000, seed=1)
    assert safe.persistent_restores == 0
    assert lossy.lost_per_failure_s > 2 * safe.lost_per_failure_s
    assert lossy.goodput < safe.goodput


@pytest.mark.parametrize("kwargs, name", [
    ({"interval_s": 0}, "interval_s"), ({"mtbf_s": -1}, "mtbf_s"),
    ({"persist_every": 0}, "persist_every"), ({"local_loss": 1.5}, "local_loss"),
])
def test_scenario_validates(kwargs, name):
    args = dict(interval_s=10, stall_s=1, durable_s=1, mtbf_s=100, restart_s=1) | kwargs
    with pytest.raises(ValueError, match=name):
        Scenario(**args)


def test_advise_recommends_daly_and_never_queues():
    cl = Cluster(params=100e9, gpus=1024, mtbf_s=48 * 3600.0, local_gbps=5.0)
    res = advise(cl, failures=1000)
    d = res["derived"]
    assert d["checkpoint_bytes"] == pytest.approx(1.6e12)
    assert d["per_gpu_bytes"] == pytest.approx(1.6e12 / 1024)
    single, tiered = res["plans"]
    # single tier: the persistent write (80 s) is below Daly's interval, so Daly decides
    assert single["interval_s"] == pytest.approx(
        young_interval(d["stall_s"], cl.mtbf_s), rel=0.01)
    assert single["period_s"] >= single["durable_s"]
    assert tiered["persist_interval_s"] >= d["persistent_write_s"]  # drains keep up
    assert res["recommended"] == "tiered"


# ---------------------------------------------------------------- the command


def test_plan_text_output(capsys):
    assert main(["plan", "--params", "100B", "--gpus", "128", "--mtbf-hours", "100",
                 "--local-gbps", "5", "--step-seconds", "10", "--failures", "500"]) == 0
    text = capsys.readouterr().out
    assert "checkpoint 1.6 TB" in text and "16 nodes" in text and "job MTBF 100 h" in text
    assert "single-tier" in text and "tiered" in text and "<- recommended" in text
    assert "persist every" in text and "(steps: " in text and "goodput" in text


def test_plan_json_matches_library(capsys):
    doc = run_json(capsys, "--params", "7e9", "--gpus", "64", "--per-gpu-failure-rate", "1e-4",
                   "--stall-seconds", "2", "--save-seconds", "60", "--failures", "300", "--seed", "5")
    assert doc["inputs"]["params"] == 7e9 and doc["inputs"]["seed"] == 5
    mtbf_s = 3600 / (1e-4 * 64)
    assert doc["derived"]["mtbf_hours"] == pytest.approx(mtbf_s / 3600)
    want = advise(Cluster(params=7e9, gpus=64, mtbf_s=mtbf_s, stall_s=2.0, save_s=60.0),
                  failures=300, seed=5)
    assert doc["plans"] == json.loads(json.dumps(want["plans"]))
    (plan,) = doc["plans"]
    assert plan["stall_s"] == 2.0 and plan["durable_s"] == 60.0
    assert 0 < plan["goodput"] < 1 and plan["goodput_first_order"] == pytest.approx(plan["goodput"], abs=0.01)


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "8", "--mtbf-hours", "5"], "the following arguments are required: --params"),
    (["--params", "1B", "--gpus", "8"], "one of the arguments --mtbf-hours --per-gpu-failure-rate"),
    (["--params", "1B", "--gpus", "8", "--mtbf-hours", "5", "--per-gpu-failure-rate", "1e-5"],
     "not allowed with argument"),
    (["--params", "lots", "--gpus", "8", "--mtbf-hours", "5"], "--params: expected a number, got 'lots'"),
    (["--params", "1B", "--gpus", "0", "--mtbf-hours", "5"], "--gpus: must be >= 1, got 0"),
    (["--params", "1B", "--gpus", "8", "--mtbf-hours", "-2"], "--mtbf-hours: must be > 0"),
    (["--params", "1B", "--gpus", "8", "--mtbf-hours", "nan"], "--mtbf-hours: must be > 0"),
    (["--params", "1B", "--gpus", "8", "--mtbf-hours", "5", "--local-gbps", "0"], "--local-gbps: must be > 0"),
])
def test_plan_bad_arguments_exit_2(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_bad_fraction_exit_2_json(capsys):
    code = main(["plan", "--json", "--params", "1B", "--gpus", "8", "--mtbf-hours", "5",
                 "--local-loss-fraction", "1.5"])
    captured = capsys.readouterr()
    assert code == 2
    assert json.loads(captured.out) == {
        "error": "--local-loss-fraction must be within [0, 1], got 1.5", "exit_code": 2}


def test_plan_command_line_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "ckptlib.cli.main", "plan", "--json", "--params", "1B", "--gpus", "8",
         "--mtbf-hours", "24", "--failures", "200"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["recommended"] == "single-tier"


def test_plan_with_failures_faster_than_restarts_ends_and_warns(capsys):
    # A failure every 3.6 s against 300-s restarts: a restart almost never completes. The run
    # used to spin in its restart loop forever; now it ends at the horizon, with a warning.
    argv = ["--params", "100B", "--gpus", "1024", "--mtbf-hours", "0.001", "--failures", "500"]
    doc = run_json(capsys, *argv)
    (plan,) = doc["plans"]
    assert plan["goodput"] < 0.01 and plan["restart_fraction"] > 0.99
    (warning,) = doc["warnings"]
    assert "restarts" in warning and "--restart-seconds" in warning
    assert main(["plan", *argv]) == 0
    captured = capsys.readouterr()
    assert "goodput" in captured.out and "ckptlib: warning: the best plan leaves only" in captured.err


def test_plan_warning_names_a_stall_longer_than_a_restart(capsys):
    # Each save stalls training longer than a restart takes: the warning blames the stall, not
    # the restarts (it used to tell the user to shorten restarts).
    doc = run_json(capsys, "--params", "7B", "--gpus", "8", "--mtbf-hours", "1", "--stall-seconds", "1e6",
                   "--failures", "200")
    (warning,) = doc["warnings"]
    assert "most of it goes to saving" in warning and "--stall-seconds" in warning, warning
    assert "--restart-seconds" not in warning


@pytest.mark.parametrize(("argv", "message"), [
    (["--mtbf-hours", "1e308"], "argument --mtbf-hours: must be <= 1e+09, got '1e308'"),
    (["--mtbf-hours", "24", "--failures", "100000000"], "argument --failures: must be <= 1,000,000, got 100000000"),
])
def test_plan_refuses_values_it_cannot_simulate_by_option(capsys, argv, message):
    assert main(["plan", "--params", "7B", "--gpus", "8", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_gives_no_warning_for_a_healthy_cluster(capsys):
    doc = run_json(capsys, "--params", "7B", "--gpus", "64", "--mtbf-hours", "24", "--failures", "300")
    assert doc["warnings"] == [] and doc["plans"][0]["goodput"] > 0.9
