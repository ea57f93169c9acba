"""What is at a checkpoint folder's path, judged by ckptlib's own names: the one rule for which
folders a save may use, move aside or must leave alone, and for explaining a wrong load path.

Callers, all on their caller's thread: :func:`ckptlib.engine.commit.check_target` (the save's
coordinator, in ``SaveSession.begin``, before any rank writes a payload) and the rename commit
(a folder that appeared at the target since), and ``ckptlib.load`` (:func:`not_a_checkpoint`,
after the manifest could not be read).

A folder is ckptlib's own only when every entry in it is a name ckptlib writes into a
checkpoint folder (``manifest.json`` and its ``.partial`` temporaries, the ``.ckptlib`` marker,
``<save id>/`` folders holding only payload files and, on object stores, an overwrite save's
claim, :data:`ckptlib.format.layout.CLAIM`): only such a folder may ever be
moved aside (``<folder>.corrupt-<id>``) when it is damaged. Anything else in a folder makes it
``foreign``: a save refuses it and touches nothing in it. A folder whose manifest is of a newer
format than this ckptlib reads is ``newer``: written by a newer ckptlib, not damaged, so it is
never moved aside, its manifest never removed, and retention leaves it alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptlib.backends import Storage, join
from ckptlib.engine.scan import check_step, read_manifest
from ckptlib.errors import CheckpointError, ManifestVersionError
from ckptlib.format import layout
from ckptlib.format.schema import MANIFEST_NAME

_SAVE_ID_RE = re.compile(r"^[0-9a-f]{8,64}$")
SHOWN = 5
"""How many foreign names a message lists."""

KINDS = ("absent", "file", "empty", "committed", "damaged", "newer", "foreign")


@dataclass(frozen=True, slots=True)
class Target:
    """The verdict on one path (:func:`judge`)."""

    kind: str
    """One of :data:`KINDS`: nothing there; a file; an empty folder; a committed checkpoint;
    a checkpoint ckptlib wrote that is not committed (crashed, damaged); a checkpoint whose
    manifest a newer ckptlib wrote (:func:`newer_format`); a folder holding entries ckptlib
    did not write."""
    foreign: tuple[str, ...] = ()
    """``foreign``: the first entries ckptlib did not write (sorted)."""
    count: int = 0
    """``foreign``: how many entries ckptlib did not write."""
    steps: tuple[int, ...] = ()
    """Step folders (``step-<n>``) directly inside: the folder is a manager's run root."""


def _is_ours(storage: Storage, folder: str, name: str, is_dir: bool) -> bool:
    if not is_dir:  # the marker, the manifest, or a put_atomic temporary of it
        return name in (layout.MARKER, MANIFEST_NAME) or (
            name.startswith(MANIFEST_NAME + ".") and name.endswith(".partial"))
    if not _SAVE_ID_RE.match(name):
        return False
    try:
        inside = storage.listdir(join(folder, name))
    except FileNotFoundError:
        return True  # gone meanwhile (a save's abort): nothing of the user's was there
    return all(not e.is_dir and (layout.is_payload_name(e.name) or e.name == layout.CLAIM) for e in inside)


def foreign_entries(storage: Storage, folder: str) -> list[str]:
    """The entries of ``folder`` ckptlib does not write into a checkpoint folder (sorted; empty
    when every entry is ckptlib's, or the folder is empty): the one ownership rule, also used
    by :mod:`ckptlib.engine.retire` for marker-less debris. ``FileNotFoundError`` if missing."""
    return sorted(e.name for e in storage.listdir(folder) if not _is_ours(storage, folder, e.name, e.is_dir))


def judge(storage: Storage, folder: str) -> Target:
    """The verdict on ``folder`` (relative to the storage root). Lists the folder (and its
    save-id folders); reads the manifest only when every entry is ckptlib's. Storage errors
    propagate."""
    if storage.size(folder) is not None:
        return Target("file")
    try:
        entries = storage.listdir(folder)
    except FileNotFoundError:
        # A missing folder, or a path that is not a folder (special file, link to a file).
        return Target("file" if storage.exists(folder) else "absent")
    if not entries:
        return Target("empty")
    steps = layout.step_folders(entries)
    alien = sorted(e.name for e in entries if not _is_ours(storage, folder, e.name, e.is_dir))
    if alien:
        return Target("foreign", tuple(alien[:SHOWN]), len(alien), steps)
    status = check_step(storage, folder).status
    if status == "committed":
        return Target("committed")
    return Target("damaged" if newer_format(storage, folder) is None else "newer")


def newer_format(storage: Storage, folder: str) -> str | None:
    """The :class:`ManifestVersionError` message when ``folder``'s manifest is of a newer format
    than this ckptlib reads (written by a newer ckptlib, not damaged); None otherwise. Called by
    :func:`judge` and by retention (:mod:`ckptlib.engine.retire`) on a step that failed its check."""
    try:
        read_manifest(storage, folder, pieces=False)
    except ManifestVersionError as e:
        return str(e)
    except (CheckpointError, OSError):
        return None
    return None


def describe_foreign(url: str, t: Target) -> str:
    """The sentence for a save refused on a ``foreign`` (or ``file``) target at ``url``."""
    if t.kind == "file":
        return (f"{url} is a file, not a checkpoint folder; nothing was written. "
                "Pass a path that does not exist yet or an empty folder")
    more = f" and {t.count - len(t.foreign)} more" if t.count > len(t.foreign) else ""
    names = ", ".join(t.foreign)
    root = ""
    if t.steps:
        root = (f" It is a run root holding steps {_steps(t.steps)}: save steps through "
                "CheckpointManager(...).save(step, state), or into a new folder.")
    return (f"{url} holds files that are not a ckptlib checkpoint ({names}{more}); nothing in it "
            f"was moved or changed.{root} Save into a new or empty folder, or move those files away")


def file_hint(url: str, more: str = "") -> str:
    """The message for a load or open given a file: what to pass instead (``more``: other
    choices the caller offers). A Hugging Face file (a shard, its index) is read as a folder.
    Called by :func:`not_a_checkpoint` and ``ckptlib.open``."""
    if url.endswith((".safetensors", ".safetensors.index.json")):
        return f"{url} is a file; pass the folder that holds it (a Hugging Face safetensors folder is read whole)"
    return f"{url} is a file; pass the checkpoint folder (the one holding {MANIFEST_NAME}){more}"


def not_a_checkpoint(storage: Storage, folder: str) -> str | None:
    """Why ``folder`` is not a checkpoint folder a load can read, with what to pass instead;
    None when the path looks like a (missing or damaged) checkpoint folder, so the caller's own
    error stands. ``ckptlib.load`` calls it after the manifest could not be read."""
    url = f"{storage.url.rstrip('/')}/{folder}".rstrip("/")
    if storage.size(folder) is not None:  # a regular file (a link or special file: the load says)
        return file_hint(url)
    if storage.exists(join(folder, MANIFEST_NAME)):
        return None  # a checkpoint folder whose manifest is wrong: that error stands
    t = judge(storage, folder)
    if t.steps:
        newest = layout.step_dir(t.steps[-1])
        return (f"{url} is a run root holding steps {_steps(t.steps)}; pass a step folder "
                f"(e.g. {url}/{newest}) or use CheckpointManager({url!r}).restore(state) / "
                f"ckptlib.open({url!r})")
    if t.kind == "empty":
        return f"{url} is an empty folder: no checkpoint was saved there"
    if t.kind == "foreign":
        return (f"{url} holds no {MANIFEST_NAME} and files ckptlib did not write "
                f"({', '.join(t.foreign)}); pass the checkpoint folder (the one holding {MANIFEST_NAME})")
    return None


def _steps(steps: tuple[int, ...]) -> str:
    shown = ", ".join(str(s) for s in steps[-10:])
    return shown if len(steps) <= 10 else f"... {shown} ({len(steps)} in all)"
