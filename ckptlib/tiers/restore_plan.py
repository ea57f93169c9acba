"""The tier restore's plans (coordinator, pure): which rank sends which file to whom, for the
manifest round and the files round of an attempt, and for the write-back; which files a rank's
load reads (:func:`needs`). Called inside :meth:`Session.consult` decisions by
:mod:`ckptlib.tiers.restore` and :mod:`ckptlib.tiers.write_back`; :func:`needs` on every rank.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from ckptlib.backends import Storage
from ckptlib.coord.session import Session
from ckptlib.engine import load as load_flow
from ckptlib.engine.index_io import load_indexes
from ckptlib.format import tree as tree_codec
from ckptlib.format.decode import decode
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.format.schema import Manifest
from ckptlib.tiers.inventory import file_name, step_files, unrestorable
from ckptlib.tiers.sources import node_view

log = logging.getLogger("ckptlib")


def plan_manifests(reports: list[dict[str, Any]], persistent: bool) -> list[dict[str, Any]]:
    """Coordinator, round 1: which ranks hold the step's manifest (compared by digest: the
    ranks report ``mdigest``, never the manifest's file list), and for each rank without it (or
    with another one), which rank sends it one. Whether every file has a copy somewhere is
    judged in round 2, once the coordinator holds the manifest (:func:`plan_files`)."""
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


def plan_files(reports: list[dict[str, Any]], needs: list[list[str]], nodes: tuple[int, ...],
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
        out |= {file_name(m.files[c.file].path) for c in t.chunks if meets(off, shape, c.offset, c.shape)}
        out |= {file_name(m.files[m.packs[p.pack].file].path) for p in t.pieces if meets(off, shape, p.offset, p.shape)}
    return out


def needs(mdata: bytes | None, state: Any, s: Session, per_rank: str, where: str, local: Storage,
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
        load_indexes(node_view(local, final, mdata, have), final, m, [f.index for f in known if f.index is not None])
        blind = {f.rank for f in files if f.index is not None} - {f.rank for f in known}
        return ({f.name for f in files if f.index is not None} | needed_files(m, boxes)
                | {f.name for f in files if f.rank in blind})
    except Exception as e:
        log.debug("ckptlib: cannot tell which files the restore reads (%s); fetching all it lacks", e)
        return None


def answers(plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Coordinator: one round's plans as the ranks' answers (:meth:`Session.consult`): each
    rank's plan with ``bytes``, the bytes it sends and receives in the round (:func:`_transfer_timeout`)."""
    sent: dict[int, int] = {}
    for p in plans:
        for src, _name, size in p.get("recv", []):
            sent[int(src)] = sent.get(int(src), 0) + int(size)
    return [{**p, "bytes": sent.get(r, 0) + sum(int(size) for _s, _n, size in p.get("recv", []))}
            for r, p in enumerate(plans)]
