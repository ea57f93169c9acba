"""The pure planners: writer assignment, tree merging, retention."""

from __future__ import annotations

import pytest

from ckptlib.plan import retention, trees
from ckptlib.plan.assign import PieceDesc, PlanError, assign, difference, digest


def desc(name, offset=(0,), shape=(10,), nbytes=40, gshape=None):
    return PieceDesc(name, offset, shape, nbytes, "float32", gshape or shape)


def test_replicated_written_once_and_balanced():
    # Sizes 100..800 over 4 ranks: round-robin gives loads 600/800/1000/1200, largest-first
    # to the least-loaded rank gives 900 each.
    rep = [desc(f"t{i}", nbytes=100 * (i + 1)) for i in range(8)]
    plans = assign(rep, [digest(rep)] * 4, [[], [], [], []])
    written = sorted(i for p in plans for i in p.replicated)
    assert written == list(range(8))  # each exactly once
    loads = [sum(rep[i].nbytes for i in p.replicated) for p in plans]
    assert loads == [900] * 4


def test_balance_is_by_bytes_not_by_count():
    # Two big tensors among small ones: round-robin (in list or size order) puts a big one
    # and small ones on the same rank; by bytes each big tensor is alone on its rank.
    sizes = [1000, 1, 1, 1, 1000, 1, 1, 1]
    rep = [desc(f"t{i}", nbytes=n) for i, n in enumerate(sizes)]
    plans = assign(rep, [digest(rep)] * 4, [[], [], [], []])
    loads = sorted(sum(rep[i].nbytes for i in p.replicated) for p in plans)
    assert loads == [3, 3, 1000, 1000]
    # Replicated tensors also fill around what each rank already writes of its own shards.
    own = [desc("w", (0,), (5,), nbytes=2000, gshape=(5,))]
    plans = assign(rep, [digest(rep)] * 4, [own, [], [], []])
    assert plans[0].replicated == []  # rank 0 already carries the most bytes
    loads = sorted(sum(rep[i].nbytes for i in p.replicated) for p in plans[1:])
    assert loads == [6, 1000, 1000]


def test_sharded_pieces_written_by_holders_and_replicas_deduplicated():
    a0 = desc("w", (0,), (5,), gshape=(10,))
    a1 = desc("w", (5,), (5,), gshape=(10,))
    # ranks 0/2 hold the first half, ranks 1/3 the second (DP replicas of a TP shard)
    plans = assign([], [digest([])] * 4, [[a0], [a1], [a0], [a1]])
    writers = {r for r, p in enumerate(plans) if p.sharded}
    assert len(writers) == 2
    assert sum(len(p.sharded) for p in plans) == 2


def test_disagreements_are_errors():
    with pytest.raises(PlanError, match="different set of plain"):
        assign([desc("a")], [digest([desc("a")]), digest([desc("b")])], [[], []])
    with pytest.raises(PlanError, match=r"rank 1 has float32 \[12\]"):
        assign([], [digest([])] * 2, [[desc("w", gshape=(10,))], [desc("w", gshape=(12,))]])


def test_differing_plain_tensors_list_every_rank_and_bound_who_names_them():
    rep = [desc("a")]
    digests = [digest(rep)] + [digest([desc("b")]) if r % 2 else digest(rep) for r in range(1, 24)]
    with pytest.raises(PlanError) as got:
        assign(rep, digests, [[]] * 24)
    odd = list(range(1, 24, 2))
    assert got.value.ranks == odd
    assert "12 ranks (1, 3, 5, 7, 9, 11, 13, 15 and 4 more) hold a different set of plain" in str(got.value)
    assert "the errors of ranks 1, 3, 5 and 7 name them" in str(got.value)


def test_difference_names_what_differs():
    ref = [desc("a"), desc("b", shape=(2, 2)), desc("c")]
    assert difference(ref, list(ref)) == ""
    mine = [desc("a"), desc("b", shape=(2, 3)), desc("d", offset=(4,))]
    assert difference(ref, mine) == ("'b' is float32 [2, 3] here, float32 [2, 2] on rank 0; "
                                     "'d'@[4] only here (float32 [10]); 'c' only on rank 0 (float32 [10])")
    assert difference(ref, [ref[1], ref[0], ref[2]]).startswith(
        "the same tensors in another order (at position 0: 'b' here, 'a' on rank 0)")
    many = [desc(f"x{i}") for i in range(7)]
    assert difference([], many).endswith("'x3' only here (float32 [10]); and 3 more")
    half = PieceDesc("a", (0,), (10,), 20, "bfloat16", (10,))
    assert difference(ref, [half, *ref[1:]]) == "'a' is bfloat16 [10] here, float32 [10] on rank 0"


def test_tree_merge_per_rank_and_mismatch():
    t0 = {"t": "dict", "items": [["lr", 0.1], ["rng", {"t": "per_rank", "rank": 0, "v": 5}]]}
    t1 = {"t": "dict", "items": [["lr", 0.1], ["rng", {"t": "per_rank", "rank": 1, "v": 6}]]}
    merged = trees.merge([t0, t1])
    assert merged["items"][1][1] == {"t": "per_rank", "ranks": [5, 6]}
    t1["items"][0][1] = 0.2
    with pytest.raises(trees.TreeMismatch, match=r"wrap per-rank values in ckptlib\.PerRank"):
        trees.merge([t0, t1])


def test_retention_never_drops_newest():
    d = retention.decide([10, 20, 30, 40], keep_last=1, keep_every=20)
    assert [x.step for x in d if x.keep] == [40, 20]
    assert all(x.keep for x in retention.decide([5], keep_last=1, keep_every=None))
    with pytest.raises(ValueError):
        retention.decide([1], keep_last=0, keep_every=None)
