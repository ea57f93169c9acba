"""The local tier: every save commits in each node's local folder, replicas durable first.

Called by the manager's persist thread (one save at a time), every rank, in order:
:func:`save_local` = :meth:`SaveSession.begin` against this node's local storage (the
coordinator opens its node's staging folder) -> the other nodes' leaders open theirs with
:func:`ckptlib.engine.commit.begin` (same save id, so the same payload prefix) and every rank
learns whether they could -> :func:`ckptlib.engine.save.write_state` (the one writer pipeline;
format v2 also writes the rank's piece index file, :meth:`SaveSession.write_index`) ->
:func:`ckptlib.tiers.replicas.replicate` -> :meth:`SaveSession.finish` (the commit protocol:
every rank durable, the coordinator's node committed) -> the other node leaders commit the
same manifest bytes in their folders (:func:`ckptlib.engine.commit.publish`). Every rank
returns or raises the same :class:`CommitError`. All of it, topology included, runs in one
liveness session (:func:`ckptlib.coord.coordinator.liveness_session`): every meeting waits on a
rank while it is alive, a dead or frozen one fails the others within the coordination timeout
(the replica bytes move over gloo). Then each node leader runs
:func:`after_local_commit` (debris and local retention).

A step folder on node n holds the manifest (naming every rank's files), the payload (and v2
index) files of n's ranks and, under ``replicas/``, copies of its source ranks' files. A save
that fails after the coordinator's node committed leaves that node's folder visible: its bytes
and replicas were all durable (the commit protocol checked), so it is a usable step, only not
reported as saved.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from ckptlib import crashpoints
from ckptlib.backends import Storage, join
from ckptlib.coord.coordinator import Coordinator, liveness_session
from ckptlib.engine import commit, retire
from ckptlib.engine.save import SaveOptions, SaveResult, SaveSession, encode_metadata, write_state
from ckptlib.errors import CheckpointError, CommitError
from ckptlib.format import layout
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.plan.flatten import FlatState, TensorItem
from ckptlib.tiers import replicas as replica_flow
from ckptlib.tiers.inventory import local_steps, retired_by_local_retention, write_back_debris
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

    def topo(self, coord: Coordinator, timeout: float) -> Topology:
        """The nodes of every rank (collective the first time)."""
        if self.topology is None or len(self.topology.nodes) != coord.world_size:
            self.topology = Topology.discover(coord, self.node, timeout)
        return self.topology


def _errors(coord: Coordinator, error: BaseException | None, timeout: float) -> dict[int, str]:
    """Every rank (collective): each rank's failure (rank -> message), the same on every rank."""
    msg = None if error is None else f"{type(error).__name__}: {error}"
    if coord.world_size <= 1:
        return {0: msg} if msg else {}
    every = coord.agree(coord.gather(msg, timeout), timeout)
    return {r: m for r, m in enumerate(every) if m}


def _raise(storage: Storage, final: str, failures: dict[int, str]) -> None:
    detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
    raise CommitError(f"checkpoint {storage.url.rstrip('/')}/{final} was not committed on the local tier: {detail}",
                      failures)


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
) -> SaveResult:
    """Save ``flat`` as ``final`` on the local tier (module docstring). Every rank.
    ``metrics``: recorded in the manifest (``keep_best``)."""
    with liveness_session(coordinator, "tier save"):
        return _save_local(tier, final, flat, step=step, metadata=metadata, options=options, coordinator=coordinator,
                           save_id=save_id, created=created, rounds=rounds, metrics=metrics)


def _save_local(
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
) -> SaveResult:
    """:func:`save_local`, inside its liveness session."""
    coord, local = coordinator, tier.storage
    topo = tier.topo(coord, options.timeout)
    meta_tree = encode_metadata(metadata)
    # The format single-tier saves use (v2 for several ranks): replicas, drains and restores move
    # every file of the step, piece index files included (tiers/drain.py step_files).
    opts = SaveOptions(options.compression, options.chunk_bytes, options.num_files, options.timeout, overwrite=True,
                       format_version=options.format_version)
    session = SaveSession.begin(local, final, step=step, options=opts, coordinator=coord, save_id=save_id,
                                created=created)
    leader = topo.is_leader(coord.rank) and not coord.is_coordinator
    node_staging: commit.Staging | None = None
    try:
        error: BaseException | None = None
        if leader:
            try:
                with session.bounded():
                    local.makedirs("")
                    node_staging = commit.begin(local, final, session.save_id)
            except FileExistsError:
                error = CommitError(f"node {tier.node}'s local folder {local.url} already holds this save's "
                                    "staging folder: is it shared with another node? Put '{node}' in local= "
                                    "or use node-local disks")
            except (CheckpointError, OSError) as e:
                error = e
        failures = _errors(coord, error, session.left())
        if failures:
            session.abort()
            _raise(local, final, failures)
        error = write_state(session, flat, rounds)
        mine = session.files
        if error is None:
            try:  # v2: the index file now, so that it is replicated with the payload
                index = session.write_index()
                if index is not None:
                    mine.append((str(index["path"]), int(index["size"])))
            except Exception as e:
                error = e
        if error is None:
            crashpoints.point("local_write", coord.rank)
        if tier.replicas and len(set(topo.nodes)) > 1:
            # Every rank learns whether all wrote, so no rank waits on a peer that never sends.
            if not _errors(coord, error, session.left()):
                try:
                    replica_flow.replicate(local, coord, topo, work=layout.tmp_dir(final, session.save_id),
                                           mine=mine, replicas=tier.replicas, jump=tier.jump,
                                           timeout=session.left())
                except Exception as e:
                    error = e
            elif error is None:
                error = CommitError("another rank failed to write its part; no replicas sent")
        if coord.is_coordinator and error is None:
            crashpoints.point("local_commit", coord.rank)
        shapes = {it.name: it.global_shape for it in flat.items}
        result = session.finish(tree=flat.tree, per_rank=flat.per_rank, shapes=shapes, error=error,
                                metadata=meta_tree, metrics=metrics)
        # The coordinator's node is committed; the other nodes commit the same bytes.
        if coord.world_size > 1 and len(set(topo.nodes)) > 1:
            text: str | None = None
            if coord.is_coordinator:
                try:
                    text = local.read(join(final, MANIFEST_NAME)).decode("ascii")
                except (OSError, CheckpointError, UnicodeDecodeError) as e:
                    text = None
                    log.warning("ckptlib: cannot read back the local manifest of %s: %s", final, e)
            text = coord.agree(text, session.left())
            error = None if text is not None else CommitError("the coordinator's manifest could not be read back")
            if leader and node_staging is not None and text is not None:
                try:
                    crashpoints.point("local_commit", coord.rank)
                    commit.publish(local, node_staging, text.encode("ascii"), overwrite=True)
                    node_staging = None
                except (CheckpointError, OSError) as e:
                    error = e
            failures = _errors(coord, error, session.left())
            if failures:
                _raise(local, final, failures)
        return result
    finally:
        session.abort()  # a no-op after finish
        if node_staging is not None:
            commit.abort(local, node_staging)


def after_local_commit(tier: LocalTier, active_ids: Collection[str], protect: Collection[int], rank: int = 0,
                       ) -> list[int]:
    """A node leader, after a local commit (persist thread): remove debris of crashed local
    saves and apply local retention: the newest ``keep_last`` locally committed steps stay, so
    does every step in ``protect`` (drain pending). Failures are logged, never raised.
    Debris includes the temporary files of crashed restore write-backs
    (:func:`ckptlib.tiers.inventory.write_back_debris`; none of this process's in flight)."""
    from ckptlib.tiers.restore import ACTIVE_WRITE_BACKS  # restore imports this module

    deleted: list[int] = []
    try:
        retire.clean_debris(tier.storage, active_ids)
        retire.remove_debris(tier.storage, write_back_debris(tier.storage, set(ACTIVE_WRITE_BACKS)))
        for step in retired_by_local_retention(local_steps(tier.storage), tier.keep_last, protect):
            crashpoints.point("local_retention", rank)
            retire.delete_step(tier.storage, layout.step_dir(step))
            deleted.append(step)
    except Exception as e:
        log.warning("ckptlib: local retention/cleanup failed (will retry after the next save): %s", e)
    return deleted
