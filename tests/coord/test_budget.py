"""The per-save budget of store traffic (docs/scale.md, "Coordination at scale"), held on the
real save flow at growing world sizes on simulated ranks (ckptlib/testing/simulation.py counts
every round trip by rank). Budget: a non-coordinator's round trips per save are constant in
the world size; the coordinator's are O(ranks / 256) (one batched call per 256 keys) plus a
constant."""

from __future__ import annotations

import functools
import logging
import math

import pytest

from ckptlib.engine.save import SaveOptions, persist, prepare
from ckptlib.format import layout
from ckptlib.testing.sim_flows import state
from ckptlib.testing.simulation import BATCH, SimCoordinator, SimStorage, World

OTHER_BUDGET = 17
"""Round trips per save of a non-coordinator, at most (the last rank to report also wakes the
coordinator): begin (1), the plan (a share, a report, a share, an answer: 6), done (3), the
outcome with its read receipt (4), leaving (3)."""


def coordinator_budget(world: int) -> int:
    return 4 + 7 * math.ceil((world - 1) / BATCH)


def one_save(world: int) -> dict[int, int]:
    w = World(world, seed=5, dead_after=30.0)
    storage = SimStorage(w)
    coords = [SimCoordinator(w, r) for r in range(world)]

    def save(r: int) -> None:
        persist(storage, layout.step_dir(1), prepare(state(r, world), r), step=1, options=SaveOptions(num_files=1),
                coordinator=coords[r])

    threads = [w.spawn(r, functools.partial(save, r)) for r in range(world)]
    w.run(until=600)
    assert all(t.error is None for t in threads), [t.error for t in threads if t.error][:1]
    calls: dict[int, int] = {}
    for (r, op), n in w.calls.items():
        if op != "beat":
            calls[r] = calls.get(r, 0) + n
    return calls


@pytest.mark.parametrize("world", [2, 16, 300])
def test_store_round_trips_per_save_keep_to_the_budget(world, caplog):
    caplog.set_level(logging.ERROR, logger="ckptlib")
    calls = one_save(world)
    assert max(calls[r] for r in range(1, world)) <= OTHER_BUDGET, calls
    assert calls[0] <= coordinator_budget(world), (calls[0], coordinator_budget(world))
