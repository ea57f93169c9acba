"""The commit protocol: one protocol, its mechanics chosen by storage capability.

Called by :mod:`ckptlib.engine.save`: :func:`begin` (coordinator, before any rank writes)
prepares where payloads go; every rank writes under ``Staging.payload_prefix``; :func:`publish`
(coordinator, every rank's files durable) makes the manifest visible atomically -- the commit
point; :func:`abort` (coordinator, any failure before that) removes the staging area.

By capability flag (never by URL scheme): ``supports_atomic_rename`` (POSIX): everything goes
into ``<final>.tmp-<id>/``, fsynced, renamed to ``<final>`` (refusing to replace anything);
``supports_conditional_put`` (S3 If-None-Match, memory): payloads under ``<final>/<id>/``, the
manifest created last with a create-only put; neither: a plain put read back for our save id.
What may be at ``<final>`` is judged by :mod:`ckptlib.engine.target`, first in :func:`begin`
(before any payload) and again at the rename: nothing, or an empty folder, is used; a valid
existing checkpoint is never replaced (``StepExistsError``) unless ``overwrite``; a corrupt or
incomplete one ckptlib wrote is moved aside (``<final>.corrupt-<id>``) or its manifest removed;
a file, or a folder holding anything ckptlib did not write, is refused
(``TargetNotEmptyError``) and nothing in it is touched.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ckptlib import crashpoints
from ckptlib.backends import Storage, join
from ckptlib.engine import target
from ckptlib.engine.scan import check_step, read_manifest
from ckptlib.errors import CheckpointError, CommitError, StepExistsError, TargetNotEmptyError
from ckptlib.format import layout
from ckptlib.format.manifest import MANIFEST_NAME


@dataclass(slots=True)
class Staging:
    final: str
    """Folder the checkpoint will live in, relative to the storage root."""
    save_id: str
    work: str
    """Folder being written (``final`` itself on object stores)."""
    payload_prefix: str
    mode: str
    """``rename``, ``conditional_put`` or ``put_verify`` (recorded in the manifest)."""


def commit_mode(storage: Storage) -> str:
    if storage.supports_atomic_rename:
        return "rename"
    if storage.supports_conditional_put:
        return "conditional_put"
    return "put_verify"


def check_target(storage: Storage, final: str, *, overwrite: bool = False) -> None:
    """Refuse a target a save must not write into, before any payload exists: a committed
    checkpoint without ``overwrite`` (``StepExistsError``), a file or a folder holding files
    ckptlib did not write (``TargetNotEmptyError``; nothing in it is touched)."""
    t = target.judge(storage, final)
    url = f"{storage.url.rstrip('/')}/{final}"
    if t.kind == "committed" and not overwrite:
        raise StepExistsError(_exists_message(url))
    if t.kind in ("file", "foreign"):
        raise TargetNotEmptyError(target.describe_foreign(url, t))


def _exists_message(url: str) -> str:
    return (f"{url} already holds a committed checkpoint; not replacing it "
            "(pass overwrite=True, or delete it first)")


def begin(storage: Storage, final: str, save_id: str, *, overwrite: bool = False) -> Staging:
    """Coordinator, before any rank writes: :func:`check_target`, then make the staging area."""
    check_target(storage, final, overwrite=overwrite)
    mode = commit_mode(storage)
    work = layout.tmp_dir(final, save_id) if mode == "rename" else final
    staging = Staging(final, save_id, work, join(work, save_id), mode)
    if mode == "rename":
        # The marker goes in first, so whatever a crash leaves in this folder is provably ours.
        storage.makedirs(work)
        try:
            marker = json.dumps({"save_id": save_id, "created": time.time()}).encode()
            w = storage.open_write(join(work, layout.MARKER))
            w.write(marker)
            w.close()
        except BaseException:
            abort(storage, staging)  # the folder name is unique to this save: safe to remove
            raise
    storage.makedirs(staging.payload_prefix)
    return staging


def abort(storage: Storage, staging: Staging) -> None:
    """Best effort: remove what this save wrote. Leftovers are cleaned by a later save."""
    try:
        storage.delete_tree(staging.work if staging.mode == "rename" else staging.payload_prefix)
    except Exception:
        pass


def publish(storage: Storage, staging: Staging, manifest: bytes, *, overwrite: bool = False) -> None:
    if staging.mode == "rename":
        _publish_rename(storage, staging, manifest, overwrite)
    else:
        _publish_put(storage, staging, manifest, overwrite)


def _publish_rename(storage: Storage, st: Staging, manifest: bytes, overwrite: bool) -> None:
    storage.put_atomic(join(st.work, MANIFEST_NAME), manifest)
    crashpoints.point("manifest")
    storage.sync_dir(st.payload_prefix)
    storage.sync_dir(st.work)
    parent = st.final.rsplit("/", 1)[0] if "/" in st.final else ""
    for _attempt in range(2):
        try:
            storage.rename(st.work, st.final)
            break
        except FileExistsError:
            _clear_target(storage, st, overwrite)
    else:
        raise CommitError(f"could not move {st.work} into place at {st.final}")
    try:
        storage.sync_dir(parent)
    except BaseException:
        # The rename may not be durable and the save is about to be reported as failed: take
        # the step back out of sight (the abort then removes it), so that what is visible
        # matches what every rank is told. Best effort: if this fails too, it stays visible.
        try:
            storage.rename(st.final, st.work)
            gone = layout.del_dir(st.final, st.save_id)
            if overwrite and storage.exists(gone):
                storage.rename(gone, st.final)  # the step we were replacing stands
        except Exception:
            pass
        raise
    if overwrite:
        storage.delete_tree(layout.del_dir(st.final, st.save_id))


def _clear_target(storage: Storage, st: Staging, overwrite: bool) -> None:
    """The rename found ``st.final`` taken (:mod:`ckptlib.engine.target` judges what is there):
    a committed step is refused or, with ``overwrite``, moved to ``.del-<id>``; a damaged one
    ckptlib wrote is moved aside to ``.corrupt-<id>``; an empty folder is removed (moved aside,
    then deleted only if still empty); anything else is refused and left as it is."""
    t = target.judge(storage, st.final)
    url = f"{storage.url.rstrip('/')}/{st.final}"
    if t.kind == "committed":
        if not overwrite:
            raise StepExistsError(_exists_message(url)) from None
        storage.rename(st.final, layout.del_dir(st.final, st.save_id))
    elif t.kind == "damaged":
        storage.rename(st.final, f"{st.final}.corrupt-{st.save_id}")
    elif t.kind == "empty":
        aside = layout.del_dir(st.final, st.save_id)  # debris rules: a crash here leaves no trash
        storage.rename(st.final, aside)
        if storage.listdir(aside):  # written into meanwhile: put it back, untouched
            storage.rename(aside, st.final)
            raise TargetNotEmptyError(f"{url} was written to by someone else during the save; left as it is")
        storage.delete_tree(aside)
    elif t.kind != "absent":
        raise TargetNotEmptyError(target.describe_foreign(url, t))


def _publish_put(storage: Storage, st: Staging, manifest: bytes, overwrite: bool) -> None:
    path = join(st.final, MANIFEST_NAME)
    if storage.size(path) is not None and (overwrite or check_step(storage, st.final).status != "committed"):
        storage.delete(path)  # a damaged manifest, or one we were asked to replace
    crashpoints.point("manifest")
    if st.mode == "conditional_put":
        try:
            storage.put_if_absent(path, manifest)
        except FileExistsError:
            raise StepExistsError(f"{storage.url}/{path} was committed by another save") from None
        return
    if storage.size(path) is not None:
        raise StepExistsError(f"{storage.url}/{path} was committed by another save")
    storage.put_atomic(path, manifest)
    try:
        back = read_manifest(storage, st.final)
    except CheckpointError as e:
        raise CommitError(f"manifest read-back failed: {e}") from e
    if back.save_id != st.save_id:
        raise StepExistsError(f"{storage.url}/{path} was committed by another save ({back.save_id})")
