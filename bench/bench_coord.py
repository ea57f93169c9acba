"""What coordination costs per save, as ranks grow: store round trips, bytes, connections and
threads, per rank and at the coordinator; save and meeting latency.

Two sources, one table (docs/scale.md, "Coordination at scale"):

- ``real``: W real gloo processes on this machine (W = 2 ... 32), each saving a small sharded
  state (``--mib`` in all, default 4) with ``CheckpointManager`` (synchronous waits), after one
  warm-up save. The job's store is wrapped in a counter (``_default_store``, the patch point of
  ``ckptlib.coord.torch_coordinator``) that counts every round trip by kind and the bytes set
  and read; ``Store.clone`` counts a connection; ``threading.Thread.start`` counts a thread.
  Heartbeats (keys ``ckptlib/hb/``, or the old ``/hb/``) are counted apart, per second.
  Store memory: the keys the job's store holds (``num_keys`` on rank 0, its host) after the
  saves minus before, per save (settled: counted after a barrier and half a second).
  CPU floor (``cpu_floor_s``): the CPU seconds every process of the plain job spent per save
  (the benchmark's barrier included), summed and divided by the machine's cores: the least wall
  time the save can take here. A summary after the last world gives each save as a multiple of
  the smallest world's and of its floor: where save/floor is near 1, the save is bound by CPU
  on this machine, and its ratio to a 2-rank save (bound by writing its bytes) moves with how
  busy the machine is (docs/scale.md, "On a quiet machine").
  Bare floor (``bare_save_s``, ``bare_cpu_s``): a third job of the same ranks and bytes doing
  the least a sharded save must do, with no library: each rank writes its shard to a file of
  its own and fsyncs it, counts itself in on the store (one ``add``), rank 0 then writes a
  manifest (fsync, rename, folder fsync) and sets a key every rank waits on. Its ratio across
  worlds is what this machine allows a save to scale by; ours against it is the library's cost.
  Breakdown (``--breakdown``, ``breakdown``): a fourth job, plain, whose ranks wrap the save's
  steps (``BREAKDOWN``) to add up each step's thread CPU (``time.thread_time``: user and kernel
  time of the thread running it) and read every live thread's CPU from ``/proc`` (the store's
  server thread on rank 0 is ``pt_tcpstore_uv``; each Python thread the job starts is given its
  own name there, ``_name_threads``; ``python`` is the training thread): where each
  rank's CPU per save goes, the coordinator apart (docs/scale.md, "Where a rank's CPU goes").
  Latency: the median seconds of ``save().wait()`` on rank 0 over ``--saves`` saves, and of one
  meeting (an exchange in a session of its own) over 20 meetings, measured in a second job of
  the same saves without the counting wrapper (``save_s``, ``meeting_s``: what a user sees; the
  counted job's own are ``counted_save_s``, ``counted_meeting_s``), and how long ``save()``
  itself held the training thread (``call_s``: the median over every rank's saves in the plain
  job; the summary's ``save()`` column). The job's span (``job_save_s``, and
  ``bare_job_save_s`` for the bare job): per save, from the first rank's ``save()`` to the
  last rank's return from its wait (``time.monotonic`` is one clock for every process of the
  machine), the median over saves: rank 0's window alone would hide a protocol that lets the
  coordinator return before the others have their answer. ``--tree DIR`` runs another
  checkout's ckptlib (``PYTHONPATH``) under the same harness: the "before" columns.
- ``rounds``: latency only, as the throughput benchmarks measure it: ``--rounds`` rounds, each
  running the plain job (without the counts' pauses and meetings) and the bare job at every
  world, the worlds' order alternated between rounds; each save is divided by the same round's
  save at the smallest world, and per world the median ratio over rounds is reported, with its
  least and most and how many rounds were within 3x (``rounds()``: why a single run's ratio
  measures the disk's drift as much as the code). Each job times ``--saves`` saves started
  after the benchmark's barrier and as many started at agreed slots on the machine's clock, in
  turn (``_Starts``; the ``clock_`` figures).
- ``sim``: the same save on W simulated ranks (ckptlib/testing/simulation.py; W = 256 ...
  4,096): the real save flow's store calls, counted per rank, and its virtual latency with a
  store that serves one request at a time (``--service`` seconds each, plus ``--per-key`` per
  key of a batch) behind ``--rtt`` of network.

    python bench/bench_coord.py real [--worlds 2 4 8 16 32] [--saves 5] [--tree DIR] [--json OUT]
    python bench/bench_coord.py rounds [--worlds 2 4 8 16 32] [--rounds 10] [--saves 20] [--json OUT]
    python bench/bench_coord.py sim [--worlds 256 1024 4096] [--json OUT]
    python bench/bench_coord.py plot RESULTS.json... --out docs/img/coord-scale.png
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

LOCAL_CALLS = {"set_timeout", "timeout", "host", "port", "libuvBackend", "has_extended_api"}


class Counting:
    """A store wrapper counting round trips (by kind), bytes, and connections (clones)."""

    def __init__(self, inner: Any, counts: collections.Counter, lock: threading.Lock) -> None:
        self._inner, self._counts, self._lock = inner, counts, lock

    def clone(self) -> Counting:
        with self._lock:
            self._counts["connections"] += 1
        return Counting(self._inner.clone(), self._counts, self._lock)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr) or name in LOCAL_CALLS:
            return attr

        def call(*a: Any, **k: Any) -> Any:
            key = str(a[0]) if a else ""
            beat = "hb/" in key and name == "add"
            sent = 0
            if name in ("set", "append") and len(a) > 1:
                sent = len(a[1])
            elif name == "multi_set" and len(a) > 1:
                sent = sum(len(v) for v in a[1])
            out = attr(*a, **k)
            got = len(out) if name == "get" else sum(len(v) for v in out) if name == "multi_get" else 0
            with self._lock:
                if beat:
                    self._counts["beats"] += 1
                else:
                    self._counts["calls"] += 1
                    self._counts[f"call:{name}"] += 1
                    self._counts["bytes"] += sent + got
            return out

        return call


BREAKDOWN = [  # (module, owner, attribute, label): the steps --breakdown times (those the tree has); they nest as indented
    ("ckptlib.manager", "CheckpointManager", "save", "save() on the caller's thread"),
    ("ckptlib.engine.snapshot", "Snapshot", "stage", "  of which the snapshot copy"),
    ("ckptlib.manager", "CheckpointManager", "_persist", "the persist thread"),
    ("ckptlib.engine.save", "SaveSession", "begin", "  open the save (staging folder, one share)"),
    ("ckptlib.engine.save", None, "plan_items", "  plan (one report, one answer)"),
    ("ckptlib.engine.save", None, "_plan", "  plan (one report, one answer)"),  # its name before 1ed59de (--tree)
    ("ckptlib.engine.save", "SaveSession", "write", "  payload file: create, write, checksum, fsync"),
    ("ckptlib.engine.save", "SaveSession", "finish", "  finish: index, report done, commit, share the outcome"),
    ("ckptlib.engine.save", "SaveSession", "write_index", "    of which the piece index: build, write, fsync"),
    ("ckptlib.engine.save", "SaveSession", "close", "  leave the session"),
    ("ckptlib.manager", "CheckpointManager", "_after_commit", "  retention and clean-up (coordinator)"),
]


def _time_steps(acc: collections.defaultdict[str, float]) -> None:
    """Wrap each ``BREAKDOWN`` step so that the thread CPU it takes is added to ``acc[label]``."""
    import importlib

    for module, owner, attr, label in BREAKDOWN:
        obj: Any = importlib.import_module(module)
        obj = getattr(obj, owner) if owner else obj
        if not hasattr(obj, attr):
            continue  # a name another tree (--tree) does not have
        found = obj.__dict__.get(attr) if isinstance(obj, type) else None
        fn = found.__func__ if isinstance(found, classmethod) else getattr(obj, attr)

        def timed(*a: Any, _fn: Any = fn, _label: str = label, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                acc[_label] += time.thread_time() - t

        setattr(obj, attr, classmethod(timed) if isinstance(found, classmethod) else timed)


def _thread_cpu() -> dict[str, tuple[str, float]]:
    """Every live thread of this process: id -> (name, CPU seconds, user and kernel). From
    ``schedstat`` (the scheduler's run time, in nanoseconds); ``stat``'s clock ticks (10 ms)
    where the kernel has no ``schedstat``."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    used = int(f.read().split()[0]) / 1e9
            except FileNotFoundError:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                used = (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue  # ended meanwhile
        out[tid] = (name, used)
    return out


def _name_threads() -> None:
    """Breakdown: every Python thread started from now on carries its own name in ``/proc``
    (``comm``, 15 bytes: ``ckptlib-store``, ``ckptlib-pulse``, ``ckptlib-persist``...), so that
    its CPU is counted apart; Python 3.11 leaves them all ``python`` (then only the training
    thread is)."""
    import ctypes

    prctl = ctypes.CDLL(None).prctl
    run = threading.Thread.run

    def named(self: threading.Thread) -> None:
        prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        run(self)

    threading.Thread.run = named  # type: ignore[method-assign]


def _shard_rows(world: int, mib: float) -> int:
    """Rows of the ``(rows, 256)`` float32 tensor sharded over ``world`` ranks (``mib`` in all)."""
    return max(world, int(mib * (1 << 20) / 4 / 256) // world * world)


CLOCK_GAP = 0.2
"""Seconds between two clock-started saves' slots (``_Starts``): room for a barrier-started save
and a clock-started one, each well under 0.1 s at 32 ranks here."""


class _Starts:
    """How each timed save starts, on every rank alike. ``alternate`` false: every save after a
    gloo barrier (``real``). ``alternate`` true (``rounds``): even saves after the barrier, odd
    ones at a slot on the machine's clock that every rank knows in advance (rank 0's
    ``time.monotonic`` plus half a second, broadcast once, then every ``CLOCK_GAP``; one clock for
    every process here). A gloo barrier of 32 processes on 2 cores lets them go over several
    milliseconds while its last messages still take CPU; a clock start has every rank call
    ``save()`` at the same instant, as after a training step, so the save is timed without the
    benchmark's barrier in it. Both are reported (``rounds``), side by side from the same
    processes. A rank that reaches a slot after it passed counts it in ``late``."""

    def __init__(self, dist: Any, alternate: bool) -> None:
        self.dist, self.alternate, self.late = dist, alternate, 0
        self.origin = time.monotonic() + 0.5
        if alternate:  # rank 0's origin, on every rank
            import torch

            t = torch.tensor([self.origin], dtype=torch.float64)
            dist.broadcast(t, 0)
            self.origin = float(t.item())

    def wait(self, i: int) -> str:
        """Block until save ``i`` may start; its kind: ``""`` (barrier) or ``"clock_"``."""
        if not self.alternate or i % 2 == 0:
            self.dist.barrier()
            return ""
        slot = self.origin + i * CLOCK_GAP
        left = slot - time.monotonic()
        if left > 0:
            time.sleep(left)
        else:
            self.late += 1
        return "clock_"


def worker(rank: int, world: int, port: int, root: str, mib: float, saves: int, out: str, mode: str) -> None:
    """One rank. ``mode``: ``counted``, through the counting store and ``Thread.start``; ``plain``
    (the latency a user sees: the counting wrapper adds a Python layer and a lock to every
    call); ``breakdown``, plain with each step's CPU added up (module docstring); ``latency``,
    plain without the store-key count's pauses and the meetings, each save timed after a barrier
    and after a clock start in turn, ``saves`` of each (``rounds``, ``_Starts``)."""
    counted = mode == "counted"
    import torch
    import torch.distributed as dist

    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    start_thread = threading.Thread.start

    def counted_start(self: threading.Thread, *a: Any, **k: Any) -> None:
        with lock:
            counts["threads"] += 1
        start_thread(self, *a, **k)

    import ckptlib
    import ckptlib.coord.torch_coordinator as tc

    real = tc._default_store
    wrapped: dict[str, Any] = {}

    def counted_store() -> Any:
        if "s" not in wrapped:
            wrapped["s"] = Counting(real(), counts, lock)
        return wrapped["s"]

    if mode == "breakdown":
        _name_threads()
    if counted:
        threading.Thread.start = counted_start  # type: ignore[method-assign]
        tc._default_store = counted_store
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    rows = _shard_rows(world, mib)
    local = torch.randn(rows // world, 256)
    state = {"w": ckptlib.Shard(local, (rows, 256), (rank * (rows // world), 0)), "b": torch.ones(256), "step": 0}
    mgr = ckptlib.CheckpointManager(root)  # as shared/tools/count-store-worker.py: no retention
    mgr.save(1, state).wait(timeout=600)  # warm-up: the coordinator is made here
    dist.barrier()
    if mode != "latency":
        time.sleep(2.5)  # as below: the warm-up's spent keys are deleted
    keys0 = real().num_keys() if rank == 0 else 0  # rank 0 hosts the job's store
    with lock:
        base = counts.copy()
    steps: collections.defaultdict[str, float] = collections.defaultdict(float)
    threads0: dict[str, tuple[str, float]] = {}
    if mode == "breakdown":
        _time_steps(steps)
        threads0 = _thread_cpu()
    starts = _Starts(dist, mode == "latency")
    timed: dict[str, list] = collections.defaultdict(list)
    t_base = time.monotonic()
    cpu0 = time.process_time()
    calls = []
    for i in range(saves * (2 if starts.alternate else 1)):
        kind = starts.wait(i)
        t0 = time.monotonic()
        handle = mgr.save(2 + i, state)
        calls.append(time.monotonic() - t0)  # how long save() held the training thread
        handle.wait(timeout=600)
        timed[kind + "save_s"].append(time.monotonic() - t0)
        timed[kind + "spans"].append((t0, time.monotonic()))
    window = time.monotonic() - t_base
    cpu = (time.process_time() - cpu0) / len(calls)
    if mode == "breakdown":  # threads alive now, but the persist thread: its saves are counted in their steps
        worker = getattr(mgr, "_worker", None)  # older trees: a thread per save, ended by now
        persist = getattr(getattr(worker, "_thread", None), "native_id", None)
        for tid, (name, used) in _thread_cpu().items():
            if persist is None or int(tid) != persist:
                steps[f"thread {name}"] += used - threads0.get(tid, (name, 0.0))[1]
    dist.barrier()
    if mode != "latency":
        time.sleep(2.5)  # spent keys are deleted at each process's next heartbeat (every 2 s here)
    keys = (real().num_keys() - keys0) / len(calls) if rank == 0 else 0.0
    dist.barrier()  # nobody starts the meetings below before rank 0 has counted
    with lock:
        diff = {k: (counts[k] - base.get(k, 0)) for k in counts}
    meet = _meetings(mgr.coordinator, 20) if mode != "latency" else []
    mgr.close()
    per_save = {k: v / len(calls) for k, v in diff.items() if k != "beats"}
    per_save["beats_per_s"] = diff.get("beats", 0) / window
    per_save["cpu_s"] = cpu
    per_save.update({f"step:{k}": v / len(calls) for k, v in steps.items()})
    per_save["store_keys_added"] = keys
    per_save["connections_total"] = counts["connections"] + 1
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "per_save": per_save, "call_s": calls, "meeting_s": meet, "late": starts.late,
                   **timed}, f)
    dist.barrier()
    os._exit(0)


def bare_worker(rank: int, world: int, port: int, root: str, mib: float, saves: int, out: str,
                alternate: bool = False) -> None:
    """One rank of the bare floor job (module docstring): the same shard bytes as ``worker``,
    the least a committed sharded save needs, timed and started like ``worker`` (``alternate``:
    barrier and clock starts in turn, as its ``latency`` mode)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    store = dist.distributed_c10d._get_default_store()
    rows = _shard_rows(world, mib)
    payload = torch.randn(rows // world, 256).numpy().tobytes() + (torch.ones(256).numpy().tobytes() if rank == 0 else b"")

    def save(step: int) -> None:
        folder = f"{root}/step-{step}"
        os.makedirs(folder, exist_ok=True)
        fd = os.open(f"{folder}/rank-{rank}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        if store.add(f"bare/in/{step}", 1) == world:
            store.set(f"bare/all/{step}", "1")
        if rank == 0:
            store.wait([f"bare/all/{step}"])
            with open(f"{folder}/.manifest.tmp", "w") as f:
                json.dump({"step": step, "world": world, "files": world}, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(f"{folder}/.manifest.tmp", f"{folder}/manifest.json")
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            store.set(f"bare/commit/{step}", "1")
        else:
            store.wait([f"bare/commit/{step}"])

    save(1)  # warm-up, as ``worker``
    dist.barrier()
    starts = _Starts(dist, alternate)
    timed: dict[str, list] = collections.defaultdict(list)
    cpu0 = time.process_time()
    n = saves * (2 if alternate else 1)
    for i in range(n):
        kind = starts.wait(i)
        t0 = time.monotonic()
        save(2 + i)
        timed[kind + "save_s"].append(time.monotonic() - t0)
        timed[kind + "spans"].append((t0, time.monotonic()))
    cpu = (time.process_time() - cpu0) / n
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "per_save": {"cpu_s": cpu}, "late": starts.late, **timed}, f)
    dist.barrier()
    os._exit(0)


def _meetings(coord: Any, n: int) -> list[float]:
    """Seconds of one exchange each: in a session of the new API, else the old coordinator's."""
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        if hasattr(coord, "session"):
            with coord.session("bench", coord.deadline(60)) as s:
                s.exchange(s.rank)
        else:
            from ckptlib.coord.coordinator import liveness_session  # type: ignore[attr-defined]  # old trees (--tree)

            with liveness_session(coord, "bench"):
                coord.exchange(coord.rank, time.monotonic() + 60)
        out.append(time.monotonic() - t0)
    return out


def _job_spans(res: list[dict[str, Any]], key: str = "spans") -> float:
    """The median over saves of each save's job-wide span: from the first rank's ``save()`` to
    the last rank's return from its wait (``time.monotonic`` is one clock for every process of
    the machine): how long the job, not one rank, waited for the save."""
    n = len(res[0][key])
    return statistics.median(max(x[key][i][1] for x in res) - min(x[key][i][0] for x in res)
                             for i in range(n))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(world: int, saves: int, mib: float, tree: str | None, where: str | None, mode: str,
         ) -> list[dict[str, Any]]:
    """One job of ``world`` ranks: every rank's result. ``mode``: ``counted``, ``plain`` or
    ``breakdown`` (``worker``), or ``bare`` (``bare_worker``: no library)."""
    with tempfile.TemporaryDirectory(dir=where) as d:
        port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(world)}
        if tree:
            env["PYTHONPATH"] = os.path.abspath(tree)
        procs = [subprocess.Popen([sys.executable, __file__, "_worker", str(r), str(world), str(port), d + "/ck",
                                   str(mib), str(saves), d + "/out", mode], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
        logs = [p.communicate(timeout=1800)[0].decode(errors="replace") for p in procs]
        results = []
        for r in range(world):
            try:
                with open(f"{d}/out.{r}.json") as f:
                    results.append(json.load(f))
            except FileNotFoundError:
                raise SystemExit(f"world {world}: rank {r} wrote no result:\n{logs[r][-3000:]}") from None
    return results


def real(worlds: list[int], saves: int, mib: float, tree: str | None, where: str | None = None,
         breakdown: bool = False) -> list[dict[str, Any]]:
    """Per world: the counted job (store traffic, threads, keys; its latencies are through the
    counting wrapper), then a plain job of the same saves (the latencies a user sees), then the
    bare floor job (no library), then with ``breakdown`` the breakdown job."""
    rows = []
    for world in worlds:
        results = _job(world, saves, mib, tree, where, "counted")
        plain = _job(world, saves, mib, tree, where, "plain")
        bare = _job(world, saves, mib, None, where, "bare")
        coord, others = results[0]["per_save"], [x["per_save"] for x in results[1:]]

        def avg(key: str, others: list[dict[str, float]] = others) -> float:
            return statistics.mean(o.get(key, 0) for o in others)

        row = {
            "source": "real", "tree": tree or "HEAD", "world": world,
            "save_s": statistics.median(plain[0]["save_s"]),
            "job_save_s": _job_spans(plain),
            "meeting_s": statistics.median(plain[0]["meeting_s"]),
            "counted_save_s": statistics.median(results[0]["save_s"]),
            # save() on the training thread (until it returns), median over every rank's saves
            "call_s": statistics.median(c for x in plain for c in x["call_s"]),
            "counted_meeting_s": statistics.median(results[0]["meeting_s"]),
            "cpu_s_plain": {"coordinator": round(plain[0]["per_save"]["cpu_s"], 4),
                            "other_mean": round(statistics.mean(x["per_save"]["cpu_s"] for x in plain[1:]), 4)},
            "coordinator": {k: round(v, 2) for k, v in coord.items()},
            "other_mean": {k: round(avg(k), 2) for k in sorted({k for o in others for k in o})},
            "other_max_calls": max(o.get("calls", 0) for o in others),
        }
        # What the save's CPU alone needs on this machine: every process's CPU per save (plain job,
        # the benchmark's barrier included) summed and spread over the cores. A save near this
        # floor is bound by CPU, not by waiting; its ratio to a small world's save then measures
        # the cores, and how busy the machine is, more than the protocol.
        cpu_all = plain[0]["per_save"]["cpu_s"] + sum(x["per_save"]["cpu_s"] for x in plain[1:])
        row["cpu_floor_s"] = round(cpu_all / (os.cpu_count() or 1), 4)
        row["bare_save_s"] = statistics.median(bare[0]["save_s"])
        row["bare_job_save_s"] = _job_spans(bare)
        row["bare_cpu_s"] = {"coordinator": round(bare[0]["per_save"]["cpu_s"], 4),
                             "other_mean": round(statistics.mean(x["per_save"]["cpu_s"] for x in bare[1:]), 4)}
        if breakdown:
            steps = _job(world, saves, mib, tree, where, "breakdown")

            def step_ms(res: list[dict[str, Any]]) -> dict[str, float]:
                keys = {k for x in res for k in x["per_save"] if k.startswith("step:")}
                return {k[5:]: round(1000 * statistics.mean(x["per_save"].get(k, 0.0) for x in res), 3)
                        for k in sorted(keys)}

            row["breakdown_ms"] = {"coordinator": step_ms(steps[:1]), "other_mean": step_ms(steps[1:]),
                                   "cpu_ms": {"coordinator": round(1000 * steps[0]["per_save"]["cpu_s"], 3),
                                              "other_mean": round(1000 * statistics.mean(
                                                  x["per_save"]["cpu_s"] for x in steps[1:]), 3)}}
            _print_breakdown(row)
        rows.append(row)
        print(f"{row['tree']} world={world}: save {row['save_s']:.3f}s, meeting {row['meeting_s'] * 1000:.1f}ms "
              f"(counted: {row['counted_save_s']:.3f}s, {row['counted_meeting_s'] * 1000:.1f}ms) | "
              f"coordinator {coord.get('calls', 0):.0f} calls, {coord.get('bytes', 0) / 1024:.1f} KiB, "
              f"{coord.get('connections', 0):.1f} new conns, {coord.get('threads', 0):.1f} threads | other ranks "
              f"{avg('calls'):.1f} calls, {avg('bytes') / 1024:.1f} KiB, {avg('connections'):.1f} new conns, "
              f"{avg('threads'):.1f} threads | beats/s/rank {avg('beats_per_s'):.2f} | CPU s/save: coordinator "
              f"{coord.get('cpu_s', 0):.3f}, other ranks {avg('cpu_s'):.3f} | store keys added per save "
              f"{coord.get('store_keys_added', 0):.1f}", flush=True)
    _summary(rows)
    return rows


def _print_breakdown(row: dict[str, Any]) -> None:
    """One world's CPU per save by step (ms): the coordinator, and the mean of every other rank."""
    b = row["breakdown_ms"]
    print(f"\nworld={row['world']}: CPU per save (ms) {'coordinator':>14} {'other ranks':>12}")
    labels = list(dict.fromkeys(label for *_, label in BREAKDOWN))
    labels += sorted({k for side in ("coordinator", "other_mean") for k in b[side]} - set(labels))
    for label in labels:
        print(f"  {label:<52} {b['coordinator'].get(label, 0.0):>8.3f} {b['other_mean'].get(label, 0.0):>12.3f}")
    print(f"  {'all of the process (user + kernel)':<52} {b['cpu_ms']['coordinator']:>8.3f} {b['cpu_ms']['other_mean']:>12.3f}")


def _summary(rows: list[dict[str, Any]]) -> None:
    """Each world's plain save against the smallest world's, against its CPU floor, and the bare
    floor job's save (no library) against the smallest world's bare save."""
    base = rows[0]
    print(f"\n{'ranks':>6} {'save':>8} {'x ' + str(base['world']) + ' ranks':>10} {'CPU floor':>10} {'save/floor':>10}"
          f" {'bare':>8} {'bare x ' + str(base['world']):>9} {'save/bare':>10} {'CPU/rank':>9} {'bare':>7}"
          f" {'save()':>8} {'job save':>9} {'x ' + str(base['world']):>6} {'bare job':>9} {'x ' + str(base['world']):>6}")
    for r in rows:
        bare = r["bare_save_s"]
        print(f"{r['world']:>6} {r['save_s']:>7.3f}s {r['save_s'] / base['save_s']:>9.1f}x "
              f"{r['cpu_floor_s']:>9.3f}s {r['save_s'] / max(r['cpu_floor_s'], 1e-9):>9.1f}x"
              f" {bare:>7.4f}s {bare / base['bare_save_s']:>8.1f}x {r['save_s'] / bare:>9.1f}x "
              f"{r['cpu_s_plain']['other_mean'] * 1e3:>6.2f}ms {r['bare_cpu_s']['other_mean'] * 1e3:>5.2f}ms"
              f" {r['call_s'] * 1e3:>6.2f}ms {r['job_save_s']:>8.3f}s {r['job_save_s'] / base['job_save_s']:>5.1f}x"
              f" {r['bare_job_save_s']:>8.4f}s {r['bare_job_save_s'] / base['bare_job_save_s']:>5.1f}x")


LATENCY = tuple(f"{lib}{start}{what}" for lib in ("", "bare_") for start in ("", "clock_")
                for what in ("save_s", "job_save_s"))
"""What ``rounds`` measures per world and round: rank 0's save (``save().wait()``) and the job's
span (first ``save()`` to last return), for ckptlib and for the bare job (``bare_``: no library),
started after the benchmark's barrier and at a clock slot (``clock_``: ``_Starts``)."""


def rounds(worlds: list[int], n: int, saves: int, mib: float, tree: str | None, where: str | None,
           ) -> list[dict[str, Any]]:
    """Latency only, in ``n`` rounds: each round runs the plain job and the bare job at every
    world, worlds in ascending order in even rounds and descending in odd ones, plain and bare
    in turn first; each latency is divided by the same round's at the smallest world. The disk's
    ``fsync`` latency here drifts by 2x over minutes, and the smallest world's save is bound by
    it while the largest is bound by CPU: a ratio of two saves taken minutes apart measures the
    drift. Per world: every round's figures, and the median, least and most ratio over rounds."""
    per_round: list[dict[int, dict[str, float]]] = []
    for i in range(n):
        got: dict[int, dict[str, float]] = {}
        for world in (worlds if i % 2 == 0 else worlds[::-1]):
            kinds = [("latency", tree, ""), ("bare-latency", None, "bare_")]
            out: dict[str, float] = {}
            for mode, t, lib in (kinds if (i + world) % 2 == 0 else kinds[::-1]):
                res = _job(world, saves, mib, t, where, mode)
                for start in ("", "clock_"):
                    out[lib + start + "save_s"] = statistics.median(res[0][start + "save_s"])
                    out[lib + start + "job_save_s"] = _job_spans(res, start + "spans")
                out[lib + "late"] = sum(x["late"] for x in res)
            got[world] = out
        per_round.append(got)
        base = got[worlds[0]]
        print(f"round {i + 1}/{n}: " + " | ".join(
            f"{w}: {got[w]['save_s'] * 1e3:.1f} ms {got[w]['save_s'] / base['save_s']:.1f}x, job "
            f"{got[w]['job_save_s'] / base['job_save_s']:.1f}x, clock job "
            f"{got[w]['clock_job_save_s'] / base['clock_job_save_s']:.1f}x, bare job "
            f"{got[w]['bare_job_save_s'] / base['bare_job_save_s']:.1f}x" for w in worlds), flush=True)
    rows = []
    for world in worlds:
        row: dict[str, Any] = {"source": "rounds", "tree": tree or "HEAD", "world": world, "rounds": n, "saves": saves,
                               "late": sum(r[world]["late"] + r[world]["bare_late"] for r in per_round),
                               "per_round": [r[world] for r in per_round]}
        for k in LATENCY:
            ratios = [r[world][k] / r[worlds[0]][k] for r in per_round]
            row[k] = statistics.median(r[world][k] for r in per_round)
            row[f"{k}_ratio"] = {"median": round(statistics.median(ratios), 2), "min": round(min(ratios), 2),
                                 "max": round(max(ratios), 2), "within_3x": sum(x <= 3.0 for x in ratios)}
        rows.append(row)
    print(f"\nmedian over {n} rounds (least-most); ratios to the same round's {worlds[0]} ranks")
    for start, title in (("", "after the benchmark's barrier"), ("clock_", "at a clock slot")):
        print(f"\nstarted {title}:")
        print(f"{'ranks':>6} {'rank 0: save, x ' + str(worlds[0]):<28} {'job: save, x ' + str(worlds[0]):<28}"
              f" {'bare job: save, x ' + str(worlds[0]):<28}")
        for r in rows:
            def cell(k: str, r: dict[str, Any] = r) -> str:
                q = r[f"{k}_ratio"]
                return f"{r[k] * 1e3:>7.1f}ms {q['median']:.1f}x ({q['min']:.1f}-{q['max']:.1f})".ljust(28)

            print(f"{r['world']:>6} {cell(start + 'save_s')} {cell(start + 'job_save_s')} "
                  f"{cell('bare_' + start + 'job_save_s')}")
    print(f"slots reached late (clock starts; counted on every rank): {sum(r['late'] for r in rows)}")
    return rows


def sim(worlds: list[int], service: float, per_key: float, rtt: float) -> list[dict[str, Any]]:
    import logging

    logging.disable(logging.WARNING)
    from ckptlib.engine.save import SaveOptions, persist, prepare
    from ckptlib.format import layout
    from ckptlib.testing.sim_flows import state
    from ckptlib.testing.simulation import SimCoordinator, SimStorage, World

    rows = []
    for world in worlds:
        w = World(world, seed=1, dead_after=30.0, latency=rtt)
        w.service, w.per_key = service, per_key
        storage = SimStorage(w)
        coords = [SimCoordinator(w, r) for r in range(world)]
        flats = [prepare(state(r, world), r) for r in range(world)]
        t0 = time.monotonic()
        def save(r: int, storage: SimStorage = storage, flats: list = flats, coords: list = coords) -> Any:
            return persist(storage, layout.step_dir(1), flats[r], step=1, options=SaveOptions(num_files=1),
                           coordinator=coords[r])

        threads = [w.spawn(r, partial(save, r)) for r in range(world)]
        w.run(until=3600)
        errors = [t.error for t in threads if t.error is not None]
        if errors:
            raise SystemExit(f"simulated save at {world} ranks failed: {errors[0]}")
        calls: collections.Counter[int] = collections.Counter()
        for (r, op), n in w.calls.items():
            if op != "beat":
                calls[r] += n
        others = [calls[r] for r in range(1, world)]
        row: dict[str, Any] = {
               "source": "sim", "tree": "HEAD", "world": world, "save_s": max(t.ended_at or 0 for t in threads),
               "coordinator": {"calls": calls[0], "bytes": w.bytes_in[0] + w.bytes_out[0], "connections": 0,
                               "threads": 0},
               "other_mean": {"calls": statistics.mean(others),
                              "bytes": statistics.mean(w.bytes_in[r] + w.bytes_out[r] for r in range(1, world)),
                              "connections": 0, "threads": 0},
               "other_max_calls": max(others), "wall_s": round(time.monotonic() - t0, 1)}
        rows.append(row)
        print(f"sim world={world}: save {row['save_s'] * 1000:.1f} ms virtual | coordinator {calls[0]} calls, "
              f"{row['coordinator']['bytes'] / 1024:.1f} KiB | other ranks {row['other_mean']['calls']:.1f} calls "
              f"(max {row['other_max_calls']}), {row['other_mean']['bytes'] / 1024:.2f} KiB | wall {row['wall_s']}s",
              flush=True)
    return rows


def plot(paths: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for p in paths for r in json.loads(Path(p).read_text())["rows"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for tree in sorted({r["tree"] for r in rows}):
        mine = sorted((r for r in rows if r["tree"] == tree), key=lambda r: r["world"])
        label = "before" if tree != "HEAD" else "now"
        xs = [r["world"] for r in mine]
        a.plot(xs, [r["coordinator"]["calls"] for r in mine], "o-", label=f"coordinator ({label})")
        a.plot(xs, [r["other_mean"]["calls"] for r in mine], "s--", label=f"other rank, mean ({label})")
        real_rows = [r for r in mine if r["source"] == "real"]
        b.plot([r["world"] for r in real_rows], [r["save_s"] * 1000 for r in real_rows], "o-",
               label=f"save ({label})")
        b.plot([r["world"] for r in real_rows], [r["meeting_s"] * 1000 for r in real_rows], "s--",
               label=f"one exchange ({label})")
        counted = [r for r in real_rows if "counted_save_s" in r]
        if counted:  # like for like with runs that measured latency through the counter only
            b.plot([r["world"] for r in counted], [r["counted_save_s"] * 1000 for r in counted], "^:",
                   label=f"save, through the counter ({label})")
    a.set(xscale="log", yscale="log", xlabel="ranks (2-32 real, 256-4,096 simulated)", ylabel="store round trips per save",
          title="Store traffic per save")
    b.set(xscale="log", yscale="log", xlabel="ranks (real, on 2 cores)", ylabel="ms", title="Latency on this machine")
    worlds = sorted({r["world"] for r in rows if r["source"] == "real"})
    b.set_xticks(worlds, [str(w) for w in worlds])
    b.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        a = sys.argv[2:]
        if a[7].startswith("bare"):
            bare_worker(int(a[0]), int(a[1]), int(a[2]), a[3], float(a[4]), int(a[5]), a[6], a[7] == "bare-latency")
        else:
            worker(int(a[0]), int(a[1]), int(a[2]), a[3], float(a[4]), int(a[5]), a[6], a[7])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("real")
    r.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    r.add_argument("--saves", type=int, default=5)
    r.add_argument("--mib", type=float, default=4.0)
    r.add_argument("--tree", default=None, help="another checkout to measure (the 'before' columns)")
    r.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp folder)")
    r.add_argument("--breakdown", action="store_true", help="one more job: each step's CPU per save")
    r.add_argument("--json", default=None)
    o = sub.add_parser("rounds", help="latency only, in rounds alternating the worlds' order (rounds())")
    o.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    o.add_argument("--rounds", type=int, default=10)
    o.add_argument("--saves", type=int, default=20)
    o.add_argument("--mib", type=float, default=4.0)
    o.add_argument("--tree", default=None, help="another checkout to measure")
    o.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp folder)")
    o.add_argument("--json", default=None)
    s = sub.add_parser("sim")
    s.add_argument("--worlds", type=int, nargs="+", default=[256, 1024, 4096])
    s.add_argument("--service", type=float, default=20e-6, help="store seconds per request")
    s.add_argument("--per-key", type=float, default=2e-6, help="store seconds per key of a batch")
    s.add_argument("--rtt", type=float, default=100e-6, help="network seconds per call (uniform 0..rtt)")
    s.add_argument("--json", default=None)
    q = sub.add_parser("plot")
    q.add_argument("paths", nargs="+")
    q.add_argument("--out", default="docs/img/coord-scale.png")
    args = p.parse_args()
    if args.cmd == "plot":
        plot(args.paths, args.out)
        return
    if args.cmd == "real":
        rows = real(args.worlds, args.saves, args.mib, args.tree, args.dir, args.breakdown)
    elif args.cmd == "rounds":
        rows = rounds(args.worlds, args.rounds, args.saves, args.mib, args.tree, args.dir)
    else:
        rows = sim(args.worlds, args.service, args.per_key, args.rtt)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.node(), "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M"),
                       "argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
