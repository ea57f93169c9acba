"""The cluster simulator behind ``ckptlib plan``: a training run with random failures.

Pure Python, deterministic for a seed, no torch (``ckptlib plan`` must start fast). Called by
:mod:`ckptlib.cli.plan`, ``bench/plot_plan.py`` and ``bench/bench_plan_vs_measured.py``; the
model and its inputs are documented in docs/scale.md.

The run (one :class:`Scenario`): after each (re)start the loop computes ``interval_s``, then a
save blocks it for ``stall_s``; the save is durable on its first tier ``durable_s`` after it
started, and a save waits for the previous one, so save ``k`` starts at
``start + T + k * P`` with ``P = max(T + C, L)`` (as ``CheckpointManager`` with
``in_flight="wait"``). With a node-local tier (``tiered=True``) every ``persist_every``-th save
is drained in the background to the persistent tier, taking ``persist_s`` after it is local,
one drain at a time. Failures are a Poisson process (mean ``mtbf_s``), also during restarts.
A failure rolls back to the newest durable save: on the local tier, unless the failure lost the
local copies too (probability ``local_loss``), then to the newest persisted save; then the job
restarts (``restart_s``, or ``restart_persistent_s`` when it reads the persistent tier).

Between two failures the schedule is periodic, so each failure is handled in closed form:
the cost is O(failures), and thousands of failures per point take milliseconds.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ckptlib.schedule import check_positive


@dataclass(frozen=True)
class Scenario:
    """One configuration of the simulated run (all times in seconds)."""

    interval_s: float
    """Compute time between saves (T)."""
    stall_s: float
    """Training-loop stall per save (C)."""
    durable_s: float
    """From a save's start to durable on its first tier (L >= C)."""
    mtbf_s: float
    """Mean time between failures of the whole job (M)."""
    restart_s: float
    """From a failure to training again: detect, reschedule, initialise, load (R)."""
    tiered: bool = False
    """True: the first tier is node-local and drains to the persistent tier."""
    persist_every: int = 1
    """Tiered: every n-th save (counted from each restart) is drained."""
    persist_s: float = 0.0
    """Tiered: duration of one drain, from local durable to persisted."""
    local_loss: float = 0.0
    """Tiered: fraction of failures that also lose the node-local copies."""
    restart_persistent_s: float | None = None
    """Tiered: restart time when loading from the persistent tier (default ``restart_s``)."""

    def __post_init__(self) -> None:
        check_positive("interval_s", self.interval_s)
        check_positive("stall_s", self.stall_s, zero_ok=True)
        check_positive("durable_s", self.durable_s, zero_ok=True)
        check_positive("mtbf_s", self.mtbf_s)
        check_positive("restart_s", self.restart_s, zero_ok=True)
        check_positive("persist_s", self.persist_s, zero_ok=True)
        if self.restart_persistent_s is not None:
            check_positive("restart_persistent_s", self.restart_persistent_s, zero_ok=True)
        if type(self.persist_every) is not int or self.persist_every < 1:
            raise ValueError(f"persist_every must be an int >= 1, got {self.persist_every!r}")
        if not 0.0 <= self.local_loss <= 1.0:
            raise ValueError(f"local_loss must be within [0, 1], got {self.local_loss!r}")

    @property
    def period_s(self) -> float:
        """One save cycle once running: ``max(T + C, L)``."""
        return max(self.interval_s + self.stall_s, max(self.stall_s, self.durable_s))


@dataclass(frozen=True)
class SimResult:
    """What one simulation measured (fractions of wall time unless stated)."""

    goodput: float
    """Useful training (progress kept at the end) / wall time."""
    stall_fraction: float
    """Time the loop was blocked by saves (stall and waiting for the previous save)."""
    lost_fraction: float
    """Work computed and then lost to failures."""
    restart_fraction: float
    """Time spent restarting after failures."""
    failures: int
    lost_per_failure_s: float
    """Mean compute seconds redone per failure that hit training (not a restart)."""
    persistent_restores: int
    """Failures that had to restore from the persistent tier."""
    wall_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _progress(u: float, t: float, period: float) -> float:
    """Compute seconds done ``u`` seconds after a (re)start (cycles: wait/stall, then T)."""
    if u < t:
        return u
    k, w = divmod(u - t, period)
    return (k + 1) * t + max(0.0, w - (period - t))


def simulate(
    sc: Scenario, *, failures: int = 2000, seed: int = 0, horizon_s: float | None = None,
    failure_times: Sequence[float] | None = None,
) -> SimResult:
    """Simulate one run of ``horizon_s`` wall seconds (default ``failures`` x MTBF, so about
    that many failures) and return its accounting. Same inputs and seed -> same result.

    ``failure_times`` (seconds from the start, e.g. the kills of a real run) replaces the
    random failures: a replay of that run (bench/bench_plan_vs_measured.py).
    """
    if horizon_s is None:
        if type(failures) is not int or failures < 1:
            raise ValueError(f"failures must be an int >= 1, got {failures!r}")
        horizon_s = failures * sc.mtbf_s
    check_positive("horizon_s", horizon_s)
    rng = random.Random(seed)
    rate = 1.0 / sc.mtbf_s
    if failure_times is None:
        def next_failure(after: float) -> float:
            return after + rng.expovariate(rate)
    else:
        pending = deque(sorted(failure_times))

        def next_failure(after: float) -> float:  # peeks: a failure is dropped once passed
            while pending and pending[0] <= after:
                pending.popleft()
            return pending[0] if pending else math.inf
    t, p = sc.interval_s, sc.period_s
    lat = max(sc.stall_s, sc.durable_s)
    m = sc.persist_every if sc.tiered else 1
    drain_gap = max(m * p, sc.persist_s)
    first_drain = t + (m - 1) * p + lat + (sc.persist_s if sc.tiered else 0.0)
    restart_persistent = sc.restart_s if sc.restart_persistent_s is None else sc.restart_persistent_s

    start, base = 0.0, 0.0  # wall time training (re)started, progress it restarted from
    persisted = 0.0  # newest progress on the persistent tier (tiered runs)
    stalled = lost = restarting = 0.0
    n_fail = n_hit = n_persist = 0  # all failures; those that hit training (not a restart)
    while True:
        fail_at = next_failure(start)
        end = min(fail_at, horizon_s)
        done = _progress(end - start, t, p)
        stalled += (end - start) - done
        if fail_at >= horizon_s:
            base += done
            break
        n_fail += 1
        n_hit += 1
        u = fail_at - start
        k_local = math.floor((u - t - lat) / p) if u >= t + lat else -1
        local = base + (k_local + 1) * t  # base itself when no save of this stretch is durable
        if sc.tiered:
            if u >= first_drain:
                j = math.floor((u - first_drain) / drain_gap)
                persisted = max(persisted, base + (j + 1) * m * t)
            from_persistent = rng.random() < sc.local_loss
        else:
            from_persistent = False
        restored = persisted if from_persistent else local
        n_persist += from_persistent
        lost += base + done - restored
        # Restart; a failure during it starts it over (the clock does not stop).
        cost = restart_persistent if from_persistent else sc.restart_s
        now = fail_at
        while True:
            nxt = next_failure(now)
            if nxt >= now + cost or nxt >= horizon_s:  # done, or the run ends first
                now += cost
                break
            now = nxt
            n_fail += 1
        restarting += min(now, horizon_s) - fail_at
        if now >= horizon_s:
            base = restored
            break
        start, base = now, restored
    return SimResult(
        goodput=base / horizon_s, stall_fraction=stalled / horizon_s, lost_fraction=lost / horizon_s,
        restart_fraction=restarting / horizon_s, failures=n_fail,
        lost_per_failure_s=lost / max(1, n_hit), persistent_restores=n_persist, wall_s=horizon_s,
    )


GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """The inputs of ``ckptlib plan`` (docs/scale.md states each one and its default)."""

    params: float
    """Model parameters."""
    gpus: int
    mtbf_s: float
    """Mean time between failures of the whole job (from --mtbf-hours or rate x GPUs)."""
    bytes_per_param: float = 16.0
    """Checkpoint bytes per parameter (weights, fp32 master copy and Adam moments)."""
    gpus_per_node: int = 8
    snapshot_gbps: float = 10.0
    """Per-GPU device-to-host copy rate (GB/s): the stall when ``stall_s`` is not given."""
    persistent_gbps: float = 20.0
    """Aggregate write (and read) bandwidth of the persistent tier (GB/s)."""
    local_gbps: float | None = None
    """Per-node write (and read) bandwidth of the node-local tier (GB/s); None: no local tier."""
    replicas: int = 1
    """Copies of each node's local bytes written to other nodes (local tier)."""
    local_loss: float = 0.1
    """Fraction of failures that also lose the local copies (both holders of a piece down)."""
    restart_s: float = 300.0
    """Fixed part of a restart (detect, reschedule, initialise), before loading."""
    stall_s: float | None = None
    """Measured training-loop stall per save (overrides the snapshot_gbps estimate)."""
    save_s: float | None = None
    """Measured time to durable on the first tier (overrides the bandwidth estimate)."""

    def __post_init__(self) -> None:
        check_positive("params", self.params)
        if type(self.gpus) is not int or self.gpus < 1:
            raise ValueError(f"gpus must be an int >= 1, got {self.gpus!r}")
        if type(self.gpus_per_node) is not int or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}")
        if type(self.replicas) is not int or self.replicas < 0:
            raise ValueError(f"replicas must be an int >= 0, got {self.replicas!r}")
        for name in ("mtbf_s", "bytes_per_param", "snapshot_gbps", "persistent_gbps"):
            check_positive(name, getattr(self, name))
        check_positive("restart_s", self.restart_s, zero_ok=True)
        if self.local_gbps is not None:
            check_positive("local_gbps", self.local_gbps)
        for name in ("stall_s", "save_s"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name), zero_ok=True)
        if not 0.0 <= self.local_loss <= 1.0:
            raise ValueError(f"local_loss must be within [0, 1], got {self.local_loss!r}")

    @property
    def checkpoint_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    def derived(self) -> dict[str, float]:
        """Sizes and times the model derives from the inputs (seconds, bytes)."""
        total = self.checkpoint_bytes
        per_gpu, per_node = total / self.gpus, total / self.nodes
        stall = per_gpu / (self.snapshot_gbps * GB) if self.stall_s is None else self.stall_s
        persistent = total / (self.persistent_gbps * GB)
        out = {
            "checkpoint_bytes": total, "per_gpu_bytes": per_gpu, "per_node_bytes": per_node,
            "nodes": float(self.nodes), "mtbf_hours": self.mtbf_s / 3600.0, "stall_s": stall,
            "persistent_write_s": persistent, "restart_persistent_s": self.restart_s + persistent,
        }
        if self.local_gbps is None:
            out["durable_s"] = stall + persistent if self.save_s is None else max(stall, self.save_s)
        else:
            local = per_node * (1 + self.replicas) / (self.local_gbps * GB)
            out["durable_s"] = stall + local if self.save_s is None else max(stall, self.save_s)
            out["restart_local_s"] = self.restart_s + per_node / (self.local_gbps * GB)
        return out


def advise(cl: Cluster, *, failures: int = 5000, seed: int = 0) -> dict[str, Any]:
    """The recommended interval(s) for ``cl`` and their simulated outcome: a single-tier plan
    (every save to the persistent tier) and, with a local tier, a tiered plan (local saves,
    every ``persist_every``-th drained). Called by ``ckptlib plan`` and bench/plot_plan.py."""
    from ckptlib.schedule import first_order_goodput, optimal_interval

    d = cl.derived()
    # Single tier: every save goes to the persistent tier (with a local tier, --save-seconds
    # describes the local one, so the single-tier comparison uses the bandwidth estimate).
    single_l = d["stall_s"] + d["persistent_write_s"] if cl.local_gbps is not None else d["durable_s"]
    t1 = max(optimal_interval(d["stall_s"], single_l, cl.mtbf_s), 1e-3)
    single = Scenario(t1, d["stall_s"], single_l, cl.mtbf_s, d["restart_persistent_s"])
    plans = [_outcome("single-tier", single, failures, seed)]
    plans[0]["goodput_first_order"] = first_order_goodput(
        t1, d["stall_s"], single_l, cl.mtbf_s, d["restart_persistent_s"])
    if cl.local_gbps is not None:
        # The local tier absorbs the failures that keep local copies; a drain costs no stall,
        # so persist as often as the persistent tier keeps up (drains never queue).
        local_mtbf = cl.mtbf_s / max(1e-9, 1.0 - cl.local_loss)
        t2 = max(optimal_interval(d["stall_s"], d["durable_s"], local_mtbf), 1e-3)
        period = max(t2 + d["stall_s"], d["durable_s"])
        every = max(1, math.ceil(d["persistent_write_s"] / period))
        tiered = Scenario(
            t2, d["stall_s"], d["durable_s"], cl.mtbf_s, d["restart_local_s"], tiered=True,
            persist_every=every, persist_s=d["persistent_write_s"], local_loss=cl.local_loss,
            restart_persistent_s=d["restart_persistent_s"],
        )
        plans.append(_outcome("tiered", tiered, failures, seed))
    best = max(plans, key=lambda p: p["goodput"])
    warnings = []
    if best["goodput"] < LOW_GOODPUT:
        lead = (f"the best plan leaves only {100 * best['goodput']:.2f} % of wall time to training: with a job "
                f"MTBF of {cl.mtbf_s:.3g} s, most of it goes to ")
        if best["stall_s"] > cl.restart_s:  # the save's stall, not the restarts, is what is too long
            warnings.append(
                lead + f"saving (each save stalls training {best['stall_s']:.3g} s, longer than a restart); no "
                "checkpoint interval fixes that: shorten the stall (--stall-seconds: asynchronous saves, a "
                "faster snapshot) or make failures rarer")
        else:
            warnings.append(
                lead + f"restarts ({cl.restart_s:.3g} s each, before loading, and started over when a failure "
                "hits one); no checkpoint interval fixes that: shorten restarts (--restart-seconds) or make "
                "failures rarer")
    return {"derived": d, "plans": plans, "recommended": best["name"], "warnings": warnings}


LOW_GOODPUT = 0.5
"""Below this simulated goodput, :func:`advise` warns that restarts, not the interval, decide."""


def _outcome(name: str, sc: Scenario, failures: int, seed: int) -> dict[str, Any]:
    r = simulate(sc, failures=failures, seed=seed)
    every = sc.persist_every if sc.tiered else 1
    return {
        "name": name, "interval_s": sc.interval_s, "period_s": sc.period_s,
        "persist_every": every, "persist_interval_s": every * sc.period_s,
        "stall_s": sc.stall_s, "durable_s": sc.durable_s, **r.as_dict(),
    }
