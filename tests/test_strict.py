"""``load(url, into=state, strict=...)`` and ``CheckpointManager.restore(state, strict=...)``:
strict (default) raises naming every key missing on either side before anything is read or
changed; ``strict=False`` loads what matches and returns the rest as ``.missing``/``.unexpected``."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same
from torch import nn

import ckptlib

SAVED = {"model": {"w": torch.arange(4.0), "b": torch.ones(2), "gone": torch.ones(1)},
         "opt": {"lr": 0.1, "moms": [torch.full((2,), 3.0)]}, "step": 7}


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    ckptlib.save(SAVED, tmp_path / "ck")
    return tmp_path / "ck"


def target() -> dict[str, Any]:
    """SAVED's shape, minus /model/gone, plus /model/new and /extra."""
    return {"model": {"w": torch.zeros(4), "b": torch.zeros(2), "new": torch.zeros(3)},
            "opt": {"lr": 0.5, "moms": [torch.zeros(2)]}, "step": 0, "extra": "mine"}


def test_strict_names_every_key_on_both_sides_and_changes_nothing(ck: Path) -> None:
    into = target()
    before = copy.deepcopy(into)
    with pytest.raises(ckptlib.StateMismatchError) as info:
        ckptlib.load(ck, into=into)
    msg = str(info.value)
    assert "in the target but not in the checkpoint: /model/new, /extra" in msg
    assert "in the checkpoint but not in the target: /model/gone" in msg
    assert "strict=False" in msg
    assert_same(into, before)  # no tensor filled, no value replaced


@pytest.mark.parametrize("side", ["missing", "unexpected"])
def test_strict_one_side(ck: Path, side: str) -> None:
    into = copy.deepcopy(SAVED)
    if side == "missing":
        into["opt"]["wd"] = 0.0
        match = r"in the target but not in the checkpoint: /opt/wd\. Nothing"
    else:
        del into["step"]
        match = r"in the checkpoint but not in the target: /step\. Nothing"
    with pytest.raises(ckptlib.StateMismatchError, match=match):
        ckptlib.load(ck, into=into)


def test_not_strict_loads_what_matches_and_reports_the_rest(ck: Path) -> None:
    into = target()
    w = into["model"]["w"]
    res = ckptlib.load(ck, into=into, strict=False)
    assert isinstance(res, ckptlib.LoadResult) and res.state is into and res.step is None
    assert res.missing == ["/model/new", "/extra"]
    assert res.unexpected == ["/model/gone"]
    assert into["model"]["w"] is w  # filled in place
    assert_same(into, {"model": {"w": torch.arange(4.0), "b": torch.ones(2), "new": torch.zeros(3)},
                       "opt": {"lr": 0.1, "moms": [torch.full((2,), 3.0)]}, "step": 7, "extra": "mine"})


def test_matching_keys_strict_returns_the_state_itself(ck: Path) -> None:
    into = copy.deepcopy(SAVED)
    for t in (into["model"]["w"], into["model"]["b"]):
        t.zero_()
    assert ckptlib.load(ck, into=into) is into
    assert_same(into, SAVED)
    res = ckptlib.load(ck, into=into, strict=False)
    assert res.missing == [] and res.unexpected == []


def test_strict_does_not_apply_without_a_target(ck: Path) -> None:
    assert_same(ckptlib.load(ck, strict=True), SAVED)
    assert_same(ckptlib.load(ck, strict=False), SAVED)


def test_many_keys_are_counted(tmp_path: Path) -> None:
    ckptlib.save({f"k{i:02d}": i for i in range(30)}, tmp_path / "ck")
    with pytest.raises(ckptlib.StateMismatchError, match=r"/k19 and 10 more\. Nothing"):
        ckptlib.load(tmp_path / "ck", into={"other": 1})


# --------------------------------------------------------------------------- modules, optimizers


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    m(torch.ones(4, 3)).sum().backward()
    opt.step()
    return m, opt


def test_fresh_optimizer_takes_the_saved_state(tmp_path: Path) -> None:
    """A fresh optimizer's empty ``state`` is a container to fill, not a key mismatch."""
    m, opt = _trained()
    ckptlib.save({"m": m, "opt": opt}, tmp_path / "ck")
    m2 = nn.Linear(3, 2)
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.5)
    assert opt2.state_dict()["state"] == {}
    ckptlib.load(tmp_path / "ck", into={"m": m2, "opt": opt2})  # strict
    assert_same(m2.state_dict(), m.state_dict())
    assert_same(opt2.state_dict(), opt.state_dict())


@pytest.mark.parametrize("strict", [True, False])
def test_optimizer_over_other_parameters_is_refused_before_reading(tmp_path: Path, strict: bool) -> None:
    """An optimizer built over more parameters than the saved one (a layer added): its state
    cannot be loaded in part, so the load refuses by name before anything is read or changed
    (it raised torch's ValueError from load_state_dict, after the model was loaded)."""
    m, opt = _trained()
    ckptlib.save({"m": m, "opt": opt}, tmp_path / "ck")
    m2 = nn.Linear(3, 2)
    extra = nn.Parameter(torch.zeros(4))
    opt2 = torch.optim.Adam([*m2.parameters(), extra], lr=0.5)
    weight = m2.weight.detach().clone()
    with pytest.raises(ckptlib.StateMismatchError,
                       match=re.escape("/opt/param_groups: checkpoint has parameter groups of [2] parameters, "
                                       "the optimizer [3]")):
        ckptlib.load(tmp_path / "ck", into={"m": m2, "opt": opt2}, strict=strict)
    assert torch.equal(m2.weight, weight) and opt2.state_dict()["state"] == {}


def test_module_with_an_extra_buffer(tmp_path: Path) -> None:
    m, _ = _trained()
    ckptlib.save({"m": m}, tmp_path / "ck")
    m2 = nn.Linear(3, 2)
    m2.register_buffer("scale", torch.full((2,), 9.0))
    with pytest.raises(ckptlib.StateMismatchError, match=r"not in the checkpoint: /m/scale\. Nothing"):
        ckptlib.load(tmp_path / "ck", into={"m": m2})
    assert torch.equal(m2.scale, torch.full((2,), 9.0))
    res = ckptlib.load(tmp_path / "ck", into={"m": m2}, strict=False)
    assert res.missing == ["/m/scale"] and res.unexpected == []
    assert torch.equal(m2.weight, m.weight) and torch.equal(m2.scale, torch.full((2,), 9.0))


# --------------------------------------------------------------------------- manager restore


def test_manager_restore_strict_and_not(tmp_path: Path) -> None:
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(4, SAVED)
        into = target()
        before = copy.deepcopy(into)
        with pytest.raises(ckptlib.StateMismatchError, match=r"/model/new, /extra.*/model/gone"):
            mgr.restore(into)
        assert_same(into, before)
        res = mgr.restore(into, strict=False)
        assert isinstance(res, ckptlib.LoadResult)
        assert (res.step, res.missing, res.unexpected) == (4, ["/model/new", "/extra"], ["/model/gone"])
        assert torch.equal(into["model"]["w"], torch.arange(4.0)) and into["extra"] == "mine"
        assert mgr.restore(copy.deepcopy(SAVED)) == 4  # strict and matching: the step, as before
    with ckptlib.CheckpointManager(tmp_path / "none") as empty:
        assert empty.restore(target(), strict=False) is None


def test_renamed_keys_are_matched_to_tied_weights_in_linear_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Loading into a dict whose keys all differ from the checkpoint's (a "module." prefix, renamed
    # layers) went over every key of the dict again for each missing key (tied weights): 20,000 keys took
    # 39 s, 100,000 keys hours. Counted, not timed: the exact check (once per missing key before) now runs only for tensors that share
    # an address. A tied weight (two keys, one memory) is still loaded through the key that matches.
    from ckptlib.engine import load as load_mod

    n = 3000
    saved = {f"w{i}": torch.full((2,), float(i)) for i in range(n)}
    ckptlib.save(saved, tmp_path / "ck")
    target: dict[str, Any] = {f"module.w{i}": torch.zeros(2) for i in range(n)}
    target["w7"] = torch.zeros(2)
    target["tied"] = target["w7"]  # the same tensor under a key the checkpoint lacks
    target["tied_view"] = target["w7"].view(2)  # another object over the same memory
    calls = 0
    same = load_mod._same_memory

    def counting(a: Any, b: Any) -> bool:
        nonlocal calls
        calls += 1
        return same(a, b)

    monkeypatch.setattr(load_mod, "_same_memory", counting)
    result = ckptlib.load(tmp_path / "ck", into=target, strict=False)
    assert calls < 100, calls
    assert torch.equal(target["w7"], saved["w7"]) and target["tied"] is target["w7"]
    assert torch.equal(target["tied_view"], saved["w7"])
    assert sorted(result.missing) == sorted(f"/module.w{i}" for i in range(n))
    assert len(result.unexpected) == n - 1
