"""The ZeRO partition arithmetic of ckptlib's DeepSpeed resharding (pure; no DeepSpeed needed).

:func:`ckptlib.integrations.deepspeed.partitions.copy_plan` is checked against an independent
model of DeepSpeed 0.19's layouts: ZeRO 1/2 lay a group's parameters end to end (each padded to
``align`` elements but the last, in any order: ``round_robin_gradients``), pad the buffer to
``2 * dp`` and cut it into ``dp`` parts; ZeRO 3 cuts every parameter into ``dp`` parts of
``ceil(numel / dp)`` and a rank lays its parts end to end. The real DeepSpeed runs are in
test_deepspeed.py.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import ckptlib
from ckptlib.integrations.deepspeed.partitions import Flat, Layout, copy_plan


def _flat_layout(numels: list[int], dp: int, align: int, order: list[int]) -> tuple[Layout, torch.Tensor]:
    offsets, at = [0] * len(numels), 0
    for i, k in enumerate(order):
        offsets[k] = at
        at += numels[k] + (0 if i == len(order) - 1 else -(at + numels[k]) % align)
    total = -(-at // (2 * dp)) * 2 * dp
    buf = torch.zeros(total, dtype=torch.float64)
    for k in order:
        buf[offsets[k]:offsets[k] + numels[k]] = _values(k, numels[k])
    names = [f"p{k}" for k in order]
    flat = Flat(tuple(names), tuple(numels[k] for k in order), tuple(offsets[k] for k in order), total // dp)
    return Layout("DeepSpeedZeroOptimizer", dp, (flat,)), buf.view(dp, -1)


def _per_param_layout(numels: list[int], dp: int) -> tuple[Layout, torch.Tensor]:
    parts = [-(-n // dp) for n in numels]
    ranks = torch.zeros(dp, sum(parts), dtype=torch.float64)
    for k, (n, part) in enumerate(zip(numels, parts, strict=True)):
        padded = torch.zeros(part * dp, dtype=torch.float64)
        padded[:n] = _values(k, n)
        at = sum(parts[:k])
        ranks[:, at:at + part] = padded.view(dp, part)
    offsets = tuple(sum(parts[:k]) for k in range(len(numels)))
    flat = Flat(tuple(f"p{k}" for k in range(len(numels))), tuple(numels), offsets, sum(parts), tuple(parts))
    return Layout("DeepSpeedZeroOptimizer_Stage3", dp, (flat,)), ranks


def _values(k: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) + 1 + 10_000 * k


def _apply(saved_parts: torch.Tensor, saved: Layout, current: Layout, rank: int) -> torch.Tensor:
    out = torch.zeros(current.flats[0].partition, dtype=torch.float64)
    hit = torch.zeros_like(out, dtype=torch.int64)
    for c in copy_plan(saved, current, rank)[0]:
        out[c.dst:c.dst + c.length] = saved_parts[c.rank, c.src:c.src + c.length]
        hit[c.dst:c.dst + c.length] += 1
    assert int(hit.max()) <= 1, "two copies wrote the same elements"
    return out


@pytest.mark.parametrize("style", ["flat", "per_param"])
def test_copy_plan_rebuilds_every_partition_at_every_size(style):
    rng = random.Random(7)
    for _ in range(20):
        numels = [rng.choice([1, 2, 3, 7, 31, 64, 100, 257]) for _ in range(rng.randint(1, 7))]
        align = rng.choice([1, 1, 4, 8])
        for dp_saved, dp_new in itertools.permutations([1, 2, 3, 4, 8], 2):
            if style == "flat":
                order = list(range(len(numels)))
                new_order = order if rng.random() < 0.5 else rng.sample(order, len(order))  # round robin
                saved, parts = _flat_layout(numels, dp_saved, align, order)
                current, want = _flat_layout(numels, dp_new, rng.choice([1, align]), new_order)
            else:
                saved, parts = _per_param_layout(numels, dp_saved)
                current, want = _per_param_layout(numels, dp_new)
            saved = Layout.from_json(saved.to_json(), "test")  # what a tag stores
            for rank in range(dp_new):
                assert torch.equal(_apply(parts, saved, current, rank), want[rank]), (numels, dp_saved, dp_new, rank)


def test_copy_plan_merges_adjacent_ranges():
    saved, _ = _flat_layout([100, 50, 30], 2, 1, [0, 1, 2])
    current, _ = _flat_layout([100, 50, 30], 1, 1, [0, 1, 2])
    copies = copy_plan(saved, current, 0)[0]
    assert [(c.rank, c.src, c.dst, c.length) for c in copies] == [(0, 0, 0, 90), (1, 0, 90, 90)]


def test_copy_plan_refuses_a_model_with_other_parameters():
    saved, _ = _flat_layout([10, 20], 2, 1, [0, 1])
    other, _ = _flat_layout([10, 21], 1, 1, [0, 1])
    with pytest.raises(ckptlib.StateMismatchError, match=r"different sizes: p1 \(20 saved, 21 now\)"):
        copy_plan(saved, other, 0)
    renamed = Layout(other.optimizer, 1, (Flat(("p0", "q"), (10, 20), (0, 10), 30),))
    with pytest.raises(ckptlib.StateMismatchError, match="not in the checkpoint: q; not in the model: p1"):
        copy_plan(saved, renamed, 0)


@pytest.mark.parametrize("change", [
    {"version": 2}, {"optimizer": "Adam"}, {"dp": 0}, {"flats": {}},
    {"flats": [{"names": ["a", "b"], "numels": [4, 4], "offsets": [0, 3], "partition": 4}]},  # overlap
    {"flats": [{"names": ["a"], "numels": [9], "offsets": [0], "partition": 4}]},  # beyond 2 x 4
    {"flats": [{"names": ["a"], "numels": [4], "offsets": [0], "partition": 4}] * 2},  # a twice
    {"flats": [{"names": ["a"], "numels": [-1], "offsets": [0], "partition": 4}]},
    {"flats": [{"names": ["a"], "numels": [4, 4], "offsets": [0], "partition": 4}]},
])
def test_malformed_layout_is_refused(change):
    good = {"version": 1, "optimizer": "DeepSpeedZeroOptimizer", "dp": 2,
            "flats": [{"names": ["a", "b"], "numels": [4, 3], "offsets": [0, 4], "partition": 4}]}
    assert Layout.from_json(good, "x").flats[0].names == ("a", "b")
    with pytest.raises(ckptlib.CorruptCheckpointError, match="ZeRO partition layout"):
        Layout.from_json({**good, **change}, "x")


def test_per_param_layout_needs_parts_that_cover_each_parameter():
    bad = {"version": 1, "optimizer": "DeepSpeedZeroOptimizer_Stage3", "dp": 2,
           "flats": [{"names": ["a"], "numels": [9], "offsets": [0], "parts": [4], "partition": 4}]}
    with pytest.raises(ckptlib.CorruptCheckpointError, match="does not fit its parts"):
        Layout.from_json(bad, "x")
