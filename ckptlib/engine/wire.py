"""The JSON forms in which a multi-rank save's plan and write records travel between ranks.

Called by the save flow (:mod:`ckptlib.engine.save`) around its meetings when several ranks
save: inside a liveness session the meetings go over the store as JSON
(coord/torch_coordinator.py), never pickle, so what travels is encoded before and decoded after
on every rank alike (through gloo as well, outside a session), and the types the planner and
the manifest build see never depend on the transport: tuples stay tuples, records stay records.
Each ``*_out`` has its ``*_in``; the decoders trust their input (it comes from ranks of the same
job, written by the encoder beside it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ckptlib.format.build import PackMember, WrittenChunk, WrittenPack
from ckptlib.plan.assign import PieceDesc, Plan
from ckptlib.plan.grid import Proposal


def pieces_out(ps: Iterable[PieceDesc]) -> list[list[Any]]:
    return [[p.name, list(p.offset), list(p.shape), p.nbytes, p.dtype, list(p.global_shape)] for p in ps]


def pieces_in(xs: Iterable[list[Any]]) -> list[PieceDesc]:
    return [PieceDesc(n, tuple(o), tuple(s), b, d, tuple(g)) for n, o, s, b, d, g in xs]


def proposal_out(proposal: Proposal) -> list[list[Any]]:
    return [[name, dtype, list(gshape), list(block)] for name, dtype, gshape, block in proposal]


def proposal_in(xs: Iterable[list[Any]]) -> Proposal:
    return [(name, dtype, tuple(gshape), tuple(block)) for name, dtype, gshape, block in xs]


def plan_out(p: Plan) -> list[list[int]]:
    return [list(p.replicated), list(p.sharded)]


def plan_in(x: list[list[int]]) -> Plan:
    return Plan(list(x[0]), list(x[1]))


def chunks_out(chunks: Iterable[WrittenChunk | WrittenPack]) -> list[list[Any]]:
    """Format v1: a rank's write records (``["c", ...]`` a chunk, ``["p", ...]`` a pack)."""
    out: list[list[Any]] = []
    for c in chunks:
        if isinstance(c, WrittenPack):
            members = [[m.name, m.dtype, list(m.offset), list(m.shape)] for m in c.members]
            out.append(["p", c.file, c.start, c.length, c.checksum, c.codec, c.raw_length, members, list(c.offsets)])
        else:
            out.append(["c", c.name, c.file, c.start, c.length, c.checksum, list(c.offset), list(c.shape), c.codec,
                        c.dtype])
    return out


def chunks_in(xs: Iterable[list[Any]]) -> list[WrittenChunk | WrittenPack]:
    out: list[WrittenChunk | WrittenPack] = []
    for x in xs:
        if x[0] == "p":
            _, file, start, length, checksum, codec, raw, members, offsets = x
            out.append(WrittenPack(file, start, length, checksum, codec, raw,
                                   [PackMember(n, d, tuple(o), tuple(s)) for n, d, o, s in members], list(offsets)))
        else:
            _, name, file, start, length, checksum, offset, shape, codec, dtype = x
            out.append(WrittenChunk(name, file, start, length, checksum, tuple(offset), tuple(shape), codec, dtype))
    return out


def shapes_out(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, list[int]]:
    return {name: list(shape) for name, shape in shapes.items()}


def shapes_in(x: Mapping[str, list[int]]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(shape) for name, shape in x.items()}
