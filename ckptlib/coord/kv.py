"""The store the coordination protocol runs on: a tiny key-value interface, and its transport
over torch.distributed's store.

:class:`KV` is all that :mod:`ckptlib.coord.session` asks of a store: ``set``, ``get``, ``add``,
``append``, ``check``, ``multi_get``, ``multi_set``, ``delete``, ``discard``, ``await_key`` and
``post``, plus a :class:`Clock`. ``discard`` deletes keys nobody reads any more off the
caller's path, so that the store holds a bounded number of keys however many sessions a job
runs (which keys, when: :mod:`ckptlib.coord.session`). Two implementations: :class:`TorchKV` (here: the job's TCPStore, for
real runs) and the seeded simulation's in-memory store (:mod:`ckptlib.testing.simulation`), so
the same protocol code runs on both.

Every call either returns, raises :class:`StoreUnreachable` (no answer within the call limit:
a frozen or dead store; torch's store bounds only ``get``/``wait`` by its own timeout, so a
``set`` to a frozen store would otherwise never return) or raises what the store raised.
:meth:`KV.await_key` waits for one key that only the caller waits for, running a liveness
``watch`` at the heartbeat cadence meanwhile; a watch's verdict ends the wait at once.

Threads of a :class:`TorchKV` (a fixed few per process, none per call or per wait): one worker
thread per :class:`TorchKV` runs its calls on a store connection of its own, in order; the
caller waits for each call's answer with a deadline. The watches of every :class:`TorchKV` of a
process run on its :class:`ckptlib.coord.liveness.Pulse` thread (which also beats, and deletes
the keys discarded since its last beat), on a third connection, and end a wait by setting the
awaited key to :data:`CANCEL` (the key is the waiter's own, so nobody else reads it).
"""

from __future__ import annotations

import _thread
import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

log = logging.getLogger("ckptlib")

CANCEL = b"\x00ckptlib-cancelled"
"""What a watch writes into the key a waiter awaits, to end the wait with its verdict."""

BATCH = 256
"""Keys per ``multi_get``/``multi_set`` round trip (the coordinator's reads grow as ranks/BATCH)."""


class StoreUnreachable(Exception):
    """A store call got no answer within the call limit, or the store is gone (its host process
    died or exited)."""


class Late(Exception):
    """:meth:`KV.await_key`: the deadline passed before the key was set."""


class Gone(Exception):
    """:meth:`KV.await_key`: the watch gave up on the ranks the wait depends on (``failures``:
    rank -> why)."""

    def __init__(self, failures: dict[int, str]) -> None:
        super().__init__("; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items())))
        self.failures = failures


Watch = Callable[["KV"], "dict[int, str] | None"]
"""A liveness check: given a store to read with, None to keep waiting, or the failures that end
the wait. Called every heartbeat period while a :meth:`KV.await_key` waits."""


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    """``time.monotonic`` and ``time.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


REAL_CLOCK = RealClock()


class KV(Protocol):
    clock: Clock
    every: float
    """The heartbeat period: how often a waiting ``await_key`` runs its watch."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes:
        """The value of an existing key."""
        ...

    def add(self, key: str, amount: int) -> int: ...

    def append(self, key: str, value: bytes) -> None: ...

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists."""
        ...

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of existing keys, in batches of :data:`BATCH`."""
        ...

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None: ...

    def delete(self, key: str) -> None: ...

    def discard(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` soon, off the caller's path (a :class:`TorchKV`: the process's pulse
        thread, at its next beat); a failed delete is dropped (it costs store memory only)."""
        ...

    def await_key(self, key: str, deadline: float, watch: Watch, first: Callable[[KV], None] | None = None,
                  ) -> bytes:
        """The value of ``key`` once it is set (by ``deadline`` on :attr:`clock`, else
        :class:`Late`); ``watch`` runs every :attr:`every` seconds meanwhile, and its verdict
        raises :class:`Gone`. Only the caller may wait on ``key``. ``first``: calls made right
        before the wait, in the same hand-off to the store (a report the session held back,
        :meth:`ckptlib.coord.session.Session.report`); a failure of theirs ends the wait."""
        ...

    def batch(self, calls: Callable[[KV], Any]) -> Any:
        """``calls(kv)``: several calls in a row, as one bounded call (one hand-off to the
        store's worker instead of one per call: what a busy machine makes costly)."""
        ...

    def post(self, calls: Callable[[KV], None], wait: float) -> None:
        """Run ``calls(self)`` after the calls before it, waiting for it at most ``wait`` seconds
        (leaving a session: done at once normally, but a frozen store must not hold the caller
        back). Failures are dropped."""
        ...


def own_connection(store: Any) -> Any:
    """A connection of this process's own to ``store`` (``Store.clone``, torch 2.6 and later),
    so that a long wait on it never queues another thread's calls; else ``store`` itself."""
    try:
        return store.clone()
    except Exception:  # older torch, or a store that cannot clone
        return store


class _Call:
    """One call handed to a :class:`TorchKV`'s worker: the worker runs ``fn`` and calls
    :meth:`finish`; the caller waits with :meth:`wait`. A bare lock, held until the call is
    finished, rather than a ``threading.Event`` (a condition and two locks per call, in Python):
    the hand-off is most of a rank's coordination CPU on a busy machine."""

    __slots__ = ("_held", "error", "finished", "fn", "value")

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.finished = False
        self._held = _thread.allocate_lock()
        self._held.acquire()

    def finish(self) -> None:
        """The worker, once ``value`` or ``error`` is set."""
        self.finished = True
        self._held.release()

    def wait(self, timeout: float) -> bool:
        """Whether the call finished, waiting for it at most ``timeout`` seconds."""
        if self.finished:
            return True
        if self._held.acquire(timeout=max(0.0, timeout)):
            self._held.release()  # later waits return at once
            return True
        return self.finished


class TorchKV:
    """:class:`KV` over a torch.distributed store (module docstring). ``limit``: how long a call
    may go unanswered before :class:`StoreUnreachable` (the coordination timeout). Made by a
    :class:`ckptlib.coord.torch_coordinator.TorchCoordinator`; used by the thread driving its
    sessions (and :meth:`post`ed leaves), one call at a time, on one worker thread."""

    def __init__(self, store: Any, limit: float, pulse: Any, name: str = "ckptlib-store", host: bool = False) -> None:
        self.clock: Clock = REAL_CLOCK
        self.host = host
        """The store lives in this process (rank 0 of a job without an agent store): calls are
        made on the caller's thread, without a worker (they cannot outlive the store)."""
        self.limit = limit
        self.pulse = pulse  # ckptlib.coord.liveness.Pulse: runs the watches
        self.every: float = pulse.every
        # A host's connection is to its own process: made here. Anyone else's is made by the
        # worker, as its first act: connecting to a frozen host's store blocks for the store's
        # own timeout (minutes), and only the worker may block; callers wait ``limit`` at most.
        self._source = store
        self._store = own_connection(store) if host else None
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.name = name  # the worker thread's (:meth:`rename`)
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        _WORKERS.add(self)

    # -- the worker
    def _serve(self) -> None:
        store = self._store if self._store is not None else own_connection(self._source)
        while True:
            call = self._queue.get()
            if call is None:
                return
            try:
                call.value = call.fn(store)
            except BaseException as e:  # handed to the caller
                call.error = e
            call.finish()
            # Hold no finished call while idle: its function's closure can reach the session and
            # the coordinator (a posted leave), and a coordinator kept alive by its own worker's
            # last call is never dropped, so that worker and its connection never ended.
            del call

    def _submit(self, fn: Callable[[Any], Any]) -> _Call:
        if self._worker is None:
            with self._lock:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._serve, name=self.name, daemon=True)
                    self._worker.start()
        call = _Call(fn)
        self._queue.put(call)
        return call

    def _run(self, fn: Callable[[Any], Any], extra: float = 0.0) -> Any:
        if self.host:
            if self._store is None:
                raise StoreUnreachable("this coordinator's store connection was closed")
            try:
                return fn(self._store)
            except Exception as e:
                raise _unreachable(e) from e
        call = self._submit(fn)
        if not call.wait(self.limit + extra):
            raise StoreUnreachable(f"store call unanswered for {self.limit + extra:.0f}s")
        if call.error is not None:
            raise _unreachable(call.error)
        return call.value

    def rename(self, name: str) -> None:
        """Name the worker thread (now, or when it starts)."""
        self.name = name
        if self._worker is not None:
            self._worker.name = name

    def stop(self, wait: float = 0.0) -> None:
        """Let the worker end after the calls queued (a dropped coordinator, interpreter exit),
        waiting for it at most ``wait`` seconds."""
        self._queue.put(None)
        worker = self._worker
        if wait and worker is not None:
            worker.join(wait)

    def close(self) -> None:
        """A closed coordinator's: :meth:`stop`, and a host drops its own connection now (no
        call follows; a worker's goes when the worker ends)."""
        self.stop()
        if self.host:
            self._store = None

    # -- KV
    def set(self, key: str, value: bytes) -> None:
        self._run(lambda s: s.set(key, value))

    def get(self, key: str) -> bytes:
        return bytes(self._run(lambda s: s.get(key)))

    def add(self, key: str, amount: int) -> int:
        return int(self._run(lambda s: s.add(key, amount)))

    def append(self, key: str, value: bytes) -> None:
        self._run(lambda s: s.append(key, value))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._run(lambda s: s.check(list(keys))))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        out: list[bytes] = []
        for i in range(0, len(keys), BATCH):
            part = list(keys[i:i + BATCH])
            out += [bytes(v) for v in self._run(lambda s, p=part: s.multi_get(p))]  # type: ignore[misc]
        return out

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        for i in range(0, len(keys), BATCH):
            ks, vs = list(keys[i:i + BATCH]), list(values[i:i + BATCH])
            self._run(lambda s, k=ks, v=vs: s.multi_set(k, v))  # type: ignore[misc]

    def delete(self, key: str) -> None:
        self._run(lambda s: s.delete_key(key))

    def discard(self, keys: Sequence[str]) -> None:
        self.pulse.discard(keys)

    def batch(self, calls: Callable[[KV], Any]) -> Any:
        return self._run(lambda store: calls(_Direct(store, self.every)))

    def post(self, calls: Callable[[KV], None], wait: float) -> None:
        def run(store: Any) -> None:
            try:
                calls(_Direct(store, self.every))
            except Exception as e:  # the others judge by heartbeats
                log.debug("ckptlib: a posted store call failed: %s", e)

        if self.host:
            run(self._store)
            return
        self._submit(run).wait(wait)

    def await_key(self, key: str, deadline: float, watch: Watch, first: Callable[[KV], None] | None = None,
                  ) -> bytes:
        def wait(store: Any) -> bytes:
            # Blocks on the server until the key is set: no polling. (Every get of this
            # connection is either such a wait or of a key known to exist.)
            store.set_timeout(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            if first is not None:
                first(_Direct(store, self.every))
            return bytes(store.get(key))

        ticket = self.pulse.watch(key, watch)
        if self.host:  # a watch's verdict sets the key (CANCEL): the wait ends with it
            try:
                value = wait(self._store)
            except Exception as e:
                if time.monotonic() >= deadline - 0.001 and _timed_out(e):
                    raise Late(key) from None
                raise _unreachable(e) from e
            finally:
                self.pulse.unwatch(ticket)
            if value == CANCEL:
                raise Gone(ticket.failures or {})
            return value
        try:
            call = self._submit(wait)
            while not call.wait(self.every):
                if ticket.failures is not None and not call.wait(self.every):
                    raise Gone(ticket.failures)  # the cancel did not reach the store
                if self.pulse.stalled():
                    raise StoreUnreachable(f"store calls unanswered for {self.limit:.0f}s (heartbeat stalled)")
                if time.monotonic() > deadline + self.limit:
                    raise StoreUnreachable(f"store wait unanswered {self.limit:.0f}s past its deadline")
            if call.error is not None:
                if time.monotonic() >= deadline - 0.001 and _timed_out(call.error):
                    raise Late(key)
                raise _unreachable(call.error)
            if call.value == CANCEL:
                raise Gone(ticket.failures or {})
            return bytes(call.value)
        finally:
            self.pulse.unwatch(ticket)


class _Direct:
    """A :class:`KV` view of a raw store connection, for calls already on the worker thread
    (:meth:`TorchKV.post`) or the pulse thread (watches): no handoff, no call limit."""

    def __init__(self, store: Any, every: float) -> None:
        self._store = store
        self.clock: Clock = REAL_CLOCK
        self.every = every

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def append(self, key: str, value: bytes) -> None:
        self._store.append(key, value)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._store.check(list(keys)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        out: list[bytes] = []
        for i in range(0, len(keys), BATCH):
            out += [bytes(v) for v in self._store.multi_get(list(keys[i:i + BATCH]))]
        return out

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        for i in range(0, len(keys), BATCH):
            self._store.multi_set(list(keys[i:i + BATCH]), list(values[i:i + BATCH]))

    def delete(self, key: str) -> None:
        self._store.delete_key(key)

    def discard(self, keys: Sequence[str]) -> None:
        for k in keys:
            try:
                self._store.delete_key(k)
            except Exception as e:  # costs store memory only
                log.debug("ckptlib: deleting a spent store key failed: %s", e)

    def await_key(self, key: str, deadline: float, watch: Watch, first: Callable[[KV], None] | None = None,
                  ) -> bytes:
        raise NotImplementedError("no waits from the worker or pulse threads")

    def batch(self, calls: Callable[[KV], Any]) -> Any:
        return calls(self)

    def post(self, calls: Callable[[KV], None], wait: float) -> None:
        calls(self)


def direct(store: Any, every: float) -> KV:
    """A :class:`KV` over a raw connection, for a thread that owns it (the pulse thread)."""
    return _Direct(store, every)


def _timed_out(error: BaseException) -> bool:
    return "timeout" in str(error).lower() or "timed out" in str(error).lower()


def _unreachable(error: BaseException) -> BaseException:
    """A store failure as :class:`StoreUnreachable` where the connection is lost (the store's
    host exited: connection reset or refused); other errors as they are."""
    if isinstance(error, StoreUnreachable):
        return error
    text = str(error).lower()
    if any(w in text for w in ("connection", "broken pipe", "reset", "refused", "socket", "closed", "timed out",
                               "timeout")):
        return StoreUnreachable(f"store unreachable: {error}")
    return error


_WORKERS: weakref.WeakSet[TorchKV] = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    """At exit, before the interpreter tears down: the workers finish what was posted (a rank's
    leave) and end, so that none is left inside a store call (which aborts the process)."""
    for kv in list(_WORKERS):
        kv.stop(wait=2.0)
