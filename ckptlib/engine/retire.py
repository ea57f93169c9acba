"""Deleting steps (retention, prune) and cleaning the debris of crashed saves.

Called by the manager after a successful commit (on its save thread, coordinator only), and
by the CLI's ``prune``. Deletion makes a step invisible first, then removes its bytes, so a
crash half-way never leaves something that looks like a valid checkpoint:
- rename-capable storage: rename ``step-N`` to ``step-N.del-<id>`` (atomic), then delete it;
- object stores: delete ``manifest.json`` first, then the payload prefix. A crash in between
  leaves payloads without a manifest: an "incomplete" step that the debris rules below remove.

Debris is only ever deleted when it is provably ours or provably dead:
- ``*.tmp-<id>``/``*.del-<id>`` folders holding the ``.ckptlib`` marker (rename-capable storage),
  or, when a crash mid-deletion already took the marker, holding nothing but what ckptlib
  writes there (manifest, manifest partials, ``<save_id>/r<rank>...bin`` payloads). ckptlib's
  own deletions remove the marker last, so they never create marker-less debris;
- object stores, inside a step folder whose manifest is valid: every ``<save_id>/`` payload
  prefix other than the manifest's (a save that lost the commit race, or crashed after a
  newer save of the same step committed), unless that save id is active in this process;
- object stores, a step folder with no manifest at all whose newest object is older than
  ``grace`` seconds (a save in progress elsewhere writes objects continuously; one that wrote
  nothing for ``grace`` seconds is dead). Keep ``grace`` well above the longest save;
- object stores, incomplete multipart uploads under the root that started more than ``grace``
  seconds ago, or that belong to a debris prefix of a committed step.
A step whose manifest is present but corrupt is never touched: it is evidence, and the commit
of a new save of that step deals with it.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Collection

from ckptlib.backends import Storage, join
from ckptlib.engine.scan import read_manifest
from ckptlib.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptlib.format import layout
from ckptlib.format.manifest import MANIFEST_NAME

log = logging.getLogger("ckptlib")

DEFAULT_GRACE = 3600.0
"""Seconds without a write before a manifest-less step or an upload counts as dead."""

SAVE_ID_RE = re.compile(r"^[0-9a-f]{8,64}$")


def delete_step(storage: Storage, folder: str) -> None:
    if storage.supports_atomic_rename:
        gone = layout.del_dir(folder, uuid.uuid4().hex)
        storage.rename(folder, gone)
        _delete_marker_last(storage, gone)
    else:
        storage.delete(join(folder, MANIFEST_NAME))
        storage.delete_tree(folder)


def clean_debris(
    storage: Storage,
    active_ids: Collection[str] = (),
    *,
    grace: float = DEFAULT_GRACE,
    now: float | None = None,
) -> list[str]:
    """Remove leftovers of crashed saves and deletions; returns what was removed.

    ``active_ids``: save ids in flight in this process (never touched). ``now``: Unix time
    (injectable for tests); ages are measured against the storage's own timestamps.
    """
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = storage.listdir("")
    except FileNotFoundError:
        return removed
    for e in entries:
        m = layout.TMP_RE.match(e.name)
        if not (m and e.is_dir) or m.group(3) in active_ids:
            continue
        if layout.parse_step(m.group(1)) is None and m.group(2) == "tmp":
            continue
        if storage.size(join(e.name, layout.MARKER)) is None and not _only_ours(storage, e.name):
            continue  # not provably ours: leave it alone
        _delete_marker_last(storage, e.name)
        removed.append(e.name)
    if not storage.supports_atomic_rename:
        removed += _clean_object_store(storage, entries, set(active_ids), grace, now)
    return removed


def _clean_object_store(storage: Storage, entries, active: set[str], grace: float, now: float) -> list[str]:
    removed: list[str] = []
    committed_ids: dict[str, str] = {}  # step folder -> save id of its manifest
    for e in entries:
        if not e.is_dir or layout.parse_step(e.name) is None:
            continue
        try:
            committed_ids[e.name] = read_manifest(storage, e.name).save_id
        except CheckpointNotFoundError:
            age = _age(storage, e.name, now)
            ids = _prefix_ids(storage, e.name)
            if age is not None and age > grace and not (ids & active):
                log.info("ckptlib: removing %s: no manifest and no write for %.0fs", e.name, age)
                storage.delete_tree(e.name)
                removed.append(e.name)
            continue
        except CorruptCheckpointError:
            continue  # evidence; never deleted by cleanup
        for sid in _prefix_ids(storage, e.name):
            if sid != committed_ids[e.name] and sid not in active:
                storage.delete_tree(join(e.name, sid))
                removed.append(join(e.name, sid))
    list_uploads = getattr(storage, "list_uploads", None)
    abort_upload = getattr(storage, "abort_upload", None)
    if list_uploads is None or abort_upload is None:
        return removed
    for path, upload_id, started in list_uploads(""):
        parts = path.split("/")
        sid = parts[1] if len(parts) > 2 else ""
        if sid in active:
            continue
        dead_prefix = parts[0] in committed_ids and sid != committed_ids[parts[0]]
        if dead_prefix or now - started > grace:
            abort_upload(path, upload_id)
            removed.append(f"{path} (upload {upload_id})")
    return removed


def _delete_marker_last(storage: Storage, folder: str) -> None:
    """Delete ``folder`` so that a crash part-way leaves the ownership marker in place."""
    try:
        entries = storage.listdir(folder)
    except FileNotFoundError:
        return
    for e in entries:
        if e.name == layout.MARKER:
            continue
        if e.is_dir:
            storage.delete_tree(join(folder, e.name))
        else:
            storage.delete(join(folder, e.name))
    storage.delete_tree(folder)


def _only_ours(storage: Storage, folder: str) -> bool:
    """Whether a marker-less ``*.tmp-``/``*.del-`` folder holds only what ckptlib writes there."""
    try:
        entries = storage.listdir(folder)
    except FileNotFoundError:
        return False
    for e in entries:
        if not e.is_dir and (
            e.name in (layout.MARKER, MANIFEST_NAME)
            or (e.name.startswith(MANIFEST_NAME + ".") and e.name.endswith(".partial"))
        ):
            continue
        if not (e.is_dir and SAVE_ID_RE.match(e.name)):
            return False
        try:
            files = storage.listdir(join(folder, e.name))
        except FileNotFoundError:
            continue
        if any(f.is_dir or not layout.is_payload_name(f.name) for f in files):
            return False
    return True


def _prefix_ids(storage: Storage, folder: str) -> set[str]:
    try:
        return {c.name for c in storage.listdir(folder) if c.is_dir and SAVE_ID_RE.match(c.name)}
    except FileNotFoundError:
        return set()


def _age(storage: Storage, folder: str, now: float) -> float | None:
    """Seconds since the newest write under ``folder`` (None: the backend cannot tell)."""
    tree_modified = getattr(storage, "tree_modified", None)
    if tree_modified is None:
        return None
    t = tree_modified(folder)
    return None if t is None else now - t
