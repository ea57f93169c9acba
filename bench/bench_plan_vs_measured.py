"""The simulator against reality: real training loops with failures, then the same run simulated.

For 1, 2 and 4 ranks (gloo on 127.0.0.1, processes started by tests/launcher.py), a small
sharded training job (``--worker`` mode of this file: a matmul workload per step, an
all-reduce, ``CheckpointManager(save_interval_steps=K)`` async saves of ckptlib.Shard
weights and Adam-like moments) runs for ``--seconds`` of wall time. This parent kills every
rank (SIGKILL by PID) at exponential random times with mean ``--mtbf`` (seeded) and relaunches
the job at once; each launch restores the newest committed step. Rank 0 logs its steps, saves
and restores to a JSON-lines file, from which the parent measures:

- the step time (median compute time of a step without a save), the stall of each save (time
  ``save()`` blocked), the time to durable (save start to ``handle.done()``), the restart
  time (kill to training again: process start, torch import, gloo, restore);
- the goodput: steps reached at the end x step time / wall time.

Then :func:`ckptlib.simulate.simulate` predicts the goodput from those measured inputs, twice:
replaying the kills of this run (``failure_times``: checks the model's accounting) and as the
expectation over many random failures (what ``ckptlib plan`` reports). The relative errors go
to docs/scale.md. About 40 s per world size.

    python bench/bench_plan_vs_measured.py [--ranks 1 2 4] [--seconds 30] [--mtbf 8] [--every 10]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS, COLS = 1024, 512  # per-rank shard of each of the three tensors: 2 MiB float32


def zygote() -> None:
    """Imports torch and ckptlib once, then forks one process per rank on request: one JSON
    line ``{"argv", "env", "log"}`` on stdin -> the child's PID on stdout. A hot spare: a
    restart does not pay ``import torch`` (seconds on a loaded machine). The children are
    real processes killed by a real SIGKILL; SIGCHLD is ignored so they are reaped at once."""
    import signal
    import threading

    import torch  # noqa: F401

    import ckptlib  # noqa: F401

    assert threading.active_count() == 1  # forking is safe only without other threads
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                out = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.dup2(out, 1)
                os.dup2(out, 2)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.environ.update(job["env"])
                worker(*job["argv"])
            finally:
                os._exit(1)
        print(pid, flush=True)


def worker(root: str, events: str, every: int, work: int) -> None:
    """One rank, until killed: restore, then train and save every ``every`` steps."""
    import threading

    import torch
    import torch.distributed as dist

    import ckptlib

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if rank == 0 else -1

    def log(**event: object) -> None:
        if fd >= 0:
            os.write(fd, (json.dumps({"t": time.time(), **event}) + "\n").encode())

    def watch(step: int, began: float, handle: ckptlib.SaveHandle) -> None:
        while not handle.done():
            time.sleep(0.002)
        log(e="durable", step=step, seconds=time.time() - began)

    shape, offset = (ROWS * world, COLS), (ROWS * rank, 0)
    g = torch.Generator().manual_seed(rank)
    w, m, v = (torch.randn(ROWS, COLS, generator=g) for _ in range(3))
    state: dict = {name: ckptlib.Shard(t, shape, offset) for name, t in (("w", w), ("m", m), ("v", v))}
    x = torch.randn(256, ROWS, generator=g)
    mgr = ckptlib.CheckpointManager(root, keep_last=2, save_interval_steps=every)
    step = mgr.restore(state) or 0
    log(e="resumed", step=step)
    last: ckptlib.SaveHandle | None = None
    while True:
        step += 1
        for _ in range(work):  # the step's compute
            m.mul_(0.9).add_((x @ w).mean(0), alpha=0.1)
        v.mul_(0.999).add_(1e-3)
        w.add_(m, alpha=-1e-6)
        if world > 1:
            dist.all_reduce(torch.ones(1))  # keep the ranks in lockstep, like a gradient sync
        log(e="step", step=step)
        if mgr.should_save(step):
            queued = last is not None and not last.done()  # save() will wait for it first
            began = time.time()
            last = mgr.save(step, state)
            log(e="save", step=step, stall=time.time() - began, queued=queued)
            threading.Thread(target=watch, args=(step, began, last), daemon=True).start()


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by the kill
    return out


def run_one(world: int, args: argparse.Namespace, tmp: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from ckptlib.manager import CheckpointManager
    from ckptlib.simulate import Scenario, simulate
    from tests.launcher import free_port

    root, events = tmp / f"ckpt-{world}", tmp / f"events-{world}.jsonl"
    job = [str(root), str(events), args.every, args.work]
    logs = str(tmp / f"ranks-{world}.log")
    spawner = subprocess.Popen([sys.executable, __file__, "--zygote"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert spawner.stdin is not None and spawner.stdout is not None

    def launch() -> list[int]:
        port, pids = free_port(), []
        for rank in range(world):
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
            spawner.stdin.write((json.dumps({"argv": job, "env": env, "log": logs}) + "\n").encode())
            spawner.stdin.flush()
            pids.append(int(spawner.stdout.readline()))
        return pids

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(pids: list[int]) -> float:
        at = time.time()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)  # our own ranks, by PID
        while any(alive(pid) for pid in pids):
            time.sleep(0.002)
        return at

    rng = random.Random(args.seed + world)
    procs = launch()
    deadline = time.monotonic() + 180
    while not any(e["e"] == "resumed" for e in read_events(events)):  # the clock starts here
        if time.monotonic() > deadline or not all(alive(p) for p in procs):
            kill(procs)
            raise SystemExit(f"{world} ranks: the job did not start; see {logs}")
        time.sleep(0.02)
    t0 = read_events(events)[0]["t"]
    end = t0 + args.seconds
    kills: list[float] = []
    next_kill = t0 + rng.expovariate(1.0 / args.mtbf)
    while True:
        now = time.time()
        if next_kill >= end and now >= end:
            break
        if now >= next_kill:
            kills.append(kill(procs) - t0)
            procs = launch()
            next_kill += rng.expovariate(1.0 / args.mtbf)
            continue
        if not all(alive(p) for p in procs):
            kill(procs)
            raise SystemExit(f"{world} ranks: a rank exited by itself; see {logs}")
        time.sleep(min(0.01, max(0.0, min(next_kill, end) - now)))
    kill(procs)
    spawner.stdin.close()  # EOF: the zygote exits
    spawner.wait(timeout=60)

    ev = [e for e in read_events(events) if e["t"] <= end]
    steps = [e for e in ev if e["e"] == "step"]
    # Step time: consecutive steps of one launch with no save() call between them. The mean
    # (not the median) is the unit of work: on a busy machine the background persist slows
    # the steps it overlaps, which the model does not describe (reported as "slowdown").
    saved = {e["step"] for e in ev if e["e"] == "save"}
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(steps)
            if b["step"] == a["step"] + 1 and a["step"] not in saved and b["t"] > a["t"]]
    step_s = statistics.mean(gaps)
    slowdown = step_s / statistics.median(gaps) - 1
    saves = [e for e in ev if e["e"] == "save"]
    if not saves or len(gaps) < 2:
        raise SystemExit(f"{world} ranks: no save or too few steps in {args.seconds:g} s; run longer")
    # The save's own stall: saves that did not first wait for the previous one (the model
    # derives that wait from the time to durable).
    stall = statistics.mean(e["stall"] for e in saves if not e["queued"]) if any(
        not e["queued"] for e in saves) else min(e["stall"] for e in saves)
    durable = [e["seconds"] for e in ev if e["e"] == "durable"]
    durable_s = statistics.mean(durable) if durable else stall
    resumes = [e["t"] - t0 for e in ev if e["e"] == "resumed"][1:]
    restarts = []
    for i, k in enumerate(kills):  # restarts that no second kill interrupted
        nxt = kills[i + 1] if i + 1 < len(kills) else float("inf")
        back = [r for r in resumes if k < r < nxt]
        if back:
            restarts.append(back[0] - k)
    restart_s = statistics.mean(restarts) if restarts else 0.0
    # Progress at the end: the last step, unless the job was killed after it and had not
    # restarted yet; then what it restores (the newest committed step, nothing ran since).
    last_resume = max(e["t"] for e in ev if e["e"] == "resumed") - t0
    if kills and kills[-1] > last_resume:
        progress = CheckpointManager(root).latest_step() or 0
    else:
        progress = steps[-1]["step"] if steps else 0
    measured = progress * step_s / args.seconds

    sc = Scenario(args.every * step_s, stall, max(stall, durable_s), args.mtbf, restart_s)
    replay = simulate(sc, horizon_s=args.seconds, failure_times=kills)
    expected = simulate(sc, failures=20_000, seed=args.seed).goodput
    # Where the wall time went, measured: restarting (kill -> training again, or the end) and
    # work lost (steps done since the restored step, when a kill hit training).
    restarting = lost_steps = 0.0
    for i, k in enumerate(kills):
        stop = min([r for r in resumes if r > k] + kills[i + 1:] + [args.seconds])
        restarting += stop - k
        before = [e for e in steps if e["t"] - t0 < k]
        resumed_before = [e for e in ev if e["e"] == "resumed" and e["t"] - t0 < k]
        if before and resumed_before and before[-1]["t"] > resumed_before[-1]["t"]:  # hit training
            after = [e for e in ev if e["e"] == "resumed" and e["t"] - t0 > k]
            restored = after[0]["step"] if after else progress
            lost_steps += before[-1]["step"] - restored
    return {
        "ranks": world, "kills": len(kills), "kill_times": kills, "step_s": step_s, "slowdown": slowdown,
        "stall_s": stall, "durable_s": durable_s, "restart_s": restart_s, "interval_s": args.every * step_s,
        "steps_reached": progress, "goodput_measured": measured, "goodput_replay": replay.goodput,
        "goodput_expected": expected,
        "error_replay": replay.goodput / measured - 1 if measured else None,
        "error_expected": expected / measured - 1 if measured else None,
        "lost_fraction_measured": lost_steps * step_s / args.seconds, "lost_fraction_replay": replay.lost_fraction,
        "restart_fraction_measured": restarting / args.seconds, "restart_fraction_replay": replay.restart_fraction,
    }


def main() -> None:
    if sys.argv[1:] == ["--zygote"]:
        zygote()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seconds", type=float, default=30.0, help="wall time of each run (default 30)")
    ap.add_argument("--mtbf", type=float, default=8.0, help="mean seconds between kills (default 8)")
    ap.add_argument("--every", type=int, default=10, help="save every K steps (default 10)")
    ap.add_argument("--work", type=int, default=4, help="matmuls per step (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints, events and rank logs")
    args = ap.parse_args()
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="ckptlib-plan-"))
    try:
        for world in args.ranks:
            rows.append(run_one(world, args, tmp))
            r = rows[-1]
            print(f"{world} ranks: {r['kills']} kills, measured {100 * r['goodput_measured']:.1f} %", flush=True)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nsave every {args.every} steps, {args.seconds:g} s per run, kills every {args.mtbf:g} s on average "
          f"(seed {args.seed})\n")
    print("| ranks | kills | step (slowdown) | stall | durable | restart | goodput measured | simulated (replay) "
          "| error | simulated (expected) | error | lost: measured / replay | restarting: measured / replay |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['ranks']} | {r['kills']} | {1000 * r['step_s']:.0f} ms ({100 * r['slowdown']:+.0f} %) | "
              f"{1000 * r['stall_s']:.0f} ms | "
              f"{1000 * r['durable_s']:.0f} ms | {r['restart_s']:.1f} s | {100 * r['goodput_measured']:.1f} % | "
              f"{100 * r['goodput_replay']:.1f} % | {100 * r['error_replay']:+.1f} % | "
              f"{100 * r['goodput_expected']:.1f} % | {100 * r['error_expected']:+.1f} % | "
              f"{100 * r['lost_fraction_measured']:.1f} / {100 * r['lost_fraction_replay']:.1f} % | "
              f"{100 * r['restart_fraction_measured']:.1f} / {100 * r['restart_fraction_replay']:.1f} % |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
