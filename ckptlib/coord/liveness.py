"""Telling slow from dead: heartbeats, and the judge that reads them.

Every process with a :class:`ckptlib.coord.torch_coordinator.TorchCoordinator` runs one
:class:`Pulse` per store (shared by its coordinators: the save's and the drain's): a daemon
thread, on a store connection of its own, that adds 1 to ``ckptlib/hb/<rank>`` every
``every`` seconds for the process's life (a rank still training before a save is alive), and
runs the watches of the waits in progress (:meth:`ckptlib.coord.kv.KV.await_key`) at the same
cadence, and deletes the keys discarded since (:meth:`ckptlib.coord.kv.KV.discard`). A watch reads heartbeats and judges them with a :class:`Judge`.

A :class:`Judge` names a rank silent when its counter has not moved for ``dead_after`` seconds
*while this process's own counter, read the same way, moved* at least :data:`MIN_BEATS` times:
a store that stalls, or a process starved of CPU, stops every counter it can see, its own
included, and so never produces a false verdict (seen before: three store connections timing
out at once, then "no heartbeat for 5s" for a live rank).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptlib.coord.kv import CANCEL, KV, StoreUnreachable, Watch, direct, own_connection

log = logging.getLogger("ckptlib")

MIN_BEATS = 3
"""Own heartbeats that must be seen to move during a silence before it counts as one."""


def heartbeat_period(dead_after: float) -> float:
    """The heartbeat period for a coordination timeout: a tenth of it, within [0.05, 2] s
    (4,096 ranks at the default 30 s timeout: about 2,000 store adds per second)."""
    return min(2.0, max(0.05, dead_after / 10))


LOST = "died, hung or stopped"
"""How every verdict of a rank gone from the job ends (a silent rank, an unreachable coordinator):
:func:`note_relaunch` looks for it."""


def hb_key(rank: int) -> str:
    return f"ckptlib/hb/{rank}"


class Judge:
    """Heartbeat observations of one wait (or one session), on whichever thread runs its watch."""

    def __init__(self, dead_after: float) -> None:
        self.dead_after = dead_after
        self.seen: dict[int, tuple[int, float, int]] = {}  # rank -> (counter, since, own counter then)

    def silent(self, now: float, beats: dict[int, int], own: int) -> list[int]:
        """The ranks in ``beats`` (rank -> counter) whose counter has not moved for
        ``dead_after`` while ``own`` (this process's counter) moved enough."""
        out = []
        for r, v in beats.items():
            last = self.seen.get(r)
            if last is None or last[0] != v:
                self.seen[r] = (v, now, own)
            elif now - last[1] > self.dead_after and own - last[2] >= MIN_BEATS:
                out.append(r)
        return out

    def why(self) -> str:
        return f"no heartbeat for {self.dead_after:.0f}s ({LOST})"


def read_beats(kv: KV, ranks: list[int], me: int) -> tuple[dict[int, int], int]:
    """Heartbeat counters of ``ranks`` and of ``me`` (one multi_get per :data:`kv.BATCH` keys)."""
    keys = [hb_key(r) for r in ranks] + [hb_key(me)]
    values = [int(v) for v in kv.multi_get(keys)]
    return dict(zip(ranks, values[:-1], strict=True)), values[-1]


@dataclass
class Ticket:
    key: str
    watch: Watch
    failures: dict[int, str] | None = None


class Pulse:
    """The heartbeat and watch thread of one process and store (module docstring). Made by the
    first :class:`TorchCoordinator` on a store (:meth:`of`); halted when the last is dropped."""

    _all: dict[int, Pulse] = {}
    _guard = threading.Lock()

    @classmethod
    def of(cls, store: Any, rank: int, every: float, limit: float) -> Pulse:
        with cls._guard:
            pulse = cls._all.get(id(store))
            if pulse is None or pulse._stop.is_set():
                pulse = cls._all[id(store)] = Pulse(store, rank, every, limit)
            pulse._users += 1
            return pulse

    def __init__(self, store: Any, rank: int, every: float, limit: float) -> None:
        self.every, self.limit, self.rank = every, limit, rank
        self._users = 0
        self._released = False  # halted by the last release(), not at interpreter exit
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watches: list[Ticket] = []
        self._litter: list[str] = []  # keys to delete at the next beat (KV.discard)
        self._last = time.monotonic()
        # The thread connects and beats once before the caller goes on (the key exists before
        # anyone reads it: the caller then meets); connecting to a frozen store blocks for the
        # store's own timeout (minutes), so the caller waits ``limit`` at most.
        first = threading.Event()
        self._failed: BaseException | None = None  # the first heartbeat's error
        self._thread = threading.Thread(target=self._run, args=(store, first), name="ckptlib-pulse", daemon=True)
        self._thread.start()
        if not first.wait(limit):
            self._stop.set()  # the thread ends once its first call returns
            raise StoreUnreachable(f"the job's store did not take this rank's first heartbeat within {limit:.0f}s")
        if self._failed is not None:
            raise StoreUnreachable(f"the job's store refused this rank's first heartbeat: {self._failed}")
        _PULSES.add(self)

    def release(self) -> None:
        """A coordinator using this pulse was dropped; the last one halts it (no wait)."""
        with Pulse._guard:
            self._users -= 1
            if self._users <= 0:
                self._released = True
                self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.every * 4 + 1)

    def watch(self, key: str, watch: Watch) -> Ticket:
        ticket = Ticket(key, watch)
        with self._lock:
            self._watches.append(ticket)
        return ticket

    def unwatch(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket in self._watches:
                self._watches.remove(ticket)

    def discard(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` at the next beat (:meth:`ckptlib.coord.kv.KV.discard`)."""
        with self._lock:
            self._litter.extend(keys)

    def stalled(self) -> bool:
        """No beat has reached the store for ``limit`` seconds (store frozen, gone, or this
        thread stuck in a call to it)."""
        return time.monotonic() - self._last > self.limit

    def _run(self, store: Any, first: threading.Event) -> None:
        key = hb_key(self.rank)
        kv = direct(own_connection(store), self.every)
        try:
            kv.add(key, 1)
            self._last = time.monotonic()
        except Exception as e:  # the constructor raises it
            self._failed = e
            self._stop.set()
            first.set()
            return
        first.set()
        self._stop.wait(self.every)
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                kv.add(key, 1)
                self._last = time.monotonic()
            except Exception:  # a busy or restarting store: the others judge by what they see
                pass
            with self._lock:
                tickets = [t for t in self._watches if t.failures is None]
                litter, self._litter = self._litter, []
            kv.discard(litter)
            for t in tickets:
                try:
                    failures = t.watch(kv)
                except Exception as e:  # store trouble: the stall check decides
                    log.debug("ckptlib: a liveness watch failed: %s", e)
                    continue
                if failures is not None:  # {}: the wait is over without a failure
                    t.failures = failures
                    try:
                        kv.set(t.key, CANCEL)  # the waiter's own key: wakes its wait
                    except Exception:
                        pass  # the waiter sees t.failures within a period
            self._stop.wait(max(0.0, self.every - (time.monotonic() - start)))
        if self._released:  # keys discarded just before the last coordinator's close still go (not at exit)
            with self._lock:
                litter, self._litter = self._litter, []
            kv.discard(litter)


_PULSES: weakref.WeakSet[Pulse] = weakref.WeakSet()


@atexit.register
def _stop_pulses() -> None:
    """At exit, before the interpreter tears down: no pulse left inside a store call."""
    for pulse in list(_PULSES):
        pulse.stop()


def note_relaunch(error: BaseException, what: str, where: str) -> None:
    """``CheckpointManager``, when a save (the persist thread, or a synchronous save's caller)
    or a restore (the caller) failed because a rank is gone from the job (a liveness verdict in
    ``error.failures``, which end in :data:`LOST`: a silent rank, an unreachable coordinator):
    add what to do next to the error's notes, which Python 3.11 and later prints under its
    traceback. ``what`` failed; ``where`` a relaunch resumes. Other
    failures (a rank's storage error, non-finite values) get no note: a relaunch does not mend
    them."""
    failures = getattr(error, "failures", None) or {}
    if not any(LOST in str(why) for why in failures.values()) or not hasattr(error, "add_note"):
        return
    error.add_note(f"ckptlib: {what}. A rank that died or froze ends the job's process group: "
                   f"relaunch the whole job; restore() then resumes from {where}.")

