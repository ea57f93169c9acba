"""Find checkpoints on storage and judge each one: the resume planner's I/O half.

Called by the manager (``steps``, ``latest_step``, ``restore``, retention), the commit (to judge
an existing folder) and the CLI. A step is ``committed`` only if its manifest validates, names
its folder's step, and every payload file has exactly the recorded size; ``deep=True`` also
checks every chunk. The pure choice of a step lives in :mod:`ckptlib.plan.select`.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ckptlib.backends import Entry, Storage, join
from ckptlib.backends.retry import deadline_scope
from ckptlib.coord.coordinator import Coordinator
from ckptlib.engine.gc_pause import paused_gc
from ckptlib.engine.pool import run_all
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    TargetNotEmptyError,
)
from ckptlib.format import fence, layout
from ckptlib.format.decode import decode
from ckptlib.format.schema import MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, IndexRef, Manifest

log = logging.getLogger("ckptlib")


class UnreadableStepError(StorageError):
    """A manifest this user may not read (:func:`read_manifest`): a :class:`StorageError`, so
    every caller stops on it; ``scan(unreadable=True)`` (``ckptlib ls``) lists the step instead."""


@dataclass(slots=True)
class StepInfo:
    """One step found under a manager root (see ``CheckpointManager.steps``)."""

    step: int
    status: str
    """``committed``, ``incomplete`` or ``corrupt`` (``unreadable``: only from ``scan(unreadable=True)``)."""
    bytes: int = 0
    """Payload bytes (committed steps), or 0."""
    created: float | None = None
    """Unix time the save started, from the manifest."""
    reason: str = ""
    """Why the step is not usable (empty when committed)."""
    path: str = ""
    """Folder name under the root."""
    save_id: str = ""
    world_size: int = 0
    num_tensors: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    """Metrics passed to ``save(..., metrics=)`` (empty when none or not readable)."""
    manifest: Manifest | None = field(default=None, repr=False, compare=False)
    tiers: dict[str, str | None] | None = None
    """With a local tier (ckptlib/tiers): ``{"local": status or None, "persistent": status or
    None}``; a persistent status may also be ``pending`` or ``failed`` (its drain)."""


def read_manifest(storage: Storage, folder: str, *, pieces: bool = True) -> Manifest:
    """Read and validate ``folder/manifest.json`` (one request on object stores: a ranged GET);
    over ``MAX_MANIFEST_BYTES`` it is refused by the size of the open file, or of the GET's
    answer, before a byte of it is read.
    Format v2: ``pieces=True`` also loads every piece index file (engine/index_io.py);
    ``pieces=False`` leaves that to the reader, which loads only the ones it needs."""
    path = join(folder, MANIFEST_NAME)
    where = f"{storage.url.rstrip('/')}/{path}"
    try:
        data = _read_limited(storage, path, where)
        record = fence.parse_abort(data, where)  # a failed save's fence (engine/commit.py)
        if record is None:
            with paused_gc():
                m = decode(data, where)
            if pieces and not m.complete:
                from ckptlib.engine.index_io import resolve

                resolve(storage, folder, m)
            return m
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint at {where} (no manifest; never committed?)") from None
    except OSError as e:  # denied: not proof of anything about the step: the caller stops
        if e.errno not in (errno.EACCES, errno.EPERM):  # a backend's StorageError carries the errno too
            raise
        raise UnreadableStepError(f"cannot read {where}: permission denied ({e.strerror or e}); every step "
                                  "folder under a root must be readable by this user: fix its permissions (or "
                                  "move the folder out of the root)") from e
    except MemoryError:  # a resource error, not proof of corruption: typed, but not Corrupt
        raise CheckpointError(f"out of memory while reading the manifest {where}") from None
    raise CheckpointNotFoundError(f"no checkpoint at {where}: {record.describe()}")


def read_capped(storage: Storage, path: str) -> bytes:
    """The bytes of ``path``, a manifest or what stands in its place (an abort record, a claim),
    refused over ``MAX_MANIFEST_BYTES`` before they are read (``CorruptCheckpointError``): a huge
    or endless file there never fills memory. ``FileNotFoundError`` when absent. Callers (on
    their own thread): the commit's look at a manifest key it lost or gave up on
    (:mod:`ckptlib.engine.commit`) and a tier restore's persistent manifest."""
    return _read_limited(storage, path, f"{storage.url.rstrip('/')}/{path}")


def _read_limited(storage: Storage, path: str, where: str) -> bytes:
    """``path`` whole, in one request on object stores (:meth:`Storage.read_small`); over
    ``MAX_MANIFEST_BYTES`` a ``CorruptCheckpointError`` without a byte read."""
    data, size = storage.read_small(path, MAX_MANIFEST_BYTES)
    if data is None:
        raise CorruptCheckpointError(
            f"manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} byte limit; refused without reading it", where
        )
    return data


LISTED_FROM = 4
"""Files in a step from which :func:`check_files` takes their sizes from one listing of the
folder (:meth:`Storage.file_sizes`, where the backend has it: object stores) instead of a request
per file."""


def check_files(storage: Storage, folder: str, m: Manifest) -> None:
    """Every payload file (and v2 index file of its own) of ``folder`` is there with the size
    ``m`` records: :class:`CorruptCheckpointError` or, a step deleted since, the error of
    :func:`missing_file`. From :data:`LISTED_FROM` files on, an object store answers with one
    listing (a page per 1,000 files); a file it leaves out or sizes otherwise is asked again alone,
    so a listing that lags behind a write cannot make a good step look damaged. Caller's thread: the step's
    judge (:func:`check_step`), a load that was not judged just before, the integrations."""
    # payload files, then v2 index files of their own (an index at a payload file's tail is checked with it)
    entries: list[FileEntry | IndexRef] = [*m.files, *(ix for ix in m.indexes if not ix.tail)]
    listed = _listed_sizes(storage, folder, [f.path for f in entries])
    for f in entries:
        size = listed.get(f.path)
        if size != f.size:  # not listed (or no listing), or listed otherwise: this file alone
            size = storage.size(join(folder, f.path))
        where = f"{storage.url.rstrip('/')}/{join(folder, f.path)}"
        if size is None:
            if storage.exists(join(folder, f.path)):
                raise CorruptCheckpointError("payload is a symlink or not a regular file; refused", where)
            raise missing_file(storage, folder, m, f.path)
        if size != f.size:
            raise CorruptCheckpointError(f"payload file size is {size} bytes, manifest records {f.size}", where)


def _listed_sizes(storage: Storage, folder: str, paths: list[str]) -> dict[str, int]:
    """The sizes of ``paths`` (relative to ``folder``) that one listing per sub-folder holding
    :data:`LISTED_FROM` or more of them gives (a save's files lie in ``<save id>/``), by path;
    none where the backend has no listing with sizes (:meth:`Storage.file_sizes` None)."""
    by_dir: dict[str, list[str]] = {}
    for p in paths:
        by_dir.setdefault(p.rpartition("/")[0], []).append(p)
    out: dict[str, int] = {}
    for sub, members in by_dir.items():
        if len(members) < LISTED_FROM:
            continue
        sizes = storage.file_sizes(join(folder, sub) if sub else folder)
        if sizes is None:
            return {}
        prefix = f"{sub}/" if sub else ""
        out.update((p, sizes[p[len(prefix):]]) for p in members if p[len(prefix):] in sizes)
    return out


def check_files_together(coord: Coordinator, storage: Storage, folder: str, m: Manifest, *, label: str,
                         timeout: float) -> None:
    """:func:`check_files` for a load that every rank of ``coord`` runs together, with no judge
    of its own: a plain Megatron ``LoadStrategy`` and DeepSpeed's ``load_checkpoint``. Every rank,
    in the same order, on the caller's thread; one session (``label``, ``timeout`` seconds).

    Each rank reports which step it opened (``folder`` and ``m.save_id``); the coordinator alone
    checks the sizes and shares one verdict, so every rank raises the same error (a
    :class:`CorruptCheckpointError` naming the file, a :class:`CheckpointNotFoundError` when the
    step went away, a :class:`CheckpointError` when the ranks opened different steps or the
    check failed otherwise), or none, before any rank reads. A load of N ranks then asks N sizes,
    not N². Each rank's reader still checks the size of every file it opens."""
    if coord.world_size <= 1:
        check_files(storage, folder, m)
        return
    own: BaseException | None = None
    with coord.session(label, coord.deadline(timeout)) as s:
        opened = s.report([folder, m.save_id])
        verdict: list[str] | None = None
        if opened is not None:
            odd = [r for r, o in enumerate(opened) if o != opened[0]]
            if odd:
                verdict = ["mismatch", f"ranks opened different checkpoints: rank 0 {opened[0][0]} "
                           f"(save {opened[0][1]}), rank {odd[0]} {opened[odd[0]][0]} (save {opened[odd[0]][1]})"]
            else:
                try:
                    check_files(storage, folder, m)
                except CorruptCheckpointError as e:
                    own, verdict = e, ["corrupt", e.detail, e.path]
                except CheckpointNotFoundError as e:
                    own, verdict = e, ["gone", str(e)]
                except Exception as e:  # every rank must get the verdict before anyone raises
                    own, verdict = e, ["error", f"{type(e).__name__}: {e}"]
        verdict = s.share(verdict, what="check the payload files' sizes")
    if own is not None:  # the coordinator: its own error, as check_files raised it
        raise own
    if verdict is None:
        return
    kind, text = verdict[0], verdict[1]
    if kind == "corrupt":
        raise CorruptCheckpointError(text, verdict[2])
    if kind == "gone":
        raise CheckpointNotFoundError(text)
    where = f"{storage.url.rstrip('/')}/{folder}".rstrip("/")
    raise CheckpointError(f"{where}: rank 0 could not check the payload files: {text}" if kind == "error" else
                          f"{where}: {text}; every rank must load the same one")


def missing_file(storage: Storage, folder: str, m: Manifest, path: str, what: str = "payload file"
                 ) -> CheckpointError:
    """The error for file ``path`` of ``folder`` that ``m`` (its manifest, read earlier) names and
    that is not there. The step was deleted since (pruned, retired) or replaced by another save
    of it (``overwrite``): :class:`CheckpointNotFoundError`, open it again. Else the step is
    damaged (the manifest that was read is still there): :class:`CorruptCheckpointError`. Called
    by :func:`check_files`, the reader (``engine/reader.py``) and the index loader
    (``engine/index_io.py``), so a load racing a prune or an overwrite says so wherever it meets
    the gap."""
    at = f"{storage.url.rstrip('/')}/{folder}".rstrip("/")
    lost = f"{path} is gone): open it again"
    try:
        now = read_manifest(storage, folder, pieces=False).save_id
    except CheckpointNotFoundError:
        return CheckpointNotFoundError(f"{at} was deleted while it was being read (pruned or retired since "
                                       f"it was opened; {lost}")
    except (CheckpointError, OSError):
        now = m.save_id  # unreadable now: the damage stands
    if now != m.save_id:
        return CheckpointNotFoundError(f"{at} was replaced by another save while it was being read "
                                       f"(saved again with overwrite since it was opened; {lost}")
    return CorruptCheckpointError(f"{what} is missing", f"{storage.url.rstrip('/')}/{join(folder, path)}")


def _check_indexes(storage: Storage, folder: str, m: Manifest, load: bool) -> None:
    """v2, after :func:`check_files` (the decode checked that every rank holding pieces has an
    index row): ``load``: read every index (checksums, validation), as a deep check needs every
    piece."""
    if m.version < 2 or not load:
        return
    from ckptlib.engine import index_io

    index_io.resolve(storage, folder, m)


def check_step(
    storage: Storage,
    folder: str,
    step: int | None = None,
    *,
    deep: bool = False,
    progress: Callable[[int], None] | None = None,
    manifest: Manifest | None = None,
    sizes: bool = True,
) -> StepInfo:
    """Judge one checkpoint folder; never raises for a bad checkpoint, only for storage errors.
    Format v2: reads no piece index file unless ``deep`` (their sizes are checked with the
    payload's; their checksums when a load or ``deep`` reads them), so ``info.manifest`` may
    lack pieces: a caller that walks every piece loads them (``index_io.resolve``).
    ``manifest``: the folder's manifest as the caller has just read it with
    :func:`read_manifest`, which then is not read again. ``sizes=False``: the payload files are
    not looked at (``committed`` then says only that the manifest validates and names the step),
    for a caller that picks a step by its manifest and checks the one it takes
    (``integrations/deepspeed/tags.py``)."""
    info = StepInfo(step=step if step is not None else -1, status="corrupt", path=folder)
    try:
        m = manifest if manifest is not None else read_manifest(storage, folder, pieces=False)
        if step is not None and m.step != step:
            raise CorruptCheckpointError(f"folder is step {step} but its manifest says step {m.step}", folder)
        info.save_id, info.created, info.world_size = m.save_id, m.created, m.world_size
        info.num_tensors, info.metrics = len(m.tensors), m.metrics
        if sizes or deep:
            check_files(storage, folder, m)
        _check_indexes(storage, folder, m, deep)
        if deep:
            from ckptlib.engine.verify import verify_chunks

            verify_chunks(storage, folder, m, progress=progress)
    except CheckpointNotFoundError as e:
        info.status, info.reason = "incomplete", str(e)
        return info
    except CorruptCheckpointError as e:
        info.status, info.reason = "corrupt", str(e)
        return info
    info.status, info.bytes, info.manifest = "committed", m.payload_bytes, m
    return info


def enclosing_checkpoint(storage: Storage) -> str | None:
    """The checkpoint a manager root lies in, or None: the root itself when it holds a manifest
    (a step folder of another run, or a folder ``ckptlib.save()`` wrote), else, on a local file
    system, the nearest folder above it named like a step (``step-N``) that holds one. Only
    folders named like a step are looked at, so a normal root costs one ``exists``. Callers:
    ``CheckpointManager`` before its first save (every rank), and the restore's listing."""
    if storage.exists(MANIFEST_NAME):
        return storage.url
    root = getattr(storage, "root", None)
    if not isinstance(root, str) or "://" in storage.url:
        return None
    folder = os.path.dirname(root)
    while folder != os.path.dirname(folder):
        if layout.parse_step(os.path.basename(folder)) is not None and os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
            return folder
        folder = os.path.dirname(folder)
    return None


ROOT_CHECK_S = 5.0
"""How long a tiered manager's first save checks its persistent root (:func:`refuse_run_inside_checkpoint`)."""


def refuse_run_inside_checkpoint(storage: Storage, patient: bool = True) -> None:
    """``CheckpointManager``'s first save, every rank: :class:`TargetNotEmptyError` when its root
    is, or lies in, a checkpoint (:func:`enclosing_checkpoint`), before anything is written.
    ``patient=False`` (a tiered manager's persistent root: its saves wait for no persistent
    tier): a storage that fails or does not answer within :data:`ROOT_CHECK_S` is logged and
    not waited for; the drain's saves meet it later."""
    if patient:
        found = enclosing_checkpoint(storage)
    else:
        try:
            with deadline_scope(storage, ROOT_CHECK_S):
                found = enclosing_checkpoint(storage)
        except OSError as e:  # a StorageError too: down or slow, not proof of anything
            log.info("ckptlib: could not check the persistent root %s before the first save: %s", storage.url, e)
            return
    if found:
        raise checkpoint_root_error(storage, found, TargetNotEmptyError)


def checkpoint_root_error(storage: Storage, found: str, cls: type[CheckpointError] = CheckpointNotFoundError
                          ) -> CheckpointError:
    """The error (``cls``: a restore's :class:`CheckpointNotFoundError`, a save's
    :class:`TargetNotEmptyError`) for a manager root that is, or lies in, the checkpoint
    ``found`` (:func:`enclosing_checkpoint`): what it is and what to do."""
    name = found.rstrip("/").rsplit("/", 1)[-1]
    if found == storage.url and (step := layout.parse_step(name)) is not None:
        run = found.rstrip("/")[: -len(name)].rstrip("/") or "/"
        return cls(f"{found} is step {step}'s folder of a CheckpointManager run (it holds {MANIFEST_NAME}), not a "
                   f"run root: give CheckpointManager the run's folder ({run}) and restore(state, step={step}) "
                   f"to go back to it, or load it alone with ckptlib.load({found!r}, into=state)")
    if found == storage.url:
        return cls(
            f"{storage.url} is a single checkpoint written by ckptlib.save() (it holds {MANIFEST_NAME}), not a "
            f"CheckpointManager run root: load it with ckptlib.load({storage.url!r}, into=state), and give "
            "CheckpointManager a folder of its own")
    return cls(
        f"{storage.url} lies inside the checkpoint {found} (it holds {MANIFEST_NAME}), not beside it: a run "
        "root inside a step folder would be deleted with that step by its run's retention; give "
        "CheckpointManager a folder of its own (e.g. a sibling of the run folder)")


def _root_entries(storage: Storage, checked: bool = True) -> list[Entry]:
    """The root's listing (:func:`scan`, :func:`step_judges`): ``CheckpointNotFoundError``
    when the root does not exist, ``StorageError`` when it cannot be listed. ``checked=False``
    (:meth:`Storage.listdir_unchecked`: one request on S3, whatever the steps; for callers that
    judge only the newest steps): a folder left empty is passed over when judged (:func:`_judge`).
    A full scan lists checked: the empty folders that a server keeps for every step deleted
    would each cost it a judgement."""
    try:
        return storage.listdir("") if checked else storage.listdir_unchecked("")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"checkpoint root {storage.url} does not exist") from None
    except OSError as e:
        raise StorageError(f"cannot list {storage.url}: {e}") from e


def newest_committed(storage: Storage) -> int | None:
    """The newest committed step under the root (quick check: manifest and sizes), or None;
    ``CheckpointManager.latest_step`` (caller's thread). Judged lazily (:func:`iter_steps`): a
    root of many steps costs a few requests, not a manifest read per step as :func:`scan` does.
    Errors as :func:`iter_steps`."""
    try:
        steps = iter_steps(storage)
    except CheckpointNotFoundError:
        return None
    return next((i.step for i in steps if i.status == "committed"), None)


_Plan = list[tuple[int, list["str | StepInfo"]]]


def _plan(entries: list[Entry]) -> _Plan:
    """The root's ``entries`` grouped by step, newest first: per step, the step folders still to
    judge (their names, in listing order), then the in-progress/crashed/fenced saves of a step
    without a folder of that name (judged already: incomplete, no I/O)."""
    groups: dict[int, list[str | StepInfo]] = {}
    folders = {e.name for e in entries if e.is_dir and layout.parse_step(e.name) is not None}
    for ent in entries:
        step = layout.parse_step(ent.name)
        if step is not None and ent.is_dir:
            groups.setdefault(step, []).append(ent.name)
    for ent in entries:
        m = layout.TMP_RE.match(ent.name)
        if m and m.group(2) == "tmp" and ent.is_dir:
            step = layout.parse_step(m.group(1))
            if step is not None and m.group(1) not in folders:
                groups.setdefault(step, []).append(
                    StepInfo(step, "incomplete", reason="save in progress, or crashed before its commit", path=ent.name)
                )
        a = fence.ABORT_RE.match(ent.name)
        if a and ent.is_dir and (step := layout.parse_step(a.group(1))) is not None and a.group(1) not in folders:
            why = f"save {a.group(2)} failed: a rank gave up on its coordinator and fenced it; never committed"
            groups.setdefault(step, []).append(StepInfo(step, "incomplete", reason=why, path=ent.name,
                                                        save_id=a.group(2)))
    return sorted(groups.items(), reverse=True, key=lambda g: g[0])


def _steps(plan: _Plan, judge: Callable[[str, int], StepInfo | None]) -> Iterator[StepInfo]:
    """The steps of ``plan`` newest first, a step's folders judged (``judge(name, step)``; None:
    an empty folder, passed over) only when the caller gets that far; within a step, committed
    entries first."""
    for step, group in plan:
        infos = [i for x in group if (i := judge(x, step) if isinstance(x, str) else x) is not None]
        yield from sorted(infos, key=lambda i: i.status == "committed", reverse=True)


def _judge(storage: Storage, name: str, step: int, deep: bool, unreadable: bool, unchecked: bool = False,
           sizes: bool = True) -> StepInfo | None:
    """One step folder; ``unchecked`` (listed by an unchecked listing): None when it has no
    manifest and nothing in it (an object store's folder entry left by a deleted step);
    ``sizes``: as :func:`check_step`'s."""
    try:
        info = check_step(storage, name, step, deep=deep, sizes=sizes)
    except UnreadableStepError as e:
        if not unreadable:
            raise
        return StepInfo(step, "unreadable", reason=str(e), path=name)
    if unchecked and info.status == "incomplete" and not storage.supports_atomic_rename and not storage.exists(name):
        return None
    return info


def iter_steps(storage: Storage, *, sizes: bool = True) -> Iterator[StepInfo]:
    """:func:`scan`'s steps in its order, but judged lazily (manifest and sizes), one step
    folder at a time as the caller iterates: a resume that takes the newest step judges one
    folder, not every one (``engine/resume.py``, ``newest_committed``; the caller's thread). The
    root is listed now (its errors as :func:`scan`); an unreadable manifest raises
    :class:`UnreadableStepError` when the iteration reaches that step. ``sizes=False``: manifests
    only (:func:`check_step`)."""
    return itertools.chain.from_iterable(judge() for _, judge in step_judges(storage, sizes=sizes))


def step_judges(storage: Storage, checked: bool = False, *, sizes: bool = True
                ) -> list[tuple[int, Callable[[], list[StepInfo]]]]:
    """The root's step numbers, newest first, each with a call that judges that step only
    (manifest and sizes, or the manifest alone with ``sizes=False``: :func:`check_step`; its :class:`StepInfo` entries in :func:`scan`'s order, committed first)
    when the caller makes it: a caller that needs some steps, not the newest ones first
    (``restore(step=N)``, a tier restore merging its local steps; the caller's thread) judges
    those alone. The root is listed now, unchecked (errors as :func:`scan`; one request on S3
    whatever the steps, not one per step folder): a step whose folder turns out empty (a deleted
    step whose folder entry the server kept) judges to ``[]``. ``checked``: listed as :func:`scan`
    lists (a request per step folder on S3, the empty ones left out), for a caller that may walk
    every step of a root where a server keeps a folder entry for every step deleted (retention:
    judging such an entry costs three requests, leaving it out one). An unreadable manifest raises
    :class:`UnreadableStepError` from that step's call."""
    def judged(step: int, group: list[str | StepInfo]) -> list[StepInfo]:
        return list(_steps([(step, group)], lambda name, n: _judge(storage, name, n, False, False, not checked, sizes)))

    return [(step, functools.partial(judged, step, group)) for step, group in _plan(_root_entries(storage, checked))]


SCAN_THREADS = 12
"""Step folders :func:`scan` judges at once (quick checks only) on an object store or another
remote file system: their requests are small and wait on the store's latency, so a few in
flight cut ``ckptlib ls`` there by about that factor; a bounded pool, gone when the scan
returns. A local file system (``supports_atomic_rename``) answers in microseconds: there the
steps are judged one at a time, so retention, which scans after every save, starts no threads."""


def _outcome(storage: Storage, name: str, step: int, unreadable: bool) -> StepInfo | Exception | None:
    """:func:`_judge` on a pool thread: its error returned, so :func:`scan` raises the first in
    step order, not the first to finish."""
    try:
        return _judge(storage, name, step, False, unreadable)
    except Exception as e:
        return e


def scan(storage: Storage, *, deep: bool = False, unreadable: bool = False) -> list[StepInfo]:
    """Every step under the root, newest first, with in-progress/crashed/fenced saves as incomplete.
    A step folder whose manifest this user may not read stops the scan (:class:`StorageError`:
    restore never skips what may be the newest good step); ``unreadable=True`` (``ckptlib ls``
    only) lists it instead, status ``unreadable``, the reason saying what to do. Called on the
    caller's thread (``ls``, ``verify``, retention, ``mgr.steps()``, the read view); the quick
    checks run on up to :data:`SCAN_THREADS` pool threads off a local file system
    (``engine/pool.py``), and an error
    from any step (a :class:`StorageError`, ...) is raised here, the oldest step's first, as a
    scan one step at a time would. ``deep`` judges one step at a time (each reads every chunk)."""
    plan = _plan(_root_entries(storage))
    todo = [(name, step) for step, group in reversed(plan) for name in group if isinstance(name, str)]
    if deep:
        judged = {name: _judge(storage, name, step, True, unreadable) for name, step in todo}
    else:
        tasks = [functools.partial(_outcome, storage, name, step, unreadable) for name, step in todo]
        threads = 1 if storage.supports_atomic_rename else SCAN_THREADS
        outcomes = run_all(tasks, threads=threads, name="ckptlib-scan")
        if errors := [o for o in outcomes if isinstance(o, Exception)]:
            raise errors[0]
        judged = {name: info for (name, _), info in zip(todo, outcomes, strict=True)}
    return list(_steps(plan, lambda name, step: judged[name]))
