"""CLI start-up: ``ckptlib ls ROOT``, ``ckptlib --help`` and ``ckptlib --version`` against the
floor (``python -c pass``) and the cost the CLI avoids (``python -c "import torch"``).

Each command runs N times as a fresh process, interleaved round-robin so that load on a shared
machine hits every row alike; the report gives the median wall time and the ratio to
``python -c pass`` (side by side, one run). The root ``ls`` reads has 3 committed steps,
written once before timing (that write imports torch; the timed processes do not).

    python bench/bench_cli_startup.py [--runs 15] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_root(where: Path) -> str:
    code = (
        "import sys, torch, ckptlib\n"
        "with ckptlib.CheckpointManager(sys.argv[1], async_save=False) as m:\n"
        "    for s in (1, 2, 3):\n"
        "        m.save(s, {'w': torch.zeros(256, 256), 'step': s})\n"
    )
    root = where / "run"
    subprocess.run([sys.executable, "-c", code, str(root)], check=True, env=_env())
    return str(root)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15, help="processes per row (median reported)")
    ap.add_argument("--json", metavar="FILE", help="also write the medians as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptlib-bench-cli-") as tmp:
        root = make_root(Path(tmp))
        cli = [sys.executable, "-m", "ckptlib.cli.main"]
        rows = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "ckptlib --version": [*cli, "--version"],
            "ckptlib --help": [*cli, "--help"],
            "ckptlib ls ROOT": [*cli, "ls", root],
            "ckptlib verify ROOT": [*cli, "verify", root],
            'python -c "import torch"': [sys.executable, "-c", "import torch"],
        }
        times: dict[str, list[float]] = {name: [] for name in rows}
        env = _env()
        for _ in range(args.runs):
            for name, argv in rows.items():
                start = time.perf_counter()
                subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
                times[name].append(time.perf_counter() - start)
    floor = statistics.median(times["python -c pass"])
    torch_s = statistics.median(times['python -c "import torch"'])
    print(f"median of {args.runs} runs, interleaved; {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print()
    print("| command | median s | x `python -c pass` | x `import torch` |")
    print("|---|---:|---:|---:|")
    medians = {}
    for name, samples in times.items():
        m = statistics.median(samples)
        medians[name] = m
        print(f"| `{name}` | {m:.3f} | {m / floor:.1f} | {m / torch_s:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": args.runs, "median_seconds": medians}, indent=2))


if __name__ == "__main__":
    main()
