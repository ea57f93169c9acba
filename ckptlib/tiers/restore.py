"""Restore across tiers: candidates from every node's local folder and the persistent tier; each
payload file read from the fastest source that verifies.

:func:`restore` (``CheckpointManager.restore`` with a local tier; every rank, caller's thread)
is the one resume loop, :func:`ckptlib.engine.resume.resume_newest`, given two things:

- the candidates: every rank lists the steps committed in its node's folder; the coordinator
  merges them with the persistent tier's scan, newest first. A step counts once, as the local
  save it came from (a drained copy names it in ``extra["tiers"]``);
- ``attempt(candidate)``, collective, two rounds: each rank verifies the copies its node holds
  (own files and replicas, checksums of every chunk); round 1, the coordinator checks that every
  file has a copy somewhere (or the step is persisted; else the step is damaged and the loop
  falls back, together, to an older one) and has manifests sent to ranks without one; round 2,
  each rank names the files its load plan reads and its node lacks (:func:`needed_files`), and
  the coordinator gives each a source: a peer on another node holding a verified copy (sent
  over the process group, :mod:`.replicas`), else the persistent tier. The rank then loads through a
  read-only :class:`SourceView` (own local > peer copy > persistent) with the reader's checksum
  checks; a copy that fails them sends the rank to the persistent copy before the step is given up.

Waits: :func:`restore` opens one coordination session (``coord.session("tier restore", ...)``;
opening it needs no meeting) around everything else: the topology (:meth:`Topology.discover`), the collection
of every rank's local steps, the resume loop (which runs in it) and :func:`write_back`. Every
meeting in it is a :meth:`Session.exchange`, :meth:`Session.share` or
:meth:`Session.consult` (the local steps and the planning rounds: the coordinator gets every
rank's report and answers each rank its own plan; no rank reads every report, each of which
lists the step's files), so a rank that is slow but alive (a slow local listing, a slow disk
verifying checksums) is waited for up to the restore's ``timeout`` per wait, while a dead or
frozen one fails the others within the coordination timeout. The bulk bytes stay on gloo
(:meth:`Coordinator.transfer`); that wait is :func:`_transfer_timeout` (coordination timeout plus
the round's bytes at a floor bandwidth, capped by the deadline). :func:`write_back` writes each
file under a temporary name carrying its id and start time; a crash leaves it for the next local
commit's cleanup (module :mod:`.inventory`, :func:`write_back_debris`).

"Files" are every file :func:`ckptlib.tiers.drain.step_files` lists: payloads and, format v2,
the ranks' piece index files (verified by size and checksum, then used to verify the payloads
of their rank). After :func:`resume_newest` returns, :func:`write_back` (collective, same
thread) puts what each node lost back into its folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from typing import Any

from ckptlib import crashpoints
from ckptlib.backends import Storage, join
from ckptlib.backends.base import Entry, ReadHandle, WriteStream
from ckptlib.coord.coordinator import Coordinator
from ckptlib.coord.session import Session
from ckptlib.engine import load as load_flow
from ckptlib.engine.index_io import load_indexes
from ckptlib.engine.resume import Candidate, resume_newest
from ckptlib.engine.scan import StepInfo, read_manifest, scan
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitError,
    CorruptCheckpointError,
)
from ckptlib.format import layout
from ckptlib.format import tree as tree_codec
from ckptlib.format.decode import decode
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.format.schema import Manifest
from ckptlib.tiers.drain import COPY_PIECE
from ckptlib.tiers.inventory import (
    StepFile,
    local_save_id,
    local_steps,
    new_write_back_id,
    step_files,
    unrestorable,
    verify_files,
    write_back_tmp,
)
from ckptlib.tiers.local import LocalTier
from ckptlib.tiers.node import Topology
from ckptlib.tiers.replicas import REPLICA_DIR, transfer_timeout

log = logging.getLogger("ckptlib")


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


class _Bytes(ReadHandle):
    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.size, self.where = data, len(data), where

    def read_into(self, start: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        end = start + len(out)
        if end > self.size:
            raise CorruptCheckpointError(f"file is shorter than expected (needed bytes up to {end}, has {self.size})",
                                         self.where)
        out[:] = self.data[start:end]

    def close(self) -> None:
        pass


class SourceView(Storage):
    """A read-only view of one step folder ``final`` whose files come from several sources, by
    file name: ``fetched`` bytes (peer copies and the manifest), ``local`` paths on this node's
    storage, else the persistent tier's folder (files under its ``persistent_prefix``).
    ``sizes``: the manifest's size of files this rank does not read and has no copy of (the
    restore planner found a verified copy elsewhere): reported by :meth:`size`, never opened."""

    def __init__(self, final: str, *, manifest: bytes, local: Storage | None, local_paths: dict[str, str],
                 fetched: dict[str, bytes], persistent: Storage | None, persistent_prefix: str,
                 sizes: dict[str, int] | None = None) -> None:
        self.final, self.manifest, self.sizes = final, manifest, sizes or {}
        self.local, self.local_paths, self.fetched = local, local_paths, fetched
        self.persistent, self.persistent_prefix = persistent, persistent_prefix
        self.url = f"tiers:{final}"

    def _where(self, path: str) -> tuple[str, Any]:
        if path == join(self.final, MANIFEST_NAME):
            return "bytes", self.manifest
        name = _name(path)
        if name in self.fetched:
            return "bytes", self.fetched[name]
        if self.local is not None and name in self.local_paths:
            return "local", self.local_paths[name]
        if self.persistent is not None:
            return "persistent", join(self.final, self.persistent_prefix, name)
        return "none", None

    def open_read(self, path: str) -> ReadHandle:
        kind, ref = self._where(path)
        if kind == "bytes":
            return _Bytes(ref, f"{self.url}/{path}")
        if kind == "local":
            assert self.local is not None
            return self.local.open_read(ref)
        if kind == "persistent":
            assert self.persistent is not None
            return self.persistent.open_read(ref)
        if _name(path) in self.sizes:
            raise CorruptCheckpointError("no copy of this file was fetched for this rank", f"{self.url}/{path}")
        raise FileNotFoundError(path)

    def size(self, path: str) -> int | None:
        kind, ref = self._where(path)
        if kind == "bytes":
            return len(ref)
        if kind == "local":
            assert self.local is not None
            return self.local.size(ref)
        if kind == "persistent":
            assert self.persistent is not None
            return self.persistent.size(ref)
        return self.sizes.get(_name(path))

    def exists(self, path: str = "") -> bool:
        return self.size(path) is not None

    def listdir(self, path: str = "") -> list[Entry]:
        raise NotImplementedError("a tier view lists nothing")

    def open_write(self, path: str) -> WriteStream:
        raise CheckpointError("a tier view is read-only")

    def put_atomic(self, path: str, data: bytes) -> None:
        raise CheckpointError("a tier view is read-only")

    def makedirs(self, path: str) -> None:
        raise CheckpointError("a tier view is read-only")

    def delete(self, path: str) -> None:
        raise CheckpointError("a tier view is read-only")

    def delete_tree(self, path: str) -> None:
        raise CheckpointError("a tier view is read-only")


def candidates(tier: LocalTier, persistent: Storage, held: list[dict[int, str]]) -> list[Candidate]:
    """Coordinator: every step of either tier, newest first. ``held``: each rank's
    :func:`local_steps`. ``extra``: ``save_id`` (the local save), ``persistent`` (the
    persistent copy's save id, or None), ``nodes`` (how many ranks' nodes hold it locally)."""
    try:
        infos = scan(persistent)
    except CheckpointNotFoundError:
        infos = []
    out: dict[int, Candidate] = {}
    for i in infos:
        if i.step in out:
            continue
        if i.status == "committed" and i.manifest is not None:
            out[i.step] = Candidate(i.step, layout.step_dir(i.step), "committed", "",
                                    {"save_id": local_save_id(i.manifest), "persistent": i.save_id})
        else:
            out[i.step] = Candidate(i.step, layout.step_dir(i.step), i.status, i.reason, None)
    local: dict[int, Counter[str]] = {}
    for mine in held:
        for step, sid in mine.items():
            local.setdefault(int(step), Counter())[sid] += 1
    for step, ids in local.items():
        c = out.get(step)
        if c is not None and c.status == "committed":
            continue
        out[step] = Candidate(step, layout.step_dir(step), "committed", "",
                              {"save_id": ids.most_common(1)[0][0], "persistent": None})
    return [out[s] for s in sorted(out, reverse=True)]


def _node_view(local: Storage, final: str, manifest: bytes, paths: dict[str, str]) -> SourceView:
    """This node's copies of a step's files (name -> path on ``local``), as a step folder."""
    return SourceView(final, manifest=manifest, local=local, local_paths=paths, fetched={}, persistent=None,
                      persistent_prefix="")


def _holdings(local: Storage, final: str, save_id: str, verify: bool) -> tuple[dict[str, str], bytes | None,
                                                                              list[list[Any]] | None]:
    """This rank: the files of step ``final`` (save ``save_id``) its node holds that verify --
    payloads and v2 index files, own copies or replicas: name -> path on ``local``; the manifest
    bytes; the manifest's (name, size) list of every file (:func:`step_files`). A payload counts
    only when its writer's index file verified too (its chunks are known from it)."""
    try:
        m = read_manifest(local, final, pieces=False)
        data = local.read(join(final, MANIFEST_NAME))
    except (CheckpointError, OSError):
        return {}, None, None
    if save_id not in (m.save_id, local_save_id(m)):
        return {}, None, None
    files = step_files(m)
    held: dict[str, str] = {}
    index_of = {f.rank: f for f in files if f.index is not None}
    for f in sorted(files, key=lambda f: f.index is None):  # index files first
        if f.file is not None and f.rank in index_of and index_of[f.rank].name not in held:
            continue  # its chunks are unknown here: fetched with its index file
        for folder in (final, join(final, REPLICA_DIR)):
            path = join(folder, f.path)
            if local.size(path) != f.size:
                continue
            try:
                if verify:
                    verify_files(_node_view(local, final, data, {f.name: path}), final, m, [f])
            except (CheckpointError, OSError) as e:
                log.warning("ckptlib: local copy %s is bad, looking for another: %s", path, e)
                continue
            held[f.name] = path
            break
    return held, data, [[f.name, f.size] for f in files]


def _plan_manifests(reports: list[dict[str, Any]], persistent: bool) -> list[dict[str, Any]]:
    """Coordinator, round 1: which ranks hold the step's manifest (compared by digest: the
    ranks report ``mdigest``, never the manifest's file list), and for each rank without it (or
    with another one), which rank sends it one. Whether every file has a copy somewhere is
    judged in round 2, once the coordinator holds the manifest (:func:`_plan_files`)."""
    world = len(reports)
    digests = Counter(rep["mdigest"] for rep in reports if rep["mdigest"] is not None)
    if not digests:
        return [{"error": None if persistent else "no manifest on any node", "send": [], "recv": []}] * world
    best = digests.most_common(1)[0][0]
    plans: list[dict[str, Any]] = [{"error": None, "send": [], "recv": []} for _ in range(world)]
    holders = [r for r, rep in enumerate(reports) if rep["mdigest"] == best]
    for r, rep in enumerate(reports):
        if rep["mdigest"] != best:  # a local manifest, from a peer
            src = holders[r % len(holders)]
            plans[src]["send"].append([r, MANIFEST_NAME])
            plans[r]["recv"].append([src, MANIFEST_NAME, reports[src]["msize"]])
    return plans


def _plan_files(reports: list[dict[str, Any]], needs: list[list[str]], nodes: tuple[int, ...],
                persistent: bool, files: dict[str, int] | None) -> list[dict[str, Any]]:
    """Coordinator, round 2: can the step be restored (:func:`unrestorable`: every file of its
    manifest, ``files`` (name -> size; None: no readable manifest), verified somewhere, or the
    step persisted)? Then, for every file a rank needs and its node lacks, a peer on another
    node that holds a verified copy (least loaded first), else the persistent tier."""
    world = len(reports)
    why = unrestorable(None if files is None else sorted(files), [rep["held"] for rep in reports], persistent)
    if why:
        return [{"error": why}] * world
    sizes = files or {}
    plans: list[dict[str, Any]] = [{"error": None, "send": [], "recv": []} for _ in range(world)]
    load: Counter[int] = Counter()
    holders_of: dict[str, list[int]] = {}
    for r, rep in enumerate(reports):
        for name in rep["held"]:
            holders_of.setdefault(name, []).append(r)
    for r, names in enumerate(needs):
        for name in names:
            holders = [h for h in holders_of.get(name, []) if nodes[h] != nodes[r]]
            if holders:
                src = min(holders, key=lambda h: (load[h], h))
                load[src] += sizes.get(name, 0)
                plans[src]["send"].append([r, name])
                plans[r]["recv"].append([src, name, sizes.get(name, 0)])
            elif not persistent:
                return [{"error": f"no rank of another node holds a verified copy of {name}"}] * world
    return plans


def needed_files(m: Manifest, boxes: list[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> set[str]:
    """The payload file names holding any byte of ``boxes`` (tensor name, offset, shape)."""
    def meets(o1: tuple[int, ...], s1: tuple[int, ...], o2: tuple[int, ...], s2: tuple[int, ...]) -> bool:
        return all(a < c + d and c < a + b for a, b, c, d in zip(o1, s1, o2, s2, strict=False))

    out: set[str] = set()
    for name, off, shape in boxes:
        t = m.tensors.get(name)
        if t is None:
            continue
        out |= {_name(m.files[c.file].path) for c in t.chunks if meets(off, shape, c.offset, c.shape)}
        out |= {_name(m.files[m.packs[p.pack].file].path) for p in t.pieces if meets(off, shape, p.offset, p.shape)}
    return out


def _needs(mdata: bytes | None, state: Any, s: Session, per_rank: str, where: str, local: Storage,
           final: str, have: dict[str, str]) -> set[str] | None:
    """The files this rank's load reads (None: unknown, take them all). Format v2: the index
    files of the ranks holding the boxes it reads (their sharding says which), and the payload
    files their pieces name -- found from the index files this node holds, else every payload
    file of those ranks. Never raises: a state that does not match is reported by the load
    itself, after the collectives."""
    if mdata is None:
        return None
    try:
        m = decode(mdata, where)
        plan = load_flow.Merge(m, s.rank, s.world, per_rank, where=where)
        plan.merge(state, tree_codec.decode(m.tree, m.tensors, where), "")
        boxes = [(q.name, tuple(q.offset), tuple(q.shape)) for q in plan.requests]
        if m.version < 2:
            return needed_files(m, boxes)
        ranks = {r for name, off, shape in boxes for r in m.sharding[name].ranks_for(off, shape)}
        files = [f for f in step_files(m) if f.rank in ranks]
        known = [f for f in files if f.index is not None and f.name in have]
        load_indexes(_node_view(local, final, mdata, have), final, m, [f.index for f in known if f.index is not None])
        blind = {f.rank for f in files if f.index is not None} - {f.rank for f in known}
        return ({f.name for f in files if f.index is not None} | needed_files(m, boxes)
                | {f.name for f in files if f.rank in blind})
    except Exception as e:
        log.debug("ckptlib: cannot tell which files the restore reads (%s); fetching all it lacks", e)
        return None


def _all_files(mdata: bytes | None, where: str) -> dict[str, int]:
    """Every file of the step: name -> size (empty when there is no readable manifest)."""
    try:
        return {} if mdata is None else {f.name: f.size for f in step_files(decode(mdata, where))}
    except CheckpointError:
        return {}  # the load reports the bad manifest


def _exchange(s: Session, plan: dict[str, Any], local: Storage, have: dict[str, str],
              mdata: bytes | None, timeout: float) -> dict[str, bytes]:
    """Every rank: run one round of a plan (send what it lists, receive what it lists)."""
    sends = [(int(dst), (mdata if name == MANIFEST_NAME else local.read(have[name])) or b"")
             for dst, name in plan["send"]]
    got = s.coord.transfer(sends, [(int(src), int(size)) for src, _, size in plan["recv"]], timeout)
    return {name: data for (_src, name, _size), data in zip(plan["recv"], got, strict=True)}


def _answers(plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Coordinator: one round's plans as the ranks' answers (:meth:`Session.consult`): each
    rank's plan with ``bytes``, the bytes it sends and receives in the round (:func:`_transfer_timeout`)."""
    sent: dict[int, int] = {}
    for p in plans:
        for src, _name, size in p.get("recv", []):
            sent[int(src)] = sent.get(int(src), 0) + int(size)
    return [{**p, "bytes": sent.get(r, 0) + sum(int(size) for _s, _n, size in p.get("recv", []))}
            for r, p in enumerate(plans)]


def _transfer_timeout(s: Session, plan: dict[str, Any], deadline: float) -> float:
    """The wait of one round of peer transfers (gloo: the one wait of a tier restore not judged
    by heartbeats): :func:`.replicas.transfer_timeout` of this rank's bytes in the round.
    The ranks enter it together, right after the :meth:`Session.consult` of the plans, so a
    dead or frozen peer fails it within about that time. ``plan``: this rank's (:func:`_answers`)."""
    return transfer_timeout(s, int(plan.get("bytes", 0)), deadline)


def restore(tier: LocalTier, persistent: Storage, state: Any, coord: Coordinator, *, step: int | None = None,
            verify: bool = True, per_rank: str = "error", timeout: float = 600.0, strict: bool = True,
            keys: dict[str, list[str]] | None = None) -> int | None:
    """``CheckpointManager.restore`` with a local tier (module docstring). Every rank.
    ``strict``/``keys``: as :func:`ckptlib.engine.resume.restore`."""
    with coord.session("tier restore", coord.deadline(timeout)) as s:  # every meeting below, write-back included
        return _restore(tier, persistent, state, s, step=step, verify=verify, per_rank=per_rank,
                        timeout=timeout, strict=strict, keys=keys)


def _restore(tier: LocalTier, persistent: Storage, state: Any, s: Session, *, step: int | None,
             verify: bool, per_rank: str, timeout: float, strict: bool, keys: dict[str, list[str]] | None,
             ) -> int | None:
    topo = tier.topo(s, timeout)
    mine = {str(n): sid for n, sid in local_steps(tier.storage).items()}
    held: list[dict[str, str]] = []

    def keep(steps: list[dict[str, str]]) -> list[None]:  # coordinator: for listing()
        held[:] = steps
        return [None] * len(steps)

    s.consult(mine, keep, deadline=s.now() + timeout)

    def listing() -> list[Candidate]:
        cands = candidates(tier, persistent, [{int(n): sid for n, sid in h.items()} for h in held])
        return cands if step is None else [c for c in cands if c.step == step]

    def deadline() -> float:
        return s.now() + timeout

    def attempt(c: Candidate) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        extra = c.extra or {}
        pers_id = extra.get("persistent")
        where = f"{c.folder} (tiers)"
        have, mdata, files = _holdings(tier.storage, c.folder, str(extra.get("save_id")), verify)
        report = {"held": sorted(have), "msize": len(mdata) if mdata is not None else 0,
                  "mdigest": None if mdata is None else hashlib.blake2b(mdata, digest_size=16).hexdigest()}
        # Round 1: is the step whole somewhere; a manifest for every rank. The coordinator gets
        # every report (a wait on a slow rank lasts while it is alive), each rank its own plan.
        kept: dict[str, Any] = {}  # coordinator: every rank's report, for round 2 and the write-back

        def manifests(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
            kept["reports"] = reports
            return _answers(_plan_manifests(reports, pers_id is not None))

        plan = s.consult(report, manifests, deadline=deadline())
        if plan["error"]:
            raise CorruptCheckpointError(f"step {c.step} cannot be restored from any tier: {plan['error']}")
        mdata = _exchange(s, plan, tier.storage, have, mdata, _transfer_timeout(s, plan, deadline())
                          ).get(MANIFEST_NAME, mdata)
        if mdata is None and pers_id is not None:  # only the persistent copy has a manifest
            try:
                mdata = persistent.read(join(c.folder, MANIFEST_NAME))
            except (CheckpointError, OSError) as e:
                log.warning("ckptlib: cannot read the persistent manifest of step %d: %s", c.step, e)
        # Round 2: the files this rank reads and its node lacks, from peers (else persistent).
        need = _needs(mdata, state, s, per_rank, where, tier.storage, c.folder, have)
        sizes = _all_files(mdata, where)
        if need is None:  # unknown: every file the manifest names
            need = set(sizes)
        mine = sorted(need - set(have))
        plan = s.consult(mine, lambda needs: _answers(_plan_files(kept["reports"], needs, topo.nodes,
                                                                  pers_id is not None, sizes or None)),
                         deadline=deadline())
        if plan["error"]:
            raise CorruptCheckpointError(f"step {c.step} cannot be restored from any tier: {plan['error']}")
        fetched = _exchange(s, plan, tier.storage, have, mdata, _transfer_timeout(s, plan, deadline()))
        if mdata is None:
            raise CorruptCheckpointError(f"step {c.step}: no readable manifest on any tier")
        view_args: dict[str, Any] = {}
        if pers_id is not None:
            view_args = {"persistent": persistent, "persistent_prefix": pers_id}
        else:
            view_args = {"persistent": None, "persistent_prefix": ""}
        view = SourceView(c.folder, manifest=mdata, local=tier.storage, local_paths=have, fetched=fetched,
                          sizes=sizes, **view_args)
        try:
            load_flow.load_checkpoint(view, c.folder, state, verify=verify, rank=s.rank,
                                      world_size=s.world, per_rank=per_rank, strict=strict, keys=found)
        except CorruptCheckpointError as e:
            if pers_id is None or (not have and not fetched):
                raise
            log.warning("ckptlib: a local or peer copy of step %d is bad (%s); reading the persistent copy", c.step, e)
            load_flow.load_checkpoint(persistent, c.folder, state, verify=verify, rank=s.rank,
                                      world_size=s.world, per_rank=per_rank, strict=strict, keys=found)
        last.update(step=c.step, folder=c.folder, manifest=mdata, have=have, fetched=fetched, reports=kept.get("reports"),
                    node_had=files is not None, persistent=pers_id)
        return found

    last: dict[str, Any] = {}
    got = resume_newest(s, listing, attempt, timeout=timeout, where=f"{tier.storage.url} and {persistent.url}")
    if got is not None and keys is not None:
        keys.update(got.value)
    if got is not None and last.get("step") == got.candidate.step:
        write_back(tier, persistent, s, topo, last, timeout=timeout)
    if got is None and step is not None:
        raise CheckpointNotFoundError(f"no step {step} under {tier.storage.url} or {persistent.url}")
    return got.candidate.step if got else None


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
        while start < src.size:
            n = min(COPY_PIECE, src.size - start)
            w.write(src.read(start, n))
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
        verify_files(_node_view(local, final, mdata, {f.name: tmp}), final, target, [f])
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
            plan = s.consult(lacking, lambda needs: _answers(_plan_files(last["reports"], needs, topo.nodes,
                                                                         True, _all_files(mdata, where))),
                             deadline=deadline)
        except CommitError as e:
            apart = e
            raise
        fetched.update(_exchange(s, plan, local, have, mdata, _transfer_timeout(s, plan, deadline)))
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


def step_infos(tier: LocalTier, persistent: list[StepInfo], drains: dict[int, Any]) -> list[StepInfo]:
    """``CheckpointManager.steps`` with a local tier: the persistent tier's steps and this node's
    locally committed ones, each with ``tiers`` filled in; ``drains``: step -> its latest
    drain ticket (pending/failed show as the persistent status of a step not committed there)."""
    by_step: dict[int, StepInfo] = {}
    out: list[StepInfo] = []
    for i in persistent:
        i.tiers = {"local": None, "persistent": i.status}
        out.append(i)
        if i.step not in by_step or i.status == "committed":
            by_step[i.step] = i
    for step in local_steps(tier.storage):
        info = by_step.get(step)
        if info is None:
            info = StepInfo(step, "committed", path=layout.step_dir(step), tiers={"local": None, "persistent": None})
            by_step[step] = info
            out.append(info)
        assert info.tiers is not None
        info.tiers["local"] = "committed"
        if info.status != "committed":
            info.status, info.reason = "committed", ""
    for step, ticket in drains.items():
        info = by_step.get(step)
        if (info is not None and info.tiers is not None and info.tiers["persistent"] != "committed"
                and ticket.status in ("pending", "failed")):
            info.tiers["persistent"] = ticket.status
    return out
