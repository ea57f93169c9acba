"""The JSON forms of a save's plan and write records (ckptlib/engine/wire.py): through a JSON
round trip, as they travel between ranks over the store, every value comes back equal and of
the same types (tuples stay tuples: the planner and the manifest build compare them)."""

from __future__ import annotations

import json

from ckptlib.engine import wire
from ckptlib.format.build import PackMember, WrittenChunk, WrittenPack
from ckptlib.plan.assign import PieceDesc, Plan, assign, digest
from ckptlib.plan.grid import conform, propose


def _trip(x):
    return json.loads(json.dumps(x))


def test_records_come_back_equal_and_typed() -> None:
    chunks = [
        WrittenChunk("w", "s/0/f0", 0, 64, "crc:1", (0, 4), (4, 4), "raw", "float32"),
        WrittenPack("s/0/f1", 64, 30, "crc:2", "zstd", 48,
                    [PackMember("b", "int64", (0,), (2,)), PackMember("c", "bfloat16", (1, 0), (2, 2))], [0, 16]),
    ]
    back = wire.chunks_in(_trip(wire.chunks_out(chunks)))
    assert back == chunks
    assert isinstance(back[1], WrittenPack) and isinstance(back[1].members[1], PackMember)
    assert type(back[0].offset) is tuple and type(back[1].members[1].shape) is tuple
    shapes = {"w": (8, 4), "s": ()}
    assert wire.shapes_in(_trip(wire.shapes_out(shapes))) == shapes


def test_plan_values_come_back_equal_and_plan_alike() -> None:
    """A grid proposal that went through JSON still matches the pieces it was made from (a
    list where a tuple was would make every tensor "odd"), and the plan is the same."""
    mine = [PieceDesc("w", (0, 0), (4, 8), 128, "float32", (8, 8)), PieceDesc("v", (0,), (3,), 12, "float32", (3,))]
    proposal = propose(mine)
    assert conform(wire.proposal_in(_trip(wire.proposal_out(proposal))), mine, 0) == []
    assert conform(_trip(proposal), mine, 0) != []  # the raw JSON form would not do
    assert wire.pieces_in(_trip(wire.pieces_out(mine))) == mine
    plans = assign([], [digest([])] * 2, [mine, []])
    assert [wire.plan_in(_trip(wire.plan_out(p))) for p in plans] == plans
    assert wire.plan_in(_trip(wire.plan_out(Plan([1, 0], [2])))) == Plan([1, 0], [2])
