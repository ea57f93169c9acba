"""A deterministic simulation of ckptlib's coordination: every rank's flow runs on a thread of
this process, one thread at a time, chosen by a seeded scheduler, on virtual time, against an
in-memory store (:class:`SimKV`) and in-memory storage (:class:`SimStorage`), with store delays,
freezes, deaths and a coordinator that exits at any step.

The code under test is the real one: :class:`ckptlib.coord.session.Session` and the flows that
meet through it (the save, the resume loop, the tier save, the drain) run unchanged on a
:class:`SimCoordinator`. Only the transport differs: a store call is a point where the scheduler
may switch threads and where virtual time passes (its latency); a wait is parked until its key
is set or a heartbeat period passes (then the wait's liveness watch runs inline, as the real
pulse thread runs it); heartbeats are bumped by the scheduler for every live, unfrozen process.

Model of a process (:class:`Proc`): ``alive``, ``frozen`` (SIGSTOP: not scheduled, no
heartbeat; if it hosts the store -- rank 0, as with ``init_process_group`` without an agent
store -- every store call blocks until it thaws or the caller's call limit ends it) or ``dead``
(SIGKILL, or exit: its threads never run again; if it hosted the store, every later call fails
at once). A dead thread is unwound at the end with :class:`Killed` (no store or storage call it
makes then has any effect).

Used by tests/sim/ (CI: a fixed seeded sample; ``make chaos``: 10,000+ schedules) and
bench/bench_coord.py (store traffic at 256 to 4,096 simulated ranks). Test tooling: never
imported by the library.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptlib.backends.base import Entry, ReadHandle, Storage, WriteStream, parent
from ckptlib.coord.coordinator import Coordinator
from ckptlib.coord.kv import BATCH, KV, Clock, Gone, Late, StoreUnreachable, Watch
from ckptlib.coord.liveness import hb_key, heartbeat_period
from ckptlib.coord.session import Session
from ckptlib.errors import CommitTimeoutError, CorruptCheckpointError


class Killed(BaseException):
    """Unwinds the thread of a simulated process that died."""


@dataclass
class Proc:
    rank: int
    state: str = "alive"
    """``alive``, ``frozen`` or ``dead``."""
    beats: int = 1
    frozen_at: float | None = None
    frozen_total: float = 0.0
    died_at: float | None = None


@dataclass(eq=False)
class SimThread:
    proc: Proc
    name: str
    fn: Callable[[], Any]
    pool: dict[SimThread, None]
    """The world's threads ready to run (insertion-ordered: the schedule stays deterministic)."""
    go: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    result: Any = None
    error: BaseException | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    steps: int = 0
    waiting: str | None = None  # the store key it is parked on, if any
    parks: int = 0  # parks so far: a timer wakes only the park that set it

    @property
    def ready(self) -> bool:
        return self in self.pool

    @ready.setter
    def ready(self, value: bool) -> None:
        if value and not self.finished:
            self.pool[self] = None
        else:
            self.pool.pop(self, None)
    os_thread: threading.Thread | None = None


class World:
    """The scheduler, its virtual clock, the store, the processes (module docstring).

    ``latency``: the most virtual seconds a store or storage call takes (uniform from 0).
    ``limit``: the call limit (the coordination timeout: ``dead_after``)."""

    def __init__(self, world: int, *, seed: int, dead_after: float = 5.0, latency: float = 0.002,
                 every: float | None = None) -> None:
        self.rng = random.Random(seed)
        self.size = world
        self.dead_after = dead_after
        self.limit = dead_after
        self.every = every or heartbeat_period(dead_after)
        self.latency = latency
        self.t = 0.0
        self.data: dict[str, bytes] = {}
        self.procs = [Proc(r) for r in range(world)]
        self.threads: list[SimThread] = []
        self._ready: dict[SimThread, None] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._waiters: dict[str, list[SimThread]] = {}
        self._parked = threading.Event()
        self._local = threading.local()
        self.calls: Counter[tuple[int, str]] = Counter()
        """(rank, operation) -> store calls made (round trips)."""
        self.bytes_in: Counter[int] = Counter()
        self.bytes_out: Counter[int] = Counter()
        self._step_hooks: dict[int, Callable[[SimThread], None]] = {}
        self._mail: dict[tuple[int, int], list[bytes]] = {}
        self._on_thaw: list[Callable[[], Any]] = []
        self.service = 0.0
        """Store seconds per request (0: none): the store serves one request at a time, so
        requests that arrive together queue (bench/bench_coord.py's latency model)."""
        self.per_key = 0.0
        """Store seconds per key of a batched request."""
        self._server_free = 0.0
        for r in range(world):
            self.data[hb_key(r)] = b"1"
            self._timer(self.rng.uniform(0, self.every), self._beat_fn(r))

    # -- clock
    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.park(until=self.t + max(0.0, seconds))

    # -- processes and threads
    def spawn(self, rank: int, fn: Callable[[], Any], name: str = "flow") -> SimThread:
        t = SimThread(self.procs[rank], name, fn, self._ready, started_at=self.t)
        t.ready = True

        def body() -> None:
            t.go.wait()
            t.go.clear()
            self._local.thread = t
            try:
                if self.procs[rank].state == "dead":
                    raise Killed()
                t.result = fn()
            except BaseException as e:  # recorded for the checks
                t.error = e
            t.finished = True
            t.ready = False
            t.ended_at = self.t
            self._parked.set()

        t.os_thread = threading.Thread(target=body, name=f"sim-r{rank}-{name}", daemon=True)
        t.os_thread.start()
        self.threads.append(t)
        return t

    def current(self) -> SimThread | None:
        return getattr(self._local, "thread", None)

    def kill(self, rank: int) -> None:
        """SIGKILL (or exit) of process ``rank``."""
        p = self.procs[rank]
        if p.state != "dead":
            if p.state == "frozen" and p.frozen_at is not None:
                p.frozen_total += self.t - p.frozen_at
            p.state, p.died_at = "dead", self.t
            self._wake_all()

    def freeze(self, rank: int, seconds: float) -> None:
        """SIGSTOP of process ``rank`` now, SIGCONT ``seconds`` later."""
        p = self.procs[rank]
        if p.state == "alive":
            p.state, p.frozen_at = "frozen", self.t
            self._timer(self.t + seconds, lambda: self.thaw(rank))

    def thaw(self, rank: int) -> None:
        p = self.procs[rank]
        if p.state == "frozen":
            p.state = "alive"
            p.frozen_total += self.t - (self.t if p.frozen_at is None else p.frozen_at)
            p.frozen_at = None
            if rank == 0:  # the store answers what was sent to it meanwhile
                pending, self._on_thaw = self._on_thaw, []
                for op in pending:
                    op()
            self._wake_all()

    def at_step(self, rank: int, step: int, action: Callable[[], None]) -> None:
        """Run ``action`` (a kill, a freeze) when rank's flow thread reaches its ``step``-th
        store or storage call."""
        def hook(t: SimThread) -> None:
            if t.proc.rank == rank and t.name == "flow" and t.steps == step:
                action()

        self._step_hooks[len(self._step_hooks)] = hook

    def at(self, time: float, action: Callable[[], None]) -> None:
        self._timer(time, action)

    # -- the scheduler
    def _timer(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), fn))

    def _beat_fn(self, rank: int) -> Callable[[], None]:
        def beat() -> None:
            p = self.procs[rank]
            if p.state == "alive":
                p.beats += 1
                self.data[hb_key(rank)] = str(p.beats).encode()
                self.calls[(rank, "beat")] += 1
            if p.state != "dead":
                self._timer(self.t + self.every, beat)

        return beat

    def _wake_all(self) -> None:
        for t in self.threads:
            if not t.finished:
                t.ready = True

    def run(self, until: float) -> None:
        """Run every thread until all finished, or virtual time ``until`` passed (threads
        still blocked then are hangs: see :meth:`hung`). Then unwind every unfinished thread."""
        while True:
            runnable = [t for t in self._ready if t.proc.state == "alive"]
            if runnable:
                self._switch(self.rng.choice(runnable))
                continue
            if all(t.finished or t.proc.state == "dead" for t in self.threads):
                break
            if not self._timers:
                break
            when, _, fn = heapq.heappop(self._timers)
            if when > until:
                heapq.heappush(self._timers, (when, next(self._seq), fn))
                break
            self.t = max(self.t, when)
            fn()
        self.end = self.t
        for t in self.threads:  # unwind: dead or hung threads raise Killed at their next call
            if not t.finished:
                t.hung = t.proc.state == "alive"  # type: ignore[attr-defined]
                t.proc.state = "dead"
                self._switch(t)

    def _switch(self, t: SimThread) -> None:
        t.ready = False
        self._parked.clear()
        t.go.set()
        self._parked.wait()

    def park(self, until: float | None = None, key: str | None = None) -> None:
        """On a simulated thread: give the baton back until ``until`` (virtual) or until
        ``key`` is set, whichever first (neither: until woken by a thaw or a death)."""
        t = self.current()
        if t is None:
            return  # a thread of no simulated process (none should call)
        if t.proc.state == "dead":
            raise Killed()
        t.parks += 1
        if until is not None:
            mine = t.parks
            self._timer(until, lambda: setattr(t, "ready", True) if t.parks == mine else None)
        if key is not None:
            t.waiting = key
            self._waiters.setdefault(key, []).append(t)
        self._parked.set()
        t.go.wait()
        t.go.clear()
        t.waiting = None
        if t.proc.state == "dead":
            raise Killed()

    def step(self, cost: float | None = None) -> None:
        """A call's latency: a point where another thread may run."""
        t = self.current()
        if t is None:
            return
        if t.proc.state == "dead":
            raise Killed()
        t.steps += 1
        for hook in list(self._step_hooks.values()):
            hook(t)
        self.park(until=self.t + (self.rng.uniform(0, self.latency) if cost is None else cost))

    def _store_ready(self, started: float, op: Callable[[], Any] | None = None) -> None:
        """Block while the store's host is frozen (up to the call limit); fail if it is gone.
        ``op``: a write the caller gave up on; a frozen store still applies it when it thaws
        (the request was sent)."""
        host = self.procs[0]
        while True:
            if host.state == "dead":
                raise StoreUnreachable("store unreachable: its host process is gone (connection refused)")
            if host.state == "alive":
                return
            if self.t >= started + self.limit:  # (started: inf for a patient caller)
                if op is not None:
                    self._on_thaw.append(op)
                raise StoreUnreachable(f"store call unanswered for {self.limit:.0f}s")
            self.park(until=None if started == float("inf") else started + self.limit)

    def _set(self, key: str, value: bytes) -> None:
        self.data[key] = value
        for w in self._waiters.pop(key, []):
            w.ready = True

    # -- bulk bytes (Coordinator.transfer)
    def transfer(self, me: int, sends: Sequence[tuple[int, bytes | bytearray]], recvs: list[tuple[int, int]],
                 timeout: float) -> list[bytes]:
        for dst, data in sends:
            if data:
                self.step()
                self._mail.setdefault((me, dst), []).append(bytes(data))  # received as bytes, as over gloo
                self._wake_all()
        out: list[bytes] = []
        end = self.t + timeout
        for src, size in recvs:
            if size <= 0:
                out.append(b"")
                continue
            box = self._mail.setdefault((src, me), [])
            while not box:
                if self.t >= end:
                    raise CommitTimeoutError(f"peer transfer with rank {src} failed or timed out after {timeout:.0f}s",
                                             {src: "no answer to a peer transfer"})
                self.park(until=min(end, self.t + self.every))
            out.append(box.pop(0))
        return out

    # -- results
    def hung(self) -> list[SimThread]:
        return [t for t in self.threads if getattr(t, "hung", False)]


class SimKV:
    """:class:`ckptlib.coord.kv.KV` of one simulated rank, over the world's store."""

    BATCH = BATCH

    def __init__(self, world: World, rank: int, patient: bool = False) -> None:
        self.world, self.rank = world, rank
        self.clock: Clock = world
        self.every = world.every
        self.patient = patient  # the worker of a post: its calls wait for a frozen store (no limit)

    def _call(self, op: str, nkeys: int = 1, write: Callable[[], Any] | None = None) -> None:
        w = self.world
        for i in range(max(1, -(-nkeys // self.BATCH))):
            w.calls[(self.rank, op)] += 1
            started = w.t
            if w.service:  # half the network, the store's queue, the other half
                keys = min(self.BATCH, nkeys - i * self.BATCH)
                done = max(w.t + w.rng.uniform(0, w.latency) / 2, w._server_free) + w.service + w.per_key * keys
                w._server_free = done
                w.step(cost=done - w.t + w.rng.uniform(0, w.latency) / 2)
            else:
                w.step()
            w._store_ready(float("inf") if self.patient else started, write)

    def set(self, key: str, value: bytes) -> None:
        self._call("set", write=lambda: self.world._set(key, bytes(value)))
        self.world.bytes_in[self.rank] += len(value)
        self.world._set(key, bytes(value))

    def get(self, key: str) -> bytes:
        self._call("get")
        if key not in self.world.data:
            raise KeyError(key)
        v = self.world.data[key]
        self.world.bytes_out[self.rank] += len(v)
        return v

    def add(self, key: str, amount: int) -> int:
        def apply() -> None:
            self.world._set(key, str(int(self.world.data.get(key, b"0")) + amount).encode())

        self._call("add", write=apply if amount else None)
        v = int(self.world.data.get(key, b"0")) + amount
        self.world._set(key, str(v).encode())
        return v

    def append(self, key: str, value: bytes) -> None:
        self._call("append")
        self.world._set(key, self.world.data.get(key, b"") + value)

    def check(self, keys: Sequence[str]) -> bool:
        self._call("check")
        return all(k in self.world.data for k in keys)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._call("multi_get", len(keys))
        missing = [k for k in keys if k not in self.world.data]
        if missing:
            raise KeyError(missing[0])
        out = [self.world.data[k] for k in keys]
        self.world.bytes_out[self.rank] += sum(len(v) for v in out)
        return out

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        def apply() -> None:
            for k, v in zip(keys, values, strict=True):
                self.world._set(k, bytes(v))

        self._call("multi_set", len(keys), write=apply)
        for k, v in zip(keys, values, strict=True):
            self.world.bytes_in[self.rank] += len(v)
            self.world._set(k, bytes(v))

    def delete(self, key: str) -> None:
        self._call("delete")
        self.world.data.pop(key, None)

    def discard(self, keys: Sequence[str]) -> None:
        """Deleted at once (TorchKV's pulse deletes them at its next beat; at once is the
        stricter schedule for anyone who would still read them); counted as round trips, at no
        time to the caller."""
        for k in keys:
            self.world.calls[(self.rank, "delete")] += 1
            self.world.data.pop(k, None)

    def await_key(self, key: str, deadline: float, watch: Watch, first: Callable[[KV], None] | None = None,
                  ) -> bytes:
        """One blocking call (as TorchKV's ``get``), after ``first``'s calls; the watch runs every
        heartbeat period, inline; a frozen store host blocks it up to the call limit (the
        pulse's stall check)."""
        w = self.world
        if first is not None:
            first(self)
        self._call("get")
        while True:
            w._store_ready(w.t)
            if key in w.data:
                return w.data[key]
            if w.t >= deadline:
                raise Late(key)
            woke_at = min(deadline, w.t + self.every)
            w.park(until=woke_at, key=key)
            if key not in w.data and woke_at <= w.t < deadline:
                failures = watch(self)  # inline, as the pulse thread runs it
                if failures is not None:
                    raise Gone(failures)

    def batch(self, calls: Callable[[KV], Any]) -> Any:
        return calls(self)

    def post(self, calls: Callable[[KV], None], wait: float) -> None:
        """Runs on a thread of this process of its own; the caller waits for it up to ``wait``."""
        w = self.world
        worker = SimKV(w, self.rank, patient=True)
        t = w.spawn(self.rank, lambda: calls(worker), name="post")
        end = w.t + wait
        while not t.finished and w.t < end:
            w.park(until=min(end, w.t + 0.001))


class SimCoordinator(Coordinator):
    """:class:`Coordinator` of one simulated rank."""

    def __init__(self, world: World, rank: int) -> None:
        self.world = world
        self.rank, self.world_size = rank, world.size
        self.clock: Clock = world
        self.dead_after = world.dead_after
        self.kv = SimKV(world, rank)
        self._count = 0
        self._spent: list[str] = []

    def session(self, label: str, deadline: float) -> Session:
        self._count += 1
        return Session(self.kv, f"ckptlib/c1/s{self._count}/", self.rank, self.world_size, deadline=deadline,
                       dead_after=self.dead_after, label=label, coord=self, spent=self._spent)

    def transfer(self, sends: Sequence[tuple[int, bytes | bytearray]], recvs: list[tuple[int, int]],
                 timeout: float) -> list[bytes]:
        return self.world.transfer(self.rank, sends, recvs, timeout)


# -- storage
class _Write(WriteStream):
    """The file appears at :meth:`close`. ``parents=False`` (:meth:`SimStorage.open_write_in`): if
    its folder was removed or moved away meanwhile, its bytes go nowhere anyone reads (on POSIX
    the open file is unlinked with the folder, or moves with it into a fence's folder)."""

    def __init__(self, storage: SimStorage, path: str, parents: bool = True) -> None:
        self.storage, self.path, self.parts, self.parents = storage, path, bytearray(), parents

    def write(self, data: Any) -> None:
        self.parts += bytes(data)

    def close(self) -> None:
        self.storage._op()
        if self.parents or self.storage.exists(parent(self.path)):
            self.storage.files[self.path] = bytes(self.parts)

    def abort(self) -> None:
        pass


class _Read(ReadHandle):
    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.size, self.where = data, len(data), where

    def read_into(self, start: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if start + len(out) > self.size:
            raise CorruptCheckpointError("file is shorter than expected", self.where)
        out[:] = self.data[start:start + len(out)]

    def close(self) -> None:
        pass


class SimStorage(Storage):
    """In-memory storage with POSIX semantics (atomic folder rename that refuses an existing
    target): a shared file system, or one node's local disk. Its commit-point calls (rename,
    puts, deletes) are scheduling points; calls from a dead process raise :class:`Killed`.
    ``commits`` records every folder renamed into place: (time, target, manifest bytes)."""

    supports_atomic_rename = True

    def __init__(self, world: World, url: str = "sim://shared") -> None:
        self.world, self.url = world, url
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = set()
        self.commits: list[tuple[float, str, bytes | None]] = []

    def _op(self) -> None:
        self.world.step()

    def open_write(self, path: str) -> WriteStream:
        return _Write(self, path)

    def open_write_in(self, path: str) -> WriteStream:
        if not self.exists(parent(path)):
            raise FileNotFoundError(f"{path}: its folder is missing")
        return _Write(self, path, parents=False)

    def put_atomic(self, path: str, data: bytes) -> None:
        self._op()
        self.files[path] = bytes(data)

    def makedirs(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts) + 1):
            self.dirs.add("/".join(parts[:i]))

    def rename(self, src: str, dst: str) -> None:
        self._op()
        if self.exists(dst):
            raise FileExistsError(dst)
        if not self.exists(src):
            raise FileNotFoundError(src)
        pre = src.rstrip("/") + "/"
        for k in [k for k in self.files if k.startswith(pre)]:
            self.files[dst + "/" + k[len(pre):]] = self.files.pop(k)
        for d in [d for d in self.dirs if d == src or d.startswith(pre)]:
            self.dirs.discard(d)
            self.dirs.add(dst + d[len(src):])
        self.commits.append((self.world.t, dst, self.files.get(dst + "/manifest.json")))

    def open_read(self, path: str) -> ReadHandle:
        if path not in self.files:
            raise FileNotFoundError(path)
        return _Read(self.files[path], f"{self.url}/{path}")

    def size(self, path: str) -> int | None:
        return len(self.files[path]) if path in self.files else None

    def listdir(self, path: str = "") -> list[Entry]:
        pre = path.strip("/") + "/" if path.strip("/") else ""
        if pre and pre[:-1] not in self.dirs and not any(k.startswith(pre) for k in self.files):
            raise FileNotFoundError(path)
        names: dict[str, bool] = {}
        for k in self.files:
            if k.startswith(pre):
                head, _, rest = k[len(pre):].partition("/")
                names[head] = names.get(head, False) or bool(rest)
        for d in self.dirs:
            if d.startswith(pre) and d != pre[:-1]:
                names[d[len(pre):].split("/")[0]] = True
        return [Entry(n, d) for n, d in sorted(names.items())]

    def exists(self, path: str = "") -> bool:
        p = path.strip("/")
        return not p or p in self.files or p in self.dirs or any(k.startswith(p + "/") for k in self.files)

    def delete(self, path: str) -> None:
        self._op()
        self.files.pop(path, None)

    def delete_tree(self, path: str) -> None:
        self._op()
        pre = path.strip("/") + "/"
        for k in [k for k in self.files if k.startswith(pre)]:
            del self.files[k]
        self.dirs = {d for d in self.dirs if d != path.strip("/") and not d.startswith(pre)}
