"""Resume a DeepSpeed engine from the newest consistent tag, on ckptlib's one resume loop.

:func:`resume` (and :func:`newest_consistent`, its first half) run on the training thread of
every rank, in the same order, after :func:`.install`. They call
:func:`ckptlib.engine.resume.resume_newest`: the coordinator lists the steps (a candidate's
``extra`` is its DeepSpeed tag), the ranks meet with the coordinator's deadlines, each rank
checksums a byte-balanced share of the step's files (the attempt), and a damaged step is
skipped on every rank together. Only then does :func:`resume` call DeepSpeed's own
``engine.load_checkpoint`` for the agreed tag.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptlib.backends import Storage, open_storage
from ckptlib.engine.index_io import load_indexes
from ckptlib.engine.resume import Candidate, resume_newest, step_candidates
from ckptlib.engine.scan import StepInfo, read_manifest
from ckptlib.engine.verify import verify_chunks
from ckptlib.errors import CorruptCheckpointError
from ckptlib.format.schema import Manifest
from ckptlib.integrations.deepspeed.install import engine_of
from ckptlib.integrations.deepspeed.tags import tag_of

log = logging.getLogger("ckptlib")


@dataclass
class ResumeResult:
    """What :func:`resume` did. ``tag`` is None when there was nothing to resume from."""

    tag: str | None = None
    step: int | None = None
    load_path: str | None = None
    client_state: dict[str, Any] | None = None
    skipped: list[str] = field(default_factory=list)
    """One line per newer step that was not used, with the reason."""


def share(files: list[tuple[str, int]], world: int) -> list[list[int]]:
    """File indices per rank, balanced by bytes (largest first). Same answer on every rank."""
    out: list[list[int]] = [[] for _ in range(world)]
    heap = [(0, r) for r in range(world)]
    for i in sorted(range(len(files)), key=lambda i: (-files[i][1], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + files[i][1], r))
    return out


def share_indexes(m: Manifest, files: set[int], rank: int, world: int) -> list[int]:
    """Format v2: the piece index rows (positions in ``m.indexes``) that ``rank`` reads to
    verify its ``files``: the rows of the ranks that wrote them, and every ``world``-th row that
    names no payload file, so each row is read by one rank. Each rank reading every row made a
    resume at N ranks read N² index files."""
    return [i for i, ix in enumerate(m.indexes)
            if any(f in files for f in range(ix.first_file, ix.first_file + ix.num_files))
            or (ix.num_files == 0 and i % world == rank)]


def candidates(storage: Storage) -> Iterator[Candidate]:
    """Every step, newest first, each judged as the caller gets to it (``step_candidates``),
    ``extra`` = its tag; a committed step without a readable tag is ``corrupt``. Runs on the
    coordinator only."""

    def judge(i: StepInfo) -> tuple[str, str, Any]:
        try:
            tag = tag_of(i.manifest, f"{storage.url}/{i.path}") if i.manifest is not None else None
        except CorruptCheckpointError as e:
            return "corrupt", str(e), None
        if tag is None:
            return "corrupt", "not a DeepSpeed checkpoint (no tag in metadata)", None
        return i.status, i.reason, tag

    return step_candidates(storage, judge)


def newest_consistent(
    engine: Any,
    load_dir: str | os.PathLike[str] | None = None,
    *,
    verify: bool = True,
    timeout: float = 600.0,
) -> tuple[str | None, int | None, list[str]]:
    """``(tag, step, skipped)``: the newest step whose manifest, file sizes and (``verify``)
    every checksum are good, checked on all ranks together. Collective. ``tag`` is None when
    no step exists; raises ``CorruptCheckpointError`` when steps exist but none is usable, and
    a ckptlib error on every rank when a rank fails otherwise, dies or freezes (within the
    coordinator's deadline)."""
    ce = engine_of(engine)
    if load_dir is None and ce.url is None:
        raise ValueError("pass load_dir (or install with a url)")
    root = ce.root_for(os.fspath(load_dir) if load_dir is not None else "")
    storage = open_storage(root, ce.storage_options)
    coord = ce.coordinator

    def verify_share(c: Candidate) -> None:
        if verify:  # the coordinator judged the step (every file's size): each rank reads its share only
            m = read_manifest(storage, c.folder, pieces=False)
            mine = set(share([(f.path, f.size) for f in m.files], coord.world_size)[coord.rank])
            load_indexes(storage, c.folder, m, share_indexes(m, mine, coord.rank, coord.world_size))
            verify_chunks(storage, c.folder, m, files=mine)

    got = resume_newest(
        coord, lambda: candidates(storage), verify_share, timeout=timeout, where=root
    )
    if got is None:
        return None, None, []
    return got.candidate.extra, got.candidate.step, got.skipped


def resume(
    engine: Any,
    load_dir: str | os.PathLike[str] | None = None,
    *,
    verify: bool = True,
    timeout: float = 600.0,
    **load_checkpoint_kwargs: Any,
) -> ResumeResult:
    """Load the newest consistent tag into ``engine`` (collective; every rank calls it).

    Ignores DeepSpeed's ``latest`` file: :func:`newest_consistent` picks the tag, then
    ``engine.load_checkpoint(load_dir, tag=..., **load_checkpoint_kwargs)`` loads it.
    ``verify=False`` skips the checksum pass (the load still verifies what it reads, but can no
    longer fall back). Returns a :class:`ResumeResult` (``tag`` None: nothing saved yet).
    """
    ce = engine_of(engine)
    tag, step, skipped = newest_consistent(engine, load_dir, verify=verify, timeout=timeout)
    result = ResumeResult(skipped=skipped)
    if tag is not None:
        ds_dir = os.fspath(load_dir) if load_dir is not None else ce.url
        load_path, client_state = engine.load_checkpoint(ds_dir, tag=tag, **load_checkpoint_kwargs)
        result = ResumeResult(tag, step, load_path, client_state, skipped)
        log.info("ckptlib: resumed DeepSpeed tag %s (step %d)", tag, step)
    ce.last_resume = result
    return result
