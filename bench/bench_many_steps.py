"""Restore and scan on a root of many steps, behind a storage with a fixed latency per call.

What a resume and ``ckptlib ls`` cost where every request waits on the network (an object
store): a root of ``--steps`` committed steps (a small state each, made once in ``--root``)
is opened through a wrapper that sleeps ``--latency-ms`` before every metadata or read call and
reports itself as an object store (``supports_atomic_rename`` False). It times, in a fresh
process each, ``engine.scan.scan`` (what ``ls``, ``verify`` and retention judge) and
``engine.resume.restore`` (one process, the newest step good), and counts the storage calls of
each. ``--tree DIR`` measures another checkout (``PYTHONPATH``) beside this one, in the same
run, the two alternated ``--rounds`` times: the "before" column.

    python bench/bench_many_steps.py [--steps 300] [--latency-ms 10] [--rounds 1] [--tree DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r'''
import json, sys, time
import torch
import ckptlib
from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import default_coordinator
from ckptlib.engine import resume, scan as scan_mod
from ckptlib.testing.faults import FaultyStorage

root, steps, latency = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) / 1000


class Remote(FaultyStorage):
    """Every call waits ``latency`` first, as a request to a remote store does."""

    def __init__(self, inner):
        super().__init__(inner, [])
        self.supports_atomic_rename = False
        self.calls = 0

    def _wait(self):
        self.calls += 1
        time.sleep(latency)

    def size(self, p):
        self._wait()
        return super().size(p)

    def exists(self, p=""):
        self._wait()
        return super().exists(p)

    def listdir(self, p=""):
        self._wait()
        return super().listdir(p)

    def open_read(self, p):
        self._wait()
        return super().open_read(p)


out = {}
st = Remote(open_storage(root))
t = time.perf_counter()
infos = scan_mod.scan(st)
out["scan_s"], out["scan_calls"] = time.perf_counter() - t, st.calls
assert len(infos) == steps and all(i.status == "committed" for i in infos), infos[:3]
st = Remote(open_storage(root))
t = time.perf_counter()
got = resume.restore(st, {"w": torch.zeros(8)}, default_coordinator(), timeout=600)
out["restore_s"], out["restore_calls"] = time.perf_counter() - t, st.calls
assert got == steps, got
out["ckptlib"] = ckptlib.__file__
print(json.dumps(out))
'''


def _make_root(root: str, steps: int) -> None:
    import torch

    import ckptlib

    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for step in range(1, steps + 1):
            mgr.save(step, {"w": torch.full((8,), float(step))})


def _measure(tree: str, root: str, steps: int, latency_ms: float) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    # cwd: not a checkout (``-c`` puts the working folder ahead of PYTHONPATH on sys.path)
    proc = subprocess.run([sys.executable, "-c", CHILD, root, str(steps), str(latency_ms)], env=env,
                          capture_output=True, text=True, timeout=3600, check=False, cwd=os.path.dirname(root))
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--latency-ms", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tree", help="another checkout to measure beside this one (the before column)")
    ap.add_argument("--root", help="where the steps are made (default: a temporary folder)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this code": here, **({"--tree": args.tree} if args.tree else {})}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or os.path.join(tmp, "root")
        if not os.path.exists(root):
            _make_root(root, args.steps)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
            for name, tree in order:
                runs[name].append(_measure(tree, root, args.steps, args.latency_ms))
    print(f"{args.steps} committed steps, {args.latency_ms:g} ms per storage call, {args.rounds} round(s); "
          "medians (time / storage calls)")
    print(f"{'code':<12} {'restore()':>22} {'scan()':>22}")
    summary: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "ckptlib"}
        print(f"  ({name}: {rs[0]['ckptlib']})")
        summary[name] = med
        print(f"{name:<12} {med['restore_s']:>10.2f} s / {med['restore_calls']:>6.0f} "
              f"{med['scan_s']:>10.2f} s / {med['scan_calls']:>6.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "latency_ms": args.latency_ms, "runs": runs, "medians": summary}, f,
                      indent=1)


if __name__ == "__main__":
    main()
