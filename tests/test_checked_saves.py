"""Checked before trusted (ckptlib/engine/checks.py): ``nonfinite="refuse"`` and
``check_replicas=True``. One process for the manager's own behaviour (retention keeps the good
step); several simulated ranks of one save for the every-rank verdicts (ckptlib/testing/
simulation.py). The multi-process runs with a memory tier: tests/distributed/test_every_step.py."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch

import ckptlib
from ckptlib.engine.save import SaveOptions, persist, prepare
from ckptlib.format import layout
from ckptlib.testing.simulation import SimCoordinator, SimStorage, World


def test_nan_with_refuse_fails_the_save_and_keep_last_one_keeps_the_good_step(tmp_path):
    model = torch.nn.Linear(4, 3)
    with ckptlib.CheckpointManager(tmp_path, keep_last=1, nonfinite="refuse", async_save=True) as mgr:
        mgr.save(1, {"model": model}).wait()
        with torch.no_grad():
            model.weight[1, 2] = math.nan
        with pytest.raises(ckptlib.NonFiniteError, match="model/weight"):
            mgr.save(2, {"model": model}).wait()
        with torch.no_grad():
            model.weight[1, 2] = math.inf
        with pytest.raises(ckptlib.NonFiniteError):
            mgr.save(3, {"model": model}).wait()
    assert [(i.step, i.status) for i in ckptlib.CheckpointManager(tmp_path).steps()] == [(1, "committed")]
    fresh = torch.nn.Linear(4, 3)
    assert ckptlib.CheckpointManager(tmp_path).restore({"model": fresh}) == 1
    assert torch.isfinite(fresh.weight).all()


def test_nonfinite_is_allowed_by_default_and_the_option_is_checked(tmp_path):
    with ckptlib.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.tensor([math.nan, 1.0])}).wait()
    with pytest.raises(ValueError, match="nonfinite"):
        ckptlib.CheckpointManager(tmp_path, nonfinite="sometimes")
    with pytest.raises(ValueError, match="check_replicas"):
        ckptlib.CheckpointManager(tmp_path, check_replicas="always")
    # 1 == True in Python: check_replicas=1 (an int from a command line) was accepted and then
    # acted as "auto" (the every-save check tests `is True`); it is refused, as is 0.
    for value in (1, 0, 1.0):
        with pytest.raises(ValueError, match="check_replicas must be one of True, False, 'auto', got"):
            ckptlib.CheckpointManager(tmp_path, check_replicas=value)
        with pytest.raises(ValueError, match="check_replicas"):
            SaveOptions(check_replicas=value)


FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_refuse_checks_float8_tensors(tmp_path, dtype, monkeypatch):
    """float8 weights (FP8 training) with nonfinite="refuse": finite ones commit, bitwise, and a
    NaN (every float8 type has one) or an Inf (float8_e5m2) is refused naming the tensor. torch's
    isfinite raised NotImplementedError for float8_e4m3fn and the fnuz types (every save failed)
    and called float8_e8m0fnu's NaN finite (committed). Small slices: the widening runs in several."""
    from ckptlib.engine import checks

    monkeypatch.setattr(checks, "FLOAT8_SLICE", 3, raising=False)
    good = torch.tensor([1.0, 2.0, 0.5, 4.0, 8.0, 0.25, 1.0]).to(dtype)
    with ckptlib.CheckpointManager(tmp_path, nonfinite="refuse", keep_last=1) as mgr:
        mgr.save(1, {"w": good, "i": torch.arange(5)}).wait()
        bad = [math.nan] + ([math.inf, -math.inf] if dtype == torch.float8_e5m2 else [])
        for step, value in enumerate(bad, start=2):
            w = good.clone()
            w.view(torch.uint8)[5] = torch.tensor([value]).to(dtype).view(torch.uint8)[0]
            assert not torch.isfinite(w[5:6].float()).all()
            with pytest.raises(ckptlib.NonFiniteError, match="/w"):
                mgr.save(step, {"w": w, "i": torch.arange(5)}).wait()
    assert [(i.step, i.status) for i in ckptlib.CheckpointManager(tmp_path).steps()] == [(1, "committed")]
    back = ckptlib.load(tmp_path / "step-000000000001")
    assert torch.equal(back["w"].view(torch.uint8), good.view(torch.uint8))


def _save(world: int, flip: int | None, nan: int | None, **opts) -> tuple[list, SimStorage]:
    w = World(world, seed=3, dead_after=10.0)
    storage = SimStorage(w)
    coords = [SimCoordinator(w, r) for r in range(world)]

    def body(r: int) -> None:
        rep = torch.arange(64, dtype=torch.float32)
        if r == flip:  # one bit of this rank's copy of a replicated tensor
            rep.view(torch.int32)[17] ^= 1 << 4
        shard = torch.full((2, 3), float(r))
        if r == nan:
            shard[1, 1] = math.nan
        state = {"rep": rep, "other": torch.ones(5), "w": ckptlib.Shard(shard, (2 * world, 3), (2 * r, 0))}
        persist(storage, layout.step_dir(7), prepare(state, r), step=7, coordinator=coords[r],
                options=SaveOptions(num_files=1, **opts))

    threads = [w.spawn(r, functools.partial(body, r)) for r in range(world)]
    w.run(until=600)
    return [t.error for t in threads], storage


@pytest.mark.parametrize("version", [1, 2])
def test_a_flipped_bit_in_one_ranks_replica_fails_the_save_on_every_rank_naming_it(version):
    errors, storage = _save(4, flip=2, nan=None, check_replicas=True, format_version=version)
    for e in errors:
        assert isinstance(e, ckptlib.ReplicaMismatchError), e
        assert "rank 2" in str(e) and "/rep" in str(e) and set(e.failures) == {2}
    assert not storage.commits and not any(k.startswith("step-000000000007/") for k in storage.files)


@pytest.mark.parametrize("flip", [0, 1])
def test_two_ranks_whose_copies_differ_are_both_named(flip):
    """Two copies that differ: neither is known to be the good one, so both ranks are named
    (the message said "rank 1" whichever rank's copy was flipped: rank 0 held the fault, the
    user was pointed at rank 1)."""
    errors, storage = _save(2, flip=flip, nan=None, check_replicas=True)
    for e in errors:
        assert isinstance(e, ckptlib.ReplicaMismatchError), e
        assert set(e.failures) == {0, 1} and "rank 0" in str(e) and "rank 1" in str(e) and "/rep" in str(e), e
        assert "no copy is held by a majority" in str(e), e
    assert not storage.commits


def test_replica_checks_pass_on_equal_copies_and_are_off_when_asked():
    errors, storage = _save(3, flip=None, nan=None, check_replicas=True)
    assert errors == [None] * 3 and len(storage.commits) == 1
    errors, storage = _save(3, flip=1, nan=None, check_replicas=False)  # not checked: committed as is
    assert errors == [None] * 3 and len(storage.commits) == 1


def test_a_nan_in_one_ranks_shard_fails_the_save_on_every_rank():
    errors, storage = _save(3, flip=None, nan=1, nonfinite="refuse")
    for e in errors:
        assert isinstance(e, ckptlib.NonFiniteError) and "rank 1" in str(e) and "/w" in str(e), e
    assert not storage.commits


def _tier_save(flip: int | None, check: bool | str = "auto", small: bool = False) -> tuple[list, list]:
    from ckptlib.tiers.local import LocalTier, save_local

    w = World(4, seed=2, dead_after=10.0)
    nodes = [SimStorage(w, f"sim://node{n}") for n in range(2)]
    tiers = [LocalTier(nodes[r // 2], r // 2, replicas=1) for r in range(4)]
    coords = [SimCoordinator(w, r) for r in range(4)]

    def body(r: int) -> None:
        rep = torch.arange(100_000, dtype=torch.float32)
        if r == flip:
            rep.view(torch.int32)[777] ^= 1
        state = {"rep": rep, "w": ckptlib.Shard(torch.full((1000,), float(r)), (4000,), (1000 * r,))}
        if small:  # small replicated tensors, a pack per writer; node 1's copy of /s01 has a flipped bit
            state = {f"s{i:02d}": torch.arange(8.0) + i for i in range(12)} | {"w": state["w"]}
            if r // 2 == 1 and flip is not None:
                state["s01"].view(torch.int32)[3] ^= 1
        save_local(tiers[r], layout.step_dir(1), prepare(state, r), step=1, metadata=None,
                   options=SaveOptions(num_files=1, check_replicas=check), coordinator=coords[r],
                   save_id="ab" * 16, created=0.0)

    threads = [w.spawn(r, functools.partial(body, r)) for r in range(4)]
    w.run(until=600)
    return [t.error for t in threads], [t.stats for t in tiers]


def test_a_tier_save_writes_replicated_pieces_on_each_node_from_its_own_memory():
    """2 nodes x 2 ranks, replicas=1: the 400 kB replicated tensor is written by one rank and
    rebuilt, byte for byte, by its peer on the other node from the peer's own copy; only the
    shards and index files (about 4 kB a rank) cross the network."""
    errors, stats = _tier_save(None)
    assert errors == [None] * 4
    assert sum(s.rebuilt for s in stats) == 400_000
    assert all(s.sent < 10_000 for s in stats), stats  # the replicated bytes never cross


def test_auto_check_catches_a_flipped_bit_in_the_rebuilding_peers_copy():
    errors, _ = _tier_save(None)
    assert errors == [None] * 4
    writer = 0  # the planner gives the one replicated tensor to rank 0 here; its peer on node 1 is rank 2
    errors, _ = _tier_save(2)
    for e in errors:
        assert isinstance(e, ckptlib.ReplicaMismatchError) and "/rep" in str(e) and 2 in e.failures, e
    assert f"rank {writer}'s copy" in str(errors[0])
    errors, _ = _tier_save(2, check=False)  # unchecked: committed; the bad copy is only a replica
    assert errors == [None] * 4


def test_auto_check_in_a_pack_of_small_tensors_says_which_could_differ():
    """Small replicated tensors share one checksum (a pack): the error named every tensor of the
    pack as differing ("/s01, /s03, ...: ... differ", all but one of them equal); it now says one
    or more of them differ."""
    errors, _ = _tier_save(2, small=True)
    for e in errors:
        assert isinstance(e, ckptlib.ReplicaMismatchError), e
        assert "/s01" in str(e) and "(small tensors packed under one checksum)" in str(e), e
        assert re.search(r"one or more of (/s\d\d, )+/s\d\d \(small", str(e)), e
