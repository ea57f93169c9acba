"""The local tier: every save commits in each node's local folder, replicas durable first.

Called by the manager's persist thread (one save at a time), every rank, in order, all in one
coordination session (``"tier save"``): the topology (the first time: one exchange) ->
:meth:`SaveSession.begin` against this node's local storage (the coordinator opens its node's
staging folder; the other nodes' leaders open theirs, ``stage_here``) ->
:func:`ckptlib.engine.save.write_state` (the one writer pipeline; format v2 also writes the
rank's piece index file, :meth:`SaveSession.write_index`) -> an exchange (did every rank
write?) and :func:`ckptlib.tiers.replicas.replicate` -> :meth:`SaveSession.finish`: the one
commit (every rank durable, replicas included; the coordinator's node commits the manifest,
the step's record; the outcome, with the manifest, is shared, and the coordinator leaves the
session last, so every live rank has read it before its process can exit; the other node
leaders then commit the same bytes in their folders). Every rank returns or raises the same
:class:`CommitError`; a rank of another node that loses the coordinator after reporting raises
:class:`CommitUnknownError` (the record is on a disk it cannot read). Every meeting waits on a
rank while it is alive; a dead or frozen one fails the others within the coordination timeout
(the replica bytes move over gloo, :meth:`Coordinator.transfer`). Then each node leader runs
:func:`after_local_commit` (debris and local retention).

A step folder on node n holds the manifest (naming every rank's files), the payload (and v2
index) files of n's ranks and, under ``replicas/``, copies of its source ranks' files. A node
leader that cannot commit its copy logs it; the step stays committed (its record is on the
coordinator's node) and a restore reads that node's files from their replicas or the
persistent tier.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptlib import crashpoints
from ckptlib.backends import Storage
from ckptlib.backends.posix import SPARE_DIR, PosixStorage, free_bytes
from ckptlib.coord.coordinator import Coordinator
from ckptlib.coord.session import Session
from ckptlib.engine import retire
from ckptlib.engine.mapped_arena import Arena
from ckptlib.engine.save import Placement, SaveOptions, SaveResult, SaveSession, persist
from ckptlib.errors import CommitError
from ckptlib.format import layout
from ckptlib.plan.flatten import FlatState, TensorItem
from ckptlib.tiers import replicas as replica_flow
from ckptlib.tiers.inventory import (
    arena_debris,
    local_steps,
    retired_by_local_retention,
    write_back_debris,
)
from ckptlib.tiers.node import Topology

log = logging.getLogger("ckptlib")


@dataclass(slots=True)
class LocalTier:
    """This rank's view of the local tier (made by the manager, training thread)."""

    storage: Storage
    node: int
    replicas: int = 1
    jump: int = 1
    keep_last: int = 2
    topology: Topology | None = field(default=None)
    room_checked: bool = False
    """The first save checked that every memory tier has room (:func:`check_room`)."""
    stats: replica_flow.ReplicaStats | None = None
    """What the last save's replica stream moved (this rank): bytes sent, received, rebuilt."""

    def __post_init__(self) -> None:
        if not self.storage.supports_atomic_rename:
            raise ValueError(
                f"local={self.storage.url!r}: the local tier must be a node-local POSIX folder "
                "(it commits by rename); put object stores in the persistent `url`"
            )
        if self.replicas < 0 or self.jump < 1:
            raise ValueError("replicas must be >= 0 and the replica jump >= 1")
        if self.keep_last < 1:
            raise ValueError("local_keep_last must be >= 1")

    def check_apart(self, persistent: Storage) -> None:
        """The manager, once, when made: refuse a local tier folder that is the persistent root,
        inside it, or holds it. Each tier's retention and clean-up run over its own folder, so an
        overlap would delete the other tier's steps (local retention keeping ``local_keep_last``
        steps of the persistent root's)."""
        if not (isinstance(persistent, PosixStorage) and isinstance(self.storage, PosixStorage)):
            return
        mine, theirs = Path(os.path.realpath(self.storage.root)), Path(os.path.realpath(persistent.root))
        if mine == theirs or theirs in mine.parents or mine in theirs.parents:
            where = "is" if mine == theirs else ("is inside" if theirs in mine.parents else "holds")
            raise ValueError(
                f"local={self.storage.url!r} {where} the persistent root {persistent.url!r}: each tier prunes its "
                "own folder, so they must not overlap; put the local tier in a folder of its own (node-local "
                "disk or /dev/shm)")

    def topo(self, s: Session, timeout: float) -> Topology:
        """The nodes of every rank (collective the first time: one exchange in ``s``)."""
        if self.topology is None or len(self.topology.nodes) != s.world:
            self.topology = Topology.discover(s, self.node, timeout)
            short = self.topology.short_of_replicas(self.replicas, self.jump)
            if short and s.rank == 0:
                log.warning("ckptlib: %s", short)
        return self.topology


def save_local(
    tier: LocalTier,
    final: str,
    flat: FlatState,
    *,
    step: int | None,
    metadata: Any,
    options: SaveOptions,
    coordinator: Coordinator,
    save_id: str,
    created: float,
    rounds: Iterable[list[TensorItem]] | None = None,
    metrics: dict[str, float] | None = None,
    arena: Arena | None = None,
) -> SaveResult:
    """Save ``flat`` as ``final`` on the local tier (module docstring): the one save flow
    (:func:`ckptlib.engine.save.persist`) on this node's local storage, placed across the nodes
    and with the replica stream after the writes. Every rank. ``metrics``: recorded in the
    manifest (``keep_best``). ``arena``: the memory tier's mapped arena ``flat`` lies in
    (ckptlib/engine/mapped_arena.py), adopted as this rank's payload file when it writes all."""
    coord, local = coordinator, tier.storage
    with coord.session("tier save", coord.deadline(options.timeout)) as s:
        topo = tier.topo(s, options.timeout)
        several = s.world > 1 and len(set(topo.nodes)) > 1
        # The format single-tier saves use (v2 for several ranks): replicas, drains and restores move
        # every file of the step, piece index files included (tiers/drain.py step_files).
        opts = dataclasses.replace(options, overwrite=True)
        dp = bool(tier.replicas) and several and rounds is None  # replicated pieces: rebuilt by the peers
        placement = Placement(stage_here=topo.is_leader(s.rank), copies=several,
                              record_elsewhere=topo.nodes[s.rank] != topo.nodes[0], own_replicated=dp)
        rebuild = replica_flow.Rebuild({it.name: it for it in flat.items if it.replicated}, opts,
                                       check=opts.check_replicas in ("auto", True)) if dp else None

        def replicate(save: SaveSession, error: BaseException | None) -> BaseException | None:
            mine = save.files
            if error is None:
                try:  # v2: the index file now, so that it is replicated with the payload
                    index = save.write_index()
                    if index is not None:
                        mine.append((str(index["path"]), int(index["size"])))
                except Exception as e:
                    error = e
            if error is None:
                crashpoints.point("local_write", s.rank)
            if tier.replicas and several:
                # Every rank learns whether all wrote, so no rank waits on a peer that never sends.
                if all(s.exchange(error is None, deadline=save.deadline)):
                    try:
                        tier.stats = replica_flow.replicate(
                            local, s, topo, work=layout.tmp_dir(final, save.save_id), mine=mine,
                            replicas=tier.replicas, jump=tier.jump, deadline=save.deadline,
                            own_replicated=save.replicated, rebuild=rebuild)
                    except Exception as e:
                        error = e
                elif error is None:
                    error = CommitError("another rank failed to write its part; no replicas sent")
            if s.is_coordinator and error is None:
                crashpoints.point("local_commit", s.rank)
            return error

        def room(save: SaveSession, planned: int) -> None:
            if not tier.room_checked:
                check_room(tier, s, topo, planned, 0 if arena is None else arena.nbytes)
                tier.room_checked = True

        return persist(local, final, flat, step=step, metadata=metadata, options=opts, session=s, save_id=save_id,
                       created=created, rounds=rounds, metrics=metrics, placement=placement, before_write=room,
                       after_write=replicate, arena=arena)


def check_room(tier: LocalTier, s: Session, topo: Topology, planned: int, held: int = 0) -> None:
    """Every rank (collective: one consult), in the first tier save, once the plan is known
    (``planned``: the bytes this rank writes; ``held``: the bytes of its mapped arena, already
    on the memory root and counted as the step in flight): every node whose local root is a
    memory file system (tmpfs) must have room for ``local_keep_last + 1`` copies of what it
    holds per step (its ranks' files and the replicas it keeps for its peers); what the root
    already holds for the tier counts as room (:func:`reusable_bytes`), and the leader first
    removes the mapped snapshot files of dead processes (a killed run's: nobody holds their
    lock), which would otherwise stay until the first local commit. Raises
    :class:`CommitError` on every rank, saying what is missing where, before anything is written."""
    leader = topo.is_leader(s.rank) and tier.storage.memory
    if leader:
        tier.storage.dead_arenas(remove=True)
    mine = [planned, free_bytes(tier.storage.url) + reusable_bytes(tier) if leader else None, tier.storage.url, held]
    copies = tier.keep_last + 1

    def decide(reports: list[Any]) -> list[Any]:
        need: dict[int, int] = {}
        held_on: dict[int, int] = {}
        for r, (nbytes, _free, _url, arena) in enumerate(reports):
            need[topo.nodes[r]] = need.get(topo.nodes[r], 0) + int(nbytes)
            held_on[topo.nodes[r]] = held_on.get(topo.nodes[r], 0) + int(arena)
        for src, dst in topo.pairs(tier.replicas, tier.jump):
            need[topo.nodes[dst]] += int(reports[src][0])
        short = []
        for r, (_n, free, url, _h) in enumerate(reports):
            node = topo.nodes[r]
            if free is not None:
                free += held_on[node]
            if free is not None and need[node] * copies > free:
                short.append(f"node {node}'s memory tier {url} has {_size(free)} free; local_keep_last + 1 = {copies} "
                             f"copies of what it holds per step ({_size(need[node])}: its ranks' files and the "
                             f"replicas it keeps) need {_size(need[node] * copies)}: {_size(need[node] * copies - free)} "
                             "missing")
        why = None if not short else ("; ".join(short) + ". Lower local_keep_last or replicas, or give the file "
                                      "system more room (a larger /dev/shm), or put local= on a disk")
        return [why] * len(reports)

    why = s.consult(mine, decide)
    if why:
        raise CommitError(f"not enough room for the local tier: {why}")


def reusable_bytes(tier: LocalTier) -> int:
    """A node leader, in :func:`check_room`: bytes its local root already holds that are among
    the ``local_keep_last + 1`` copies the check asks room for, so count as room: the newest
    ``keep_last`` locally committed steps (a relaunch, or a restore's write-back, finds them
    there; retention retires them as the run saves) and the spares (taken by the next save's
    files, else freed at the next deletion)."""
    storage = tier.storage
    newest = sorted(local_steps(storage))[-tier.keep_last:]
    folders = [layout.step_dir(step) for step in newest] + [SPARE_DIR]
    return sum(retire.tree_bytes(storage, folder) or 0 for folder in folders)


def _size(n: float) -> str:
    """Bytes for :func:`check_room`'s message: GiB from 1 GiB up, else MiB."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def after_local_commit(tier: LocalTier, active_ids: Collection[str], protect: Collection[int], rank: int = 0,
                       ) -> list[int]:
    """A node leader, after a local commit (persist thread): remove debris of crashed local
    saves and apply local retention: the newest ``keep_last`` locally committed steps stay, so
    does every step in ``protect`` (drain pending). Failures are logged, never raised.
    Debris includes the temporary files of crashed restore write-backs
    (:func:`ckptlib.tiers.inventory.write_back_debris`; none of this process's in flight) and a
    memory tier's snapshot files of dead processes (:func:`ckptlib.tiers.inventory.arena_debris`)."""
    from ckptlib.tiers.write_back import ACTIVE_WRITE_BACKS  # write_back imports this module

    deleted: list[int] = []
    try:
        retire.clean_debris(tier.storage, active_ids)
        retire.remove_debris(tier.storage, write_back_debris(tier.storage, set(ACTIVE_WRITE_BACKS)))
        retire.remove_debris(tier.storage, arena_debris(tier.storage))  # dead processes' snapshots
        _retain(tier, protect, rank, deleted)
    except Exception as e:
        log.warning("ckptlib: local retention/cleanup failed (will retry after the next save): %s", e)
    return deleted


def retain_after_drains(tier: LocalTier, protect: Collection[int], rank: int = 0) -> list[int]:
    """A node leader, at the manager's ``close`` once its drains ended (no save in flight):
    local retention again, without the debris cleanup. Steps kept only because their drain was
    pending are retired now instead of at a next save that never comes: a memory tier would
    keep a drain backlog in the node's RAM after the job. Failures are logged, never raised."""
    deleted: list[int] = []
    try:
        _retain(tier, protect, rank, deleted)
    except Exception as e:
        log.warning("ckptlib: local retention after the drains failed (the next job's first save retries): %s", e)
    return deleted


def _retain(tier: LocalTier, protect: Collection[int], rank: int, deleted: list[int]) -> None:
    for step in retired_by_local_retention(local_steps(tier.storage), tier.keep_last, protect):
        crashpoints.point("local_retention", rank)
        retire.delete_step(tier.storage, layout.step_dir(step),
                           recycled=lambda: crashpoints.point("local_retention", rank))  # mid-deletion
        deleted.append(step)
