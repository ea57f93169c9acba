"""The scale tables and plot of docs/scale.md: 100B parameters on 128 / 1,024 / 4,096 GPUs.

For each cluster size, ``ckptlib.simulate.advise`` recommends the single-tier and the tiered
interval, and the simulator sweeps the (local) save interval to draw goodput against it, with
the recommended points marked. Prints the markdown tables pasted into docs/scale.md and writes
docs/img/plan_goodput.png. Pure Python + matplotlib; seconds to run.

    python bench/plot_plan.py [--out docs/img/plan_goodput.png] [--failures 3000] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ckptlib.simulate import Cluster, Scenario, advise, simulate

PARAMS = 100e9
GPUS = (128, 1024, 4096)
PER_GPU_FAILURE_RATE = 2e-5  # failures per GPU-hour (docs/scale.md: where this comes from)
LOCAL_GBPS = 5.0  # per-node NVMe tier, when tiered
SWEEP = [2 ** (i / 4) for i in range(-12, 13)]  # x the recommended interval: 1/8 .. 8
Y_MIN = 97.0  # % goodput; a sweep point below (saves queueing) is drawn at the bottom edge


def cluster(gpus: int, *, tiered: bool) -> Cluster:
    return Cluster(params=PARAMS, gpus=gpus, mtbf_s=3600.0 / (PER_GPU_FAILURE_RATE * gpus),
                   local_gbps=LOCAL_GBPS if tiered else None)


def scenario_at(plan: dict, cl: Cluster, interval_s: float) -> Scenario:
    """The recommended plan's scenario with another save interval (same persist cadence in
    wall time for the tiered plan, so only the local interval moves)."""
    d = cl.derived()
    if plan["name"] == "single-tier":
        return Scenario(interval_s, d["stall_s"], d["stall_s"] + d["persistent_write_s"], cl.mtbf_s,
                        d["restart_persistent_s"])
    period = max(interval_s + d["stall_s"], d["durable_s"])
    every = max(1, round(plan["persist_interval_s"] / period))
    return Scenario(interval_s, d["stall_s"], d["durable_s"], cl.mtbf_s, d["restart_local_s"], tiered=True,
                    persist_every=every, persist_s=d["persistent_write_s"], local_loss=cl.local_loss,
                    restart_persistent_s=d["restart_persistent_s"])


def human(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/img/plan_goodput.png"))
    ap.add_argument("--failures", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    inputs = dataclasses.asdict(cluster(GPUS[0], tiered=True))
    print("inputs:", {k: v for k, v in inputs.items() if k not in ("gpus", "mtbf_s")},
          f"per-GPU failure rate {PER_GPU_FAILURE_RATE}/h")
    print("\n| GPUs | job MTBF | ckpt per GPU | stall | persistent write | local durable |")
    print("|---:|---:|---:|---:|---:|---:|")
    results = {}
    for g in GPUS:
        cl = cluster(g, tiered=True)
        res = advise(cl, failures=args.failures, seed=args.seed)
        results[g] = (cl, res)
        d = res["derived"]
        print(f"| {g:,} | {d['mtbf_hours']:.1f} h | {d['per_gpu_bytes'] / 1e9:.2f} GB | {d['stall_s']:.2f} s | "
              f"{d['persistent_write_s']:.0f} s | {d['durable_s']:.1f} s |")
    print("\n| GPUs | plan | save every | persist every | stall overhead | lost per failure "
          "| restarts | goodput (simulated) | goodput (first order) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for g, (_cl, res) in results.items():
        for p in res["plans"]:
            first = f"{100 * p['goodput_first_order']:.2f} %" if "goodput_first_order" in p else "-"
            persist = human(p["persist_interval_s"]) if p["name"] == "tiered" else "every save"
            print(f"| {g:,} | {p['name']} | {human(p['interval_s'])} | {persist} | "
                  f"{100 * p['stall_fraction']:.3f} % | {human(p['lost_per_failure_s'])} | "
                  f"{100 * p['restart_fraction']:.2f} % | {100 * p['goodput']:.2f} % | {first} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    colors = {128: "tab:blue", 1024: "tab:orange", 4096: "tab:green"}
    for g, (cl, res) in results.items():
        for p in res["plans"]:
            xs = [p["interval_s"] * f for f in SWEEP]
            ys = [100 * simulate(scenario_at(p, cl, x), failures=args.failures, seed=args.seed).goodput for x in xs]
            style = "-" if p["name"] == "single-tier" else "--"
            ax.plot([x / 60 for x in xs], ys, style, color=colors[g], label=f"{g:,} GPUs, {p['name']}")
            ax.plot(p["interval_s"] / 60, 100 * p["goodput"], "o" if style == "-" else "s", color=colors[g],
                    markeredgecolor="black")
    ax.set_ylim(Y_MIN, 100.0)
    ax.set_xscale("log")
    ax.set_xlabel("compute time between saves (minutes, log scale)")
    ax.set_ylabel(f"goodput (% of wall time, from {Y_MIN:g})")
    ax.set_title("100B parameters, simulated: goodput vs save interval (markers: recommended)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower center", ncol=2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
