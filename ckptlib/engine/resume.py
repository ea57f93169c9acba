"""The resume loop: restore the newest step every rank can load, falling back together.

One loop for the manager and every integration, on the caller's thread, every rank in the
same order, in one coordination session (the caller's, or its own): the coordinator lists the
candidates (newest first), judging steps only as far as the loop needs, and every rank gets the
same candidates in batches (:func:`_shared`, :meth:`Session.share`); for each
``committed`` candidate the ranks meet, run ``attempt(candidate)``, and exchange the outcomes
(:meth:`Session.exchange`): if any rank found the step damaged, all move on to the next older
one; other failures are raised everywhere. A wait on another rank lasts while that rank's
heartbeat moves (a slow listing of a big root, a slow load) up to ``timeout`` per wait; a dead
or frozen rank fails the others within the coordination timeout. The session's coordinator
leaves last, so the last verdict never vanishes with its process. :func:`resume_newest` returns None without candidates and raises
:class:`CorruptCheckpointError` when none is usable; :func:`restore` is the manager's use.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ckptlib import crashpoints
from ckptlib.backends import Storage
from ckptlib.coord.coordinator import Coordinator
from ckptlib.coord.session import Session
from ckptlib.engine import load as load_flow
from ckptlib.engine.options import flag
from ckptlib.engine.scan import (
    StepInfo,
    UnreadableStepError,
    checkpoint_root_error,
    enclosing_checkpoint,
    iter_steps,
    step_judges,
)
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestVersionError,
    StateMismatchError,
)

log = logging.getLogger("ckptlib")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One step a resume may load. Travels between ranks as a JSON-typed list."""

    step: int
    folder: str
    """Where it is: relative to the storage root, or a path/URL, as the caller needs."""
    status: str
    """``committed`` (try it); anything else (``incomplete``, ``corrupt``, ...) is skipped."""
    reason: str = ""
    extra: Any = None
    """Caller data (JSON-typed): a DeepSpeed tag, a save id, ..."""


@dataclass(slots=True)
class Resumed(Generic[T]):
    candidate: Candidate
    value: T
    """What ``attempt`` returned on this rank."""
    skipped: list[str] = field(default_factory=list)
    """Newer steps passed over, each ``"<label> <step>: <status>: <reason>"``."""


def corruption_of(error: BaseException) -> str | None:
    """The default damage test: a :class:`CorruptCheckpointError` means "try an older step"; so
    does a :class:`CheckpointNotFoundError`, the step deleted (or replaced) while it was read."""
    if isinstance(error, CheckpointNotFoundError):
        return f"vanished: {error}"
    return str(error) if isinstance(error, CorruptCheckpointError) else None


def resume_newest(
    coord: Coordinator | Session,
    list_candidates: Callable[[], Iterable[Candidate]],
    attempt: Callable[[Candidate], T],
    *,
    timeout: float,
    where: str,
    label: str = "step",
    damaged: Callable[[BaseException], str | None] = corruption_of,
    corrupt: list[int] | None = None,
) -> Resumed[T] | None:
    """Run the resume loop (module docstring). Collective when several ranks. ``coord``: a
    coordinator (the loop opens its own session) or the caller's open session (a tier restore).

    ``list_candidates`` runs on the coordinator only and returns a list or an iterator (read
    lazily, up to the candidate that loads); ``attempt`` on every rank, in the same
    order. ``damaged(error)`` says why an exception from ``attempt`` means the step is damaged
    (fall back), or None for a failure every rank must raise (a state that does not match).
    ``where`` (the root) and ``label`` ("step", "iteration") word the log lines and errors.
    ``corrupt``: gets the steps passed over because a rank found them damaged while loading
    (every rank the same list, also when the loop then raises); not those passed over because
    they vanished meanwhile (a :class:`CheckpointNotFoundError` that ``damaged`` accepts) or
    because a newer ckptlib wrote them (a :class:`ManifestVersionError`: an unknown node kind).
    """
    if isinstance(coord, Session):
        return _loop(coord, list_candidates, attempt, timeout, where, label, damaged, corrupt)
    with coord.session("restore", coord.deadline(timeout)) as s:
        return _loop(s, list_candidates, attempt, timeout, where, label, damaged, corrupt)


def _loop(s: Session, list_candidates: Callable[[], Iterable[Candidate]], attempt: Callable[[Candidate], T],
          timeout: float, where: str, label: str, damaged: Callable[[BaseException], str | None],
          corrupt: list[int] | None = None) -> Resumed[T] | None:
    def deadline() -> float:
        return s.now() + timeout

    skipped: list[str] = []
    corrupt_seen = False
    for cand in _shared(s, list_candidates, deadline):
        if cand.status != "committed":
            log.warning("ckptlib: skipping %s %d (%s): %s", label, cand.step, cand.status, cand.reason)
            skipped.append(f"{label} {cand.step}: {cand.status}: {cand.reason}")
            corrupt_seen |= cand.status == "corrupt"
            continue
        crashpoints.point("restore", s.rank)
        if s.world > 1:
            s.exchange(cand.step, deadline=deadline())  # everyone alive and here
        value: Any = None
        mine: tuple[str, str] = ("ok", "")
        own_error: BaseException | None = None
        try:
            value = attempt(cand)
        except Exception as e:  # every rank must learn the outcome before anyone raises
            why = damaged(e)
            if why is not None:  # a step a newer ckptlib wrote is passed over, like a vanished one, never replaced
                mine = ("gone" if isinstance(e, CheckpointNotFoundError) else
                        "newer" if isinstance(e, ManifestVersionError) else "corrupt", why)
            else:
                mine, own_error = (type(e).__name__, str(e)), e
        verdicts = [mine] if s.world <= 1 else [tuple(v) for v in s.exchange(list(mine), deadline=deadline())]
        passed_over = ("corrupt", "gone", "newer")
        fatal = [(r, kind, msg) for r, (kind, msg) in enumerate(verdicts) if kind not in ("ok", *passed_over)]
        if fatal:
            r, kind, msg = fatal[0]
            cls = StateMismatchError if kind == "StateMismatchError" else CheckpointError
            text = f"loading {label} {cand.step}: rank {r}: {msg}" if cls is StateMismatchError else (
                f"loading {label} {cand.step}: rank {r}: {kind}: {msg}"
            )
            raise cls(text) from own_error
        bad = [f"rank {r}: {msg}" for r, (kind, msg) in enumerate(verdicts) if kind in passed_over]
        if bad:
            detail = "; ".join(bad)
            damage = any(kind == "corrupt" for kind, _ in verdicts)
            newer = any(kind == "newer" for kind, _ in verdicts)
            log.warning("ckptlib: %s %d %s, trying an older one: %s", label, cand.step, "is corrupt" if damage
                        else "was written by a newer ckptlib" if newer else "vanished while it was read", detail)
            skipped.append(f"{label} {cand.step}: {'corrupt' if damage else 'newer' if newer else 'vanished'}: {detail}")
            corrupt_seen = True
            if corrupt is not None and damage:
                corrupt.append(cand.step)
            continue
        log.info("ckptlib: restored %s %d from %s", label, cand.step, where)
        return Resumed(cand, value, skipped)
    if corrupt_seen:
        raise CorruptCheckpointError(f"no usable checkpoint under {where}: " + "; ".join(skipped))
    return None


def _shared(s: Session, list_candidates: Callable[[], Iterable[Candidate]],
            deadline: Callable[[], float]) -> Iterator[Candidate]:
    """The candidates, newest first, the same on every rank, in batches: the coordinator takes
    them from ``list_candidates()`` (a list, or an iterator that judges steps as it goes) up to
    and including the next ``committed`` one, or to the end, and shares that batch with an end
    flag (:meth:`Session.share`). Every rank asks for the next batch together, only when the
    loop goes on past the batch's committed candidate (every rank's verdict on it exchanged),
    so a restore whose newest step loads judges one step folder, not the whole root."""
    source = iter(list_candidates()) if s.is_coordinator else None
    while True:
        batch: list[list[Any]] = []
        if source is not None:
            for c in source:
                batch.append([c.step, c.folder, c.status, c.reason, c.extra])
                if c.status == "committed":
                    break
        mine = {"batch": batch, "end": not batch or batch[-1][2] != "committed"} if source is not None else None
        got = s.share(mine, deadline=deadline(), what="list the checkpoints")
        for step, folder, status, reason, extra in got["batch"]:
            yield Candidate(int(step), folder, status, reason, extra)
        if got["end"]:
            return


def step_candidates(
    storage: Storage, judge: Callable[[StepInfo], tuple[str, str, Any]] | None = None
) -> Iterator[Candidate]:
    """Every step under ``storage`` (manifest, sizes), newest first, each judged only when the
    caller iterates that far (:func:`ckptlib.engine.scan.iter_steps`). ``judge(info)``, called
    for committed steps only, returns ``(status, reason, extra)``: an integration's own verdict
    (e.g. ``not_dcp``) and its caller data (a DeepSpeed tag, ...)."""
    try:
        infos = iter_steps(storage)
    except CheckpointNotFoundError:
        return
    yield from as_candidates(infos, judge)


def as_candidates(infos: Iterable[StepInfo], judge: Callable[[StepInfo], tuple[str, str, Any]] | None = None
                  ) -> Iterator[Candidate]:
    """``infos`` as candidates, in their order (``judge``: as :func:`step_candidates`)."""
    for i in infos:
        yield (Candidate(i.step, i.path, *judge(i)) if judge is not None and i.status == "committed"
               else Candidate(i.step, i.path, i.status, i.reason))


def _judges(storage: Storage) -> list[tuple[int, Callable[[], list[StepInfo]]]]:
    """:func:`step_judges`, none when the root does not exist."""
    try:
        return step_judges(storage)
    except CheckpointNotFoundError:
        return []


def _committed(judge: Callable[[], list[StepInfo]], url: str) -> bool:
    """Whether a step newer than ``restore(step=N)``'s is committed, for its rollback warning
    only (coordinator): a manifest this user may not read there is logged, not raised, since
    the restore does not read that step."""
    try:
        return any(i.status == "committed" for i in judge())
    except UnreadableStepError as e:
        log.warning("ckptlib: %s: a newer step than the one restored cannot be read (%s); not counted", url, e)
        return False


def check_target(state: Any, strict: Any, verify: Any) -> None:
    """Refuse, before any rank meets, a ``CheckpointManager.restore(state, strict=..., verify=...)``
    that cannot load in place: ``state`` None (a restore into nothing would report a step
    restored while loading nothing), or ``strict``/``verify`` not a bool (``verify=None`` would
    skip every checksum). Caller's (training) thread."""
    if state is None:
        raise TypeError("restore(state) loads in place into the tensors of `state`, got None: pass "
                        "the state to fill (e.g. {'model': model, 'optim': optim}); for a fresh copy "
                        "use ckptlib.open(url).load() or ckptlib.load(step_folder)")
    flag("strict", strict)
    flag("verify", verify)


def restore(
    storage: Storage,
    state: Any,
    coord: Coordinator,
    *,
    step: int | None = None,
    verify: bool = True,
    per_rank: str = "error",
    timeout: float = 600.0,
    strict: bool = True,
    keys: dict[str, list[str]] | None = None,
    corrupt: list[int] | None = None,
) -> int | None:
    """``CheckpointManager.restore``: load the newest usable step into ``state`` in place.
    ``strict``/``keys``: as :func:`ckptlib.engine.load.load_checkpoint` (keys of the step restored);
    ``corrupt``: as :func:`resume_newest`."""

    def listing() -> Iterator[Candidate] | list[Candidate]:  # the coordinator: its error reaches every rank
        judges = _judges(storage)
        if not judges and (found := enclosing_checkpoint(storage)):  # a first run would start from scratch
            raise checkpoint_root_error(storage, found)
        if step is None:
            return as_candidates(itertools.chain.from_iterable(judge() for _, judge in judges))
        # restore(step=N): step N judged alone; for the warning, the newer steps newest first,
        # up to the first committed one (the newest committed: what a restore() without step= takes)
        newest = next((n for n, judge in judges if n > step and _committed(judge, storage.url)), None)
        if newest is not None:  # a rollback: say now what a resume after the next crash will do
            log.warning("ckptlib: restoring step %d from %s, which holds newer committed step(s), the newest %d: "
                        "a restore() without step= resumes from step %d, not from the saves this run makes "
                        "next. To go on from step %d for good, delete the newer steps or save to a new folder",
                        step, storage.url, newest, newest, step)
        return list(as_candidates(i for n, judge in judges if n == step for i in judge()))

    def attempt(c: Candidate) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        load_flow.load_checkpoint(  # judged: the coordinator checked every file's size (listing)
            storage, c.folder, state, verify=verify, rank=coord.rank, world_size=coord.world_size,
            per_rank=per_rank, strict=strict, keys=found, judged=True,
        )
        return found

    got = resume_newest(coord, listing, attempt, timeout=timeout, where=storage.url, corrupt=corrupt)
    if got is not None and keys is not None:
        keys.update(got.value)
    if got is None and step is not None:
        # Rank 0 lists again for its message (an error path; the other ranks' say less).
        raise missing_step(step, storage.url, f"ckptlib ls {storage.url}",
                           list(step_candidates(storage)) if coord.rank == 0 else None)
    return got.candidate.step if got else None


def missing_step(step: int, where: str, ls: str, candidates: list[Candidate] | None = None
                 ) -> CheckpointNotFoundError:
    """``restore(step=N)`` found nothing to load at N (every rank, after the resume loop): the
    error, saying whether N is absent or incomplete (from ``candidates``, newest first, when the
    caller listed them) and what to do instead (``ls``: the command that lists the steps)."""
    here = [c for c in candidates or [] if c.step == step]
    what = f"step {step} under {where} is {here[0].status}: {here[0].reason}" if here else f"no step {step} under {where}"
    newest = next((c.step for c in candidates or [] if c.status == "committed"), None)
    hint = "" if newest is None else f" (step {newest})"
    return CheckpointNotFoundError(f"{what}; restore without step= loads the newest committed step{hint}, and "
                                   f"`{ls}` lists every step with its status")
