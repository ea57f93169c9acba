"""Restore and scan on a root of many steps, behind a storage with a fixed latency per call.

What a resume and ``ckptlib ls`` cost where every request waits on the network (an object
store): a root of ``--steps`` committed steps (a small state each, made once in ``--root``)
is opened through a wrapper that sleeps ``--latency-ms`` before every metadata or read call and
reports itself as an object store (``supports_atomic_rename`` False). The steps are saved
through a node-local tier (``ROOT/node0``, the newest two kept) and drained to ``ROOT/persistent``,
the root measured. It times, in a fresh process each, ``engine.scan.scan`` (what ``ls``,
``verify`` and retention judge), ``engine.resume.restore`` (one process, the newest step good;
and with ``step=`` the middle step, a rollback), ``tiers.restore.restore`` (the tier restore,
the newest step on both tiers) and ``engine.retire.apply_retention`` with ``keep_last=3`` and
``keep_every=1`` (a pass after a save of a run whose older steps are all kept, as a run's
``keep_every`` multiples are; it deletes nothing), and counts the storage calls to the persistent
root of each. ``--tree DIR`` measures another checkout (``PYTHONPATH``) beside this one, in the same
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
import json, os, sys, time
import torch
import ckptlib
from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import default_coordinator
from ckptlib.engine import resume, retire, scan as scan_mod
from ckptlib.testing.faults import FaultyStorage
from ckptlib.tiers import restore as tier_restore
from ckptlib.tiers.local import LocalTier

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
persistent = os.path.join(root, "persistent")
st = Remote(open_storage(persistent))
t = time.perf_counter()
infos = scan_mod.scan(st)
out["scan_s"], out["scan_calls"] = time.perf_counter() - t, st.calls
assert len(infos) == steps and all(i.status == "committed" for i in infos), infos[:3]
st = Remote(open_storage(persistent))  # keep_every=1: every step kept, as a run's keep_every multiples are
t = time.perf_counter()
assert retire.apply_retention(st, 3, 1, just_saved=steps) == []
out["retention_s"], out["retention_calls"] = time.perf_counter() - t, st.calls
for key, kw, want in (("restore", {}, steps), ("restore_n", {"step": steps // 2}, steps // 2)):
    st = Remote(open_storage(persistent))
    t = time.perf_counter()
    got = resume.restore(st, {"w": torch.zeros(8)}, default_coordinator(), timeout=600, **kw)
    out[key + "_s"], out[key + "_calls"] = time.perf_counter() - t, st.calls
    assert got == want, got
st = Remote(open_storage(persistent))
t = time.perf_counter()
tier = LocalTier(open_storage(os.path.join(root, "node0")), 0)
got = tier_restore.restore(tier, st, {"w": torch.zeros(8)}, default_coordinator(), timeout=600)
out["tier_s"], out["tier_calls"] = time.perf_counter() - t, st.calls
assert got == steps, got
out["ckptlib"] = ckptlib.__file__
print(json.dumps(out))
'''


def _make_root(root: str, steps: int) -> None:
    import torch

    import ckptlib

    with ckptlib.CheckpointManager(os.path.join(root, "persistent"), local=os.path.join(root, "node{node}"),
                                   local_keep_last=2, async_save=False) as mgr:
        for step in range(1, steps + 1):
            mgr.save(step, {"w": torch.full((8,), float(step))})
        mgr.wait()


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
    cols = (("restore", "restore()"), ("restore_n", f"restore(step={args.steps // 2})"),
            ("tier", "tier restore()"), ("scan", "scan()"), ("retention", "retention"))
    print(f"{'code':<12}" + "".join(f" {title:>22}" for _, title in cols))
    summary: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "ckptlib"}
        print(f"  ({name}: {rs[0]['ckptlib']})")
        summary[name] = med
        print(f"{name:<12}" + "".join(f" {med[k + '_s']:>11.2f} s / {med[k + '_calls']:>6.0f}" for k, _ in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "latency_ms": args.latency_ms, "runs": runs, "medians": summary}, f,
                      indent=1)


if __name__ == "__main__":
    main()
