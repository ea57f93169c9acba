"""File-system metadata calls per save, per rank: what a save asks of a parallel file system.

On Lustre, GPFS or NFS every ``mkdir``, ``stat``, ``open(O_CREAT)``, ``rename`` and ``unlink`` of
a path is a round trip to a metadata server shared by the whole job; at thousands of ranks what
one rank does per save is multiplied by the ranks. This counts them exactly: a real gloo job of
``--ranks`` processes (default 2) saves a small row-sharded state with ``CheckpointManager``
(synchronous waits, no retention, format v2) ``--saves`` times after a warm-up, with rank 0 (the
coordinator) and rank 1 (every other rank) each run under ``strace -f``. Counted per save, from a
marker after the warm-up to a marker after the last save, in all of the rank's threads: the
system calls that name a path inside the checkpoint folder, by kind, and every ``fsync`` /
``fdatasync`` (a flush of the file system's journal). ``--tree DIR`` measures another checkout
(``PYTHONPATH``): the "before" column. Needs ``strace`` (Linux).

    python bench/bench_metadata.py [--ranks 2] [--saves 20] [--tree DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from typing import Any

MARK = "/nonexistent-ckptlib-bench-mark"
KINDS = {
    "mkdir": "mkdir", "mkdirat": "mkdir",
    "newfstatat": "stat", "statx": "stat", "stat": "stat", "lstat": "stat", "access": "stat",
    "faccessat": "stat", "faccessat2": "stat",
    "openat": "open", "open": "open",
    "rename": "rename", "renameat": "rename", "renameat2": "rename",
    "unlink": "unlink", "unlinkat": "unlink", "rmdir": "unlink",
}
CALL = re.compile(r"^\d+\s+(?:<\.\.\. )?(\w+)\(")


def job(rank: int, world: int, port: int, root: str, saves: int) -> None:
    """One rank: a warm-up save, the start marker, ``saves`` saves, the end marker."""
    import torch
    import torch.distributed as dist

    import ckptlib

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    rows = 64 * world
    state = {"w": ckptlib.Shard(torch.randn(rows // world, 256), (rows, 256), (rank * (rows // world), 0)),
             "b": torch.ones(256), "step": 0}
    mgr = ckptlib.CheckpointManager(root)
    mgr.save(1, state).wait(timeout=300)
    dist.barrier()
    os.path.exists(f"{MARK}-start")  # a marker in the trace
    for i in range(saves):
        dist.barrier()
        mgr.save(2 + i, state).wait(timeout=300)
    dist.barrier()
    os.path.exists(f"{MARK}-end")
    mgr.close()
    dist.destroy_process_group()


def count(trace: str, root: str, saves: int) -> dict[str, float]:
    """Per save: path calls inside ``root`` by kind, and fsyncs, between the two markers."""
    got: collections.Counter[str] = collections.Counter()
    inside = False
    with open(trace) as f:
        for line in f:
            if f"{MARK}-start" in line:
                inside = True
            elif f"{MARK}-end" in line:
                break
            elif inside and (m := CALL.match(line)):
                name = m.group(1)
                if name in ("fsync", "fdatasync"):
                    got["fsync"] += 1
                elif name in KINDS and root in line and "resumed>" not in line:
                    got[KINDS[name]] += 1
    per = {k: v / saves for k, v in sorted(got.items())}
    per["path calls"] = sum(v for k, v in per.items() if k != "fsync")
    return per


def measure(ranks: int, saves: int, tree: str | None) -> dict[str, dict[str, float]]:
    """One job; returns the per-save counts of rank 0 and rank 1."""
    with tempfile.TemporaryDirectory(prefix="ckptlib-meta-") as tmp:
        root = os.path.join(tmp, "ckpt")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ)
        if tree:
            env["PYTHONPATH"] = os.path.abspath(tree) + os.pathsep + env.get("PYTHONPATH", "")
        procs = []
        for r in range(ranks):
            cmd = [sys.executable, __file__, "--job", str(r), str(ranks), str(port), root, str(saves)]
            if r < 2:
                cmd = ["strace", "-f", "-qq", "-o", os.path.join(tmp, f"trace.{r}"),
                       "-e", "trace=%file,%desc,fsync,fdatasync", *cmd]
            procs.append(subprocess.Popen(cmd, env=env))
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise SystemExit(f"a rank failed (exit {p.returncode})")
        return {who: count(os.path.join(tmp, f"trace.{r}"), root, saves)
                for r, who in ((0, "coordinator"), (1, "other rank"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--saves", type=int, default=20)
    ap.add_argument("--tree", default=None, help="another checkout to measure (the 'before' column)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--job", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.job:
        job(int(a.job[0]), int(a.job[1]), int(a.job[2]), a.job[3], int(a.job[4]))
        return
    if shutil.which("strace") is None:
        raise SystemExit("bench_metadata needs strace (apt install strace)")
    if a.ranks < 2:
        raise SystemExit("--ranks must be at least 2 (rank 1 is the 'other rank')")
    rows: dict[str, Any] = {"ranks": a.ranks, "saves": a.saves, "tree": a.tree}
    rows["now"] = measure(a.ranks, a.saves, None)
    if a.tree:
        rows["before"] = measure(a.ranks, a.saves, a.tree)
    for who in ("coordinator", "other rank"):
        for col in ("before", "now"):
            if col in rows:
                got = rows[col][who]
                print(f"{who:12s} {col:6s} " + "  ".join(f"{k} {v:.1f}" for k, v in got.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
