"""Deleting steps (retention, prune) and cleaning the debris of crashed saves.

:func:`find_debris` lists every leftover with a verdict, :func:`remove_debris` removes the
removable ones. The manager calls :func:`clean_debris` and :func:`apply_retention` after a
commit (coordinator, persist thread); ``ckptlib prune`` lists, prints, then removes.
Deletion makes a step invisible first (rename to ``step-N.del-<id>``; on object stores delete
``manifest.json`` first), so a crash half-way never leaves something that looks valid.

Debris is deleted only when provably ours or provably dead: ``*.tmp-``/``*.del-`` folders with
the ``.ckptlib`` marker (or, inside the owning job, holding only ckptlib's files; the CLI also
waits ``min_age``); on object stores, payload prefixes of save ids other than the committed
manifest's, manifest-less step folders and multipart uploads idle for ``grace`` seconds.
A step whose manifest is corrupt is never touched: it is evidence.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from ckptlib import crashpoints
from ckptlib.backends import Entry, Storage, join
from ckptlib.engine import target
from ckptlib.engine.scan import read_manifest, scan
from ckptlib.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ckptlib.format import layout
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.plan import retention

log = logging.getLogger("ckptlib")

DEFAULT_GRACE = 3600.0
"""Seconds without a write before a manifest-less step or an upload counts as dead."""

SAVE_ID_RE = re.compile(r"^[0-9a-f]{8,64}$")
MAX_MARKER_BYTES = 1 << 16


def delete_step(storage: Storage, folder: str) -> None:
    """Delete one step folder, invisible first (retention and ``ckptlib prune``)."""
    if storage.supports_atomic_rename:
        gone = layout.del_dir(folder, uuid.uuid4().hex)
        storage.rename(folder, gone)
        _delete_marker_last(storage, gone)
    else:
        storage.delete(join(folder, MANIFEST_NAME))
        storage.delete_tree(folder)


def apply_retention(storage: Storage, keep_last: int | None, keep_every: int | None) -> list[int]:
    """Delete the committed steps that :func:`ckptlib.plan.retention.decide` does not keep
    (manager, after a commit, on the coordinator's save thread); returns them, newest first."""
    if keep_last is None:
        return []
    committed = [i.step for i in scan(storage) if i.status == "committed"]
    deleted: list[int] = []
    for d in retention.decide(committed, keep_last, keep_every):
        if not d.keep:
            log.info("ckptlib: deleting step %d (%s)", d.step, d.why)
            crashpoints.point("retention")
            delete_step(storage, layout.step_dir(d.step))
            deleted.append(d.step)
    return deleted


@dataclass(frozen=True, slots=True)
class Debris:
    """One leftover and its verdict. ``kind``: ``tmp`` (a save's folder), ``del`` (a deletion's
    folder), and on object stores ``step`` (a step folder without manifest), ``prefix`` (a
    save id's payloads in a step another save committed), ``upload`` (a multipart upload)."""

    path: str
    save_id: str
    kind: str
    age_seconds: float | None
    removable: bool
    why: str
    upload_id: str = ""

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
) -> list[Debris]:
    """Every leftover under the root with its verdict, sorted by name; deletes nothing.

    ``active_ids``: save ids in flight in the calling job (never removable; a marker-less folder
    of only ckptlib's files counts as ours); ``None`` outside any job (``ckptlib prune``): only
    the marker proves a folder ours. ``min_age``: younger ``.tmp-`` folders are kept (maybe
    still running). Object stores list ``step``/``prefix``/``upload`` debris once removable.
    """
    now = time.time() if now is None else now
    try:
        entries = sorted(storage.listdir(""), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    found = [d for e in entries if e.is_dir and (d := _judge_folder(storage, e.name, active_ids, min_age, now))]
    if not storage.supports_atomic_rename:
        found += _object_store_debris(storage, entries, set(active_ids or ()), grace, now)
    return found


def remove_debris(storage: Storage, debris: Iterable[Debris]) -> list[str]:
    """Remove the removable entries of :func:`find_debris`; returns their names, in order."""
    removed: list[str] = []
    for d in debris:
        if not d.removable:
            continue
        if d.kind == "upload":
            storage.abort_upload(d.path, d.upload_id)
        elif d.kind in ("tmp", "del"):
            _delete_marker_last(storage, d.path)
        else:
            log.info("ckptlib: removing %s: %s", d.path, d.why)
            storage.delete_tree(d.path)
        removed.append(d.name)
    return removed


def clean_debris(
    storage: Storage, active_ids: Collection[str] = (), *, grace: float = DEFAULT_GRACE, now: float | None = None
) -> list[str]:
    """Remove leftovers of crashed saves and deletions (the manager, after each commit, on its
    save thread): :func:`remove_debris` of :func:`find_debris`. Returns what was removed."""
    return remove_debris(storage, find_debris(storage, active_ids, grace=grace, now=now))


def _judge_folder(
    storage: Storage, name: str, active_ids: Collection[str] | None, min_age: float, now: float
) -> Debris | None:
    """The verdict on a ``*.tmp-<id>``/``*.del-<id>`` folder; None for any other folder."""
    m = layout.TMP_RE.match(name)
    if not m or (layout.parse_step(m.group(1)) is None and m.group(2) == "tmp"):
        return None
    kind, save_id = m.group(2), m.group(3)
    if active_ids is not None and save_id in active_ids:
        return Debris(name, save_id, kind, None, False, "a save in flight in this job")
    created = _marker_created(storage, name)
    age = None if created is None else now - created

    def verdict(removable: bool, why: str) -> Debris:
        return Debris(name, save_id, kind, age, removable, why)

    if storage.size(join(name, layout.MARKER)) is None:
        if active_ids is None or not _only_ours(storage, name):
            return verdict(False, f"no {layout.MARKER} marker: not provably ours, left alone")
    elif kind == "tmp" and min_age > 0 and (age is None or age < min_age):
        when = "of unknown age" if age is None else f"started {age:.0f}s ago"
        return verdict(False, f"save {when}: may still be running (younger than {min_age:.0f}s)")
    return verdict(True, "crashed save" if kind == "tmp" else "interrupted deletion")


def _marker_created(storage: Storage, folder: str) -> float | None:
    """The ``created`` time in a folder's marker (None: no marker, too big, or unreadable)."""
    path = join(folder, layout.MARKER)
    try:
        size = storage.size(path)
        if size is None or size > MAX_MARKER_BYTES:
            return None
        created = json.loads(storage.read(path)).get("created")
    except (OSError, CheckpointError, ValueError, AttributeError):
        return None
    return float(created) if isinstance(created, int | float) else None


def _object_store_debris(
    storage: Storage, entries: list[Entry], active: set[str], grace: float, now: float
) -> list[Debris]:
    found: list[Debris] = []
    committed_ids: dict[str, str] = {}  # step folder -> save id of its manifest
    for e in entries:
        if not e.is_dir or layout.parse_step(e.name) is None:
            continue
        try:
            committed_ids[e.name] = read_manifest(storage, e.name).save_id
        except CheckpointNotFoundError:
            age = _age(storage, e.name, now)
            if age is not None and age > grace and not (_prefix_ids(storage, e.name) & active):
                found.append(Debris(e.name, "", "step", age, True, f"no manifest and no write for {age:.0f}s"))
            continue
        except CorruptCheckpointError:
            continue  # evidence; never deleted by cleanup
        for sid in sorted(_prefix_ids(storage, e.name)):
            if sid != committed_ids[e.name] and sid not in active:
                found.append(Debris(join(e.name, sid), sid, "prefix", None, True,
                                    f"payloads of a save that did not commit {e.name}"))
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
