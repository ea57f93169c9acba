"""A restore of a checkpoint of many ranks: the coordinator's judge and one rank's load, counted.

At N ranks a step holds N payload files. A restore has the coordinator judge the step (its
manifest and every payload file's size), then every rank loads its part. This bench makes such a
step for ``--worlds`` ranks (256, 1,024, 4,096 by default) with ckptlib's own save flow on
simulated ranks (``ckptlib/testing/simulation.py``: the real writer, plan and commit, the
ranks' meetings on an in-memory store), copies its files to a local S3 server (SeaweedFS,
``weed mini`` on 127.0.0.1) and to a local folder, and then measures, in a fresh process per
checkout:

- ``judge``: ``engine.scan.check_step`` of the step, as the coordinator runs it: S3 requests by
  kind, and the time;
- ``rank load``: what one rank's attempt in the resume loop runs (``engine.load.load_checkpoint``
  as ``engine/resume.py`` calls it, for ranks 0, N/2 and N-1 of N, into that rank's state): S3
  requests and time, and on the local folder the ``stat`` calls of payload files; the bytes
  loaded are checked against the state each rank saved.

``--tree DIR`` measures another checkout (``PYTHONPATH``) beside this one, alternated
``--rounds`` times: the "before" column.

    python bench/bench_wide.py [--worlds 256 1024 4096] [--rounds 2] [--tree DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

BUCKET = "ckptlib-bench-wide"

CHILD = r'''
import inspect, json, os, sys, time
import torch
from ckptlib.backends import open_storage
from ckptlib.backends import posix
from ckptlib.engine import load as load_flow
from ckptlib.engine.scan import check_step
from ckptlib.format import layout
from ckptlib.testing.sim_flows import state

url, local, world, opts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
folder = layout.step_dir(1)
kw = {"judged": True} if "judged" in inspect.signature(load_flow.load_checkpoint).parameters else {}
out = {"ckptlib": os.path.dirname(load_flow.__file__)}
s3 = open_storage(url, opts)
s3.stats.clear()
t = time.perf_counter()
info = check_step(s3, folder, 1)
out["judge"] = {"s": time.perf_counter() - t, "requests": dict(s3.stats)}
assert info.status == "committed", info.reason

stats = []
real = posix.PosixStorage.size
def counting(self, p):
    stats.append(p)
    return real(self, p)
posix.PosixStorage.size = counting
disk = open_storage(local)
for rank in sorted({0, world // 2, world - 1}):
    for name, storage in (("s3", s3), ("local", disk)):
        target = state(rank, world)
        target["w"].local.zero_()
        target["b"].zero_()
        if name == "s3":
            s3.stats.clear()
        stats.clear()
        t = time.perf_counter()
        load_flow.load_checkpoint(storage, folder, target, rank=rank, world_size=world, **kw)
        took = time.perf_counter() - t
        want = state(rank, world)
        assert torch.equal(target["w"].local, want["w"].local) and torch.equal(target["b"], want["b"]), rank
        row = out.setdefault(f"rank {rank}", {})
        if name == "s3":
            row.update(s=took, requests=dict(s3.stats))
        else:
            row.update(local_s=took, local_payload_stats=sum(p.endswith(".bin") for p in stats))
print(json.dumps(out))
'''


def make_step(world: int) -> dict[str, bytes]:
    """Step 1 of ``world`` simulated ranks, saved by ckptlib's save flow: path -> bytes."""
    from helpers import wide_step

    logging.disable(logging.WARNING)
    try:
        return wide_step(world)
    finally:
        logging.disable(logging.NOTSET)


def copy_out(files: dict[str, bytes], s3: object, local: Path) -> None:
    for path, data in files.items():
        p = local / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    with cf.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: s3.put_atomic(*kv), files.items()))  # type: ignore[attr-defined]


def child(tree: str, url: str, local: Path, world: int, opts: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run([sys.executable, "-c", CHILD, url, str(local), str(world), json.dumps(opts)],
                          env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"child ({tree}, {world} ranks) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tree", default=None, help="another checkout, measured beside this one (before)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from backends.servers import SeaweedServer

    from ckptlib.backends import open_storage

    trees = [("now", str(HERE.parent))] + ([("before", os.path.abspath(args.tree))] if args.tree else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckptlib-bench-wide-") as tmp:
        server = SeaweedServer(Path(tmp) / "weed").start()
        try:
            server.create_bucket(BUCKET)
            opts = server.storage_options()
            for world in args.worlds:
                t = time.monotonic()
                files = make_step(world)
                url = f"s3://{BUCKET}/wide-{world}"
                local = Path(tmp) / f"wide-{world}"
                copy_out(files, open_storage(url, opts), local)
                print(f"{world} ranks: {len(files)} files, {sum(map(len, files.values())) / 1024:.0f} KiB "
                      f"(made and copied in {time.monotonic() - t:.0f} s)", flush=True)
                got: dict[str, list[dict]] = {name: [] for name, _ in trees}
                for r in range(args.rounds):
                    for name, tree in (trees if r % 2 == 0 else trees[::-1]):
                        got[name].append(child(tree, url, local, world, opts))
                for name, results in got.items():
                    rank_keys = [k for k in results[0] if k.startswith("rank ")]
                    row = {"world": world, "tree": name, "rounds": results,
                           "judge_s": statistics.median(x["judge"]["s"] for x in results),
                           "judge_requests": results[0]["judge"]["requests"],
                           "rank_s": statistics.median(x[k]["s"] for x in results for k in rank_keys),
                           "rank_requests": {k: results[0][k]["requests"] for k in rank_keys},
                           "rank_local_stats": {k: results[0][k]["local_payload_stats"] for k in rank_keys}}
                    rows.append(row)
                    print(f"  {name:>6}: judge {row['judge_s'] * 1000:8.1f} ms {row['judge_requests']} | one rank's "
                          f"load {row['rank_s'] * 1000:8.1f} ms {row['rank_requests'][rank_keys[-1]]} | payload "
                          f"stats per rank on a local folder {sorted(set(row['rank_local_stats'].values()))}",
                          flush=True)
        finally:
            server.kill()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "worlds": args.worlds, "rounds": args.rounds,
                                               "tree": args.tree}, indent=1))


if __name__ == "__main__":
    main()
