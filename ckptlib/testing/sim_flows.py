"""Schedules of the simulation (:mod:`ckptlib.testing.simulation`): the real save, restore,
tier save and drain flows on simulated ranks, one seeded fault each, and the invariants every
schedule must keep.

:func:`run_schedule` picks, from its seed, a flow (``save``, ``save_v1``, ``restore``,
``tier_save``, ``drain``, ``meetings``), a world size, store latencies and one fault:

- ``none``; ``late`` (a rank reaches the flow late, alive);
- ``kill`` (a rank dies at its k-th store or storage call; rank 0 hosts the store);
- ``freeze`` (a rank stops at its k-th call, for half, twice or fifty times ``dead_after``);
- ``exit`` (the coordinator's process exits the instant its flow returns; the others' too).

and returns a :class:`Report` of what every rank concluded, what storage holds, and the
invariant violations found (:func:`violations`):

1. no live rank reports a committed step failed (a ``CommitError`` other than
   ``CommitUnknownError``, which only a tier save's rank of another node may raise);
2. no live rank reports an uncommitted step saved;
3. at most one manifest is ever committed per step;
4. every live rank's flow ends by its deadline (no thread of a live process still blocked);
5. a rank frozen longer than the liveness timeout is named, within it (twice it where a bulk
   transfer waits on it first: a tier save's replica stream), by every rank whose flow failed
   while it was frozen;
6. a restore (steps 2 and 3, and a newest step 4 damaged inside, which the ranks must find and
   pass over): every live rank returns the same step with the saved bytes, or every live rank
   raises;
7. with no fault before the flows returned (none, a late rank, exits after returning), no rank
   of any flow fails.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptlib.engine import resume as resume_flow
from ckptlib.engine.save import SaveOptions, persist, prepare
from ckptlib.errors import CheckpointError, CommitError, CommitUnknownError
from ckptlib.format import layout
from ckptlib.plan.flatten import PerRank, Shard
from ckptlib.testing.simulation import SimCoordinator, SimStorage, SimThread, World

FLOWS = ("save", "save_v1", "restore", "tier_save", "drain", "meetings")
FAULTS = ("none", "late", "kill", "freeze", "exit")
TIMEOUT = 60.0
"""The flows' own timeout (a save's ``timeout``, a restore's per-wait timeout)."""


@dataclass
class Fault:
    kind: str = "none"
    rank: int = 0
    step: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "exit":
            return "exit after return"
        if self.kind == "late":
            return f"rank {self.rank} late by {self.seconds:.1f}s"
        extra = f" for {self.seconds:.1f}s" if self.kind == "freeze" else ""
        return f"{self.kind} rank {self.rank} at call {self.step}{extra}"


@dataclass
class Report:
    seed: int
    flow: str
    world: int
    fault: Fault
    outcomes: dict[int, str] = field(default_factory=dict)
    """rank -> ``saved``, ``restored <step>``, ``drained``, ``ok``, ``unknown``, ``failed: ...``,
    ``dead``, ``hung``."""
    committed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    end: float = 0.0


def state(rank: int, world: int, step: int = 1) -> dict[str, Any]:
    """A small training state of ``rank``: a row-sharded tensor, a replicated one, a per-rank value."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    rep = torch.Generator().manual_seed(step)
    return {"w": Shard(torch.randn(4, 8, generator=g), (4 * world, 8), (4 * rank, 0)),
            "b": torch.randn(16, generator=rep), "step": step, "rng": PerRank(rank * 7 + step)}


def _empty(rank: int, world: int) -> dict[str, Any]:
    return {"w": Shard(torch.zeros(4, 8), (4 * world, 8), (4 * rank, 0)), "b": torch.zeros(16), "step": 0,
            "rng": PerRank(0)}


def pick(seed: int, flow: str | None = None, fault: str | None = None) -> tuple[str, int, Fault]:
    """The flow, world size and fault of schedule ``seed`` (``flow``/``fault``: forced)."""
    import random

    rng = random.Random(seed * 7919 + 17)
    flow = flow or rng.choice(FLOWS)
    world = 4 if flow in ("tier_save", "drain") else rng.choice((2, 3, 4))
    kind = fault or rng.choice(FAULTS)
    f = Fault(kind)
    if kind in ("kill", "freeze", "late"):
        f.rank = rng.randrange(world)
        f.step = rng.randint(1, 24)
        f.seconds = rng.choice((0.5, 2.0, 50.0)) * 5.0 if kind == "freeze" else rng.uniform(1.0, 12.0)
    return flow, world, f


def run_schedule(seed: int, flow: str | None = None, fault: str | None = None, dead_after: float = 5.0,
                 spec: Fault | None = None, world: int | None = None) -> Report:
    """One schedule (module docstring); ``spec``/``world`` replace the seed's fault and size."""
    flow, picked, f = pick(seed, flow, fault)
    f = spec or f
    world = world or picked
    rep = Report(seed, flow, world, f)
    w = World(world, seed=seed, dead_after=dead_after, latency=0.003)
    coords = [SimCoordinator(w, r) for r in range(world)]
    setup, body, expect = _FLOWS[flow](w, coords)
    expect.fault_free = f.kind in ("none", "late", "exit")
    setup()
    starts = w.t
    bodies: dict[int, SimThread] = {}
    for r in range(world):
        delay = f.seconds if f.kind == "late" and f.rank == r else 0.0

        def run(r: int = r, delay: float = delay) -> Any:
            if delay:
                w.sleep(delay)
            out = body(r)
            if f.kind == "exit":
                w.kill(r)  # the process exits the instant its flow returns
            return out

        bodies[r] = w.spawn(r, run)
    if f.kind == "kill":
        w.at_step(f.rank, f.step, lambda: w.kill(f.rank))
    elif f.kind == "freeze":
        w.at_step(f.rank, f.step, lambda: w.freeze(f.rank, f.seconds))
    horizon = starts + TIMEOUT * 3 + 20 * dead_after + (f.seconds if f.kind in ("freeze", "late") else 0)
    w.run(until=horizon)
    rep.end = w.t
    for r, t in bodies.items():
        rep.outcomes[r] = _outcome(t, w)
    rep.committed = expect.committed()
    rep.problems = violations(rep, w, bodies, expect, starts)
    return rep


def _outcome(t: SimThread, w: World) -> str:
    if getattr(t, "hung", False):
        return "hung"
    if t.proc.died_at is not None and (t.ended_at is None or t.proc.died_at <= (t.ended_at or 0)) and not t.finished:
        return "dead"
    if t.error is not None:
        if type(t.error).__name__ == "Killed":
            return "dead"
        if isinstance(t.error, CommitUnknownError):
            return "unknown"
        return f"failed: {type(t.error).__name__}: {t.error}"
    return "ok" if t.result is None else str(t.result)


class _Expect:
    """What storage says, for the invariants: ``committed()`` lists the commits of the flow's
    step (save ids), ``record`` the storage holding the step's record."""

    def __init__(self, storage: SimStorage, final: str, restore_step: int | None = None,
                 check: Callable[[int, Any], str | None] | None = None, unknown_ok: Callable[[int], bool] | None = None,
                 ) -> None:
        self.storage, self.final = storage, final
        self.restore_step = restore_step
        self.check = check
        self.unknown_ok = unknown_ok or (lambda r: False)
        self.setup_commits = 0
        self.fault_free = False
        """No fault before the flows returned (set by :func:`run_schedule`)."""

    def committed(self) -> list[str]:
        from ckptlib.format.manifest import decode

        out = []
        for _t, dst, manifest in self.storage.commits[self.setup_commits:]:
            if dst == self.final and manifest is not None:
                out.append(decode(manifest, dst).save_id)
        return out


def violations(rep: Report, w: World, bodies: dict[int, SimThread], expect: _Expect, starts: float) -> list[str]:
    """The invariants (module docstring) this schedule broke, in words."""
    out: list[str] = []
    f = rep.fault
    commits = rep.committed
    if len(commits) > 1:
        out.append(f"{len(commits)} manifests committed for {expect.final}")
    def alive_at_end(r: int, t: SimThread) -> bool:
        died = w.procs[r].died_at
        return died is None or (t.finished and t.ended_at is not None and t.ended_at <= died
                                and type(t.error).__name__ != "Killed")

    live = {r: t for r, t in bodies.items() if alive_at_end(r, t)}
    for r, t in live.items():
        o = rep.outcomes[r]
        if o == "hung":
            out.append(f"rank {r} still waiting at the horizon ({w.t:.0f}s)")
            continue
        if rep.flow in ("save", "save_v1", "tier_save", "drain"):
            if o.startswith("failed") and commits and isinstance(t.error, CommitError):
                out.append(f"rank {r} reports committed {expect.final} failed: {o[:300]}")
            if o == "unknown" and not expect.unknown_ok(r):
                out.append(f"rank {r} cannot tell the outcome where it could read the record")
            if not o.startswith(("failed", "unknown")) and not commits and o != "skipped":
                out.append(f"rank {r} reports {o!r} but nothing was committed")
        bound = starts + TIMEOUT + 3 * w.dead_after + 60 + sum(p.frozen_total for p in w.procs) + (
            f.seconds if f.kind == "late" else 0)
        if t.ended_at is not None and t.ended_at > bound:
            out.append(f"rank {r} ended at {t.ended_at:.1f}s, past its bound {bound:.1f}s")
    if f.kind == "freeze" and f.seconds > w.dead_after + 3 * w.every:
        p = w.procs[f.rank]
        frozen_at = _frozen_at(w, f, bodies)
        for r, t in live.items():
            if r == f.rank or t.error is None or frozen_at is None or (t.ended_at or 0) < frozen_at:
                continue
            text = str(t.error) + repr(getattr(t.error, "failures", {}))
            if isinstance(t.error, CheckpointError) and f"rank {f.rank}" not in text and f.rank not in getattr(
                    t.error, "failures", {}):
                out.append(f"rank {r} failed without naming frozen rank {f.rank}: {str(t.error)[:300]}")
            # A bulk transfer (a tier save's replica stream) waits on gloo first, for as long again.
            limit = frozen_at + w.dead_after * (2 if rep.flow == "tier_save" else 1) + 6 * w.every + 1.0
            if f.rank != 0 and t.ended_at is not None and t.ended_at > limit and t.ended_at < frozen_at + f.seconds:
                out.append(f"rank {r} failed {t.ended_at - frozen_at:.1f}s after rank {f.rank} froze "
                           f"(liveness timeout {w.dead_after:.0f}s)")
        del p
    if expect.check is not None:
        for r, t in live.items():
            if t.finished and t.error is None:
                problem = expect.check(r, t.result)
                if problem:
                    out.append(f"rank {r}: {problem}")
    if rep.flow == "restore":
        done = {rep.outcomes[r] for r in live if rep.outcomes[r] != "hung"}
        if len({o for o in done if o.startswith("restored")}) > 1 or (
                any(o.startswith("restored") for o in done) and any(o.startswith("failed") for o in done)
                and f.kind in ("none", "exit", "late")):
            out.append(f"ranks disagree on the restore: {sorted(done)}")
    if f.kind in ("none", "exit", "late"):  # no fault before the flows returned: nothing may fail
        failed = sorted({o[:200] for r, o in rep.outcomes.items() if o.startswith(("failed", "unknown", "hung"))})
        if failed:
            out.append(f"a {rep.flow} failed with no fault before it returned: {failed}")
    return out


def _frozen_at(w: World, f: Fault, bodies: dict[int, SimThread]) -> float | None:
    p = w.procs[f.rank]
    if p.frozen_total <= 0 and p.frozen_at is None:
        return None
    return p.frozen_at if p.frozen_at is not None else (w.end - p.frozen_total if w.end else None)


# -- the flows: each returns (setup, body(rank), expectations)
Flow = tuple[Callable[[], None], Callable[[int], Any], _Expect]


def _options(version: int | None = 2) -> SaveOptions:
    return SaveOptions(num_files=1, timeout=TIMEOUT, format_version=version)


def _save_flow(version: int) -> Callable[[World, list[SimCoordinator]], Flow]:
    def make(w: World, coords: list[SimCoordinator]) -> Flow:
        storage = SimStorage(w)
        final = layout.step_dir(1)

        def body(r: int) -> str:
            flat = prepare(state(r, w.size), r)
            persist(storage, final, flat, step=1, options=_options(version), coordinator=coords[r])
            return "saved"

        return (lambda: None), body, _Expect(storage, final)

    return make


def _setup(w: World, save: Callable[[int], Any]) -> None:
    """``save(rank)`` on every rank, fault-free, before the schedule's flow."""
    threads = [w.spawn(r, functools.partial(save, r), name="setup") for r in range(w.size)]
    w.run(until=w.t + 600)
    for t in threads:
        if t.error is not None:
            raise RuntimeError(f"setup failed: {t.error}")
    w.threads = [t for t in w.threads if t.name != "setup" and not t.finished]


def _pre_save(w: World, coords: list[SimCoordinator], storage: SimStorage, step: int) -> None:
    """A fault-free save of ``step`` before the schedule's flow (setup)."""
    _setup(w, lambda r: persist(storage, layout.step_dir(step), prepare(state(r, w.size, step), r), step=step,
                                options=_options(), coordinator=coords[r]))


def _restore_flow(w: World, coords: list[SimCoordinator]) -> Flow:
    storage = SimStorage(w)
    expect = _Expect(storage, layout.step_dir(3), restore_step=3)

    def setup() -> None:
        for step in (2, 3, 4):
            _pre_save(w, coords, storage, step)
        # Step 4 passes the quick check (manifest, sizes) but holds a flipped byte: the ranks load
        # it, the one that reads the byte finds it damaged, and all fall back to step 3 through
        # the loop's second batch of candidates (engine/resume.py, _shared).
        folder = layout.step_dir(4) + "/"
        payload = max((k for k in storage.files if k.startswith(folder) and not k.endswith("manifest.json")),
                      key=lambda k: (len(storage.files[k]), k))
        data = bytearray(storage.files[payload])
        data[len(data) // 2] ^= 0xFF
        storage.files[payload] = bytes(data)
        expect.setup_commits = len(storage.commits)

    def body(r: int) -> str:
        target = _empty(r, w.size)
        step = resume_flow.restore(storage, target, coords[r], timeout=TIMEOUT)
        want = state(r, w.size, step or 0)
        ok = torch.equal(target["w"].local, want["w"].local) and torch.equal(target["b"], want["b"])
        return f"restored {step}" + ("" if ok else " WRONG BYTES")

    def check(r: int, result: Any) -> str | None:
        if "WRONG" in str(result):
            return f"restored wrong bytes ({result})"
        if expect.fault_free and result != "restored 3":
            return f"{result} with no fault: step 4 is damaged, so every rank must fall back to step 3"
        return None

    expect.check = check
    return setup, body, expect


def _tier_flow(w: World, coords: list[SimCoordinator]) -> Flow:
    from ckptlib.tiers.local import LocalTier, save_local

    nodes = [SimStorage(w, f"sim://node{n}") for n in range(2)]
    tiers = [LocalTier(nodes[r // 2], r // 2, replicas=1) for r in range(w.size)]
    final = layout.step_dir(1)

    def body(r: int) -> str:
        flat = prepare(state(r, w.size), r)
        save_local(tiers[r], final, flat, step=1, metadata=None, options=_options(None), coordinator=coords[r],
                   save_id="ab" * 16, created=0.0)
        # What the rank's drain reads next: its node's copy of the step, there when it returns.
        return "saved" if nodes[r // 2].size(f"{final}/manifest.json") is not None else "saved without a node copy"

    expect = _Expect(nodes[0], final, unknown_ok=lambda r: r // 2 != 0)
    expect.check = lambda r, result: "returned before its node's copy was committed" if "without" in str(result) \
        and expect.fault_free else None
    return (lambda: None), body, expect


def _drain_flow(w: World, coords: list[SimCoordinator]) -> Flow:
    from ckptlib.tiers.drain import drain_step
    from ckptlib.tiers.local import LocalTier, save_local

    nodes = [SimStorage(w, f"sim://node{n}") for n in range(2)]
    persistent = SimStorage(w, "sim://persistent")
    tiers = [LocalTier(nodes[r // 2], r // 2, replicas=1) for r in range(w.size)]
    final = layout.step_dir(1)

    def setup() -> None:
        _setup(w, lambda r: save_local(tiers[r], final, prepare(state(r, w.size), r), step=1, metadata=None,
                                       options=_options(None), coordinator=coords[r], save_id="ab" * 16,
                                       created=0.0))

    def body(r: int) -> str:
        return "drained" if drain_step(tiers[r], persistent, coords[r], 1, timeout=TIMEOUT) else "skipped"

    return setup, body, _Expect(persistent, final)


def _meetings_flow(w: World, coords: list[SimCoordinator]) -> Flow:
    """Every meeting shape in a row, with values that check themselves."""
    storage = SimStorage(w)

    def body(r: int) -> str:
        c = coords[r]
        with c.session("meetings", c.deadline(TIMEOUT)) as s:
            if s.share("x" * 3000 if s.is_coordinator else None) != "x" * 3000:
                return "wrong share"
            got = s.report({"r": r})
            if s.is_coordinator and got != [{"r": q} for q in range(w.size)]:
                return "wrong report"
            if s.answer_each([q * 2 for q in range(w.size)] if s.is_coordinator else None) != 2 * r:
                return "wrong answer"
            if s.exchange(r) != list(range(w.size)):
                return "wrong exchange"
            if s.consult(r, lambda vs: [v + 1 for v in vs]) != r + 1:
                return "wrong consult"
            if s.share(0 if s.is_coordinator else None, receipts=True) != 0:
                return "wrong receipts"
        return "ok"

    def check(r: int, result: Any) -> str | None:
        return None if result == "ok" else str(result)

    expect = _Expect(storage, "none", check=check)
    return (lambda: None), body, expect


_FLOWS: dict[str, Callable[[World, list[SimCoordinator]], Flow]] = {
    "save": _save_flow(2), "save_v1": _save_flow(1), "restore": _restore_flow, "tier_save": _tier_flow,
    "drain": _drain_flow, "meetings": _meetings_flow,
}
