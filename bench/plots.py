#!/usr/bin/env python3
"""Benchmark charts for docs/performance.md, rendered from stored JSON results.

Two steps, so the charts can be redrawn without re-running anything:

* ``python bench/plots.py collect`` runs the existing benchmarks once at modest sizes (each
  with ``--json``) and stores their results under ``bench/results/plots/`` together with
  ``meta.json`` (date, machine, versions, the exact commands and how long each took).
  That folder is kept in the repository: it is the data behind the published charts.
* ``python bench/plots.py render`` (``make bench-plots``) reads that folder and writes PNG
  charts into ``docs/img/`` with matplotlib's Agg backend (no display needed).

Every plotted figure is either a time measured in one run or, where it says so, a ratio of
two contenders measured side by side in the same round of that run (medians of per-round
ratios, as the benchmarks report them). Absolute times swing 2-4x between runs on a shared VM;
the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DATA = BENCH / "results" / "plots"
IMG = REPO / "docs" / "img"
GIB = 2**30

# The sizes of one `collect` run: modest, so the whole run takes minutes on a 2-core VM.
# bench_async's GPT-like state with hidden size 1024 (its fp32 embedding alone is 0.19 GiB).
ASYNC_GIB = (0.25, 0.5, 1.0)
ASYNC_WIDTH = 1024


def commands(py: str) -> list[tuple[str, list[str]]]:
    """(result file, argv) for every benchmark run that `collect` makes, in order."""
    b = str(BENCH)
    cmds = [
        (
            f"async-{g}.json",
            [py, f"{b}/bench_async.py", "--gib", str(g), "--width", str(ASYNC_WIDTH), "--rounds",
             "3", "--skip-loop", "--skip-rss", "--json", str(DATA / f"async-{g}.json")],
        )
        for g in ASYNC_GIB
    ]
    cmds += [
        (
            "save_load.json",
            [py, f"{b}/bench_save_load.py", "--gib", "0.5", "--small-count", "5000", "--rounds",
             "3", "--no-out", "--json", str(DATA / "save_load.json")],
        ),
        (
            "dcp.json",
            [py, f"{b}/bench_dcp.py", "--mib", "256", "--small", "1000", "--rounds", "4",
             "--json", str(DATA / "dcp.json")],
        ),
        (
            "distributed.json",
            [py, f"{b}/bench_distributed.py", "--gib", "0.5", "--ranks", "1", "2", "4",
             "--rounds", "2", "--json", str(DATA / "distributed.json")],
        ),
    ]
    return cmds


def collect(only: list[str] | None) -> None:
    """Run the benchmarks (one at a time) and store their JSON under DATA.

    ``meta.json`` is updated after each run (re-read first, so two ``collect --only ...``
    processes on different files keep each other's entries).
    """
    DATA.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import torch

    for name, argv in commands(sys.executable):
        if only and name not in only:
            continue
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        print(f"[collect] {name}: {' '.join(argv[1:])}", flush=True)
        subprocess.run(argv, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
        _update_meta(name, {
            "argv": [Path(argv[0]).name, *(os.path.relpath(a, REPO) if a.startswith(str(REPO))
                                          else a for a in argv[1:])],
            "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
            "seconds": round(time.perf_counter() - t0, 1),
            "loadavg_before": round(load_before, 2),
            "machine": f"{_cpu()}, {os.cpu_count()} cores",
            "python": platform.python_version(),
            "torch": torch.__version__,
        })


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _update_meta(name: str, run: dict[str, Any]) -> None:
    path = DATA / "meta.json"
    meta: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    meta.setdefault("runs", {})[name] = run
    meta["runs"] = dict(sorted(meta["runs"].items()))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    tmp.replace(path)


# ----------------------------------------------------------------------------- rendering
def _load(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _per_round(rows_a: list[dict[str, float]], rows_b: list[dict[str, float]], key: str) -> float:
    """Median over rounds of a[key] / b[key] (both from the same round)."""
    return _median([a[key] / b[key] for a, b in zip(rows_a, rows_b, strict=True)])


def plot_stall(plt: Any, out: Path) -> Path:
    """Stall (time until training may go on) vs state size, and stall / memcpy floor."""
    series = {
        "memcpy (floor)": "memcpy",
        "ckptlib (default)": "ckptlib",
        "ckptlib overlap": "ckptlib.overlap",
        "DCP async_save": "dcp",
        "DCP async_save + reused stager": "dcp+stager",
        "torch.save (sync)": "torch.save",
    }
    styles = {"memcpy": "k.--", "ckptlib": "C0o-", "ckptlib.overlap": "C0s:", "dcp": "C1^-",
              "dcp+stager": "C1v:", "torch.save": "C3d-"}
    sizes, stall, ratio = [], {k: [] for k in series.values()}, {k: [] for k in series.values()}
    for g in ASYNC_GIB:
        d = _load(f"async-{g}.json")
        sizes.append(d["bytes"] / GIB)
        for key in series.values():
            stall[key].append(_median([r["stall"] for r in d["rows"][key]]))
            ratio[key].append(_per_round(d["rows"][key], d["rows"]["memcpy"], "stall"))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, key in series.items():
        a1.plot(sizes, stall[key], styles[key], label=label)
        if key != "memcpy":
            a2.plot(sizes, ratio[key], styles[key], label=label)
    a2.axhline(1.0, color="k", ls="--", lw=1, label="memcpy floor = 1")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("state size (GiB)")
        ax.set_xticks(sizes, [f"{s:.3g}" for s in sizes])
        ax.grid(True, which="both", alpha=0.3)
        _plain_log(ax)
    a1.set_ylabel("stall (s, median)")
    a1.set_title("Time the training loop waits per save")
    a2.set_ylabel("stall / memcpy (per-round ratio, median)")
    a2.set_title("Stall relative to the memcpy floor")
    a1.legend(fontsize=8)
    return _save(fig, "stall_vs_size.png", [f"async-{g}.json" for g in ASYNC_GIB], out)


SAVE_ROWS = (("ckptlib", "ckptlib"), ("torch.save", "torch.save"), ("DCP", "dcp"))
LOAD_ROWS = (("ckptlib.load", "ckptlib.load"), ("ckptlib.load(into)", "ckptlib.load(into)"),
             ("torch.load", "torch.load"), ("DCP load(into)", "dcp.load(into)"),
             ("raw read(into)", "raw.read(into)"))


def save_load_ratios() -> dict[str, dict[str, dict[str, float]]]:
    """{workload: {label: ratio}} for saves vs raw write and cold loads vs raw read."""
    d = _load("save_load.json")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for wl, w in d["workloads"].items():
        s = w["summary"]
        out[wl] = {"save": {}, "load": {}}
        for label, key in SAVE_ROWS:
            if key in s["save"]:
                out[wl]["save"][label] = s["save"][key]["ratios"]["raw"]["median"]
        for label, key in LOAD_ROWS:
            if key in s["load_cold"]:
                out[wl]["load"][label] = s["load_cold"][key]["ratios"]["raw.read"]["median"]
    return out


def plot_ratios(plt: Any, out: Path) -> Path:
    """Save time / raw write+fsync and cold load time / raw read per workload (bars), and the
    DCP storage layer: ckptlib's StorageWriter/Reader time / DCP's FileSystemWriter/Reader."""
    r = save_load_ratios()
    d = _load("save_load.json")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4), gridspec_kw={"width_ratios": [3, 4, 1.4]})
    for ax, op, title in ((axes[0], "save", "Save time / raw write+fsync"),
                          (axes[1], "load", "Cold load time / raw read (fresh buffers)")):
        wls = list(r)
        labels = list(dict.fromkeys(lab for wl in wls for lab in r[wl][op]))
        width = 0.8 / max(1, len(wls))
        for i, wl in enumerate(wls):
            xs = [j + (i - (len(wls) - 1) / 2) * width for j in range(len(labels))]
            vals = [r[wl][op].get(lab, float("nan")) for lab in labels]
            w = d["workloads"][wl]
            bars = ax.bar(xs, vals, width, color=f"C{i}",
                          label=f"{wl}: {w['tensors']:,} tensors, {w['bytes'] / GIB:.2f} GiB")
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_xticks(range(len(labels)), labels, fontsize=8, rotation=15)
        ax.set_yscale("log")
        _plain_log(ax)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("time ratio, median of per-round ratios\n(< 1: faster than the raw disk)")
    axes[0].legend(fontsize=8)
    dc = _load("dcp.json")
    vals = [_median(dc["ratios"]["save"]), _median(dc["ratios"]["load"])]
    bars = axes[2].bar(["save", "load(into)"], vals, 0.6, color="C2")
    axes[2].bar_label(bars, fmt="%.2f", fontsize=8)
    axes[2].axhline(1.0, color="k", ls="--", lw=1)
    axes[2].set_title(f"DCP API, {dc['bytes'] / GIB:.2f} GiB:\nckptlib writer / FileSystem",
                      fontsize=10)
    axes[2].set_ylabel("time ratio (< 1: ckptlib faster)")
    axes[2].grid(True, axis="y", alpha=0.3)
    return _save(fig, "save_load_vs_raw.png", ["save_load.json", "dcp.json"], out)


def plot_ranks(plt: Any, out: Path) -> Path:
    """Throughput (GB/s) vs world size for raw write/read and ckptlib save/load."""
    d = _load("distributed.json")
    ranks = [row["ranks"] for row in d["rows"]]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for key, label, style in (("raw", "raw write+fsync", "k--"), ("save", "ckptlib save", "C0o-"),
                              ("rawload", "raw cold read", "k:"),
                              ("load", "ckptlib cold load(into)", "C2s-")):
        gbs = [row["bytes"] / 1e9 / row["median_s"][key] for row in d["rows"]]
        ax.plot(ranks, gbs, style, label=label)
    ax.set_xticks(ranks)
    ax.set_xlabel("ranks (processes, gloo on one machine)")
    ax.set_ylabel("GB/s (total bytes / median time)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Same total bytes ({d['rows'][0]['bytes'] / GIB:.2f} GiB) over 1-4 ranks")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, "throughput_vs_ranks.png", ["distributed.json"], out)


def _plain_log(ax: Any) -> None:
    """Log-scale y ticks as plain numbers (0.2, 1, 5) rather than powers of ten."""
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda y, _pos: f"{y:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda y, _pos: f"{y:g}" if y > 0 and round(y / 10 ** math.floor(math.log10(y))) in (2, 3, 5)
        else ""))
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _footer(fig: Any, files: list[str]) -> str:
    """The line under a chart: when and where its data was measured (from meta.json)."""
    runs = json.loads((DATA / "meta.json").read_text())["runs"]
    got = [runs[f] for f in files if f in runs]
    days = ", ".join(sorted({r["finished"][:10] for r in got})) or "?"
    where = f"{got[0]['machine']}, torch {got[0]['torch']}" if got else "?"
    loads = sorted(round(r["loadavg_before"]) for r in got if r.get("loadavg_before") is not None)
    load = "" if not loads else (
        f", load average {loads[0]}" + (f"-{loads[-1]}" if loads[-1] != loads[0] else "")
        + " (shared machine)")
    return (f"measured {days} on {where}{load};"
            " one run of bench/plots.py collect: compare ratios, not seconds")


def _save(fig: Any, name: str, files: list[str], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    text = _footer(fig, files)
    if fig.get_figwidth() < 10:  # too narrow for one line: break after the semicolon
        text = text.replace("; ", ";\n")
    fig.tight_layout(rect=(0, 0.04 * (text.count("\n") + 1), 1, 1))
    fig.text(0.5, 0.005, text, ha="center", va="bottom", fontsize=7, color="0.35")
    # No "Software" tag (matplotlib's version): re-rendering the same data gives the same bytes.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    return path


def render(out: Path = IMG) -> list[Path]:
    """Draw every chart from DATA into ``out`` (default docs/img); return the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [plot_stall(plt, out), plot_ratios(plt, out), plot_ranks(plt, out)]
    plt.close("all")
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="run the benchmarks, store JSON under bench/results/plots")
    c.add_argument("--only", nargs="*", help="result files to (re)collect, e.g. dcp.json")
    sub.add_parser("render", help="draw docs/img/*.png from the stored JSON")
    args = ap.parse_args(argv)
    if args.cmd == "collect":
        collect(args.only)
    for p in render():
        print(f"wrote {os.path.relpath(p, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
