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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptlib import crashpoints
from ckptlib.backends import Storage, join, parent
from ckptlib.backends.base import WriteStream
from ckptlib.coord.session import Session
from ckptlib.errors import CommitError, ReplicaMismatchError
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.tiers.node import Topology

if TYPE_CHECKING:  # torch stays out of the CLI's ls/verify/prune --local (tiers.inventory)
    from ckptlib.plan.flatten import TensorItem

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


@dataclass
class ReplicaStats:
    """What one rank's replica stream moved in one save."""

    sent: int = 0
    """Bytes this rank sent to its peers over the network."""
    received: int = 0
    """Bytes this rank received from its sources."""
    rebuilt: int = 0
    """Bytes of its sources' files this rank rebuilt from its own memory instead (replicated
    pieces: the same bytes already here, :class:`Rebuild`)."""


@dataclass
class Rebuild:
    """A rank's own copy of the replicated pieces (data-parallel copies) and what to write them
    with, so that it can rebuild its sources' replicated files byte for byte (their write
    records say what they hold), instead of receiving them. ``check``: the rebuilt bytes'
    checksums must equal the source's (``check_replicas``); a difference fails the save."""

    items: dict[str, TensorItem]
    options: Any  # engine.save.SaveOptions
    check: bool


def replicate(storage: Storage, s: Session, topo: Topology, *, work: str, mine: list[tuple[str, int]],
              replicas: int, jump: int, deadline: float, piece: int = PIECE,
              own_replicated: tuple[list[tuple[str, int]], list[Any], list[str]] | None = None,
              rebuild: Rebuild | None = None) -> ReplicaStats:
    """Every rank (collective, in session ``s``): make the replicas of its sources' files
    (payloads and v2 index file) durable under ``work``'s ``replicas/`` on ``storage`` (this
    node's local tier), and its own files durable on its peers. ``mine``: this rank's files
    (paths under ``work``, sizes); ``own_replicated``: those of them that hold only its
    replicated pieces, with their write records and the tensors in the writer's order
    (``Placement.own_replicated``, ``SaveSession.replicated``).

    One consult first: each rank reports its file list (and its replicated files' records);
    the coordinator answers each rank with what it sends to each peer and receives from each
    source, and which of its sources' replicated files it rebuilds from its own memory
    (``rebuild``; where it cannot, they are sent): no rank reads every list, and only bytes
    that exist on one node cross the network. Then the stream: rounds of one piece per pair
    (every rank runs the same number, so no send waits on an unposted receive), pipelined: the
    next round's pieces are read, and the last round's written, while a round moves; the
    rebuilds run beside the stream. Memory: about three pieces per pair. Returns what moved.
    Raises on any failure, after the stream ends (the caller fails the save through the
    commit): a rebuilt file whose checksums differ from its source's raises
    :class:`ReplicaMismatchError` naming the tensors."""
    pairs = topo.pairs(replicas, jump)
    stats = ReplicaStats()
    if not pairs:
        return stats
    me = s.rank

    def rel(p: str) -> str:
        return p[len(work) + 1:] if p.startswith(work + "/") else p

    rep = None
    if own_replicated is not None and own_replicated[0]:
        files, records, order = own_replicated
        rep = {"files": [rel(p) for p, _ in files], "sums": [r.checksum for r in records], "items": order}
    report = {"files": [(rel(p), n) for p, n in mine], "rep": rep, "rebuild": rebuild is not None}

    def plan(reports: list[Any]) -> list[Any]:
        out: list[dict[str, Any]] = [{"send": {}, "recv": {}, "rebuild": {}} for _ in reports]
        longest = 0
        for src, dst in pairs:
            r_src = reports[src]
            local = r_src["rep"] is not None and reports[dst]["rebuild"]
            skip = set(r_src["rep"]["files"]) if local else set()
            stream = [(p, n) for p, n in r_src["files"] if p not in skip]
            out[src]["send"][str(dst)] = stream
            out[dst]["recv"][str(src)] = stream
            if local:
                sizes = dict((p, n) for p, n in r_src["files"])
                out[dst]["rebuild"][str(src)] = {**r_src["rep"], "sizes": [sizes[p] for p in r_src["rep"]["files"]]}
            longest = max(longest, len(pieces([(str(p), int(n)) for p, n in stream], piece)))
        for o in out:
            o["rounds"] = longest
        return out

    answer = s.consult(report, plan, deadline=deadline)
    sends = {int(d): pieces([(str(p), int(n)) for p, n in files], piece) for d, files in answer["send"].items()}
    recvs = {int(r): pieces([(str(p), int(n)) for p, n in files], piece) for r, files in answer["recv"].items()}
    sizes = {(int(r), str(p)): int(n) for r, files in answer["recv"].items() for p, n in files}
    rebuilt: list[Future[int]] = []
    pool = ThreadPoolExecutor(3, thread_name_prefix="ckptlib-replicas")
    writers: dict[tuple[int, str], WriteStream] = {}
    folders: set[str] = set()
    try:
        for src, info in answer["rebuild"].items():
            rebuilt.append(pool.submit(_rebuild, storage, work, int(src), info, rebuild))
        reader = ThreadPoolExecutor(1, thread_name_prefix="ckptlib-replica-read")
        writer = ThreadPoolExecutor(1, thread_name_prefix="ckptlib-replica-write")
        try:
            rounds = int(answer["rounds"])
            ahead = reader.submit(_read_round, storage, work, sends, 0) if rounds else None
            written: Future[None] | None = None
            for k in range(rounds):
                assert ahead is not None
                outgoing = ahead.result(timeout=max(0.1, deadline - s.now()))
                if k + 1 < rounds:
                    ahead = reader.submit(_read_round, storage, work, sends, k + 1)
                want = [(src, st[k]) for src, st in sorted(recvs.items()) if k < len(st)]
                got = s.coord.transfer(outgoing, [(src, length) for src, (_, _, length) in want], transfer_timeout(
                    s, sum(len(d) for _, d in outgoing) + sum(n for _, (_, _, n) in want), deadline))
                stats.sent += sum(len(d) for _, d in outgoing)
                if written is not None:
                    written.result(timeout=max(0.1, deadline - s.now()))
                written = writer.submit(_write_round, storage, work, writers, folders, sizes, want, got, me,
                                        stats.received == 0)
                stats.received += sum(len(d) for d in got)
            if written is not None:
                written.result(timeout=max(0.1, deadline - s.now()))
        finally:
            reader.shutdown(wait=False)
            writer.shutdown(wait=True)
        if writers:
            raise CommitError(f"replica streams ended early: {sorted(p for _, p in writers)}")
        for (_src, path), size in sizes.items():  # files of size 0 have no pieces
            if size == 0:
                target = replica_path(work, path)
                _folder(storage, work, folders, parent(target))
                _create(storage, target).close()
        stats.rebuilt = sum(f.result(timeout=max(0.1, deadline - s.now())) for f in rebuilt)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        pool.shutdown(wait=True)
    for folder in sorted(folders | {replica_path(work, "")}):
        if storage.exists(folder):
            storage.sync_dir(folder)
    return stats


def _names(records: list[Any]) -> list[str]:
    """The tensors of write records (chunks and packs), in the order they were written."""
    out = []
    for r in records:
        out += [m.name for m in r.members] if hasattr(r, "members") else [r.name]
    return out


def _folder(storage: Storage, work: str, folders: set[str], folder: str) -> None:
    """Make ``folder`` (of replica files, under ``work``) once per save (``folders``: those made),
    and only while ``work`` exists: a save given up, whose staging folder was removed, is not
    made again by a peer's late replica stream (a folder without its marker, litter until the
    job's next clean-up). The files themselves are created by :func:`_create`, which never makes
    a folder: one removed while the stream runs fails the stream."""
    if folder not in folders:
        if not storage.exists(work):
            raise CommitError(f"staging folder {work} is gone: the save was abandoned (no replicas written)")
        storage.makedirs(folder)
        folders.add(folder)


def _create(storage: Storage, path: str) -> WriteStream:
    """A replica file, in its folder made by :func:`_folder`: the writer's create (the folder is
    never made again; :class:`CommitError` when it is gone), imported here because the writer
    imports torch and this module must not (``tiers.inventory``, the CLI)."""
    from ckptlib.engine.writer import create

    return create(storage, path)


def _read_round(storage: Storage, work: str, sends: dict[int, list[tuple[str, int, int]]], k: int,
                ) -> list[tuple[int, bytes | bytearray]]:
    """The pieces this rank sends in round ``k`` (the reader thread), each read once."""
    cache: dict[tuple[str, int, int], bytearray] = {}
    out: list[tuple[int, bytes | bytearray]] = []
    for dst, stream in sorted(sends.items()):
        if k < len(stream):
            key = stream[k]
            if key not in cache:
                path, start, length = key
                with storage.open_read(join(work, path)) as h:
                    cache[key] = h.read_buffer(start, length)
            out.append((dst, cache[key]))
    return out


def _write_round(storage: Storage, work: str, writers: dict[tuple[int, str], WriteStream], folders: set[str],
                 sizes: dict[tuple[int, str], int], want: list[tuple[int, tuple[str, int, int]]], got: list[bytes],
                 me: int, first: bool) -> None:
    """Append round ``k``'s received pieces to their replica files (the writer thread, in
    round order); a file complete is closed, which makes it durable before the commit."""
    for (src, (path, start, length)), data in zip(want, got, strict=True):
        w = writers.get((src, path))
        if w is None:
            target = replica_path(work, path)
            _folder(storage, work, folders, parent(target))
            w = writers[(src, path)] = _create(storage, target)
        w.write(data)
        if first:
            crashpoints.point("replica_transfer", me)  # once per save: a replica half-written
            first = False
        if start + length == sizes[(src, path)]:
            writers.pop((src, path)).close()


def _rebuild(storage: Storage, work: str, src: int, info: dict[str, Any], rebuild: Rebuild | None) -> int:
    """Rebuild source ``src``'s replicated files from this rank's own copies of their tensors
    (a helper thread), byte for byte as the source wrote them; returns the bytes written.
    Raises :class:`ReplicaMismatchError` when ``rebuild.check`` and a checksum differs."""
    assert rebuild is not None
    from ckptlib.engine.save import REP_TAG, cpu_contiguous
    from ckptlib.engine.writer import split_chunks, write_files

    opts = rebuild.options
    jobs = []
    for name in info["items"]:
        it = rebuild.items[name]
        jobs += split_chunks(name, cpu_contiguous(it.tensor), it.global_offset, opts.chunk_bytes)
    folder = join(work, REPLICA_DIR, info["files"][0].rsplit("/", 1)[0]) if "/" in info["files"][0] else \
        join(work, REPLICA_DIR)
    _folder(storage, work, set(), folder)
    files, records = write_files(storage, folder, src, jobs, compression=opts.compression,
                                 num_files=len(info["files"]), tag=REP_TAG, exact=True)
    if [f"{folder}/{p.rsplit('/', 1)[-1]}" for p, _ in files] != [replica_path(work, p) for p in info["files"]]:
        raise CommitError(f"rebuilt replicas of rank {src} are laid out differently: {files} vs {info['files']}")
    if rebuild.check:
        bad = [_names([r]) for mine, theirs, r in zip([r.checksum for r in records], info["sums"], records, strict=False)
               if mine != theirs]
        differ = sorted({n for names in bad for n in names})
        if differ or len(records) != len(info["sums"]):
            # A pack of small tensors has one checksum: which of its tensors differ is not known.
            what = ", ".join(differ[:10]) or "replicated tensors"
            if any(len(names) > 1 for names in bad):
                what = f"one or more of {what} (small tensors packed under one checksum)"
            raise ReplicaMismatchError(
                f"{what}: rank {src}'s copy and this rank's copy differ (a "
                "silent fault in a data-parallel replica?); nothing of this step is committed")
    return sum(n for _, n in files)


def run_round(s: Session, plan: dict[str, Any], local: Storage, have: dict[str, str],
              mdata: bytes | None, timeout: float) -> dict[str, bytes]:
    """Every rank: run one round of a plan (send what it lists, receive what it lists)."""
    sends = [(int(dst), (mdata if name == MANIFEST_NAME else _read_all(local, have[name])) or b"")
             for dst, name in plan["send"]]
    got = s.coord.transfer(sends, [(int(src), int(size)) for src, _, size in plan["recv"]], timeout)
    return {name: data for (_src, name, _size), data in zip(plan["recv"], got, strict=True)}


def _read_all(storage: Storage, path: str) -> bytearray:
    with storage.open_read(path) as h:
        return h.read_buffer(0, h.size)


def round_timeout(s: Session, plan: dict[str, Any], deadline: float) -> float:
    """The wait of one round of peer transfers (gloo: the one wait of a tier restore not judged
    by heartbeats): :func:`.replicas.transfer_timeout` of this rank's bytes in the round.
    The ranks enter it together, right after the :meth:`Session.consult` of the plans, so a
    dead or frozen peer fails it within about that time. ``plan``: this rank's (:func:`_answers`)."""
    return transfer_timeout(s, int(plan.get("bytes", 0)), deadline)
