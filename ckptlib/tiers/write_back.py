"""The write-back after a tier restore: each node's folder made to hold again what the save left
there, from the copies the restore fetched, a peer's verified copy, or the persistent tier.

:func:`write_back` is called by :func:`ckptlib.tiers.restore.restore` on every rank (collective,
the restore's session and thread) once the resume loop returned. Files are written under a
temporary name carrying the write-back's id and start time; a crash leaves them for the next
local commit's cleanup (:func:`ckptlib.tiers.inventory.write_back_debris`, which spares the ids
in :data:`ACTIVE_WRITE_BACKS`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ckptlib import crashpoints
from ckptlib.backends import Storage, join
from ckptlib.backends.base import ReadHandle
from ckptlib.coord.session import Session
from ckptlib.engine.index_io import load_indexes
from ckptlib.errors import CheckpointError, CommitError
from ckptlib.format import layout
from ckptlib.format.decode import decode
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.format.schema import Manifest
from ckptlib.tiers.drain import COPY_PIECE
from ckptlib.tiers.inventory import (
    StepFile,
    new_write_back_id,
    step_files,
    verify_files,
    write_back_tmp,
)
from ckptlib.tiers.local import LocalTier
from ckptlib.tiers.node import Topology
from ckptlib.tiers.replicas import REPLICA_DIR, round_timeout, run_round
from ckptlib.tiers.restore_plan import answers, plan_files
from ckptlib.tiers.sources import SourceView, all_files, node_view

log = logging.getLogger("ckptlib")


def duties(m: Manifest, final: str, topo: Topology, rank: int, replicas: int, jump: int,
           ) -> dict[str, tuple[str, StepFile]]:
    """The files of step ``m`` that ``rank`` keeps in its node's folder ``final`` after a save:
    its own (payloads and index file) at their paths, and those of the ranks it holds replicas
    for (:meth:`Topology.pairs`) under ``replicas/``. name -> (path on the local storage, file)."""
    sources = {src for src, dst in topo.pairs(replicas, jump) if dst == rank}
    out: dict[str, tuple[str, StepFile]] = {}
    for f in step_files(m):
        if f.rank == rank:
            out[f.name] = (join(final, f.path), f)
        elif f.rank in sources:
            out[f.name] = (join(final, REPLICA_DIR, f.path), f)
    return out


def _put_verified(local: Storage, final: str, mdata: bytes, m: Manifest, path: str, f: StepFile,
                  src: ReadHandle, write_back_id: str, rank: int = 0) -> None:
    """Write ``src`` to ``path`` on ``local`` atomically: a temporary name
    (:func:`write_back_tmp`, naming ``write_back_id``: what a crash leaves is found and removed by
    :func:`ckptlib.tiers.inventory.write_back_debris`), fsynced, checked (:func:`verify_files`:
    size and checksums), then renamed over any bad copy; the folder synced."""
    tmp = write_back_tmp(path, write_back_id)
    w = local.open_write(tmp)
    try:
        start = 0
        buf = memoryview(bytearray(min(COPY_PIECE, src.size)))  # reused for every piece
        while start < src.size:
            n = min(COPY_PIECE, src.size - start)
            src.read_into(start, buf[:n])
            w.write(buf[:n])
            if not start:
                crashpoints.point("write_back", rank)  # a temporary file half-written
            start += n
        w.close()  # fsync
    except BaseException:
        w.abort()
        raise
    try:
        # An index file is checked into a fresh decode: ``m`` may hold its pieces already.
        target = decode(mdata, f"{local.url.rstrip('/')}/{final}") if f.index is not None else m
        verify_files(node_view(local, final, mdata, {f.name: tmp}), final, target, [f])
        if local.size(path) is not None:  # a copy that failed its checks
            local.delete(path)
        local.rename(tmp, path)
    except BaseException:
        local.delete(tmp)
        raise
    local.sync_dir(path.rsplit("/", 1)[0])


ACTIVE_WRITE_BACKS: set[str] = set()
"""Ids of the write-backs running in this process (:func:`write_back` adds and removes its own;
the node leader's post-commit cleanup, :func:`ckptlib.tiers.local.after_local_commit`, leaves
their temporary files alone)."""


def write_back(tier: LocalTier, persistent: Storage, s: Session, topo: Topology, last: dict[str, Any], *,
               timeout: float) -> list[str]:
    """Every rank (collective), right after a restore that every rank finished: make this
    node's folder hold again what the save left there (:func:`duties`), from the copies the
    restore fetched (peer replicas), else from a peer's verified copy, else from the persistent
    tier; each file written with :func:`_put_verified`. Then each node leader whose folder had
    no manifest of the step writes it (atomically) if every rank of its node got all its files,
    so ``local_steps`` (``ls --local``, ``StepInfo.tiers``) counts the node again. Only when the
    world size is the step's (otherwise the next save lays the local tier out anew). Runs inside
    the restore's liveness session: the ranks meet twice, :meth:`Coordinator.consult` (the
    files each lacks; each its plan) then :meth:`Coordinator.exchange` (whether each got them
    all), so a slow-but-alive rank is waited for up
    to ``timeout`` while a dead or frozen one makes the others log a warning and return within
    about the coordination timeout; the peer transfer waits :func:`_transfer_timeout`. A failure
    is logged, never raised. ``last``: what the restore's attempt kept.
    Returns the paths this rank wrote. While it runs, its id is in :data:`ACTIVE_WRITE_BACKS`."""
    wid = new_write_back_id()
    ACTIVE_WRITE_BACKS.add(wid)
    try:
        return _write_back(tier, persistent, s, topo, last, timeout=timeout, wid=wid)
    finally:
        ACTIVE_WRITE_BACKS.discard(wid)


def _write_back(tier: LocalTier, persistent: Storage, s: Session, topo: Topology, last: dict[str, Any], *,
                timeout: float, wid: str) -> list[str]:
    deadline = s.now() + timeout

    def left() -> float:
        return s.left(deadline)

    local, final, mdata = tier.storage, str(last["folder"]), last["manifest"]
    have: dict[str, str] = last["have"]
    fetched: dict[str, bytes] = dict(last["fetched"])
    pers_id: str | None = last["persistent"]
    where = f"{local.url.rstrip('/')}/{final}"
    todo: dict[str, tuple[str, StepFile]] = {}
    m: Manifest | None = None
    ok = True
    try:
        m = decode(mdata, where)
        if m.world_size == s.world and (last["node_had"] or local.size(join(final, MANIFEST_NAME)) is None):
            todo = {n: d for n, d in duties(m, final, topo, s.rank, tier.replicas, tier.jump).items()
                    if n not in have}
    except (CheckpointError, OSError) as e:
        ok = False
        log.warning("ckptlib: no write-back of %s: %s", where, e)
    written: list[str] = []
    apart: CommitError | None = None  # a meeting failed, alike on every live rank: none follows
    try:
        # Peers send what neither the restore fetched nor this node holds (the coordinator plans
        # from the attempt's reports, as in its round 2).
        lacking = sorted(n for n in todo if n not in fetched)
        try:
            plan = s.consult(lacking, lambda needs: answers(plan_files(last["reports"], needs, topo.nodes,
                                                                         True, all_files(mdata, where))),
                             deadline=deadline)
        except CommitError as e:
            apart = e
            raise
        fetched.update(run_round(s, plan, local, have, mdata, round_timeout(s, plan, deadline)))
        if m is not None and todo:
            view = SourceView(final, manifest=mdata, local=local, local_paths=have, fetched=fetched,
                              persistent=persistent if pers_id is not None else None, persistent_prefix=pers_id or "")
            index_of = {g.rank: g.index for g in step_files(m) if g.index is not None}
            with local.deadline(left()):
                marker = join(final, layout.MARKER)  # first: what a crash leaves here is provably ours
                if local.size(marker) is None:
                    local.put_atomic(marker, json.dumps({"save_id": m.save_id, "created": time.time()}).encode())
                for name, (path, f) in sorted(todo.items(), key=lambda kv: kv[1][1].index is None):
                    if name not in fetched and pers_id is None:
                        ok = False
                        continue
                    try:
                        load_indexes(view, final, m, [index_of[f.rank]] if f.rank in index_of else [])
                        with view.open_read(join(final, name)) as h:
                            _put_verified(local, final, mdata, m, path, f, h, wid, s.rank)
                        written.append(path)
                    except (CheckpointError, OSError) as e:
                        ok = False
                        log.warning("ckptlib: write-back of %s to %s failed: %s", name, where, e)
    except Exception as e:
        ok = False
        log.warning("ckptlib: write-back to %s failed: %s", where, e)
    oks: list[Any] = []
    if apart is None:
        try:  # every rank reaches the end together (a dead or frozen one fails the others in time)
            oks = s.exchange(ok, deadline=deadline) if s.world > 1 else [ok]
        except CommitError as e:
            log.warning("ckptlib: write-back to %s: the ranks did not finish together: %s", where, e)
    try:
        node_ok = bool(oks) and all(o for r, o in enumerate(oks) if topo.nodes[r] == topo.nodes[s.rank])
        if (topo.is_leader(s.rank) and node_ok and m is not None and m.world_size == s.world
                and not last["node_had"] and local.size(join(final, MANIFEST_NAME)) is None):
            with local.deadline(left()):
                local.put_atomic(join(final, MANIFEST_NAME), mdata)
            written.append(join(final, MANIFEST_NAME))
    except Exception as e:
        log.warning("ckptlib: write-back of the manifest to %s failed: %s", where, e)
    if written:
        log.info("ckptlib: wrote back %d file(s) of step %s into %s", len(written), last["step"], local.url)
    return written
