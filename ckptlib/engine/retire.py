"""Deleting steps (retention, prune) and cleaning the debris of crashed saves.

Called by the manager after a successful commit, and by the CLI's ``prune``. Deletion makes
a step invisible first, then removes its bytes, so a crash half-way never leaves something
that looks like a valid checkpoint:
- rename-capable storage: rename ``step-N`` to ``step-N.del-<id>`` (atomic), then delete it;
- object stores: delete ``manifest.json`` first, then the payload prefix.
Debris is only ever deleted when it is provably ours: ``*.tmp-<id>``/``*.del-<id>`` folders
holding the ``.ckptlib`` marker, or payload prefixes inside a committed step whose id is not
the manifest's save id.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection

from ckptlib.backends import Storage, join
from ckptlib.format import layout
from ckptlib.format.manifest import MANIFEST_NAME


def delete_step(storage: Storage, folder: str) -> None:
    if storage.supports_atomic_rename:
        gone = layout.del_dir(folder, uuid.uuid4().hex)
        storage.rename(folder, gone)
        storage.delete_tree(gone)
    else:
        storage.delete(join(folder, MANIFEST_NAME))
        storage.delete_tree(folder)


def clean_debris(storage: Storage, active_ids: Collection[str] = ()) -> list[str]:
    """Remove leftovers of crashed saves and deletions; returns what was removed."""
    removed = []
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
        if storage.size(join(e.name, layout.MARKER)) is None:
            continue  # not provably ours: leave it alone
        storage.delete_tree(e.name)
        removed.append(e.name)
    return removed
