"""What the local tier holds, judged without torch: the rules the manager, restore and the
command line share.

Who calls what:

- :func:`local_steps`: the manager's local retention and restore (every rank, its node's folder),
  ``ckptlib ls/verify/prune --local`` (the command's worker thread);
- :func:`retired_by_local_retention`: :func:`ckptlib.tiers.local.after_local_commit` (a node
  leader, persist thread) and ``ckptlib prune --local``: which local steps go;
- :func:`unrestorable` / :func:`lost_pieces`: the restorability rule, in restore's coordinator
  (:func:`ckptlib.tiers.restore_plan.plan_files`) and in ``ckptlib verify --local``;
- :func:`check_copies`: ``ckptlib verify --local``, one node folder's copies of one step (its
  ranks' own files and the replicas it holds), every chunk's checksum;
- :func:`node_folders`: ``ckptlib ls/verify/prune --local``: the node folders a ``local=``
  template names;
- :func:`write_back_tmp` names a restore write-back's temporary file
  (:func:`ckptlib.tiers.write_back.write_back`); :func:`write_back_debris` judges the ones a crash
  left (:func:`ckptlib.tiers.local.after_local_commit` after each local commit, ``ckptlib prune
  --local``).

Nothing here imports torch (tests/test_cli_imports.py runs the commands with ``-X importtime``).
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from ckptlib.backends import Storage, join
from ckptlib.backends.posix import ARENA_DIR
from ckptlib.engine.index_io import load_indexes
from ckptlib.engine.retire import Debris
from ckptlib.engine.scan import read_manifest
from ckptlib.engine.verify import verify_chunks
from ckptlib.errors import CheckpointError
from ckptlib.format import layout
from ckptlib.format.schema import Manifest
from ckptlib.plan import retention
from ckptlib.tiers.node import local_root
from ckptlib.tiers.replicas import REPLICA_DIR


def local_steps(storage: Storage) -> dict[int, str]:
    """Steps committed in this node's local folder (manifest present and valid): step -> the
    local save id (:func:`local_save_id`: a step written back from the persistent copy counts as
    the same save on every node). Only the manifest is judged here; restore verifies the files."""
    out: dict[int, str] = {}
    try:
        entries = storage.listdir("")
    except FileNotFoundError:
        return out
    for ent in entries:
        step = layout.parse_step(ent.name)
        if step is None or not ent.is_dir:
            continue
        try:
            m = read_manifest(storage, ent.name, pieces=False)  # v2: index files live on several nodes
        except CheckpointError:
            continue
        if m.step == step:
            out[step] = local_save_id(m)
    return out


def retired_by_local_retention(steps: Iterable[int], keep_last: int, protect: Collection[int]) -> list[int]:
    """The locally committed ``steps`` local retention deletes, oldest first: all but the newest
    ``keep_last``, never one in ``protect`` (drain pending), never the newest."""
    ordered = sorted(set(steps))
    newest = ordered[-1:]
    return [d.step for d in retention.decide(ordered, keep_last, None)
            if not d.keep and d.step not in protect and d.step not in newest]


def lost_pieces(files: Sequence[str], held: Iterable[Collection[str]]) -> list[str]:
    """The payload file names of ``files`` that no holder in ``held`` (one collection of file
    names with a verified copy per node, or per rank) has, in ``files`` order."""
    have: set[str] = set()
    for names in held:
        have.update(names)
    return [name for name in files if name not in have]


def unrestorable(files: Sequence[str] | None, held: Iterable[Collection[str]], persisted: bool) -> str | None:
    """The restorability rule: why a step cannot be restored, or None when it can. A step can
    be when it is persisted (the persistent copy is the fallback of every piece) or when every
    file its manifest names (``files``; None: no manifest found) has a verified copy in some
    holder of ``held``."""
    if persisted:
        return None
    if files is None:
        return "no manifest on any node"
    lost = lost_pieces(files, held)
    if lost:
        return f"no verified copy of {', '.join(lost)} on any node and the step is not persisted"
    return None


def local_save_id(m: Manifest) -> str:
    """The save id of the local step ``m`` came from (its own for a local manifest; a drained
    copy, or a step written back from it by a restore, names it in ``extra["tiers"]``)."""
    tiers = (m.extra or {}).get("tiers")
    if isinstance(tiers, dict) and isinstance(tiers.get("local_save_id"), str):
        return str(tiers["local_save_id"])
    return m.save_id


def file_name(path: str) -> str:
    """A payload file's name (files are found by name across tiers and save ids)."""
    return path.rsplit("/", 1)[-1]


def writer_rank(name: str) -> int | None:
    """The rank that wrote payload file ``name`` (``r<rank>-...bin``), or None."""
    return int(name[1:6]) if layout.is_payload_name(name) else None


@dataclass(frozen=True, slots=True)
class StepFile:
    """One file of a step that a node holds: a payload file or (format v2) a piece index file."""

    path: str
    """Relative to the step folder (``<save id>/r00001-0.bin``)."""
    size: int
    rank: int | None
    """The rank that wrote it."""
    file: int | None = None
    """Its position in ``Manifest.files`` (payloads)."""
    index: int | None = None
    """Its position in ``Manifest.indexes`` (v2 index files)."""

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def step_files(m: Manifest) -> list[StepFile]:
    """Every file of step ``m`` -- payloads and v2 index files -- with the rank that wrote it,
    from the manifest's own lists (v2: each ``indexes`` row names its rank's slice of
    ``files``; v1: the payload name). What replicas, drains and restores move."""
    writer: dict[int, int] = {}
    out: list[StepFile] = []
    tails: dict[int, int] = {}  # payload file -> the index at its tail (IndexRef.tail): moved with it
    for j, ix in enumerate(m.indexes):
        writer.update((i, ix.rank) for i in range(ix.first_file, ix.first_file + ix.num_files))
        if ix.holder is not None:
            tails[ix.holder] = j
        else:
            out.append(StepFile(ix.path, ix.size, ix.rank, index=j))
    files = [StepFile(f.path, f.size, writer.get(i, writer_rank(file_name(f.path))) if m.indexes else writer_rank(file_name(f.path)), file=i,
                      index=tails.get(i)) for i, f in enumerate(m.files)]
    return files + out


def verify_files(storage: Storage, folder: str, m: Manifest, files: list[StepFile]) -> None:
    """Check ``files`` of ``m`` as held under ``folder`` on ``storage``: index files (size,
    checksum, contents: they are loaded into ``m``, engine/index_io.py), then every chunk of
    the payload files (engine/verify.py). The index files of the payloads' writers must be
    among ``files`` or already loaded. Raises :class:`CorruptCheckpointError`."""
    load_indexes(storage, folder, m, [f.index for f in files if f.index is not None])
    payloads = {f.file for f in files if f.file is not None}
    if payloads:
        verify_chunks(storage, folder, m, files=payloads)


@dataclass(frozen=True, slots=True)
class Copy:
    """One copy of one payload file in a node's local step folder."""

    name: str
    rank: int | None
    copy: str
    """``own`` (the node's ranks wrote it) or ``replica`` (under ``replicas/``)."""
    status: str
    """``ok``, ``corrupt`` (size or a checksum wrong) or ``missing`` (the node holds its rank's
    other files, or other replicas of it, but not this one)."""
    reason: str = ""
    bytes: int = 0


def check_copies(storage: Storage, final: str, m: Manifest,
                 progress: Callable[[int], None] | None = None) -> list[Copy]:
    """Every copy of the files of step ``m`` (:func:`step_files`: payloads and v2 index files) in
    the node folder ``storage``, step folder ``final``, own and under ``replicas/``: size, then
    :func:`verify_files` (an index file's checksum and contents; every chunk of a payload, one
    file at a time). Each copy set is checked against its own fresh manifest, so a good own copy
    never vouches for a bad replica. A v2 payload is checked with its writer's index file from
    whichever copy here is good; with none it is ``corrupt`` (cannot be checked on this node).
    A rank's file counts as ``missing`` where the node holds some of that rank's files in the
    same place (own or replica) but not this one."""
    files = sorted(step_files(m), key=lambda f: f.index is None)  # index files first
    index_of = {f.rank: f.index for f in files if f.index is not None}
    good_index: dict[int, str] = {}  # index position -> a folder holding a good copy
    out: list[Copy] = []
    present: dict[str, set[int | None]] = {"own": set(), "replica": set()}
    absent: list[tuple[str, StepFile]] = []
    for kind, folder in (("own", final), ("replica", join(final, REPLICA_DIR))):
        mk = read_manifest(storage, final, pieces=False)
        for f in files:
            size = storage.size(join(folder, f.path))
            if size is None:
                absent.append((kind, f))
                continue
            present[kind].add(f.rank)
            if size != f.size:
                out.append(Copy(f.name, f.rank, kind, "corrupt", f"{size} bytes, the manifest says {f.size}", size))
                if progress is not None:
                    progress(f.size)
                continue
            j = index_of.get(f.rank) if f.file is not None and mk.version >= 2 else None
            if j is not None and j != f.index and j not in mk.loaded:  # (a file holding its own index: checked with it)
                if j not in good_index:
                    out.append(Copy(f.name, f.rank, kind, "corrupt",
                                    f"cannot be checked: no good copy of rank {f.rank}'s index file here", size))
                    if progress is not None:
                        progress(f.size)
                    continue
                load_indexes(storage, good_index[j], mk, [j])
            try:
                verify_files(storage, folder, mk, [f])
            except (CheckpointError, OSError) as e:
                out.append(Copy(f.name, f.rank, kind, "corrupt", str(e), size))
                continue
            finally:
                if progress is not None:
                    progress(f.size)
            if f.index is not None:
                good_index.setdefault(f.index, folder)
            out.append(Copy(f.name, f.rank, kind, "ok", "", size))
    for kind, f in absent:
        if f.rank is not None and f.rank in present[kind]:
            where = "replicas/" if kind == "replica" else "the step folder"
            out.append(Copy(f.name, f.rank, kind, "missing", f"not in {where}, though other files of rank {f.rank} are"))
            if progress is not None:
                progress(f.size)
    return sorted(out, key=lambda c: (c.name, c.copy))


def node_folders(template: str, nodes: Sequence[int] | None = None) -> list[tuple[int | None, str]]:
    """(node index, folder) of every node folder ``template`` names, by node: ``{node}`` replaced
    by each of ``nodes``, or, without ``nodes``, matched against the folders that exist (the
    index read back from the name; None when it is not a number). A template without
    ``{node}`` is one folder (node None)."""
    template = os.path.expanduser(template)  # as local_root does
    if "{node}" not in template:
        return [(None, template)]
    if nodes is not None:
        return [(n, local_root(template, n)) for n in nodes]
    pattern = re.compile("^" + re.escape(template).replace(re.escape("{node}"), "(.*)") + "$")
    found: list[tuple[int | None, str]] = []
    for folder in glob.glob(glob.escape(template).replace(glob.escape("{node}"), "*")):
        m = pattern.match(folder)
        text = m.group(1) if m else ""
        found.append((int(text) if text.isascii() and text.isdigit() else None, folder))
    return sorted(found, key=lambda nf: (nf[0] is None, nf[0] or 0, nf[1]))


WRITE_BACK_TMP_RE = re.compile(r"^(.+)\.wb-(\d{1,12})-([0-9a-f]{8,32})\.partial$")
"""A write-back's temporary file: ``<file>.wb-<unix start time>-<write-back id>.partial``."""

MAX_WRITE_BACK_DEPTH = 3
"""Folders under a step folder searched for them (``<save id>/``, ``replicas/<save id>/``)."""


def new_write_back_id() -> str:
    """A fresh write-back id (:func:`ckptlib.tiers.write_back.write_back`, every rank its own)."""
    return secrets.token_hex(6)


def write_back_tmp(path: str, write_back_id: str, started: float | None = None) -> str:
    """The temporary name a write-back of ``path`` writes and verifies before its rename."""
    return f"{path}.wb-{int(time.time() if started is None else started)}-{write_back_id}.partial"


def arena_debris(storage: Storage) -> list[Debris]:
    """A memory tier's snapshot files (``.ckptlib-arena/``, ckptlib/engine/mapped_arena.py) that
    dead processes left (kind ``arena``; removable: no live process holds their lock, the proof
    :func:`ckptlib.backends.posix.sweep_arenas` uses, checked again when each is removed). Called
    by a node leader's cleanup after a local commit and ``ckptlib prune --local``. Deletes
    nothing."""
    return [Debris(join(ARENA_DIR, name), "", "arena", None, True,
                   "snapshot file of a memory-tier process that is gone (nothing holds its lock)")
            for name, _ in storage.dead_arenas()]


def write_back_debris(storage: Storage, active_ids: Collection[str] | None, *, min_age: float = 0.0,
                      now: float | None = None) -> list[Debris]:
    """The temporary files of write-backs that crashed (SIGKILL between open and rename), in
    every step folder of this node's local folder, with a verdict (kind ``partial``).

    The rule: a temp file is provably not being written when its write-back id is not in
    ``active_ids``, the write-backs running in the calling process
    (:data:`ckptlib.tiers.write_back.ACTIVE_WRITE_BACKS`). The job's cleanup runs after a local
    commit: that save is collective and began after every rank of the job left the restore
    (whose write-back ends in a collective), and no other job writes into a node's local folder
    (the same assumption as for ``.tmp-`` folders). From outside any job (``active_ids`` None,
    ``ckptlib prune --local``) a file counts as crashed once it started ``min_age`` seconds ago
    (the start time is in its name). Deletes nothing; :func:`ckptlib.engine.retire.remove_debris`
    removes the removable ones."""
    now = time.time() if now is None else now
    out: list[Debris] = []
    try:
        entries = storage.listdir("")
    except FileNotFoundError:
        return []
    todo = [(e.name, 0) for e in entries if e.is_dir and layout.parse_step(e.name) is not None]
    while todo:
        folder, depth = todo.pop()
        try:
            children = storage.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in children:
            path = join(folder, e.name)
            if e.is_dir:
                if depth < MAX_WRITE_BACK_DEPTH:
                    todo.append((path, depth + 1))
                continue
            m = WRITE_BACK_TMP_RE.match(e.name)
            if m is None:
                continue
            wid, age = m.group(3), now - int(m.group(2))
            if active_ids is not None and wid in active_ids:
                out.append(Debris(path, wid, "partial", age, False, "a write-back in flight in this process"))
            elif active_ids is None and age < min_age:
                out.append(Debris(path, wid, "partial", age, False,
                                  f"write-back started {age:.0f}s ago: may still be running "
                                  f"(younger than {min_age:.0f}s)"))
            else:
                out.append(Debris(path, wid, "partial", age, True, "crashed restore write-back"))
    return sorted(out, key=lambda d: d.path)
