"""Peer copies of a step's files (payloads and format v2 piece index files) over ckptlib's own
process group.

:func:`transfer` moves whole files between ranks point to point (gloo ``isend``/``irecv`` on the
coordinator's dedicated group, every wait bounded). Two users, both collective and on the
thread driving the save or restore: :func:`replicate` (the local save, after this rank's
payload is durable and before the local commit) and the restore's fetch of files a rank lacks
(:mod:`ckptlib.tiers.restore`). Replica files live in the holder's local step folder under
``replicas/`` with the payload's own relative path (``replicas/<save id>/r00001-0.bin``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from ckptlib import crashpoints
from ckptlib.backends import Storage, join
from ckptlib.backends.base import WriteStream
from ckptlib.coord.coordinator import Coordinator
from ckptlib.errors import CheckpointError, CommitError, CommitTimeoutError
from ckptlib.tiers.node import Topology

REPLICA_DIR = "replicas"


TRANSFER_FLOOR = 8 << 20
"""Bytes per second a peer transfer (a save's replica round, a restore's round) is allowed at the
slowest (the sender reads the files from its local disk, then gloo moves them)."""


def transfer_timeout(coord: Coordinator, nbytes: int, deadline: float) -> float:
    """The wait of one round of peer transfers moving ``nbytes`` (all ranks together): gloo
    cannot read heartbeats, so the coordination timeout (``dead_after``) plus ``nbytes`` at
    :data:`TRANSFER_FLOOR`, never past ``deadline`` (``time.monotonic()``): a dead or frozen
    peer fails the round within about that time, not at the save's or restore's deadline."""
    base = float(getattr(coord, "dead_after", 30.0))
    return max(0.1, min(base + nbytes / TRANSFER_FLOOR, deadline - time.monotonic()))


def transfer(coord: Coordinator, sends: list[tuple[int, bytes]], recvs: list[tuple[int, int]],
             timeout: float) -> list[bytes]:
    """Send each ``(rank, data)`` and receive each ``(rank, size)``, in list order (a pair of
    ranks must list their messages in the same order). Returns the received bytes. Raises
    :class:`CommitTimeoutError` when a peer does not answer within ``timeout``."""
    sends = [(r, d) for r, d in sends if d]
    wanted = [(i, r, n) for i, (r, n) in enumerate(recvs) if n > 0]
    out: list[bytes] = [b""] * len(recvs)
    if not sends and not wanted:
        return out
    group = getattr(coord, "group", None)
    if group is None:
        raise CheckpointError("peer transfers need torch.distributed (no process group)")
    import torch
    import torch.distributed as dist

    works = []
    for r, data in sends:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works.append(dist.isend(t, dist.get_global_rank(group, r), group=group))
    bufs = []
    for i, r, n in wanted:
        t = torch.empty(n, dtype=torch.uint8)
        works.append(dist.irecv(t, dist.get_global_rank(group, r), group=group))
        bufs.append((i, t))
    try:
        for w in works:
            assert w is not None  # a rank of the group always gets a Work
            w.wait(timeout=timedelta(seconds=max(0.1, timeout)))
    except RuntimeError as e:
        raise CommitTimeoutError(f"peer transfer failed or timed out after {timeout:.0f}s: {e}") from e
    for i, t in bufs:
        out[i] = t.numpy().tobytes()
    return out


def replica_path(work: str, payload: str) -> str:
    """Where a replica of ``payload`` (relative to the step folder) goes in ``work``."""
    return join(work, REPLICA_DIR, payload)


PIECE = int(os.environ.get("CKPTLIB_REPLICA_PIECE", 64 << 20))
"""Bytes per message of a replica stream (memory held: one piece per peer and per source);
env ``CKPTLIB_REPLICA_PIECE`` (tests use small pieces to run many rounds)."""


def pieces(files: list[tuple[str, int]], piece: int = PIECE) -> list[tuple[str, int, int]]:
    """A rank's replica stream: ``(path, start, length)`` of every piece of every file, in order."""
    out = []
    for path, size in files:
        out += [(path, start, min(piece, size - start)) for start in range(0, size, piece)]
    return out


def replicate(storage: Storage, coord: Coordinator, topo: Topology, *, work: str, mine: list[tuple[str, int]],
              replicas: int, jump: int, timeout: float, piece: int = PIECE) -> int:
    """Every rank (collective): send this rank's files ``mine`` (payloads and v2 index file;
    paths under ``work``, sizes) to its peers and make the replicas of its sources durable
    under ``work``'s ``replicas/`` on ``storage`` (this node's local tier). Streamed in rounds
    of one piece per pair (every rank runs the same number of rounds, so no send waits on an
    unposted receive). Returns the bytes this rank received. Raises on any failure (the caller
    fails the save through the commit protocol)."""
    pairs = topo.pairs(replicas, jump)
    if not pairs:
        return 0
    deadline = time.monotonic() + timeout
    rel = [(p[len(work) + 1:] if p.startswith(work + "/") else p, n) for p, n in mine]
    listing = coord.agree(coord.gather(rel, timeout), timeout) if coord.world_size > 1 else [rel]
    streams = [pieces([(str(p), int(n)) for p, n in files], piece) for files in listing]
    me = coord.rank
    peers = [dst for src, dst in pairs if src == me]
    sources = [src for src, dst in pairs if dst == me]
    writers: dict[tuple[int, str], WriteStream] = {}
    folders: set[str] = set()
    received = 0
    try:
        for k in range(max(len(st) for st in streams)):
            sends: list[tuple[int, bytes]] = []
            if k < len(streams[me]):
                path, start, length = streams[me][k]
                with storage.open_read(join(work, path)) as h:
                    data = h.read(start, length)
                sends = [(dst, data) for dst in peers]
            want = [(src, streams[src][k]) for src in sources if k < len(streams[src])]
            moved = sum(st[k][2] for st in streams if k < len(st)) * replicas  # this round, all ranks
            got = transfer(coord, sends, [(src, length) for src, (_, _, length) in want],
                           transfer_timeout(coord, moved, deadline))
            for (src, (path, start, length)), data in zip(want, got, strict=True):
                w = writers.get((src, path))
                if w is None:
                    target = replica_path(work, path)
                    folder = target.rsplit("/", 1)[0]
                    if folder not in folders:
                        storage.makedirs(folder)
                        folders.add(folder)
                    w = writers[(src, path)] = storage.open_write(target)
                w.write(data)
                if not received:
                    crashpoints.point("replica_transfer", me)  # once per save: a replica half-written
                received += len(data)
                if start + length == dict(listing[src]).get(path):
                    writers.pop((src, path)).close()  # durable (fsync) before the save may commit
        if writers:
            raise CommitError(f"replica streams ended early: {sorted(p for _, p in writers)}")
        for src in sources:  # files of size 0 have no pieces
            for path, size in listing[src]:
                if int(size) == 0:
                    target = replica_path(work, str(path))
                    folders.add(target.rsplit("/", 1)[0])
                    storage.makedirs(target.rsplit("/", 1)[0])
                    storage.open_write(target).close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    for folder in sorted(folders):
        storage.sync_dir(folder)
    if folders:
        storage.sync_dir(join(work, REPLICA_DIR))
    return received
