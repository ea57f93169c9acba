"""Deleting steps (retention, prune) and cleaning the debris of crashed saves.

:func:`find_debris` lists every leftover with a verdict, :func:`remove_debris` removes the
removable ones. The manager calls :func:`clean_debris` and :func:`apply_retention` after a
commit (coordinator, persist thread); ``ckptlib prune`` lists, prints, then removes.
Deletion makes a step invisible first (rename to ``step-N.del-<id>``; on object stores delete
``manifest.json`` first), so a crash half-way never leaves something that looks valid.

Debris is deleted only when provably ours or provably dead: never a ``*.tmp-`` folder that a
running process holds (``Storage.hold``: its save is in flight, in this job or another one on
the same root); ``*.tmp-``/``*.del-`` folders with the ``.ckptlib`` marker (or, inside the owning job, holding only ckptlib's files; the CLI also
waits ``min_age``); a fenced save's ``*.abort-`` folder or abort record (format/fence.py: it can
never commit); on object stores, payload prefixes of save ids other than the committed
manifest's (the payloads of a step an ``overwrite`` save replaced among them), the claim an
``overwrite`` save left beside its committed payloads, manifest-less step folders and multipart
uploads idle for ``grace`` seconds.
A step whose manifest is corrupt is never touched by a job: it is evidence. ``ckptlib prune``
(which passes the steps it judged, ``steps=``) also removes, once superseded by a newer
committed step, damaged step folders and the ``step-N.corrupt-<id>`` folders a save moved
aside, and manifest-less step folders that are ours and idle for ``grace`` seconds.
"""

from __future__ import annotations

import functools
import logging
import re
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from ckptlib import crashpoints
from ckptlib.backends import Entry, Storage, join
from ckptlib.engine import target
from ckptlib.engine.pool import run_all
from ckptlib.engine.scan import SCAN_THREADS, StepInfo, check_step, read_manifest, scan, step_judges
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from ckptlib.format import fence, jsonio, layout
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.plan import retention

log = logging.getLogger("ckptlib")

DEFAULT_GRACE = 3600.0
"""Seconds without a write before a manifest-less step or an upload counts as dead."""

SAVE_ID_RE = re.compile(r"^[0-9a-f]{8,64}$")
MAX_MARKER_BYTES = 1 << 16
MAX_TREE_FILES = 100_000
""":func:`tree_bytes` stops counting after this many entries, files and folders (and says so with ``None``)."""


def delete_step(storage: Storage, folder: str, recycled: Callable[[], None] | None = None) -> None:
    """Delete one step folder, invisible first (retention and ``ckptlib prune``). With
    ``recycled`` (the local tier's retention, during a job), a memory tier keeps the large
    files' pages for the next save (:meth:`Storage.recycle`), then ``recycled()`` runs (a crash
    point); then the rest goes, the marker last."""
    if storage.supports_atomic_rename:
        gone = layout.del_dir(folder, uuid.uuid4().hex)
        storage.rename(folder, gone)
        if recycled is not None:
            storage.recycle(gone, keep=(layout.MARKER,))
            recycled()
        _delete_marker_last(storage, gone)
    else:
        storage.delete(join(folder, MANIFEST_NAME))
        storage.delete_tree(folder)


def apply_retention(
    storage: Storage,
    keep_last: int | None,
    keep_every: int | None,
    *,
    keep_best: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    just_saved: int | None = None,
) -> list[int]:
    """Delete the committed steps that :func:`ckptlib.plan.retention.decide` does not keep
    (manager, after a commit, on the coordinator's save thread); returns them, newest first.
    ``keep_best``: also keep the best k by the metric each manifest records (``best_metric``;
    ``best_mode`` "min" or "max"); steps without it rank worst. The newest committed step is
    always kept, and so is ``just_saved`` (the step the manager has just committed); when that
    one is older than the newest, a warning says that a resume will not pick it."""
    if keep_last is None and keep_best is None:
        return []
    if keep_best is None and keep_last is not None:
        infos = _retention_candidates(storage, keep_last, keep_every)
    else:  # every committed step's metric may rank among the best
        infos = [i for i in scan(storage) if i.status == "committed"]
    committed = [i.step for i in infos]
    metrics = {i.step: i.metrics for i in infos}
    deleted: list[int] = []
    newest = max(committed, default=None)
    if just_saved is not None and newest is not None and just_saved < newest:
        warn_rollback(storage.url, just_saved, newest)
    decisions = retention.decide(committed, keep_last, keep_every, keep_best=keep_best, best_metric=best_metric,
                                 best_mode=best_mode, metrics=metrics, just_saved=just_saved)
    for d in decisions:
        if not d.keep:
            log.info("ckptlib: deleting step %d (%s)", d.step, d.why)
            crashpoints.point("retention")
            delete_step(storage, layout.step_dir(d.step))
            deleted.append(d.step)
    return deleted


def _retention_candidates(storage: Storage, keep_last: int, keep_every: int | None) -> list[StepInfo]:
    """The committed steps that :func:`apply_retention` decides over with ``keep_last`` (no
    ``keep_best``), judged newest first (``scan.step_judges``, the root listed as a full scan
    lists it). Once ``keep_last`` committed steps are found, a step divisible by ``keep_every``
    is not judged at all: the policy keeps it
    whatever it holds (only committed steps are ever deleted), and the steps older than it are
    past the newest ``keep_last`` either way, so the decisions are those of a full scan. A run
    that keeps every 1,000th step judges ``keep_last`` + 1 steps per save, not every step it
    ever kept (each a manifest read and a size check per payload file: 4,096 at 4,096 ranks)."""
    committed: list[StepInfo] = []
    for step, judge in step_judges(storage, checked=True):
        if len(committed) >= keep_last and keep_every is not None and step % keep_every == 0:
            continue
        committed.extend(i for i in judge() if i.status == "committed")
    return committed


def warn_rollback(url: str, step: int, newest: int) -> None:
    """Log that ``step`` was just saved under ``url`` although ``newest`` (a higher step) is
    committed there: a training run that went back (``restore(step=N)``) and goes on saving.
    Called by :func:`apply_retention` on the coordinator's save thread."""
    log.warning("ckptlib: step %d was saved in %s, which holds a newer committed step %d: a restore() without "
                "step= resumes from step %d, not from this run's saves, and retention keeps only the step just "
                "saved among them. To go on from step %d for good, delete the newer steps (ckptlib ls %s lists "
                "them) or save to a new folder", step, url, newest, newest, step, url)


@dataclass(frozen=True, slots=True)
class Debris:
    """One leftover and its verdict. ``kind``: ``tmp`` (a save's folder), ``del`` (a deletion's
    folder), ``abort`` (a fenced save: its ``*.abort-`` folder, or on object stores the step
    folder holding its abort record), ``step`` (a step folder without manifest), ``damaged`` (a
    step folder that failed its check), ``quarantined`` (a ``step-N.corrupt-<id>`` folder a later
    save moved aside), and on object stores ``prefix`` (a save id's payloads in a step another
    save committed, or the step an ``overwrite`` save replaced), ``aside`` (POSIX: a committed
    step an ``overwrite`` save moved aside and then crashed before its rename: "removing" it
    puts it back), ``claim`` (an ``overwrite``
    save's claim, format/layout.py ``CLAIM``, left in the committed save's folder once its
    manifest is in place), ``upload`` (a multipart upload), ``partial`` (a local tier's crashed
    restore write-back's temporary file, :func:`ckptlib.tiers.inventory.write_back_debris`),
    ``arena`` (a memory tier's snapshot file of a dead process,
    :func:`ckptlib.tiers.inventory.arena_debris`). ``live``: a running process holds it (a
    ``tmp`` folder whose save is in flight, :meth:`Storage.hold`): never removable."""

    path: str
    save_id: str
    kind: str
    age_seconds: float | None
    removable: bool
    why: str
    upload_id: str = ""
    live: bool = False

    @property
    def name(self) -> str:
        """What :func:`remove_debris` reports for it."""
        return f"{self.path} (upload {self.upload_id})" if self.upload_id else self.path


def find_debris(
    storage: Storage,
    active_ids: Collection[str] | None = (),
    *,
    min_age: float = 0.0,
    grace: float = DEFAULT_GRACE,
    now: float | None = None,
    steps: Sequence[StepInfo] | None = None,
    settled: dict[str, str] | None = None,
) -> list[Debris]:
    """Every leftover under the root with its verdict, sorted by name; deletes nothing.

    ``active_ids``: save ids in flight in the calling job (never removable; a marker-less folder
    of only ckptlib's files counts as ours); ``None`` outside any job (``ckptlib prune``): only
    the marker proves a folder ours. ``min_age``: younger ``.tmp-`` folders are kept (maybe
    still running). Object stores list ``step``/``prefix``/``upload`` debris (``step`` ones
    also while young, not removable). ``steps``: the steps under the root as the caller judged
    them (:func:`ckptlib.engine.scan.scan`, maybe deep-checked); given only from outside any job
    (``active_ids`` None), it adds the ``damaged``, ``quarantined`` and (POSIX) ``step`` verdicts.
    ``settled`` (object stores; the manager's, kept between its clean-ups): committed step folders
    found clean (folder -> the save id of its manifest) are not read again, and those found clean
    now are added, so a save's clean-up reads only new steps, not every step of a long run.
    """
    now = time.time() if now is None else now
    try:
        entries = sorted(storage.listdir(""), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    found = [d for e in entries if e.is_dir and (d := _judge_folder(storage, e.name, active_ids, min_age, now))]
    if not storage.supports_atomic_rename:
        known = {i.path: i.save_id for i in steps or () if i.status == "committed" and i.save_id}
        found += _object_store_debris(storage, entries, set(active_ids or ()), grace, now, settled, known)
    if steps is not None and active_ids is None:
        found += _judge_steps(storage, entries, steps, {d.path for d in found}, grace, now)
    return sorted(found, key=lambda d: (d.path, d.upload_id))


def tree_bytes(storage: Storage, folder: str) -> int | None:
    """Bytes of every file under ``folder`` (``ls``/``prune`` show debris sizes); None when
    the folder is gone, holds more than ``MAX_TREE_FILES`` entries (files and folders), or cannot be walked (a path
    past the file system's length limit, a folder we may not list): an unknown size, never an
    error that would stop ``ls`` or ``prune`` over one debris folder."""
    total, files = 0, 0
    try:
        size = storage.size(folder)
        if size is not None:  # one file (``partial`` debris)
            return size
        todo = [folder]
        while todo:
            path = todo.pop()
            try:
                entries = storage.listdir(path)
            except FileNotFoundError:
                if path == folder:
                    return None
                continue
            for e in entries:  # folders count too: a tree of empty folders (or a loop of links) ends
                files += 1
                if files > MAX_TREE_FILES:
                    return None
                child = join(path, e.name)
                if e.is_dir:
                    todo.append(child)
                    continue
                total += storage.size(child) or 0
    except OSError:  # StorageError included
        return None
    return total


def verified_retention(
    storage: Storage,
    steps: Sequence[StepInfo],
    keep: Callable[[list[int]], list[retention.Decision]],
    *,
    deep: bool,
    progress: Callable[[int], None] | None = None,
    on_check: Callable[[StepInfo], None] | None = None,
) -> tuple[list[retention.Decision], list[StepInfo]]:
    """Retention over the committed ``steps`` (``ckptlib prune``, caller's thread): ``keep``
    maps committed step numbers to decisions (:func:`ckptlib.plan.retention.decide` with the
    user's policy). With ``deep``, every step kept is deep-checked first (newest first); one
    that fails is re-judged (status ``corrupt``) and never counts as kept, and the policy is
    applied again over the good ones, so the newest N kept are N good steps. Returns the
    decisions and ``steps`` with the failed checks' results in place. ``on_check(info)`` is
    called before each deep check (progress display)."""
    infos = list(steps)
    checked: set[int] = set()
    while True:
        decisions = keep([i.step for i in infos if i.status == "committed"])
        todo = [d.step for d in decisions if d.keep and d.step not in checked] if deep else []
        if not todo:
            return decisions, infos
        for step in todo:
            at = next(k for k, i in enumerate(infos) if i.step == step and i.status == "committed")
            if on_check is not None:
                on_check(infos[at])
            checked.add(step)
            result = check_step(storage, infos[at].path, step, deep=True, progress=progress)
            if result.status != "committed":
                infos[at] = result
                break  # one kept step fewer: decide again over the good ones


def remove_debris(storage: Storage, debris: Iterable[Debris]) -> list[str]:
    """Remove the removable entries of :func:`find_debris`; returns their names, in order."""
    removed: list[str] = []
    for d in debris:
        if not d.removable:
            continue
        if d.kind == "upload":
            storage.abort_upload(d.path, d.upload_id)
        elif d.kind in ("tmp", "del", "quarantined") or (d.kind == "abort" and fence.ABORT_RE.match(d.path)):
            _delete_marker_last(storage, d.path)
        elif d.kind == "abort":  # object store: the abandoned payloads, then the record last
            storage.delete_tree(join(d.path, d.save_id))
            storage.delete(join(d.path, MANIFEST_NAME))
        elif d.kind == "aside":  # the step an interrupted overwrite moved aside goes back
            m = layout.TMP_RE.match(d.path)
            if m is None or storage.exists(m.group(1)):
                continue  # something took its place meanwhile: judged again next time
            log.info("ckptlib: putting %s back: %s", d.path, d.why)
            storage.rename(d.path, m.group(1))
        elif d.kind == "arena":  # only if still dead: judged again under its lock
            if not storage.dead_arenas(remove=True, only=(d.path.rsplit("/", 1)[-1],)):
                continue
        elif d.kind in ("claim", "partial"):  # one file, in a committed step's folder
            storage.delete(d.path)
        elif d.kind in ("damaged", "step"):
            log.info("ckptlib: removing %s: %s", d.path, d.why)
            delete_step(storage, d.path)  # invisible first, like retention
        else:
            log.info("ckptlib: removing %s: %s", d.path, d.why)
            storage.delete_tree(d.path)
        removed.append(d.name)
    return removed


def clean_debris(
    storage: Storage, active_ids: Collection[str] = (), *, grace: float = DEFAULT_GRACE, now: float | None = None,
    settled: dict[str, str] | None = None,
) -> list[str]:
    """Remove leftovers of crashed saves and deletions (the manager, after each commit, on its
    save thread): :func:`remove_debris` of :func:`find_debris` (``settled``: as there). Returns
    what was removed."""
    return remove_debris(storage, find_debris(storage, active_ids, grace=grace, now=now, settled=settled))


def _judge_folder(
    storage: Storage, name: str, active_ids: Collection[str] | None, min_age: float, now: float
) -> Debris | None:
    """The verdict on a ``*.tmp-<id>``/``*.del-<id>``/``*.abort-<id>`` folder; None for any other."""
    m = layout.TMP_RE.match(name)
    a = fence.ABORT_RE.match(name)
    if a and layout.parse_step(a.group(1)) is not None:
        kind, save_id = "abort", a.group(2)
    elif not m or (layout.parse_step(m.group(1)) is None and m.group(2) == "tmp"):
        return None
    else:
        kind, save_id = m.group(2), m.group(3)
    if active_ids is not None and save_id in active_ids:
        return Debris(name, save_id, kind, None, False, "a save in flight in this job")
    created = _marker_created(storage, name)
    age = None if created is None else now - created
    if kind == "tmp" and storage.held(name):  # another job on this root, or a save of this one in flight
        return Debris(name, save_id, kind, age, False, "a save in flight: a running process holds this folder",
                      live=True)

    def verdict(removable: bool, why: str) -> Debris:
        return Debris(name, save_id, kind, age, removable, why)

    final = m.group(1) if m else ""
    if kind == "del" and _moved_aside(storage, final, name, save_id):
        return Debris(name, save_id, "aside", age, True,
                      f"the committed step an overwrite moved aside before it crashed: put back at {final}")
    if storage.size(join(name, layout.MARKER)) is None:
        if active_ids is None or not _only_ours(storage, name):
            return verdict(False, f"no {layout.MARKER} marker: not provably ours, left alone")
    elif kind == "tmp" and min_age > 0 and (age is None or age < min_age):
        when = "of unknown age" if age is None else f"started {age:.0f}s ago"
        return verdict(False, f"save {when}: may still be running (younger than {min_age:.0f}s)")
    why = {"tmp": "crashed save", "del": "interrupted deletion", "abort": "failed save, fenced: never committed"}
    return verdict(True, why[kind])


def _moved_aside(storage: Storage, final: str, name: str, save_id: str) -> bool:
    """Whether the ``.del-`` folder ``name`` is a committed step that an ``overwrite`` save moved
    aside and then crashed before renaming its own folder into place (engine/commit.py
    ``_clear_target``): ``final`` is missing, that save's ``.tmp-``/``.abort-`` folder is still
    there (a deletion by retention has no such partner) and ``name`` holds a committed step."""
    partners = (layout.tmp_dir(final, save_id), fence.abort_dir(final, save_id))
    try:
        return (not storage.exists(final) and any(storage.exists(p) for p in partners)
                and check_step(storage, name).status == "committed")
    except (OSError, CheckpointError):
        return False


def _judge_steps(
    storage: Storage, entries: list[Entry], steps: Sequence[StepInfo], seen: set[str], grace: float, now: float
) -> list[Debris]:
    """Verdicts on step folders that failed their check and on quarantined ``.corrupt-``
    folders (outside any job only; see :func:`find_debris`). Superseded = a newer committed
    step exists: resume never picks these, and no save of ours writes into them (POSIX saves
    write into ``.tmp-`` folders; on object stores ``grace`` seconds without a write)."""
    good = [i.step for i in steps if i.status == "committed"]
    newest = max(good, default=None)
    found: list[Debris] = []

    def superseded(step: int, path: str, resaved: bool = False) -> tuple[bool, str, float | None]:
        """``resaved``: the folder is a copy moved aside, so step ``step`` committed counts."""
        if newest is None or step > newest or (step == newest and not resaved):
            return False, "not superseded by a newer committed step: kept as evidence", None
        if storage.supports_atomic_rename:
            return True, f"superseded by committed step {newest}", None
        age = _age(storage, path, now)
        if age is None or age < grace:
            return False, f"superseded, but written to {'at an unknown time' if age is None else f'{age:.0f}s ago'}", age
        return True, f"superseded by committed step {newest}, no write for {age:.0f}s", age

    for i in steps:
        if i.status == "committed" or i.path in seen or layout.parse_step(i.path) != i.step:
            continue
        if i.status == "corrupt":
            ok, why, age = superseded(i.step, i.path)
            if ok and target.newer_format(storage, i.path) is not None:
                ok, why = False, "its manifest is of a newer format than this ckptlib reads: left alone"
            found.append(Debris(i.path, i.save_id, "damaged", age, ok, f"{why} ({i.reason})"))
        elif storage.supports_atomic_rename:  # no manifest: never a save of ours in progress here
            age = _age(storage, i.path, now)
            if storage.size(join(i.path, layout.MARKER)) is None and not _only_ours(storage, i.path):
                found.append(Debris(i.path, "", "step", age, False, "no manifest, not provably ours: left alone"))
            elif age is None or age < grace:
                found.append(Debris(i.path, "", "step", age, False, "no manifest; written to recently (a copy "
                                    f"in progress?); removable after {grace:.0f}s idle"))
            else:
                found.append(Debris(i.path, "", "step", age, True, f"no manifest and no write for {age:.0f}s"))
    for e in entries:
        m = layout.CORRUPT_RE.match(e.name)
        step = layout.parse_step(m.group(1)) if m and e.is_dir else None
        if m is None or step is None:
            continue
        ok, why, age = superseded(step, e.name, resaved=True)
        found.append(Debris(e.name, m.group(2), "quarantined", age, ok, f"moved aside as damaged; {why}"))
    return found


def _marker_created(storage: Storage, folder: str) -> float | None:
    """The ``created`` time in a folder's marker (None: no marker, too big, or unreadable: not
    JSON, nested past the parser's limit, not an object). Parsed by the strict manifest parser,
    so a hostile marker is a ``CorruptCheckpointError`` here, never a ``RecursionError`` that
    would stop ``ls``, ``prune`` and the manager's retention."""
    path = join(folder, layout.MARKER)
    try:
        size = storage.size(path)
        if size is None or size > MAX_MARKER_BYTES:
            return None
        created = jsonio.loads(storage.read(path), path).get("created")
    except (OSError, CheckpointError, ValueError, AttributeError):
        return None
    return float(created) if isinstance(created, int | float) else None


def _object_store_debris(
    storage: Storage, entries: list[Entry], active: set[str], grace: float, now: float,
    settled: dict[str, str] | None = None, known: dict[str, str] | None = None,
) -> list[Debris]:
    """:func:`find_debris` on object stores. A committed step folder costs a manifest read, a
    listing of its prefixes and a claim lookup; ``settled`` ones (found clean before, by the same
    manager) cost nothing: no save of this job writes into a committed step again. ``known``
    (outside any job: the steps ``ls``/``prune`` judged; folder -> the save id of its committed
    manifest) spares those manifest reads, and the folders are then looked at on up to
    :data:`~ckptlib.engine.scan.SCAN_THREADS` threads (results in name order); a manager's
    clean-up (``settled``) stays on its own thread."""
    found: list[Debris] = []
    committed_ids: dict[str, str] = {}  # step folder -> save id of its manifest
    if settled is not None:  # steps deleted since (retention) are forgotten
        names = {e.name for e in entries}
        for gone in [name for name in settled if name not in names]:
            del settled[gone]
    todo = []
    for e in entries:
        if not e.is_dir or layout.parse_step(e.name) is None:
            continue
        if settled is not None and e.name in settled:
            committed_ids[e.name] = settled[e.name]
            continue
        todo.append(e.name)
    threads = 1 if settled is not None else SCAN_THREADS
    looks = run_all([functools.partial(_step_debris, storage, name, active, grace, now, (known or {}).get(name))
                     for name in todo], threads=threads, name="ckptlib-debris")
    for name, (sid, debris) in zip(todo, looks, strict=True):
        found += debris
        if sid is not None:
            committed_ids[name] = sid
            if settled is not None and sid not in active and not debris:  # clean: not read again
                settled[name] = sid
    for path, upload_id, started in storage.list_uploads(""):
        parts = path.split("/")
        sid = parts[1] if len(parts) > 2 else ""
        if sid in active:
            continue
        dead_prefix = parts[0] in committed_ids and sid != committed_ids[parts[0]]
        if dead_prefix or now - started > grace:
            why = "upload of a save that did not commit" if dead_prefix else "upload abandoned"
            found.append(Debris(path, sid, "upload", now - started, True, why, upload_id))
    return found


def _step_debris(storage: Storage, name: str, active: set[str], grace: float, now: float, sid: str | None
                 ) -> tuple[str | None, list[Debris]]:
    """One step folder on an object store (:func:`_object_store_debris`, on its thread or a
    pool's): the save id of its committed manifest (None: no manifest, or a corrupt one) and its
    debris. ``sid``: that save id when the caller already read the manifest."""
    if sid is None:
        try:
            sid = read_manifest(storage, name, pieces=False).save_id
        except CheckpointNotFoundError:
            return None, _manifestless(storage, name, active, grace, now)
        except CorruptCheckpointError:
            return None, []  # evidence; never deleted by cleanup
    found = [Debris(join(name, other), other, "prefix", None, True,
                    f"payloads of a save that did not commit {name}, or of the one it replaced")
             for other in sorted(_prefix_ids(storage, name)) if other != sid and other not in active]
    claim = layout.claim_path(name, sid)
    if sid not in active and storage.size(claim) is not None:
        found.append(Debris(claim, sid, "claim", None, True,
                            f"the commit claim of the save {name}'s manifest names: no longer needed"))
    return sid, found


def _manifestless(storage: Storage, name: str, active: set[str], grace: float, now: float) -> list[Debris]:
    """A step folder without a manifest on an object store: an abort record's fenced save, a
    save of this job in progress (nothing), or a folder removable once idle for ``grace``."""
    record = _abort_record(storage, name)
    if record is not None:
        removable = record.save_id not in active
        why = record.describe() if removable else "a save in flight in this job"
        return [Debris(name, record.save_id, "abort", None, removable, why)]
    age = _age(storage, name, now)
    if _prefix_ids(storage, name) & active:
        return []  # a save of this job is writing it
    if age is not None and age > grace:
        return [Debris(name, "", "step", age, True, f"no manifest and no write for {age:.0f}s")]
    when = "at an unknown time" if age is None else f"{age:.0f}s ago"
    return [Debris(name, "", "step", age, False, f"no manifest; last write {when}: may "
                   f"be a save in progress (removable after {grace:.0f}s idle)")]


def _abort_record(storage: Storage, folder: str) -> fence.AbortRecord | None:
    """The abort record where ``folder``'s manifest goes (object stores), if one is there."""
    path = join(folder, MANIFEST_NAME)
    try:
        data, _size = storage.read_small(path, fence.MAX_RECORD_BYTES)
        return None if data is None else fence.parse_abort(data, path)
    except (OSError, CheckpointError):
        return None


def _delete_marker_last(storage: Storage, folder: str) -> None:
    """Delete ``folder`` so that a crash part-way leaves the ownership marker in place."""
    try:
        entries = storage.listdir(folder)
    except FileNotFoundError:
        return
    for e in entries:
        if e.name != layout.MARKER:
            (storage.delete_tree if e.is_dir else storage.delete)(join(folder, e.name))
    storage.delete_tree(folder)


def _only_ours(storage: Storage, folder: str) -> bool:
    """Whether a marker-less ``*.tmp-``/``*.del-`` folder holds only what ckptlib writes there
    (the one ownership rule: :func:`ckptlib.engine.target.foreign_entries`)."""
    try:
        return not target.foreign_entries(storage, folder)
    except FileNotFoundError:
        return False


def _prefix_ids(storage: Storage, folder: str) -> set[str]:
    try:
        return {c.name for c in storage.listdir(folder) if c.is_dir and SAVE_ID_RE.match(c.name)}
    except FileNotFoundError:
        return set()


def _age(storage: Storage, folder: str, now: float) -> float | None:
    """Seconds since the newest write under ``folder`` (None: the backend cannot tell)."""
    t = storage.tree_modified(folder)
    return None if t is None else now - t
