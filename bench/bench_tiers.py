"""Tiers (docs/tiers.md) against a single-tier save to the same persistent backend, side by side.

Every round is one real multi-process gloo job on 127.0.0.1 (``--nodes`` simulated nodes x
``--ranks-per-node`` ranks, ``CKPTLIB_NODE`` per process, ``local=<round>/<backend>/node{node}``),
started through tests/launcher.py. Each rank holds a 1/W row shard of 8 float32 tensors
(``--mib`` in total). In one job, for each persistent backend (``posix``: a folder behind a
``--rate-mb`` MB/s per-process bandwidth limit (ckptlib.testing.faults.throttle_url), standing in
for a shared file system, one backend per rate, on ``--persist-dir`` (default /dev/shm, so it does
not share the local tier's disk); ``s3``: the local SeaweedFS server, ``weed mini``) and each mode
(``single``: ``CheckpointManager(url)``; ``tiers``: ``CheckpointManager(url, local=...,
replicas=1, persist_every=1)``), in an order rotated per round, a fresh manager makes one
untimed warm-up save (staging arena, folders, connections; tiers: local only), then one timed
save:

- **stall**: how long ``save()`` blocks the training loop (returns after the snapshot);
- **local**: until ``handle.wait()`` returns (tiers: committed on every node's local folder,
  replicas durable; single: committed on the persistent backend);
- **persisted**: until ``handle.wait_persisted()`` returns (single: the same as local).

Also in the rotation, the local disk's floor for a tiers save: every rank writes its bytes twice
(own copy + the replica it holds) to its node's folder with write + fsync (**raw**).

Then, per backend, restore of the timed step, cold (every file fsynced and dropped from the page
cache with ``posix_fadvise(DONTNEED)``, SeaweedFS's data folder included; never
``/proc/sys/vm/drop_caches``; a persistent folder on tmpfs stays in memory, its reads are paced
by the bandwidth limit), in this order (each deletes more): **own local** (every folder
intact), **peer** (node 0's local folder deleted: its ranks fetch the replicas from node 1 over
the process group), **persistent** (every local folder deleted). Every restore is checked
bitwise against the saved state. Times are the slowest rank's; ratios are per round
(tiers / single, peer / own, persistent / own), reported as the median and min-max over rounds.

    python bench/bench_tiers.py [--mib 256] [--rounds 5] [--nodes 2] [--ranks-per-node 1]
        [--rate-mb 200 25] [--backends posix s3] [--dir DIR] [--persist-dir DIR] [--json PATH]

Results: a markdown table on stdout and JSON in ``bench/results/tiers-<date>.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_distributed import drop_cache  # noqa: E402 - bench/ is on sys.path when run as a script

N_TENSORS = 8
COLS = 4096
BUCKET = "ckptlib-bench-tiers"
MODES = ("single", "tiers")
SCENARIOS = ("local", "peer", "persistent")
JOB_TIMEOUT = 900.0

# ratio name -> (numerator, denominator) in a round's measurements, per backend
RATIOS = {
    "stall tiers/single": (("tiers", "stall"), ("single", "stall")),
    "local commit tiers / single save": (("tiers", "local"), ("single", "persisted")),
    "local commit tiers / raw write of its bytes": (("tiers", "local"), ("raw", "write")),
    "persisted tiers / single save": (("tiers", "persisted"), ("single", "persisted")),
    "restore peer / own local": (("restore", "peer"), ("restore", "local")),
    "restore persistent / own local": (("restore", "persistent"), ("restore", "local")),
}


# ----------------------------------------------------------------------------- worker (one rank)
def make_state(mib: float, world: int, rank: int) -> dict[str, Any]:
    import torch

    import ckptlib

    rows = max(world, int(mib * (1 << 20) / 4 / COLS / N_TENSORS))
    rows -= rows % world
    per = rows // world
    g = torch.Generator().manual_seed(1000 + rank)
    return {f"w{i}": ckptlib.Shard(torch.randn(per, COLS, generator=g), (rows, COLS), (rank * per, 0))
            for i in range(N_TENSORS)}


def raw_write(state: dict[str, Any], folder: str, rank: int) -> float:
    """The local disk's floor for a tiers save: this rank's bytes written twice (its own copy and
    the replica it holds for a peer) to its node's folder, 4 MiB per ``write()``, each file
    fsynced; every rank at once. Seconds until this rank is done (files removed afterwards)."""
    import torch.distributed as dist

    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"r{rank}-{copy}.bin") for copy in ("own", "replica")]
    dist.barrier()
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "wb") as f:
            for s in state.values():
                view = memoryview(s.local.numpy()).cast("B")
                for i in range(0, len(view), 4 << 20):
                    f.write(view[i : i + (4 << 20)])
            f.flush()
            os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    for path in paths:
        os.unlink(path)
    return elapsed


def worker(rank: int, world: int, port: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of a round: every save of every (backend, mode), then the restores."""
    import torch
    import torch.distributed as dist

    import ckptlib
    from ckptlib.testing.faults import throttle_url

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    node = int(os.environ["CKPTLIB_NODE"])
    leader = rank % spec["ranks_per_node"] == 0  # lowest rank of its node
    state = make_state(spec["mib"], world, rank)
    out: dict[str, Any] = {"rank": rank, "node": node, "saves": {}, "restore": {}, "throttled_bytes": {}}

    @contextlib.contextmanager
    def manager(backend: str, mode: str, key: str) -> Iterator[Any]:
        """A fresh manager on ``backend`` (posix: behind the bandwidth limit), closed on exit."""
        b = spec["backends"][backend]
        url = b["url"][mode]
        kw: dict[str, Any] = {"storage_options": b.get("storage_options"), "save_timeout": 300.0}
        if mode != "single":
            kw.update(local=b["local"], replicas=1, persist_every=1)
        with contextlib.ExitStack() as stack:
            bw = stack.enter_context(throttle_url(url, b["rate"])) if "rate" in b else None
            mgr = ckptlib.CheckpointManager(url, **kw)
            try:
                yield mgr
            finally:
                mgr.close()
                if bw is not None:
                    out["throttled_bytes"][key] = out["throttled_bytes"].get(key, 0) + bw.nbytes

    for backend, mode in spec["order"]:
        if backend == "raw":
            out["raw"] = raw_write(state, spec["raw"].format(node=node), rank)
            dist.barrier()
            continue
        with manager(backend, mode, f"{backend}/{mode}") as mgr:
            # warm-up: staging arena, folders, connections (tiers: local only, not drained)
            mgr.save(0, state, **({"persist": False} if mode == "tiers" else {})).wait()
            dist.barrier()
            t0 = time.perf_counter()
            h = mgr.save(1, state)
            t_call = time.perf_counter() - t0
            h.wait()
            t_local = time.perf_counter() - t0
            h.wait_persisted()
            t_persisted = time.perf_counter() - t0
        out["saves"][f"{backend}/{mode}"] = {"stall": t_call, "local": t_local, "persisted": t_persisted}
        dist.barrier()

    target = {k: ckptlib.Shard(torch.zeros_like(s.local), s.global_shape, s.global_offset) for k, s in state.items()}
    bitwise = True
    for backend in spec["restore_backends"]:
        b = spec["backends"][backend]
        own = b["local"].format(node=node)
        for scenario in SCENARIOS:
            if leader and (scenario == "persistent" or (scenario == "peer" and node == 0)):
                shutil.rmtree(own, ignore_errors=True)
            dist.barrier()
            if leader and os.path.isdir(own):
                drop_cache(own)
            if rank == 0:
                drop_cache(b["cold"])
            for s in target.values():
                s.local.zero_()
            with manager(backend, "tiers", f"{backend}/restore") as mgr:
                dist.barrier()
                t0 = time.perf_counter()
                got = mgr.restore(target)
                elapsed = time.perf_counter() - t0
            same = got == 1 and all(torch.equal(target[k].local, state[k].local) for k in state)
            bitwise = bitwise and same
            out["restore"][f"{backend}/{scenario}"] = {"seconds": elapsed, "step": got, "bitwise": same}
            dist.barrier()
    out["bitwise"] = bitwise
    out["bytes"] = sum(s.local.numel() * 4 for s in state.values())
    dist.barrier()
    dist.destroy_process_group()
    return out


def worker_main(argv: list[str]) -> None:
    rank, world, port, res = int(argv[0]), int(argv[1]), argv[2], argv[3]
    spec = json.loads(argv[4])
    try:
        result = worker(rank, world, port, spec)
    except BaseException as e:  # reported by the parent, which stops with it
        result = {"crash": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    path = os.path.join(res, f"result-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    if "crash" in result:  # a peer may be stuck in a collective: do not tear the group down
        sys.stdout.flush()
        os._exit(1)


# ----------------------------------------------------------------------------- parent
def run_round(r: int, args: argparse.Namespace, base: Path, pbase: Path, s3: dict[str, Any] | None) -> list[dict]:
    """Round ``r``: one job; its folders (local under ``base``, posix persistent under ``pbase``)
    removed afterwards. The results of every rank."""
    import launcher

    root = base / f"round{r}"
    world = args.nodes * args.ranks_per_node
    backends: dict[str, Any] = {}
    persist = pbase / f"round{r}"
    for name in names(args):
        if name.startswith("posix"):
            backends[name] = {"url": {m: str(persist / name / m) for m in MODES},
                              "local": str(root / name / "node{node}"), "cold": str(persist / name),
                              "rate": float(name[len("posix"):]) * 1e6}
        else:
            assert s3 is not None
            backends[name] = {"url": {m: f"s3://{BUCKET}/round{r}-{m}" for m in MODES},
                              "local": str(root / name / "node{node}"), "cold": s3["data"],
                              "storage_options": s3["options"]}
    pairs = [("raw", "raw")] + [(b, m) for b in backends for m in MODES]
    k = r % len(pairs)
    spec = {"mib": args.mib, "ranks_per_node": args.ranks_per_node, "backends": backends,
            "raw": str(root / "raw" / "node{node}"),
            "order": pairs[k:] + pairs[:k], "restore_backends": list(backends)}
    res = root / "results"
    res.mkdir(parents=True)
    rank_env = {rank: {"CKPTLIB_NODE": str(rank // args.ranks_per_node)} for rank in range(world)}
    procs = launcher.start(lambda rank, port: [__file__, "--worker", str(rank), str(world), port, str(res),
                                               json.dumps(spec)], world, rank_env=rank_env)
    outcomes = launcher.finish("tiers bench round", procs, lambda rank: res / f"result-{rank}.json", JOB_TIMEOUT)
    results = []
    for o in outcomes:
        if o.result is None or "crash" in o.result:
            why = o.result["crash"] if o.result else "no result"
            raise SystemExit(f"round {r}, rank {o.rank} failed: {why}\n{o.log}")
        results.append(o.result)
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(persist, ignore_errors=True)
    return results


def names(args: argparse.Namespace) -> list[str]:
    """The persistent backends of a run: ``posix<MB/s>`` per ``--rate-mb``, then ``s3``."""
    out = [f"posix{rate:g}" for rate in args.rate_mb] if "posix" in args.backends else []
    return out + (["s3"] if "s3" in args.backends else [])


def summarize(rounds: list[list[dict]], backends: list[str]) -> dict[str, Any]:
    """Slowest rank per measurement and round; per-round ratios; median and min-max."""
    per_round: list[dict[str, dict[str, dict[str, float]]]] = []
    for results in rounds:
        m: dict[str, dict[str, dict[str, float]]] = {}
        for b in backends:
            m[b] = {mode: {k: max(x["saves"][f"{b}/{mode}"][k] for x in results)
                           for k in ("stall", "local", "persisted")} for mode in MODES}
            m[b]["restore"] = {s: max(x["restore"][f"{b}/{s}"]["seconds"] for x in results) for s in SCENARIOS}
            m[b]["raw"] = {"write": max(x["raw"] for x in results)}
        per_round.append(m)

    def spread(values: list[float]) -> dict[str, Any]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}

    seconds = {b: {group: {k: spread([m[b][group][k] for m in per_round]) for k in per_round[0][b][group]}
                   for group in per_round[0][b] if group != "raw"} for b in backends}
    seconds["raw"] = {"write": spread([per_round[i][backends[0]]["raw"]["write"] for i in range(len(rounds))])}
    ratios = {b: {name: spread([m[b][num[0]][num[1]] / m[b][den[0]][den[1]] for m in per_round])
                  for name, (num, den) in RATIOS.items()} for b in backends}
    return {"seconds": seconds, "ratios": ratios}


def table(summary: dict[str, Any], backends: list[str]) -> str:
    lines = ["| backend | measurement | median s | min-max s |", "|---|---|---:|---:|"]
    raw = summary["seconds"]["raw"]["write"]
    lines.append(f"| local disk | raw write+fsync, own + replica bytes | {raw['median']:.3f} | "
                 f"{raw['min']:.3f}-{raw['max']:.3f} |")
    for b in backends:
        for group, vals in summary["seconds"][b].items():
            for k, v in vals.items():
                lines.append(f"| {b} | {group} {k} | {v['median']:.3f} | {v['min']:.3f}-{v['max']:.3f} |")
    lines += ["", "| backend | ratio (per round) | median | min-max |", "|---|---|---:|---:|"]
    for b in backends:
        for name, v in summary["ratios"][b].items():
            lines.append(f"| {b} | {name} | {v['median']:.2f} | {v['min']:.2f}-{v['max']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=256.0, help="state size in MiB, all ranks together")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--rate-mb", type=float, nargs="+", default=[200.0, 25.0],
                    help="bandwidth limits of the posix persistent tier, MB/s per process (one backend each)")
    ap.add_argument("--backends", nargs="+", choices=("posix", "s3"), default=["posix", "s3"])
    ap.add_argument("--dir", default=None, help="where the local tier's folders go (default: under $TMPDIR)")
    ap.add_argument("--persist-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the posix persistent tier's folders go (default: /dev/shm, so they do not "
                         "share the local tier's disk; the bandwidth limit stands for the shared file system)")
    ap.add_argument("--json", default=None, help="default: bench/results/tiers-<date>.json")
    args = ap.parse_args()
    if args.nodes < 2 or args.ranks_per_node < 1 or args.rounds < 1:
        ap.error("--nodes >= 2 (replicas go to another node), --ranks-per-node >= 1, --rounds >= 1")

    started, load_start, t0 = datetime.now(UTC), os.getloadavg(), time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="ckptlib-bench-tiers-", dir=args.dir))
    pbase = Path(tempfile.mkdtemp(prefix="ckptlib-bench-tiers-", dir=args.persist_dir)) if args.persist_dir else base
    server = None
    rounds: list[list[dict]] = []
    try:
        s3 = None
        if "s3" in args.backends:
            from backends.servers import SeaweedServer

            server = SeaweedServer(base / "weed").start()
            server.create_bucket(BUCKET)
            s3 = {"options": server.storage_options(), "data": str(base / "weed" / "data")}
        for r in range(args.rounds):
            rounds.append(run_round(r, args, base, pbase, s3))
            print(f"round {r + 1}/{args.rounds} done ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(pbase, ignore_errors=True)
    load_end = os.getloadavg()
    summary = summarize(rounds, names(args))
    first = rounds[0][0]
    report = {
        "argv": sys.argv, "started": started.isoformat(timespec="seconds"),
        "wall_s": time.monotonic() - t0, "loadavg_start": load_start, "loadavg_end": load_end,
        "cpus": os.cpu_count(), "world": args.nodes * args.ranks_per_node, "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node, "rounds": args.rounds, "rate_mb_s": args.rate_mb,
        "persist_dir": str(pbase.parent), "local_dir": str(base.parent),
        "state_bytes": sum(res["bytes"] for res in rounds[0]), "bytes_per_rank": first["bytes"],
        "bitwise": all(res["bitwise"] for results in rounds for res in results),
        "throttled_bytes": [res["throttled_bytes"] for results in rounds for res in results],
        **summary,
    }
    path = Path(args.json) if args.json else HERE / "results" / f"tiers-{started:%Y-%m-%d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, {report['state_bytes'] / 2**20:.0f} MiB state, "
          f"{args.rounds} rounds, posix tiers at {args.rate_mb} MB/s per process; load average "
          f"{load_start[0]:.1f} -> {load_end[0]:.1f}; {report['wall_s']:.0f} s; restores bitwise: "
          f"{report['bitwise']}")
    print(table(summary, names(args)))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
