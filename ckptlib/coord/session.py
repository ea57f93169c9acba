"""One coordination session: the meetings of one flow (a save, a restore, a tier save, a drain)
over a :class:`~ckptlib.coord.kv.KV`.

A flow opens it on every rank, in the same order, with ``with coord.session(label, deadline) as
s:`` (no meeting: the n-th session of a coordinator has the same keys on every rank,
``ckptlib/<coordinator>/s<n>/``) and passes ``s`` to whatever meets inside. Meetings are
numbered the same way (``m<k>``); each is one of three shapes:

- :meth:`Session.share`: the coordinator's value to every rank (others pass None);
- :meth:`Session.report`: every rank's value to the coordinator (the others go on at once);
- :meth:`Session.answer_each`: the coordinator gives each rank its own value.

:meth:`Session.exchange` (report, then the list shared) and :meth:`Session.consult` (report, then
each rank its own answer) are the two compounds. ``receipts=True`` on a share or an answer makes
the coordinator wait until every live rank has read it. Store traffic (docs/scale.md): a
non-coordinator posts one key and one counter per report and reads one key of its own per share
or answer, blocking on it in the store (no polling); the coordinator reads reports and writes
answers in batches (:data:`~ckptlib.coord.kv.BATCH` keys per round trip) and blocks on one key
per report (set by the last rank to post). Liveness is read only while a wait lasts longer than
a heartbeat period (:mod:`ckptlib.coord.liveness`). A report whose next step is the session's
next meeting can be held (``hold=True``): the rank posts it with its wait for that meeting's
answer, one hand-off to the store's worker thread instead of two (docs/distributed.md).

Leaving: :meth:`Session.close` (the ``with`` block's end) posts ``left/<rank>`` (with this
rank's failures when it leaves on an error). The coordinator leaves last: it waits until every
rank still alive has left, so no answer of the session vanishes with its process (its store)
when it returns and exits at once; a coordinator leaving on an error first posts ``abort`` with
its failures, which ends every wait on it.

Store memory stays bounded however many sessions a job runs: every key is deleted by the one
rank that knows nobody reads it any more, right after a read that proves it
(:meth:`KV.discard`: off the caller's path). The coordinator's wake key and its counter: once it has read
the wake key (every rank has counted itself in). A key a non-coordinator posts (a report, a read
receipt, ``left``): the coordinator reads it before it posts its next answer, so the rank
deletes it once it reads that answer, in this session or the next. A rank's answer key: once it
reads its next answer, not at once: on busy ranks, an answer key deleted right after it was read
was seen to come back with the same value though the coordinator's one ``multi_set`` wrote it
once (torch 2.13's TCPStore; the cause is not known); the next answer comes from a later request
on the coordinator's connection, after that ``multi_set``.
The rank's list (``spent``) is kept by the coordinator object across its sessions. The
coordinator deletes a long shared value once every rank has left. A coordinator that is closed
(a manager's drain coordinator, ``TorchCoordinator.close``) has no next session: then rank 0
deletes what the others posted in its last session, once every rank left it
(:meth:`Session.spent_keys`), and each other rank its last answer key. A failed session's
``abort`` key goes once every rank has left it. After a failure some keys stay behind (a few
per failed session in which a rank did not leave: it died or froze). Every wait is bounded by its deadline and by the
liveness of whom it waits for: a rank that died, froze or left fails the others within the
coordination timeout (``dead_after``), naming it.

Threads: one thread drives a session (the flow's). Watches run on the process's pulse thread
(:class:`~ckptlib.coord.liveness.Pulse`) with the store handle it passes them; they touch only
the session's judge and bookkeeping of the wait in progress.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ckptlib.coord.kv import BATCH, KV, REAL_CLOCK, Clock, Gone, Late, StoreUnreachable
from ckptlib.coord.liveness import LOST, Judge, read_beats
from ckptlib.errors import CommitError, CommitTimeoutError

log = logging.getLogger("ckptlib")

UNREACHABLE = f"coordinator (rank 0) unreachable: it {LOST}, or its store is gone"
INLINE = 1024
"""A shared value up to this many bytes travels in every rank's own key; a longer one is stored
once and each rank reads it after its key says so."""


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _failures(doc: dict[str, str]) -> dict[int, str]:
    return {int(r): str(m) for r, m in doc.items()}


def detail(failures: dict[int, str]) -> str:
    return "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))


class Session:
    """One session on one rank (module docstring). Made by ``Coordinator.session``."""

    def __init__(self, kv: KV | None, prefix: str, rank: int, world: int, *, deadline: float, dead_after: float,
                 label: str, coord: Any = None, clock: Clock | None = None, spent: list[str] | None = None,
                 after_close: Callable[[], None] | None = None) -> None:
        self.kv = kv
        self.clock: Clock = clock or (kv.clock if kv is not None else REAL_CLOCK)
        self.prefix, self.rank, self.world, self.label = prefix, rank, world, label
        self.deadline, self.dead_after = deadline, dead_after
        self.coord = coord
        """The coordinator that opened it (bulk transfers: ``coord.transfer``)."""
        self.failed: dict[int, str] = {}
        """Ranks this rank knows failed in this session (rank -> why)."""
        self.closed = False
        self._k = 0
        self._left: dict[int, dict[int, str] | None] = {}  # coordinator: who left, with what
        self._judge = Judge(dead_after)  # heartbeats seen in this session's waits (by their watches)
        self._spent = spent if spent is not None else []
        """Non-coordinators: the keys to delete once this rank reads its next answer: its last
        answer key, and the keys it posted since (the coordinator's list, shared by its
        sessions, so a session's last keys go with the next session's first take)."""
        self._shared: list[str] = []  # coordinator: long shared values, deleted once every rank left
        self._held: Callable[[KV], None] | None = None  # others: a report held back (report(hold=True))
        self._tail: list[str] = []
        """Coordinator: the keys the others posted since its last answer (a report's, a read
        receipt's, ``left``), without the rank: nobody deletes them until a next answer, so a
        coordinator that has no next session deletes them itself (:meth:`spent_keys`)."""
        self._everyone_left = False
        self._after_close = after_close  # the coordinator's: end the turn this session took

    # -- basics
    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def now(self) -> float:
        return self.clock.now()

    def left(self, deadline: float | None = None) -> float:
        """Seconds before ``deadline`` (default: the session's), at least 0.1."""
        return max(0.1, (deadline or self.deadline) - self.clock.now())

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _next(self) -> str:
        self._k += 1
        return f"m{self._k}"

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None,
                 ) -> None:
        self.close(error)

    # -- the three meetings
    def share(self, value: Any = None, *, deadline: float | None = None, receipts: bool = False,
              what: str = "share its value") -> Any:
        """The coordinator's ``value`` (JSON-typed) on every rank; the others pass None and wait
        for it while the coordinator is alive, until ``deadline``. ``receipts``: the coordinator
        returns once every live rank has read it."""
        m = self._next()
        if self.world == 1:
            return value
        if self.is_coordinator:
            text = _dumps({"v": value})
            self._post(m, [text] * self.world, receipts, deadline)
            return value if _plain(value) else json.loads(text)["v"]
        return self._take(m, deadline, what, receipts)

    def answer_each(self, values: list[Any] | None, *, deadline: float | None = None, receipts: bool = False,
                    what: str = "send this rank its answer") -> Any:
        """Each rank gets its entry of the coordinator's ``values`` (others pass None)."""
        m = self._next()
        if self.world == 1:
            assert values is not None
            return values[0]
        if self.is_coordinator:
            assert values is not None and len(values) == self.world
            texts = [_dumps({"v": v}) for v in values]
            self._post(m, texts, receipts, deadline)
            return json.loads(texts[0])["v"]
        return self._take(m, deadline, what, receipts)

    def report(self, value: Any, *, deadline: float | None = None, patient: bool = False,
               hold: bool = False) -> list[Any] | None:
        """Coordinator: every rank's ``value`` in rank order (raises :class:`CommitError` naming
        ranks that died, froze, left the session, or came to another session's meeting);
        others: post it and return None at once. ``patient``: a long wait is expected (ranks
        writing), so no warning for ranks that are alive but absent. ``hold`` (others; for a
        caller whose next step is this session's next meeting): the post is made with this
        rank's next store call of the session (its next wait for an answer, or its leave), in
        the same hand-off to the store; a failure to post is then raised by that call."""
        m = self._next()
        if self.world == 1:
            return [value]
        kv = self._kv()
        if not self.is_coordinator:
            text, world, key = _dumps([self.label, value]), self.world, self._key

            def post(b: KV) -> None:
                b.set(key(f"{m}/r/{self.rank}"), text)
                if b.add(key(f"{m}/n"), 1) == world - 1:
                    b.set(key(f"{m}/in"), b"1")

            self._spent.append(key(f"{m}/r/{self.rank}"))
            self._hold(post)
            if hold:
                return None
            try:
                kv.batch(self._release())
            except StoreUnreachable:
                raise CommitError(f"coordination failed: {UNREACHABLE}", {0: UNREACHABLE}) from None
            return None
        others = list(range(1, self.world))
        self._await_ranks(f"{m}/in", lambda r: f"{m}/r/{r}", deadline, "did not arrive before the deadline",
                          warn=not patient, counter=f"{m}/n")
        got = [json.loads(t) for t in kv.multi_get([self._key(f"{m}/r/{r}") for r in others])]
        self._tail.append(f"{m}/r/")
        astray = {r: f"at another session's meeting ({label!r}, not {self.label!r})"
                  for r, (label, _v) in zip(others, got, strict=True) if label != self.label}
        if astray:
            self.failed.update(astray)
            raise CommitError(f"coordination failed during {self.label}: {detail(astray)}", astray)
        return [value] + [v for _label, v in got]

    # -- compounds
    def exchange(self, value: Any, *, deadline: float | None = None) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank (a report, then the list
        shared); a failure at the coordinator is raised on every rank."""
        return list(self._round(value, None, deadline))

    def consult(self, value: Any, decide: Callable[[list[Any]], list[Any]], *, deadline: float | None = None) -> Any:
        """Every rank's ``value`` to the coordinator, which answers each rank with its entry of
        ``decide(values)`` (runs on the coordinator only; its exception fails every rank)."""
        return self._round(value, decide, deadline)

    def _round(self, value: Any, decide: Callable[[list[Any]], list[Any]] | None, deadline: float | None) -> Any:
        try:
            got = self.report(value, deadline=deadline)
        except CommitError as e:
            if self.is_coordinator:  # the others wait for the answer: give them the failure
                self._fail_next(e.failures or {0: str(e)})
            raise
        if not self.is_coordinator:
            return (self.share if decide is None else self.answer_each)(None, deadline=deadline,
                                                                      what="collect every rank's value")
        assert got is not None
        if decide is None:
            return self.share(got, deadline=deadline)
        try:
            answers = decide(got)
        except Exception as e:
            self._fail_next({0: f"{type(e).__name__}: {e}"})
            raise
        return self.answer_each(answers, deadline=deadline)

    def _fail_next(self, failures: dict[int, str]) -> None:
        """Coordinator: post ``failures`` as the next meeting's answer to every rank."""
        self.failed.update(failures)
        m = self._next()
        try:
            self._post(m, [_dumps({"failed": {str(r): w for r, w in failures.items()}})] * self.world, False, None)
        except StoreUnreachable:
            pass

    # -- posting and taking answers
    def _hold(self, calls: Callable[[KV], None]) -> None:
        """Others: ``calls`` run with this rank's next store call of the session, after those
        held before them."""
        held = self._held
        if held is None:
            self._held = calls
            return

        def both(b: KV) -> None:
            held(b)
            calls(b)

        self._held = both

    def _release(self) -> Callable[[KV], None]:
        """Others: the calls held (:meth:`_hold`) and no longer held; a no-op when none are."""
        held, self._held = self._held, None
        return held if held is not None else _nothing

    def _post(self, m: str, texts: list[bytes], receipts: bool, deadline: float | None) -> None:
        kv = self._kv()
        self._tail = []  # each rank deletes what it posted before once it reads this answer
        keys = [self._key(f"{m}/w/{r}") for r in range(1, self.world)]
        if len(set(texts[1:])) == 1 and len(texts[1]) > INLINE:  # one long value: stored once
            kv.set(self._key(f"{m}/all"), texts[1])
            self._shared.append(self._key(f"{m}/all"))
            kv.multi_set(keys, [b"@"] * len(keys))
        else:
            kv.multi_set(keys, texts[1:])
        if receipts:
            try:
                self._await_ranks(f"{m}/allread", lambda r: f"{m}/read/{r}", deadline, "did not read the answer",
                                  until_all=True, counter=f"{m}/nread")
            except CommitError as e:  # those ranks failed; the answer is posted all the same
                log.debug("ckptlib: not every rank read %s: %s", m, e)
            self._tail.append(f"{m}/read/")

    def _take(self, m: str, deadline: float | None, what: str, receipts: bool) -> Any:
        raw = self._from_coordinator(f"{m}/w/{self.rank}", deadline, what)
        kv = self._kv()
        me, world, key = self.rank, self.world, self._key

        def rest(b: KV) -> bytes:
            got = b.get(key(f"{m}/all")) if raw == b"@" else raw
            if receipts:
                b.set(key(f"{m}/read/{me}"), b"1")
                if b.add(key(f"{m}/nread"), 1) == world - 1:
                    b.set(key(f"{m}/allread"), b"1")
            return got

        if receipts:
            self._spent.append(key(f"{m}/read/{me}"))
        try:
            if raw == b"@" or receipts:
                raw = kv.batch(rest)
        except StoreUnreachable:
            if raw == b"@":
                raise CommitError(f"coordination failed: {UNREACHABLE}", {0: UNREACHABLE}) from None
        doc = json.loads(raw)
        if "failed" in doc:
            failures = _failures(doc["failed"])
            self.failed.update(failures)
            raise CommitError(f"coordination failed during {self.label}: {detail(failures)}", failures)
        return doc["v"]

    # -- waits
    def _kv(self) -> KV:
        assert self.kv is not None, "a one-rank session has no store"
        return self.kv

    def _from_coordinator(self, name: str, deadline: float | None, what: str) -> bytes:
        """Non-coordinators: the value of key ``name`` (this rank's own) once the coordinator
        sets it, waited for while it is alive and has not aborted the session."""
        judge = self._judge
        abort = self._key("abort")

        def watch(kv: KV) -> dict[int, str] | None:
            beats, own = read_beats(kv, [0], self.rank)
            if judge.silent(self.clock.now(), beats, own):
                return {0: f"coordinator (rank 0) silent for {self.dead_after:.0f}s ({LOST})"}
            if kv.check([abort]):
                return _failures(json.loads(kv.get(abort))) or {0: "the coordinator left the session"}
            return None

        kv = self._kv()
        try:
            first, self._held = self._held, None  # posted once, whatever the wait's fate
            value = kv.await_key(self._key(name), deadline or self.deadline, watch, first=first)
            kv.discard(self._spent)
            self._spent[:] = [self._key(name)]  # deleted with the next answer (module docstring)
            return value
        except Late:
            raise CommitTimeoutError(f"the coordinator (rank 0) did not {what} before the deadline",
                                     {0: "alive, but late"}) from None
        except Gone as e:
            self.failed.update(e.failures)
            why = detail(e.failures) or "the coordinator left the session"
            raise CommitError(f"coordination failed during {self.label}: {why}", e.failures or {0: why}) from None
        except StoreUnreachable:
            raise CommitError(f"coordination failed during {self.label}: {UNREACHABLE}", {0: UNREACHABLE}) from None

    def _await_ranks(self, wake: str, posted: Callable[[int], str], deadline: float | None, late: str, *,
                     warn: bool = False, until_all: bool = False, counter: str) -> None:
        """Coordinator: wait for key ``wake`` (set by the last of the other ranks to post its
        key ``posted(rank)`` and count itself in ``counter``; both are deleted once read). While it waits, a rank that is silent (:class:`Judge`) or left
        the session without posting is a failure: the wait ends with :class:`CommitError`
        naming it; ``until_all``: only once every rank still missing is such a rank (read
        receipts, leaving). ``warn``: log once when ranks alive but absent kept it waiting
        ``dead_after``. Past ``deadline``: :class:`CommitTimeoutError` ``"ranks [..] <late>"``."""
        kv = self._kv()
        judge = self._judge
        start = self.clock.now()
        state = {"warned": not warn}
        others = list(range(1, self.world))

        def watch(kv: KV) -> dict[int, str] | None:
            beats, own = read_beats(kv, others, self.rank)
            now = self.clock.now()
            suspects = {r: judge.why() for r in judge.silent(now, beats, own)}
            if until_all:  # receipts, leaving: ranks known failed are not waited for
                suspects.update({r: w for r, w in self.failed.items() if r != self.rank})
            for r, why in self._read_left(kv).items():
                suspects.setdefault(r, detail(why) if why else "left the session before this meeting")
            if suspects:
                missing = set(_absent(kv, [self._key(posted(r)) for r in others], others))
                if not missing:
                    return {}  # every rank posted (one died before counting itself): done
                failures = {r: w for r, w in suspects.items() if r in missing}
                if until_all:
                    return failures if missing <= set(failures) else None
                if failures:
                    return failures
            if not state["warned"] and now - start > 1.5 * self.dead_after:
                state["warned"] = True
                missing_now = _absent(kv, [self._key(posted(r)) for r in others], others)
                if missing_now:
                    log.warning("ckptlib: rank 0 has waited %.0fs for ranks %s, alive but not at this meeting of %s; "
                                "waiting up to %.0fs more (every rank must call save/restore for the same steps in "
                                "the same order)", now - start, _short(missing_now), self.label,
                                max(0.0, (deadline or self.deadline) - now))
            return None

        try:
            kv.await_key(self._key(wake), deadline or self.deadline, watch)
            kv.discard([self._key(wake), self._key(counter)])
        except Late:
            missing = _absent(kv, [self._key(posted(r)) for r in others], others)
            raise CommitTimeoutError(f"ranks {_short(missing)} {late}", {r: "late" for r in missing}) from None
        except Gone as e:
            if not e.failures:
                return  # every rank posted
            self.failed.update(e.failures)
            raise CommitError(f"coordination failed during {self.label}: {detail(e.failures)}", e.failures) from None
        except StoreUnreachable as e:
            raise CommitError(f"coordination failed during {self.label}: store unreachable ({e})", {0: str(e)}) from None

    def _read_left(self, kv: KV) -> dict[int, dict[int, str] | None]:
        """Coordinator: the ranks that left the session so far, each with the failures it knew
        (None: it left normally). One store call unless someone new left."""
        count = kv.add(self._key("nleft"), 0)
        if count > len(self._left):
            new = [r for r in range(1, self.world) if r not in self._left]
            for r in _present(kv, [self._key(f"left/{r}") for r in new], new):
                doc = json.loads(kv.get(self._key(f"left/{r}")))
                self._left[r] = _failures(doc) if doc is not None else None
        return dict(self._left)

    # -- leaving
    def close(self, error: BaseException | None = None) -> None:
        """Leave the session (idempotent; module docstring). Never raises."""
        if self.closed:
            return
        self.closed = True
        try:
            self._leave(error)
        finally:
            if self._after_close is not None:
                self._after_close()

    def _leave(self, error: BaseException | None) -> None:
        if self.world == 1 or self.kv is None:
            return
        failures = dict(self.failed)
        if error is not None and not failures:
            failures = {self.rank: f"{type(error).__name__}: {error}"[:2000]}
        if not self.is_coordinator:
            text = _dumps({str(r): m for r, m in failures.items()} if error is not None else None)
            me, world, key = self.rank, self.world, self._key

            held = self._release()  # a report not posted yet goes first

            def leave(kv: KV) -> None:
                held(kv)
                kv.set(key(f"left/{me}"), text)
                if kv.add(key("nleft"), 1) == world - 1:
                    kv.set(key("allleft"), b"1")

            self._spent.append(key(f"left/{me}"))
            self.kv.post(leave, min(1.0, self.dead_after))  # a process exiting next must not lose it
            return
        # Normal end: the others are at the last meeting and leave within moments; wait for
        # them at least dead_after. After an error: at most dead_after.
        now = self.clock.now()
        bound = max(self.deadline, now + self.dead_after) if error is None else now + self.dead_after
        if error is not None:
            try:
                self.kv.set(self._key("abort"), _dumps({str(r): m for r, m in failures.items()}))
            except Exception:  # the others judge by heartbeats
                pass
        try:  # the store lives in this process: leave last, so that nobody loses its last answer
            self._await_ranks("allleft", lambda r: f"left/{r}", bound, "did not leave the session", until_all=True,
                              counter="nleft")
        except Exception as e:  # those ranks died or froze; nothing is left to tell them
            log.debug("ckptlib: leaving %s without waiting for every rank: %s", self.label, e)
            return
        if error is not None:  # every rank has left: no wait of theirs watches the abort key any more
            self.kv.discard([self._key("abort")])
        if error is None and not self.failed:  # every rank has read them
            if self._shared:
                self.kv.discard(self._shared)
            self._tail.append("left/")
            self._everyone_left = True

    def spent_keys(self) -> list[str] | None:
        """Coordinator, after :meth:`close`: the keys the other ranks posted in this session
        that nobody will delete (no answer follows: the coordinator is closed, see
        :meth:`ckptlib.coord.torch_coordinator.TorchCoordinator.close`), or None unless every
        rank left it normally (a key may then still be read: it stays)."""
        if not self._everyone_left:
            return None
        return [self._key(f"{t}{r}") for t in self._tail for r in range(1, self.world)]


def _nothing(_kv: KV) -> None:
    return None


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"{ranks[:16]} and {len(ranks) - 16} more"


def _absent(kv: KV, keys: list[str], ranks: list[int]) -> list[int]:
    """The ranks whose key in ``keys`` (parallel to ``ranks``) does not exist: one ``check`` per
    :data:`BATCH` keys, halving the batches that miss keys (a slow path: few calls when few miss)."""
    out: list[int] = []

    def walk(lo: int, hi: int) -> None:
        if kv.check(keys[lo:hi]):
            return
        if hi - lo == 1:
            out.append(ranks[lo])
            return
        mid = (lo + hi) // 2
        walk(lo, mid)
        walk(mid, hi)

    for start in range(0, len(keys), BATCH):
        walk(start, min(len(keys), start + BATCH))
    return out


def _present(kv: KV, keys: list[str], ranks: list[int]) -> list[int]:
    missing = set(_absent(kv, keys, ranks))
    return [r for r in ranks if r not in missing]

