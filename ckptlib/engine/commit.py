"""The commit protocol: one protocol, its mechanics chosen by storage capability.

Called by :mod:`ckptlib.engine.save`: :func:`begin` (coordinator, before any rank writes)
prepares where payloads go; every rank writes under ``Staging.payload_prefix``; :func:`publish`
(coordinator, every rank's files durable) makes the manifest visible atomically -- the commit
point; :func:`abort` (coordinator, any failure before that) removes the staging area;
:func:`fence` (any other rank that gave up waiting for the coordinator's verdict) claims the
commit point first, so that a late coordinator cannot commit, or finds the save committed.

By capability flag (never by URL scheme): ``supports_atomic_rename`` (POSIX): everything goes
into ``<final>.tmp-<id>/``, fsynced, renamed to ``<final>`` (refusing to replace anything);
``supports_conditional_put`` (S3 If-None-Match, memory): payloads under ``<final>/<id>/``, the
manifest created last with a create-only put; neither: a plain put read back for our save id.
What may be at ``<final>`` is judged by :mod:`ckptlib.engine.target`, first in :func:`begin`
(before any payload) and again at the rename: nothing, or an empty folder, is used; a valid
existing checkpoint (or one a newer ckptlib wrote) is never replaced (``StepExistsError``)
unless ``overwrite``; a corrupt or incomplete one ckptlib wrote is moved aside (``<final>.corrupt-<id>``) or its manifest removed;
a file, or a folder holding anything ckptlib did not write, is refused
(``TargetNotEmptyError``) and nothing in it is touched.
On object stores the removal of a damaged manifest (or a failed save's abort record) happens
in :func:`begin`, before any rank writes: at publish time the manifest key holds nothing, a
fence, or (``overwrite``) the committed step being replaced; the coordinator never deletes a
fence.

``overwrite`` on ``conditional_put`` storage (:func:`_publish_claimed`) never loses the old
step: its commit point is the save's *claim* ``<final>/<id>/claim.json``
(:func:`ckptlib.format.layout.claim_path`), created with a create-only put holding the new
manifest; then the manifest is put over ``<final>/manifest.json`` (one atomic replacement:
readers see the old step or the new one, never neither), then the claim is deleted, and the
replaced save's payload prefix with it (best effort: else it is debris, below). Readers
look only at ``manifest.json``: a claim is never read by them, and one left by a crash is debris
(engine/retire.py: with the old save's payloads once the new manifest is in, with the new
save's payloads if the old manifest still stands). A crash before the claim, or between the
claim and the replacement with no rank left to settle the save, leaves the old step committed
and nobody told otherwise; after the replacement, the new one. Once claimed, the payloads are
never removed by :func:`abort` (a fencing rank may put the manifest in place). ``put_verify``
storage has no create-only put: there ``overwrite`` still removes the old manifest in
:func:`begin` (best effort, like its fence), so a failed overwrite there loses the old step.

The fence (one rule, by capability; names and record in :mod:`ckptlib.format.fence`):
``rename``: the giving-up rank renames ``<final>.tmp-<id>/`` to ``<final>.abort-<id>/``; the
coordinator's rename of the tmp folder can then only fail, and it checks after writing the
manifest that its folder still holds the ``.ckptlib`` marker (writing the manifest would
recreate a moved folder). ``conditional_put``: the rank first creates the save's claim holding
an abort record (an ``overwrite`` coordinator's claim then fails; a claim it finds holding the
save's manifest means the save committed: the rank puts that manifest over the old one, as
the coordinator would have, and reports committed), then creates ``<final>/manifest.json``
holding the abort record, both with a create-only put (a coordinator without ``overwrite``
commits there: its create-only put then fails). The rank does both whether or not the save
asked for ``overwrite``, so ranks need not agree on it. Whoever loses reads what won: a rank
that finds our committed manifest reports the save committed. ``put_verify`` has no atomic
primitive: the fence there is best effort (an abort record put where no manifest is yet, read
back). A ``rename`` fence also puts back a step an ``overwrite`` coordinator moved aside
before freezing (:func:`_put_back`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptlib import crashpoints
from ckptlib.backends import Storage, join, parent
from ckptlib.backends.base import Held
from ckptlib.engine import target
from ckptlib.engine.scan import check_step, read_capped, read_manifest
from ckptlib.errors import (
    CheckpointError,
    CommitError,
    CommitUnknownError,
    CorruptCheckpointError,
    StepExistsError,
    StorageError,
    TargetNotEmptyError,
)
from ckptlib.format import fence as fence_format
from ckptlib.format import layout
from ckptlib.format.decode import decode
from ckptlib.format.manifest import MANIFEST_NAME

COMMITTED = "committed"
FENCED = "fenced"
"""Verdicts of :func:`fence`."""


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
    claimed: bool = False
    """``overwrite`` on object stores: the claim was created (:func:`_publish_claimed`). From
    then on a fencing rank may put this save's manifest in place, so :func:`abort` leaves the
    payloads to the debris rules (engine/retire.py) instead of removing them. Also set when
    the manifest's create-only put failed without a definite answer (:func:`_publish_put`):
    it may have landed, and a committed manifest must never lose its payloads."""
    hold: Held | None = None
    """The coordinator's hold on ``work`` (:meth:`Storage.hold`, POSIX) from :func:`begin` until
    :func:`publish` or :func:`abort` ends: no other process's debris clean-up deletes it meanwhile."""

    def release(self) -> None:
        """Give the hold on ``work`` up (idempotent); the kernel does it if the process dies."""
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.close()


def commit_mode(storage: Storage) -> str:
    if storage.supports_atomic_rename:
        return "rename"
    if storage.supports_conditional_put:
        return "conditional_put"
    return "put_verify"


def check_target(storage: Storage, final: str, *, overwrite: bool = False) -> None:
    """Refuse a target a save must not write into, before any payload exists: a committed
    checkpoint, or one a newer ckptlib wrote, without ``overwrite`` (``StepExistsError``), a file or a folder holding files
    ckptlib did not write (``TargetNotEmptyError``; nothing in it is touched)."""
    t = target.judge(storage, final)
    url = f"{storage.url.rstrip('/')}/{final}"
    if t.kind in ("committed", "newer") and not overwrite:
        raise StepExistsError(_exists_message(url, t.kind == "newer"))
    if t.kind in ("file", "foreign"):
        raise TargetNotEmptyError(target.describe_foreign(url, t))


EXISTS = "Checkpoint already exists"
"""Every ``StepExistsError`` message starts with this phrase (DCP's own writer's words, which
DCP users and tests look for)."""


def _exists_message(url: str, newer: bool = False) -> str:
    held = ("a checkpoint written by a newer ckptlib (its manifest's format version is newer than this one "
            "reads; upgrade ckptlib to load it)") if newer else "a committed checkpoint"
    return (f"{EXISTS}: {url} already holds {held}; not replacing it. ckptlib.save: pass "
            "overwrite=True, or delete it first. CheckpointManager.save never replaces a committed step: save "
            "under a new step number (a loop that resumes at the step restore() returned saves it again: "
            "start at the next one)")


def begin(storage: Storage, final: str, save_id: str, *, overwrite: bool = False) -> Staging:
    """Coordinator, before any rank writes: :func:`check_target`, then make the staging area."""
    check_target(storage, final, overwrite=overwrite)
    mode = commit_mode(storage)
    if mode != "rename":
        _clear_manifest_key(storage, final, overwrite and mode == "put_verify")
    work = layout.tmp_dir(final, save_id) if mode == "rename" else final
    staging = Staging(final, save_id, work, join(work, save_id), mode)
    if mode == "rename":
        # The marker goes in first, so whatever a crash leaves in this folder is provably ours.
        storage.makedirs(work)
        staging.hold = storage.hold(work)  # before the marker: a marked folder of ours is held
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
        if not staging.claimed:
            storage.delete_tree(staging.work if staging.mode == "rename" else staging.payload_prefix)
    except Exception:
        pass
    finally:
        staging.release()


def publish(storage: Storage, staging: Staging, manifest: bytes, *, overwrite: bool = False) -> None:
    """Coordinator: commit ``staging`` with ``manifest`` by the storage's commit mode. Its hold
    ends here either way (a failed publish is then aborted)."""
    try:
        if staging.mode == "rename":
            _publish_rename(storage, staging, manifest, overwrite)
        else:
            _publish_put(storage, staging, manifest, overwrite)
    finally:
        staging.release()


def _publish_rename(storage: Storage, st: Staging, manifest: bytes, overwrite: bool) -> None:
    storage.put_atomic(join(st.work, MANIFEST_NAME), manifest)
    crashpoints.point("manifest")
    where = f"{fence_format.abort_dir(st.final, st.save_id)} holds its files"
    # A fence moves the folder away; the put above would have recreated it, without the marker.
    # Nothing below recreates it, so after this check the rename can only fail once fenced.
    if storage.size(join(st.work, layout.MARKER)) is None:
        raise _fenced_error(storage, st, where) if _fenced(storage, st) else _vanished_error(storage, st)
    folder = parent(st.final)
    try:
        storage.sync_dir(st.payload_prefix)
        storage.sync_dir(st.work)
        _move_into_place(storage, st, overwrite)
    except (FileNotFoundError, StorageError) as e:
        if _fenced(storage, st):
            raise _fenced_error(storage, st, where) from e
        raise
    try:
        storage.sync_dir(folder)
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


def _move_into_place(storage: Storage, st: Staging, overwrite: bool) -> None:
    """Rename ``st.work`` to ``st.final`` (the commit point), replacing a committed step only
    with ``overwrite`` and moving a damaged one aside. A replaced step is put back if the
    rename then fails (a fence took ``st.work`` meanwhile)."""
    gone = layout.del_dir(st.final, st.save_id)
    try:
        _rename_replacing(storage, st, overwrite)
    except BaseException:
        try:
            if overwrite and storage.exists(gone) and not storage.exists(st.final):
                storage.rename(gone, st.final)  # the step we were replacing stands
        except Exception:
            pass
        raise


def _rename_replacing(storage: Storage, st: Staging, overwrite: bool) -> None:
    for _attempt in range(2):
        try:
            storage.rename(st.work, st.final)
            return
        except FileExistsError:
            _clear_target(storage, st, overwrite)
    raise CommitError(f"could not move {st.work} into place at {st.final}")


def _clear_manifest_key(storage: Storage, final: str, replace: bool) -> None:
    """Object stores, in :func:`begin`: remove what holds ``final``'s manifest key unless it is a
    committed manifest we must keep (without ``overwrite`` :func:`publish` then raises
    ``StepExistsError``; with it, :func:`_publish_claimed` replaces it; so is a manifest a newer
    ckptlib wrote): a damaged manifest, a
    failed save's abort record, or (``replace``: ``put_verify`` stores only, which have no
    claim) the step being replaced."""
    path = join(final, MANIFEST_NAME)
    if storage.size(path) is not None and (replace or (
            check_step(storage, final).status != "committed" and target.newer_format(storage, final) is None)):
        storage.delete(path)


def _clear_target(storage: Storage, st: Staging, overwrite: bool) -> None:
    """The rename found ``st.final`` taken (:mod:`ckptlib.engine.target` judges what is there):
    a committed step (or one a newer ckptlib wrote) is refused or, with ``overwrite``, moved to
    ``.del-<id>``; a damaged one
    ckptlib wrote is moved aside to ``.corrupt-<id>``; an empty folder is removed (moved aside,
    then deleted only if still empty); anything else is refused and left as it is."""
    t = target.judge(storage, st.final)
    url = f"{storage.url.rstrip('/')}/{st.final}"
    if t.kind in ("committed", "newer"):
        if not overwrite:
            raise StepExistsError(_exists_message(url, t.kind == "newer")) from None
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
    crashpoints.point("manifest")
    if st.mode == "conditional_put" and overwrite:
        _publish_claimed(storage, st, manifest)
        return
    if st.mode == "conditional_put":
        try:
            _put_manifest(storage, st, manifest, storage.put_if_absent)
        except FileExistsError:
            raise _taken(storage, st) from None
        return
    if storage.size(path) is not None:
        raise _taken(storage, st)
    _put_manifest(storage, st, manifest, storage.put_atomic)
    try:
        back = read_manifest(storage, st.final, pieces=False)
    except CheckpointError as e:
        raise _taken(storage, st) if storage.size(path) is not None else CommitError(
            f"manifest read-back failed: {e}") from e
    if back.save_id != st.save_id:
        raise StepExistsError(f"{EXISTS}: {storage.url}/{path} was committed by another save ({back.save_id})")


def _put_manifest(storage: Storage, st: Staging, manifest: bytes, put: Callable[[str, bytes], None]) -> None:
    """:func:`_publish_put` (coordinator): ``put`` the manifest at ``<final>/manifest.json``. A
    put that fails without a definite answer (out of attempts or time) may still have landed:
    the manifest is read back (ours: done), else ``st.claimed`` is set so that :func:`abort`
    leaves the payloads a landed manifest names to the debris rules, and
    :class:`CommitUnknownError` is raised (every rank raises it: the step may be committed).
    ``FileExistsError`` (a definite answer) is raised as it is."""
    try:
        put(join(st.final, MANIFEST_NAME), manifest)
    except FileExistsError:
        raise
    except (OSError, CheckpointError) as e:
        if _holds(storage, st.final, manifest):
            return  # an attempt landed; only its answers were lost
        st.claimed = True
        raise CommitUnknownError(
            f"the manifest's put to {storage.url}/{st.final} failed without a definite answer and could not be read "
            f"back ({type(e).__name__}: {e}): it may have landed, so the step may be committed; its payloads are "
            "kept and the next restore decides") from e


def _publish_claimed(storage: Storage, st: Staging, manifest: bytes) -> None:
    """Object stores, ``overwrite``: create the claim (the commit point: the old step is
    replaced from here on), then put the manifest over ``<final>/manifest.json`` (one atomic
    replacement: readers see the old manifest or the new one, never none), then drop the claim.
    A claim already there holds a fencing rank's abort record: this save failed."""
    claim = layout.claim_path(st.final, st.save_id)
    st.claimed = True  # a put that fails may still have landed
    try:
        storage.put_if_absent(claim, manifest)
    except FileExistsError:
        record, held, _ = _read_claim(storage, claim)
        if record is not None:
            st.claimed = False  # a fence's: nobody can put this save's manifest in place
            raise _fenced_error(storage, st, record.describe()) from None
        if held != manifest:
            raise CommitError(f"{storage.url.rstrip('/')}/{claim} holds another manifest than this save's") from None
    crashpoints.point("claimed")
    replaced = _committed_save_id(storage, st.final)
    try:
        storage.put_atomic(join(st.final, MANIFEST_NAME), manifest)
    except (OSError, CheckpointError) as e:
        _claim_failed(storage, st, manifest, e)
    crashpoints.point("replaced")
    try:  # a rank fencing late then finds no claim and our manifest: it reports committed
        storage.delete(claim)
    except (OSError, CheckpointError):
        pass  # debris (engine/retire.py): the manifest names this save
    if replaced and replaced != st.save_id:
        # The payloads of the save just replaced: that save committed, so nobody writes there
        # any more (as POSIX removes the replaced folder). Without this a one-shot save or an
        # integration's overwrite would leave one whole copy per overwrite, which only a
        # manager's debris clean-up would find.
        try:
            storage.delete_tree(join(st.final, replaced))
        except (OSError, CheckpointError):
            pass  # debris, as before


def _committed_save_id(storage: Storage, final: str) -> str | None:
    """The save id of the manifest committed at ``final`` (None when there is none, or it
    cannot be read): read right before an overwrite replaces it."""
    try:
        return read_manifest(storage, final, pieces=False).save_id
    except (OSError, CheckpointError):
        return None


def _claim_failed(storage: Storage, st: Staging, manifest: bytes, error: BaseException) -> None:
    """The manifest put after our claim failed (storage error, deadline). Returns if the
    manifest is there anyway (a fencing rank rolled the save forward); else turns the claim
    into an abort record, so that a rank fencing from now on reports failure like us, and
    raises. (A rank that read the claim just before may still roll it forward: a storage failure
    on the coordinator racing a fence on another rank is the one case left to chance.)"""
    if _holds(storage, st.final, manifest):
        return
    why = f"the coordinator could not put the manifest: {type(error).__name__}: {error}"
    try:
        storage.put_atomic(layout.claim_path(st.final, st.save_id),
                           fence_format.encode_abort(st.save_id, 0, why[:500], time.time()))
    except (OSError, CheckpointError):
        pass
    if _holds(storage, st.final, manifest):
        return
    raise CommitError(f"{storage.url.rstrip('/')}/{st.final} was not replaced: {why}; the step "
                      "it had stays committed; save again") from error


def _holds(storage: Storage, final: str, manifest: bytes) -> bool:
    """Whether ``final``'s manifest key holds exactly ``manifest`` (False when unreadable)."""
    path = join(final, MANIFEST_NAME)
    try:
        return storage.size(path) == len(manifest) and storage.read(path) == manifest
    except (OSError, CheckpointError):
        return False


def _read_claim(storage: Storage, path: str) -> tuple[fence_format.AbortRecord | None, bytes, str]:
    """What a claim holds: (its abort record, its bytes, ""), or (None, its bytes, the save id
    it names) when it holds a manifest, decoded and validated like ``manifest.json`` (claim
    bytes are untrusted: same size limit, same decoder). ``CommitError`` when it is neither,
    or unreadable."""
    where = f"{storage.url.rstrip('/')}/{path}"
    try:
        try:
            data = read_capped(storage, path)
        except FileNotFoundError:
            raise CommitError(f"{where} vanished while being read") from None
        record = fence_format.parse_abort(data, where)
        return record, data, "" if record is not None else decode(data, where).save_id
    except CommitError:
        raise
    except (OSError, CheckpointError) as e:
        raise CommitError(f"cannot read the claim {where}: {e}") from e


def _taken(storage: Storage, st: Staging) -> CommitError:
    """The error for a manifest key that something else holds: our save's fence, or another
    save's manifest (``StepExistsError``)."""
    path = join(st.final, MANIFEST_NAME)
    try:
        record = fence_format.parse_abort(read_capped(storage, path), path)
    except (OSError, CheckpointError):
        record = None
    if record is not None:
        return _fenced_error(storage, st, record.describe())
    return StepExistsError(f"{EXISTS}: {storage.url}/{path} was committed by another save")


def _fenced_error(storage: Storage, st: Staging, detail: str) -> CommitError:
    return CommitError(
        f"{storage.url.rstrip('/')}/{st.final} was not committed: another rank gave up waiting for this "
        f"coordinator and fenced the save ({detail}); every rank reports it failed; save again"
    )


def _vanished_error(storage: Storage, st: Staging) -> CommitError:
    """:func:`_publish_rename` found its staging folder gone and no rank's fence holding it: it
    was removed from outside the save (the root or the folder deleted, a cleanup job)."""
    url = storage.url.rstrip("/")
    return CommitError(
        f"{url}/{st.final} was not committed: its staging folder {st.work} disappeared during the save "
        f"(deleted by something other than ckptlib: a cleanup job, a person, another job using {url}?); "
        f"older steps are untouched. Stop whatever deletes files under {url}, then save again"
    )


def _fenced(storage: Storage, st: Staging) -> bool:
    """Rename mode: whether a rank moved our staging folder to its abort name."""
    try:
        return storage.exists(fence_format.abort_dir(st.final, st.save_id))
    except (OSError, CheckpointError):
        return False


def fence(storage: Storage, final: str, save_id: str, rank: int, reason: str) -> str:
    """A non-coordinator rank that gave up waiting for the coordinator's verdict (after sending it
    its results, so the coordinator might still commit): make that commit impossible, or find it
    done. Returns :data:`COMMITTED` (the save ``save_id`` is committed at ``final``: report
    success) or :data:`FENCED` (it is not, and now never will be: report failure). Raises
    :class:`CommitError` when it can tell neither (storage failing: the fence may be missing).
    Called by :meth:`ckptlib.engine.save.SaveSession.finish` on the thread driving the save;
    any number of ranks may race here and with the coordinator's :func:`publish`."""
    mode = commit_mode(storage)
    if mode == "rename":
        work, gone = layout.tmp_dir(final, save_id), fence_format.abort_dir(final, save_id)
        for _attempt in range(3):
            try:
                storage.rename(work, gone)
                return _put_back(storage, final, save_id)  # the coordinator's rename now finds no source
            except (FileExistsError, FileNotFoundError, StorageError):
                pass
            if storage.exists(gone):
                return _put_back(storage, final, save_id)  # another rank's fence (a ``work`` the
                # manifest put recreated has no marker)
            if not storage.exists(work):
                break  # moved into place (committed), or removed by the coordinator's abort
        else:
            raise CommitError(f"could not fence {storage.url.rstrip('/')}/{work}: it is still there")
    else:
        path = join(final, MANIFEST_NAME)
        record = fence_format.encode_abort(save_id, rank, reason, time.time())
        if mode == "conditional_put" and _claim_committed(storage, final, save_id, record):
            return COMMITTED
        try:
            if mode == "conditional_put":
                storage.put_if_absent(path, record)
                return FENCED  # the coordinator's create-only manifest put now fails
            if storage.size(path) is None:
                storage.put_atomic(path, record)  # best effort: no atomic primitive here
        except FileExistsError:
            pass  # something holds the commit point: see what
    return COMMITTED if committed_id(storage, final) == save_id else FENCED


def committed_id(storage: Storage, final: str) -> str | None:
    """The save id of the manifest committed at ``final`` (the commit point), or None: its bytes
    decode, nothing more is checked (the files were durable before it was written; a restore
    judges them). Raises :class:`CommitError` when storage cannot tell."""
    path = join(final, MANIFEST_NAME)
    try:
        data = read_capped(storage, path)
    except FileNotFoundError:
        return None
    except CorruptCheckpointError:
        return None  # over the size limit: no manifest of ours
    except Exception as e:
        raise CommitError(f"could not read {storage.url.rstrip('/')}/{path} after giving up: {e}") from e
    try:
        return decode(data, f"{storage.url.rstrip('/')}/{path}").save_id
    except CorruptCheckpointError:
        return None  # an abort record (a fence), or not ours


def _claim_committed(storage: Storage, final: str, save_id: str, record: bytes) -> bool:
    """:func:`fence` on object stores, first: take the claim an ``overwrite`` save commits with
    (:func:`_publish_claimed`; the coordinator's claim then fails), or find that the coordinator
    took it: then the save is committed, and this rank puts its manifest over the old one, as
    the coordinator would have (it may be dead), before reporting it. Returns whether the
    coordinator's claim won. The claim decides only ``overwrite`` saves: the caller then settles
    the manifest key, which a save without ``overwrite`` commits with."""
    claim = layout.claim_path(final, save_id)
    try:
        storage.put_if_absent(claim, record)
        return False
    except FileExistsError:
        pass
    found, manifest, named = _read_claim(storage, claim)
    if found is not None:
        return False  # another rank's fence, or a coordinator that gave up on its claim
    if named != save_id:
        raise CommitError(f"{storage.url.rstrip('/')}/{claim} holds the manifest of save {named}, not {save_id}")
    if not _holds(storage, final, manifest):
        storage.put_atomic(join(final, MANIFEST_NAME), manifest)
    return True


def _put_back(storage: Storage, final: str, save_id: str) -> str:
    """:func:`fence`, rename mode, the save fenced: an ``overwrite`` coordinator frozen between
    moving the committed step aside (``.del-<id>``) and its rename may never come back to put it
    back (:func:`_move_into_place`): do it here, so the old step stands. Returns :data:`FENCED`."""
    aside = layout.del_dir(final, save_id)
    try:
        if storage.exists(aside) and not storage.exists(final):
            storage.rename(aside, final)
    except (OSError, CheckpointError):
        pass  # the coordinator put it back meanwhile, or the cleanup will (engine/retire.py)
    return FENCED
