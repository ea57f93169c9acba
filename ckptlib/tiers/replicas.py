"""Peer copies of a step's files (payloads and format v2 piece index files), sent point to
point over the coordinator's group (:meth:`ckptlib.coord.coordinator.Coordinator.transfer`).

Two users, both collective and on the thread driving the save or restore, inside its session:
:func:`replicate` (the local save, after this rank's payload is durable and before the local
commit) and the restore's fetch of files a rank lacks (:mod:`ckptlib.tiers.restore`). Replica
files live in the holder's local step folder under ``replicas/`` with the payload's own
relative path (``replicas/<save id>/r00001-0.bin``).
"""

from __future__ import annotations

import os
from typing import Any

from ckptlib import crashpoints
from ckptlib.backends import Storage, join
from ckptlib.backends.base import WriteStream
from ckptlib.coord.session import Session
from ckptlib.errors import CommitError
from ckptlib.tiers.node import Topology

REPLICA_DIR = "replicas"


TRANSFER_FLOOR = 8 << 20
"""Bytes per second a peer transfer (a save's replica round, a restore's round) is allowed at the
slowest (the sender reads the files from its local disk, then gloo moves them)."""


def transfer_timeout(s: Session, nbytes: int, deadline: float) -> float:
    """The wait of one round of peer transfers moving ``nbytes`` (this rank's sends and receives): gloo
    cannot read heartbeats, so the coordination timeout (``dead_after``) plus ``nbytes`` at
    :data:`TRANSFER_FLOOR`, never past ``deadline`` (on the session's clock): a dead or frozen
    peer fails the round within about that time, not at the save's or restore's deadline."""
    return max(0.1, min(s.dead_after + nbytes / TRANSFER_FLOOR, deadline - s.now()))


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


def replicate(storage: Storage, s: Session, topo: Topology, *, work: str, mine: list[tuple[str, int]],
              replicas: int, jump: int, deadline: float, piece: int = PIECE) -> int:
    """Every rank (collective, in session ``s``): send this rank's files ``mine`` (payloads and
    v2 index file; paths under ``work``, sizes) to its peers and make the replicas of its
    sources durable under ``work``'s ``replicas/`` on ``storage`` (this node's local tier).
    One consult first: each rank reports its file list and learns only its sources' lists and
    the number of rounds (no rank reads every list). Then rounds of one piece per pair (every
    rank runs the same number, so no send waits on an unposted receive). Returns the bytes this
    rank received. Raises on any failure (the caller fails the save through the commit)."""
    pairs = topo.pairs(replicas, jump)
    if not pairs:
        return 0
    me = s.rank
    rel = [(p[len(work) + 1:] if p.startswith(work + "/") else p, n) for p, n in mine]

    def plan(lists: list[Any]) -> list[Any]:
        rounds = max(len(pieces([(str(p), int(n)) for p, n in files], piece)) for files in lists)
        return [{"rounds": rounds, "sources": {str(src): lists[src] for src, dst in pairs if dst == r}}
                for r in range(len(lists))]

    answer = s.consult(rel, plan, deadline=deadline)
    listing = {int(src): [(str(p), int(n)) for p, n in files] for src, files in answer["sources"].items()}
    streams = {src: pieces(files, piece) for src, files in listing.items()}
    own = pieces([(str(p), int(n)) for p, n in rel], piece)
    peers = [dst for src, dst in pairs if src == me]
    writers: dict[tuple[int, str], WriteStream] = {}
    folders: set[str] = set()
    received = 0
    try:
        for k in range(int(answer["rounds"])):
            sends: list[tuple[int, bytes]] = []
            if k < len(own):
                path, start, length = own[k]
                with storage.open_read(join(work, path)) as h:
                    data = h.read(start, length)
                sends = [(dst, data) for dst in peers]
            want = [(src, st[k]) for src, st in sorted(streams.items()) if k < len(st)]
            moved = sum(len(d) for _r, d in sends) + sum(length for _s, (_p, _st, length) in want)  # this rank's
            got = s.coord.transfer(sends, [(src, length) for src, (_, _, length) in want],
                                   transfer_timeout(s, moved, deadline))
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
        for files in listing.values():  # files of size 0 have no pieces
            for path, size in files:
                if size == 0:
                    target = replica_path(work, path)
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
