"""Coordination over torch.distributed: the job's store for meetings and liveness, a
dedicated gloo group for meetings outside a session and for bulk bytes (tier replicas). Used by
the save and restore flows on every rank when a default process group is initialized.

Liveness: from its creation, each rank's coordinator bumps ``ckptlib/<name>/hb/<rank>`` every
``heartbeat`` seconds (:class:`_Heart`, for the process's life: a rank still training before a
save is alive). A session (:meth:`TorchCoordinator.begin_session`: a save, a restore, a tier
save, a drain) needs no meeting to open: every rank counts its sessions, and the n-th one's keys
are ``ckptlib/<name>/s<n>/...`` on every rank. Inside one, every meeting goes over the store as
JSON, and every wait on a rank lasts while its heartbeat moves, up to the caller's deadline; a
rank whose heartbeat stalls for ``dead_after`` is judged dead or frozen, and a rank that left
the session (``gone/<rank>``, posted by :meth:`_Session.stop`: it failed on its own, or the
coordinator gave up) is known at once. The meetings: :meth:`TorchCoordinator.agree` /
``share`` (the coordinator's value to all), ``gather`` (all to the coordinator; the others go
on), ``scatter`` (each rank its own part), ``exchange`` (all to all) and ``consult`` (all in,
each its own answer); and the save's handshake: each rank posts ``done/<rank>`` (``ok`` or its
error) when its files are durable, the coordinator waits for every rank and posts
``release``; after publishing it posts ``outcome``, which the others await while its heartbeat
moves, answering ``read/<rank>``. Survivors of a failed save raise :class:`CommitError` naming
the failed ranks; a rank waking after its save was abandoned reads the failed verdict. A rank
that gives up on a silent coordinator while awaiting ``outcome`` says so (``"gave_up": True``);
the save flow then fences the save on storage (:func:`ckptlib.engine.commit.fence`), so a
coordinator frozen mid-publish and woken later cannot commit what the others reported failed.
Outside a session, agree/gather/scatter are gloo object collectives (group timeout
``dead_after``); ckptlib's own flows (saves, restores, drains, the adapters' checks before a
save, the auto interval's agree) all run inside one.

Threads: every method runs on the thread driving the save; the heartbeat thread only bumps
``hb/<rank>``; :meth:`_Session.bounded` runs one store call on a throwaway daemon thread; a
:class:`_Wake` blocks in ``store.wait`` on a throwaway daemon thread with a connection of its
own, so that a polling wait ends as soon as the keys it waits for exist.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptlib.coord.coordinator import Coordinator
from ckptlib.errors import CommitError, CommitTimeoutError

DEFAULT_DEAD_AFTER = 30.0
log = logging.getLogger("ckptlib")


def _default_store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


ALIGN_TIMEOUT = 120.0
"""How long ranks wait for each other before creating the coordinator's group."""
_generation = [0]


def _meet(store: Any, world: int, timeout: float) -> int:
    """Store barrier before :class:`TorchCoordinator` creates its gloo group (collective, in
    the same order on every rank, so the n-th call on each rank uses the same key). Returns
    that number: the coordinator's name in the store, the same on every rank."""
    _generation[0] += 1
    key = f"ckptlib/coordinator-init/{_generation[0]}"
    store.add(key, 1)
    end = time.monotonic() + timeout
    while store.add(key, 0) < world:
        if time.monotonic() > end:
            raise CommitTimeoutError(
                f"ranks did not all create the checkpoint coordinator within {timeout:.0f}s"
            )
        time.sleep(0.02)
    return _generation[0]


class TorchCoordinator(Coordinator):
    """Created collectively (every rank, same order) the first time a save or load needs it."""

    def __init__(self, dead_after: float = DEFAULT_DEAD_AFTER, heartbeat: float = 0.5) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dead_after = dead_after
        self.heartbeat = heartbeat
        self.store = _default_store()
        # Ranks reach this point seconds apart (whatever each did since init_process_group);
        # gloo's connect timeout is the group timeout (dead_after), so meet first.
        self.name = f"c{_meet(self.store, self.world_size, max(ALIGN_TIMEOUT, dead_after))}"
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=dead_after))
        self._session: _Session | None = None
        self._sessions = 0  # sessions opened so far: the same count on every rank (collective)
        # One heartbeat for the coordinator's life, not one per session: a rank that has not
        # reached a save yet (training) is alive, and is waited for as long as the save allows.
        self._heart = _Heart(self.store, f"ckptlib/{self.name}/hb/{self.rank}", heartbeat)
        weakref.finalize(self, self._heart.halt)  # a manager's drain coordinator, once dropped

    # -- gloo data channel
    def _wrap(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except (RuntimeError, ValueError) as e:  # gloo raises RuntimeError/DistBackendError
            failures = self._session.failed_ranks() if self._session else {}
            if not failures and self._session is not None:
                failures = self._session.read_release(5.0) or {}
            detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
            raise CommitError(
                f"coordination failed during {what}: {detail or e}", failures or {self.rank: str(e)}
            ) from e

    def agree(self, value: Any, timeout: float) -> Any:
        """With a session open: over the store (:meth:`_Session.share`, JSON-typed values), a
        wait lasting while the coordinator's heartbeat moves, up to ``timeout``; else gloo."""
        if self._session is not None:
            return self._store("agreeing", self._session.share, value, time.monotonic() + timeout)
        box = [value]
        self._wrap("agree", lambda: dist.broadcast_object_list(box, src=self._global(0), group=self.group))
        return box[0]

    def gather(self, value: Any, timeout: float) -> list[Any] | None:
        """With a session open: over the store (:meth:`_Session.gather`); else gloo."""
        if self._session is not None:
            return self._store("gathering", self._session.gather, value, time.monotonic() + timeout)
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._wrap("gather", lambda: dist.gather_object(value, out, dst=self._global(0), group=self.group))
        return out

    def scatter(self, values: list[Any] | None, timeout: float) -> Any:
        """With a session open: over the store (:meth:`_Session.scatter`); else gloo."""
        if self._session is not None:
            return self._store("scattering", self._session.scatter, values, time.monotonic() + timeout)
        out = [None]
        self._wrap(
            "scatter",
            lambda: dist.scatter_object_list(out, values if self.rank == 0 else None, src=self._global(0), group=self.group),
        )
        return out[0]

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    # -- liveness channel
    def begin_session(self, label: str) -> None:
        """Open the next session (collective, in the same order on every rank: its keys are
        named by the count of sessions, so no meeting is needed to open it)."""
        self.end_session()
        self._sessions += 1
        self._session = _Session(self.store, f"{self.name}/s{self._sessions}", self.rank, self.world_size,
                                 self.dead_after, self.heartbeat, beats=f"ckptlib/{self.name}/")

    def end_session(self) -> None:
        """Close the session; the others stop waiting for this rank in it (``gone/<rank>``)."""
        if self._session is not None:
            self._session.stop()
            self._session = None

    @property
    def _live(self) -> _Session:
        assert self._session is not None
        return self._session

    @staticmethod
    def _store(what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, a session call: a store failure fails the save as a CommitError."""
        try:
            return fn(*args)
        except CommitError:
            raise
        except Exception as e:
            raise CommitError(f"store failure while {what}: {e}", {0: str(e)}) from e

    def report_done(self, error: str | None) -> None:
        try:
            self._live.post_done(error)
        except Exception as e:  # the store lives in rank 0's process
            raise CommitError(f"{_UNREACHABLE} ({e})", {0: "unreachable"}) from e

    def wait_all_done(self, deadline: float) -> dict[int, str]:
        """Coordinator: block until every rank is done; returns rank -> error for failed ranks."""
        return self._store("waiting for ranks", self._live.wait_all_done, deadline)

    def release(self, failures: dict[int, str]) -> None:
        self._store("releasing ranks", self._live.set, "release", json.dumps({str(k): v for k, v in failures.items()}))

    def wait_release(self, deadline: float) -> dict[int, str]:
        return self._live.wait_release(deadline)

    def share_outcome(self, outcome: Any, deadline: float) -> Any:
        """Over the store, not gloo: the coordinator's publish may take longer than
        ``dead_after`` while it is alive (see :meth:`_Session.share_outcome`)."""
        if self._session is None:
            return super().share_outcome(outcome, deadline)
        return self._store("sharing the outcome", self._session.share_outcome, outcome, deadline)


    def share(self, value: Any, deadline: float) -> Any:
        """Over the store while a session is open: the others wait while the coordinator's
        heartbeat moves (see :meth:`_Session.share`); else :meth:`Coordinator.share`."""
        if self._session is None:
            return super().share(value, deadline)
        return self._store("sharing a value", self._session.share, value, deadline)

    def exchange(self, value: Any, deadline: float) -> list[Any]:
        """Over the store while a session is open: waits on a rank last while its heartbeat
        moves (see :meth:`_Session.exchange`); else :meth:`Coordinator.exchange`."""
        if self._session is None:
            return super().exchange(value, deadline)
        return self._store("exchanging values", self._session.exchange, value, deadline)

    def consult(self, value: Any, decide: Callable[[list[Any]], list[Any]], deadline: float) -> Any:
        """Over the store while a session is open (see :meth:`_Session.consult`): each rank
        reads only its own answer; else :meth:`Coordinator.consult`."""
        if self._session is None:
            return super().consult(value, decide, deadline)
        return self._store("consulting the coordinator", self._session.consult, value, decide, deadline)


class _Heart:
    """A daemon thread adding 1 to ``key`` every ``every`` seconds until :meth:`stop`: the rank's
    heartbeat, which the others read to tell slow from dead. On a store connection of its own
    (``Store.clone``, where the store can), so that a beat never queues behind another thread's
    long store call; a failed beat (a busy or restarting store) is retried at the next one, never
    the end of the heartbeat (the others would judge this live rank dead for the rest of the job)."""

    def __init__(self, store: Any, key: str, every: float) -> None:
        self._stop = threading.Event()
        self.every = every

        def beat() -> None:
            try:
                own = store.clone()
            except Exception:  # older torch, or a store that cannot clone: share the caller's
                own = store
            while not self._stop.is_set():
                try:
                    own.add(key, 1)
                except Exception:  # the others judge by what they see; try again next beat
                    pass
                self._stop.wait(every)

        self._thread = threading.Thread(target=beat, name="ckptlib-heartbeat", daemon=True)
        self._thread.start()
        _HEARTS.add(self)

    def halt(self) -> None:
        """Stop beating, without waiting for the thread (a finalizer's call)."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.every * 4 + 1)


_HEARTS: weakref.WeakSet[_Heart] = weakref.WeakSet()


@atexit.register
def _stop_hearts() -> None:
    """At exit, before the interpreter tears down: no heartbeat left inside a store call."""
    for heart in list(_HEARTS):
        heart.stop()


class _Session:
    """Store keys of one session (a save, a restore): under ``ckptlib/<name>/``. Heartbeats
    ``hb/<rank>`` live under ``beats`` (a :class:`TorchCoordinator`'s, beating for its whole
    life); without ``beats``, under the session's keys, moved by :meth:`start` (unit tests)."""

    def __init__(self, store: Any, name: str, rank: int, world: int, dead_after: float, every: float,
                 beats: str | None = None) -> None:
        self.store = store
        self.prefix = f"ckptlib/{name}/"
        self.beats = beats if beats is not None else self.prefix
        self.rank = rank
        self.world = world
        self.dead_after = dead_after
        self.every = every
        self._heart: _Heart | None = None
        self._failed: dict[int, str] = {}
        self._exchanges = 0  # meetings so far: the same count on every rank

    def k(self, name: str) -> str:
        return self.prefix + name

    def hb(self, rank: int) -> str:
        return f"{self.beats}hb/{rank}"

    def set(self, name: str, value: str) -> None:
        self.store.set(self.k(name), value)

    def start(self) -> None:
        """A heartbeat of the session's own (without ``beats``)."""
        self._heart = _Heart(self.store, self.hb(self.rank), self.every)

    def stop(self) -> None:
        """This rank leaves the session: ``gone/<rank>`` (the failures it knows, JSON) tells
        whoever still waits for it here to stop waiting (:meth:`gone`). Never blocks on the
        store: elsewhere than on the coordinator the post runs on a daemon thread, not waited
        for (a frozen coordinator's store would hold it for ``dead_after``)."""
        text = json.dumps({str(r): m for r, m in self._failed.items()})

        def post() -> None:
            try:
                self.set(f"gone/{self.rank}", text)
            except Exception:  # the store is gone or unreachable: the others judge by heartbeats
                pass

        if self.rank == 0:
            post()
        else:
            threading.Thread(target=post, name="ckptlib-store-call", daemon=True).start()
        if self._heart is not None:
            self._heart.stop()

    def gone(self, rank: int) -> dict[int, str] | None:
        """None while ``rank`` is in the session; once it left (:meth:`stop`), why: the failures
        it knew, or that it left."""
        key = self.k(f"gone/{rank}")
        if not self.bounded(self.store.check, [key]):
            return None
        known = {int(r): m for r, m in json.loads(bytes(self.bounded(self.store.get, key)).decode()).items()}
        return known or {rank: "left the save or restore (it failed before this meeting, or gave up)"}

    def bounded(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` (a store call) on a helper thread, given up after ``dead_after``
        (:class:`_Unreachable`): the store's own timeout does not cover ``set``/``add``/``check``,
        so a call to a frozen coordinator's store would never return."""
        if self.rank == 0:
            return fn(*args)  # the store is in this process
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # handed to the caller below
                box["error"] = e

        t = threading.Thread(target=call, name="ckptlib-store-call", daemon=True)
        t.start()
        t.join(self.dead_after)
        if t.is_alive():
            raise _Unreachable(f"store call unanswered for {self.dead_after:.0f}s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def post_done(self, error: str | None) -> None:
        def post() -> None:
            self.set(f"done/{self.rank}", "ok" if error is None else "err:" + error)
            self.store.add(self.k("ndone"), 1)

        self.bounded(post)  # one helper thread for both calls

    def failed_ranks(self) -> dict[int, str]:
        return dict(self._failed)

    def wait_ranks(self, name: str, deadline: float, late: str, count: str | None = None) -> dict[int, str]:
        """Coordinator: wait until every rank ``r`` posted key ``<name>/<r>`` (``count``: a
        counter key that reaches the world size once all did, one store call per poll), judging
        a rank whose heartbeat stalls for ``dead_after`` as failed. Returns rank -> why for the
        failed ranks (empty: every rank posted); past ``deadline`` raises
        :class:`CommitTimeoutError` ``"ranks [..] <late>"``."""
        seen: dict[int, tuple[int, float]] = {}
        pending = set(range(self.world))
        failed: dict[int, str] = {}
        pause = _pauses(min(0.2, self.every))
        wake = _Wake(self, [self.k(f"{name}/{r}") for r in range(self.world)], deadline)
        patience = _Patience(self, name != "done")  # writing for long is normal; a meeting is not
        while True:
            now = time.monotonic()
            patience.check(pending, deadline)
            if count is not None and self.store.add(self.k(count), 0) >= self.world:
                return {}
            for r in sorted(pending):
                if self.store.check([self.k(f"{name}/{r}")]):
                    pending.discard(r)
                    continue
                left = self.gone(r)
                if left is not None:
                    if self.store.check([self.k(f"{name}/{r}")]):  # it posted, then left, meanwhile
                        pending.discard(r)
                    else:
                        failed.update(left)
                    continue
                beat = self.store.add(self.hb(r), 0)
                last = seen.get(r)
                if last is None or last[0] != beat:
                    seen[r] = (beat, now)
                elif now - last[1] > self.dead_after:
                    failed[r] = f"no heartbeat for {self.dead_after:.0f}s (died, hung or stopped)"
            if failed:
                return failed
            if not pending:
                return {}
            if now > deadline:
                raise CommitTimeoutError(f"ranks {sorted(pending)} {late}")
            wake.sleep(next(pause))

    def wait_all_done(self, deadline: float) -> dict[int, str]:
        dead = self.wait_ranks("done", deadline, "did not finish writing before the deadline", count="ndone")
        if dead:
            self._failed.update(dead)
            return dict(self._failed)
        failures = {}
        values = self.store.multi_get([self.k(f"done/{r}") for r in range(self.world)])
        for r, v in enumerate(values):
            text = v.decode()
            if text != "ok":
                failures[r] = text[4:]
        self._failed.update(failures)
        return failures

    def read_release(self, wait: float) -> dict[int, str] | None:
        """The coordinator's verdict, if it gives one within ``wait`` seconds."""
        end = time.monotonic() + wait
        key = self.k("release")
        pause = _pauses(0.05)
        while True:
            try:
                if self.bounded(self.store.check, [key]):
                    verdict = {int(k): v for k, v in json.loads(self.bounded(self.store.get, key).decode()).items()}
                    self._failed.update(verdict)
                    return verdict
            except Exception:
                return {0: _UNREACHABLE}
            if time.monotonic() > end:
                return None
            time.sleep(next(pause))

    def wait_release(self, deadline: float) -> dict[int, str]:
        """Non-coordinators: wait for the verdict while watching the coordinator's heartbeat."""
        watch = _Watch(self)
        pause = _pauses(0.1)
        wake = _Wake(self, [self.k("release")], deadline)
        while True:
            verdict = self.read_release(0.0)
            if verdict is not None:
                return verdict
            silent = watch.silent()
            if silent:
                verdict = self.read_release(0.0)  # posted, then left, since the read above
                return verdict if verdict is not None else {0: silent}
            if time.monotonic() > deadline:
                raise CommitTimeoutError("the coordinator did not finish the save before the deadline")
            wake.sleep(next(pause))

    def share_outcome(self, outcome: Any, deadline: float) -> Any:
        """The coordinator posts ``outcome`` (JSON) and waits, at most ``dead_after``, until
        every other rank read it; the others wait while its heartbeat moves (at most
        ``dead_after`` past ``deadline``). Every rank returns the same decoded JSON (rank keys
        as strings), except a rank that gave up on a silent or unreachable coordinator, or at
        the deadline: it returns a failed outcome with ``"gave_up": True`` (the coordinator
        may still be publishing: the caller must settle the save on storage)."""
        readers = [self.k(f"read/{r}") for r in range(1, self.world)]
        if self.rank == 0:
            text = json.dumps(outcome)
            self.set("outcome", text)
            # The others read it within a poll; one that died since gather is not waited for.
            self._await_readers(readers)
            return json.loads(text)
        try:
            value = json.loads(self.await_coordinator("outcome", deadline + self.dead_after).decode())
            self.bounded(self.set, f"read/{self.rank}", "1")
            return value
        except _Unreachable:
            return {"failures": {"0": _UNREACHABLE}, "gave_up": True}
        except _Silent as e:
            return {"failures": {"0": str(e)}, "gave_up": True}
        except _Late:
            late = "CommitTimeoutError: the coordinator did not publish the save before the deadline"
            return {"failures": {"0": late}, "gave_up": True}

    def await_coordinator(self, name: str, deadline: float) -> bytes:
        """Non-coordinators: the value of key ``name`` once the coordinator posts it, waited for
        while its heartbeat moves. Raises :class:`_Silent` (it died, froze, or its store is
        gone) or :class:`_Late` (past ``deadline``, alive)."""
        key = self.k(name)
        watch = _Watch(self)
        patience = _Patience(self, name.startswith("x"))  # a meeting's answer, not the outcome
        while True:
            patience.check({0}, deadline)
            try:
                self.bounded(self.store.wait, [key], timedelta(seconds=self.every))
                return bytes(self.bounded(self.store.get, key))
            except _Unreachable:
                raise _Silent(_UNREACHABLE) from None
            except Exception:  # store.wait timed out (or the store is gone: the watch says so)
                pass
            silent = watch.silent()
            if silent:
                try:  # it may have posted, then left, since the wait above looked
                    if self.bounded(self.store.check, [key]):
                        return bytes(self.bounded(self.store.get, key))
                except Exception:  # unreachable: silent it is
                    pass
                raise _Silent(silent)
            if time.monotonic() > deadline:
                raise _Late(name)

    def _await_readers(self, readers: list[str]) -> None:
        """Coordinator: wait, at most ``dead_after``, until every key in ``readers`` exists (the
        others' "I have read it"), so that the store in this process outlives their reads."""
        end, pause = time.monotonic() + self.dead_after, _pauses(0.05)
        wake = _Wake(self, readers, end)
        while readers and not self.store.check(readers) and time.monotonic() < end:
            wake.sleep(next(pause))

    def _next(self) -> str:
        self._exchanges += 1
        return f"x{self._exchanges}"

    def share(self, value: Any, deadline: float) -> Any:
        """:meth:`Coordinator.share` over the store: the coordinator posts ``value`` (JSON)
        and goes on; the others wait for it while its heartbeat moves, until ``deadline``."""
        name = f"{self._next()}/all"
        if self.rank == 0:
            text = json.dumps(value)
            self.set(name, text)
            return json.loads(text)
        return json.loads(self._from_coordinator(name, deadline, "share its value"))

    def gather(self, value: Any, deadline: float) -> list[Any] | None:
        """:meth:`Coordinator.gather` over the store: every rank posts ``value`` (JSON, tagged
        as a gather) and goes on; the coordinator waits for all while their heartbeats move
        (:meth:`wait_ranks`) and returns the decoded values in rank order, or raises
        :class:`CommitError` naming the ranks that died, froze, left the session or came to
        another kind of meeting (it then leaves the session: the others, waiting on it at their
        next meeting, see ``gone/0``)."""
        n = self._next()
        try:
            self.bounded(self.set, f"{n}/{self.rank}", json.dumps(["gather", value]))
        except _Unreachable:
            raise CommitError(f"coordination failed: {_UNREACHABLE}", {0: _UNREACHABLE}) from None
        if self.rank != 0:
            return None
        dead = self.wait_ranks(n, deadline, "did not arrive before the deadline")
        if not dead:
            got = [json.loads(v.decode()) for v in
                   self.store.multi_get([self.k(f"{n}/{r}") for r in range(self.world)])]
            dead = {r: f"at another meeting (a {k}, not the coordinator's gather)"
                    for r, (k, _v) in enumerate(got) if k != "gather"}
        if dead:
            self._failed.update(dead)
            detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(dead.items()))
            raise CommitError(f"coordination failed during gather: {detail}", dead)
        return [v for _k, v in got]

    def scatter(self, values: list[Any] | None, deadline: float) -> Any:
        """:meth:`Coordinator.scatter` over the store: the coordinator posts ``values[r]`` (JSON)
        under a key of rank ``r``'s own and goes on; each other rank waits for its own while the
        coordinator's heartbeat moves, until ``deadline``."""
        n = self._next()
        if self.rank == 0:
            assert values is not None and len(values) == self.world
            texts = [json.dumps(v) for v in values]
            self.store.multi_set([self.k(f"{n}/to/{r}") for r in range(self.world)], texts)
            return json.loads(texts[0])
        return json.loads(self._from_coordinator(f"{n}/to/{self.rank}", deadline, "send this rank its part"))

    def exchange(self, value: Any, deadline: float) -> list[Any]:
        """:meth:`Coordinator.exchange` over the store: every rank posts ``value`` (JSON); the
        coordinator waits for all while their heartbeats move (:meth:`wait_ranks`) and posts
        the list, or the ranks it judged dead, which every rank then raises as a CommitError."""
        return list(self._round(value, deadline, None))

    def consult(self, value: Any, decide: Callable[[list[Any]], list[Any]], deadline: float) -> Any:
        """:meth:`Coordinator.consult` over the store: as :meth:`exchange`, but the coordinator
        posts ``decide(values)[r]`` under a key of rank ``r``'s own, which only that rank reads."""
        return self._round(value, deadline, decide)

    def _round(self, value: Any, deadline: float, decide: Callable[[list[Any]], list[Any]] | None) -> Any:
        """One meeting: every rank posts ``value`` (key ``<n>/<rank>``, tagged with the kind of
        meeting); the coordinator waits for all (:meth:`wait_ranks`) and posts, for every rank,
        the list of values (``decide`` None, an exchange: one key ``<n>/all``) or its own answer
        (a consult: key ``<n>/to/<rank>``); or, to every key either kind reads, the ranks it
        judged dead, its own failure, or the ranks that came to another kind of meeting (one
        that skipped a meeting after a local failure), which every rank raises as a CommitError."""
        n = self._next()
        kind = "exchange" if decide is None else "consult"
        every = [f"{n}/all"] + [f"{n}/to/{r}" for r in range(self.world)]
        names = every[:1] if decide is None else every[1:]
        try:
            self.bounded(self.set, f"{n}/{self.rank}", json.dumps([kind, value]))
        except _Unreachable:
            raise CommitError(f"coordination failed: {_UNREACHABLE}", {0: _UNREACHABLE}) from None
        if self.rank == 0:

            def post(keys: list[str], docs: list[Any]) -> None:
                self.store.multi_set([self.k(x) for x in keys], [json.dumps(d) for d in docs])

            def fail(failures: dict[int, str]) -> None:
                post(every, [{"failed": {str(r): why for r, why in failures.items()}}] * len(every))

            try:
                dead = self.wait_ranks(n, deadline, "did not arrive before the deadline")
            except CommitTimeoutError as e:
                fail({0: str(e)})
                raise
            if dead:
                fail(dead)
            else:
                got = [json.loads(v.decode()) for v in
                       self.store.multi_get([self.k(f"{n}/{r}") for r in range(self.world)])]
                astray = {r: f"at another meeting (a {k}, not the coordinator's {kind})"
                          for r, (k, _v) in enumerate(got) if k != kind}
                values = [v for _k, v in got]
                if astray:
                    fail(astray)
                elif decide is None:
                    post(names, [{"values": values}])
                else:
                    try:
                        answers = decide(values)
                    except Exception as e:  # the others must not wait for answers that never come
                        fail({0: f"{type(e).__name__}: {e}"})
                        raise
                    post(names, [{"values": a} for a in answers])
            # The store lives in this process: wait (at most ``dead_after``) until the others have
            # read their answer, so that a coordinator that returns and exits at once (the last
            # meeting of a restore) does not take it with it.
            self._await_readers([self.k(f"{n}/read/{r}") for r in range(self.world) if r != 0 and r not in dead])
        doc = json.loads(self._from_coordinator(names[0 if decide is None else self.rank], deadline,
                                                "collect every rank's value"))
        if self.rank != 0:
            try:
                self.bounded(self.set, f"{n}/read/{self.rank}", "1")
            except _Unreachable:
                pass  # the coordinator stopped waiting for us: the answer is ours already
        if "failed" in doc:
            failures = {int(r): why for r, why in doc["failed"].items()}
            detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
            raise CommitError(f"coordination failed during {kind}: {detail}", failures)
        return doc["values"]

    def _from_coordinator(self, name: str, deadline: float, what: str) -> bytes:
        """The coordinator's key ``name`` (its own process: read directly); a silent or late
        coordinator raises :class:`CommitError` naming rank 0."""
        if self.rank == 0:
            return bytes(self.store.get(self.k(name)))
        try:
            return self.await_coordinator(name, deadline)
        except _Silent as e:
            raise CommitError(f"coordination failed: {e}", {0: str(e)}) from None
        except _Late:
            raise CommitTimeoutError(f"the coordinator (rank 0) did not {what} before the deadline",
                                     {0: "alive, but late"}) from None


_UNREACHABLE = "coordinator (rank 0) unreachable: it died or its store is gone"


def _pauses(cap: float) -> Iterator[float]:
    """Sleeps between store polls: 5 ms, doubling up to ``cap``. A wait that ends at once (the
    usual case: the other ranks finish writing within milliseconds of each other) costs
    milliseconds instead of a whole poll period; a long wait polls at most every ``cap``
    seconds, so the store's load stays what it was (bench/bench_distributed.py measured about
    0.15 s per 4-rank save spent in fixed 0.1-0.2 s sleeps)."""
    d = 0.005
    while True:
        yield min(d, cap)
        d *= 2


class _Wake:
    """Ends a polling loop's sleep as soon as every key in ``keys`` exists: a daemon thread
    opens a connection of its own to the store (``Store.clone``, torch 2.6 and later; so that
    the heartbeat and the polls never queue behind it, and a frozen store never blocks the
    loop), blocks in ``wait(keys)`` and sets an event. The loop still polls and watches
    heartbeats as before (the same liveness bounds); the wake-up only removes the lag of its
    back-off, up to 0.1-0.2 s after the last key (bench/bench_distributed.py saw ranks wake
    40-100 ms after the release). The thread waits at most ``dead_after``, and not past
    ``deadline``; after that, or where the store cannot clone itself, the polls alone notice.
    Made and slept on by the thread driving the session."""

    def __init__(self, session: _Session, keys: list[str], deadline: float) -> None:
        self._event = threading.Event()
        if not keys:
            return
        store, wait = session.store, max(0.01, min(session.dead_after, deadline - time.monotonic()))

        def run() -> None:
            try:
                store.clone().wait(keys, timedelta(seconds=wait))
            except Exception:  # no clone (older torch), timed out, or the store is gone: polls see to it
                return
            self._event.set()

        threading.Thread(target=run, name="ckptlib-store-wake", daemon=True).start()

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the keys appear meanwhile."""
        self._event.wait(seconds)


class _Patience:
    """Logs once when a meeting has waited ``dead_after`` on ranks that are alive but not there:
    late (a slow step before the save), or never coming (``save`` called on some ranks only: it
    then fails at the deadline). Made by the thread waiting."""

    def __init__(self, session: _Session, meeting: bool) -> None:
        self.session, self.meeting = session, meeting
        self.start = time.monotonic()

    def check(self, ranks: set[int], deadline: float) -> None:
        s = self.session
        if self.meeting and ranks and time.monotonic() - self.start > s.dead_after:
            self.meeting = False
            log.warning("ckptlib: rank %d has waited %.0fs for ranks %s, alive but not at this meeting; waiting "
                        "up to %.0fs more (every rank must call save/restore for the same steps in the same "
                        "order)", s.rank, time.monotonic() - self.start, sorted(ranks),
                        max(0.0, deadline - time.monotonic()))


class _Unreachable(TimeoutError):
    """A store call from a non-coordinator went unanswered for ``dead_after``."""


class _Silent(Exception):
    """:meth:`_Session.await_coordinator`: the coordinator died, froze or is unreachable (why)."""


class _Late(Exception):
    """:meth:`_Session.await_coordinator`: the deadline passed while the coordinator was alive."""


@dataclass
class _Watch:
    """Non-coordinators: is the coordinator's heartbeat (``hb/0``) still moving?"""

    session: _Session
    last: tuple[int, float] | None = None

    def silent(self) -> str | None:
        """None while the coordinator is alive; else why it is judged dead."""
        s = self.session
        try:
            left = s.gone(0)
            beat = s.bounded(s.store.add, s.hb(0), 0)
        except Exception:
            return _UNREACHABLE
        if left is not None:
            return "coordinator (rank 0) left the session: " + "; ".join(
                f"rank {r}: {m}" for r, m in sorted(left.items()))
        now = time.monotonic()
        if self.last is None or self.last[0] != beat:
            self.last = (beat, now)
        elif now - self.last[1] > s.dead_after:
            return f"coordinator (rank 0) silent for {s.dead_after:.0f}s (died, hung or stopped)"
        return None
