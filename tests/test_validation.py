"""Arguments are checked when given, with messages that name the argument
(ckptlib/engine/options.py), and a load pointed at the wrong path says what to pass instead."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlib
from ckptlib.format import layout

BAD_MANAGER_ARGS = [
    ({"keep_last": "3"}, TypeError, "keep_last must be a positive int, got '3'"),
    ({"keep_last": 0}, ValueError, "keep_last must be a positive int, got 0"),
    ({"keep_last": True}, TypeError, "keep_last must be a positive int, got True"),
    ({"keep_every": 2.5}, TypeError, "keep_every must be a positive int, got 2.5"),
    ({"compression": "gzip"}, ValueError, "compression must be None or 'zstd', got 'gzip'"),
    ({"compression": 3}, TypeError, "compression must be None or 'zstd', got 3"),
    ({"async_save": "yes"}, TypeError, "async_save must be True or False, got 'yes'"),
    ({"in_flight": "drop"}, ValueError, "in_flight must be one of 'wait', 'skip', got 'drop'"),
    ({"save_timeout": 0}, ValueError, "save_timeout must be a positive, finite number, got 0"),
    ({"save_timeout": "60"}, TypeError, "save_timeout must be a positive number, got '60'"),
    ({"snapshot_timeout": float("nan")}, ValueError, "snapshot_timeout must be a positive, finite number"),
    ({"overlap": 1}, TypeError, "overlap must be True or False, got 1"),
    ({"persist_nice": "10"}, TypeError, "persist_nice must be an int or None, got '10'"),
]


@pytest.mark.parametrize(("kwargs", "exc", "message"), BAD_MANAGER_ARGS,
                         ids=[next(iter(k)) + "=" + repr(next(iter(k.values()))) for k, _, _ in BAD_MANAGER_ARGS])
def test_manager_arguments(tmp_path: Path, kwargs: dict[str, Any], exc: type[Exception], message: str) -> None:
    with pytest.raises(exc) as info:
        ckptlib.CheckpointManager(tmp_path / "run", **kwargs)
    assert message in str(info.value)
    assert not (tmp_path / "run").exists()  # refused before touching storage


BAD_TIER_ARGS = [
    ({"local_keep_last": "2"}, TypeError, "local_keep_last must be an int >= 1, got '2'"),
    ({"local_keep_last": 0}, ValueError, "local_keep_last must be an int >= 1, got 0"),
    ({"replicas": "1"}, TypeError, "replicas must be an int >= 0, got '1'"),
    ({"replicas": -1}, ValueError, "replicas must be an int >= 0, got -1"),
    ({"persist_every": 2.0}, TypeError, "persist_every must be an int >= 1, got 2.0"),
    ({"persist_every": 0}, ValueError, "persist_every must be an int >= 1, got 0"),
]


@pytest.mark.parametrize(("kwargs", "exc", "message"), BAD_TIER_ARGS,
                         ids=[next(iter(k)) + "=" + repr(next(iter(k.values()))) for k, _, _ in BAD_TIER_ARGS])
def test_manager_tier_arguments(tmp_path: Path, kwargs: dict[str, Any], exc: type[Exception], message: str) -> None:
    """The tier options are checked like the others (before the fix a string count failed deep
    in the tier's code with "'<' not supported between instances of 'str' and 'int'")."""
    with pytest.raises(exc) as info:
        ckptlib.CheckpointManager(tmp_path / "run", local=tmp_path / "local" / "{node}", **kwargs)
    assert message in str(info.value)
    assert not (tmp_path / "local").exists()  # refused before the local tier's folder is made


def test_manager_good_arguments_accepted(tmp_path: Path) -> None:
    with ckptlib.CheckpointManager(tmp_path, keep_last=2, keep_every=10, compression="zstd", save_timeout=30,
                                   snapshot_timeout=1.5, persist_nice=None, in_flight="skip") as mgr:
        assert mgr.options.keep_last == 2 and mgr.options.compression == "zstd"


BAD_SAVE_ARGS = [
    ({"compression": "gzip"}, ValueError, "compression must be None or 'zstd', got 'gzip'"),
    ({"overwrite": "no"}, TypeError, "overwrite must be True or False, got 'no'"),
]


@pytest.mark.parametrize(("kwargs", "exc", "message"), BAD_SAVE_ARGS, ids=["compression", "overwrite"])
def test_save_arguments_refused_at_call_time(
    tmp_path: Path, kwargs: dict[str, Any], exc: type[Exception], message: str
) -> None:
    with pytest.raises(exc, match=message):
        ckptlib.save({"w": torch.ones(2)}, tmp_path / "ck", **kwargs)
    assert os.listdir(tmp_path) == []  # nothing was created


def test_manager_bad_compression_fails_construction_not_wait(tmp_path: Path) -> None:
    """The old behaviour: accepted, and the error came from handle.wait() of the first save."""
    with pytest.raises(ValueError, match="compression"):
        ckptlib.CheckpointManager(tmp_path, compression="gzip")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_writer_arguments_checked_at_construction(tmp_path: Path) -> None:
    from ckptlib.integrations.dcp import CkptlibWriter

    with pytest.raises(ValueError, match="compression must be None or 'zstd', got 'lz4'"):
        CkptlibWriter(tmp_path, compression="lz4")
    with pytest.raises(ValueError, match="num_files must be a positive int, got 0"):
        CkptlibWriter(tmp_path, num_files=0)
    with pytest.raises(TypeError, match="timeout must be a positive number, got None"):
        CkptlibWriter(tmp_path, timeout=None)  # type: ignore[arg-type]


def test_strict_must_be_a_bool(tmp_path: Path) -> None:
    ckptlib.save({"w": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(TypeError, match="strict must be True or False, got 'no'"):
        ckptlib.load(tmp_path / "ck", into={"w": torch.zeros(2)}, strict="no")


def test_restore_into_none_is_refused_not_reported_as_restored(tmp_path: Path) -> None:
    """It returned the step (1) while loading nothing anywhere: a resume that looked done."""
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        with pytest.raises(TypeError, match="loads in place into the tensors of `state`, got None"):
            mgr.restore(None)
        with pytest.raises(TypeError, match="strict must be True or False, got 'no'"):
            mgr.restore({"w": torch.zeros(2)}, strict="no")  # type: ignore[call-overload]
        state = {"w": torch.zeros(2)}
        assert mgr.restore(state) == 1 and torch.equal(state["w"], torch.ones(2))


def test_save_after_close_says_what_happened_and_what_to_do(tmp_path: Path) -> None:
    with ckptlib.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    with pytest.raises(ckptlib.CheckpointError, match=r"save\(2\): this CheckpointManager is closed \(close\(\) ran, "
                       r"or its with block ended\); nothing was saved. Save before closing, or open a new manager"):
        mgr.save(2, {"w": torch.ones(2)})
    assert [i.step for i in mgr.steps()] == [1]


def test_verify_none_is_refused_not_a_silent_skip_of_every_checksum(tmp_path: Path) -> None:
    """``verify=None`` (falsy) loaded a checkpoint with a flipped bit without a word."""
    from helpers import flip_bit

    with ckptlib.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, {"w": torch.arange(64, dtype=torch.float32)})
    step = tmp_path / "run" / "step-000000000001"
    flip_bit(next(p for p in step.rglob("*.bin")), 8)
    with pytest.raises(TypeError, match="verify must be True or False, got None"):
        ckptlib.load(step, verify=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="verify must be True or False, got None"):
        ckptlib.open(tmp_path / "run", verify=None)  # type: ignore[arg-type]
    with ckptlib.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(TypeError, match="verify must be True or False, got None"):
            mgr.restore({"w": torch.zeros(64)}, verify=None)  # type: ignore[call-overload]
        with pytest.raises(ckptlib.CorruptCheckpointError):
            mgr.restore({"w": torch.zeros(64)})
    with pytest.raises(ckptlib.CorruptCheckpointError):
        ckptlib.load(step)


# --------------------------------------------------------------------------- wrong load paths


def test_load_a_file_says_pass_the_folder(tmp_path: Path) -> None:
    ckptlib.save({"w": torch.ones(2)}, tmp_path / "ck")
    for f in (tmp_path / "ck" / "manifest.json", tmp_path / "model.pt"):
        f.touch()
        with pytest.raises(ckptlib.CheckpointNotFoundError) as info:
            ckptlib.load(f)
        assert str(info.value) == f"{f} is a file; pass the checkpoint folder (the one holding manifest.json)"
        with pytest.raises(ckptlib.CheckpointNotFoundError, match="is a file"):
            ckptlib.load_metadata(f)


def test_load_a_run_root_points_to_a_step_or_restore(tmp_path: Path) -> None:
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        for step in (3, 5, 7):
            mgr.save(step, {"w": torch.full((2,), float(step))})
    with pytest.raises(ckptlib.CheckpointNotFoundError) as info:
        ckptlib.load(tmp_path)
    msg = str(info.value)
    assert f"{tmp_path} is a run root holding steps 3, 5, 7; pass a step folder" in msg
    assert f"{tmp_path}/{layout.step_dir(7)}" in msg and ".restore(state)" in msg and "ckptlib.open(" in msg
    # The suggested folder is one that loads.
    assert torch.equal(ckptlib.load(tmp_path / layout.step_dir(7))["w"], torch.full((2,), 7.0))


def test_load_an_empty_or_unrelated_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckptlib.CheckpointNotFoundError, match="is an empty folder"):
        ckptlib.load(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.bin").write_bytes(b"x")
    with pytest.raises(ckptlib.CheckpointNotFoundError, match=r"files ckptlib did not write \(a.bin\)"):
        ckptlib.load(tmp_path / "other")
    # A safetensors folder is read (docs/read.md), so a broken .safetensors file is a corrupt
    # checkpoint that says which file and why, not "no checkpoint here".
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "a.safetensors").write_bytes(b"x")
    with pytest.raises(ckptlib.CorruptCheckpointError, match=r"a.safetensors: .*needs at least 8 bytes"):
        ckptlib.load(tmp_path / "st")


def test_load_a_damaged_checkpoint_keeps_its_own_error(tmp_path: Path) -> None:
    """Only wrong paths get the "pass instead" message; a broken checkpoint still says what broke."""
    ckptlib.save({"w": torch.ones(2)}, tmp_path / "ck")
    (tmp_path / "ck" / "manifest.json").write_text("{")
    with pytest.raises(ckptlib.CorruptCheckpointError):
        ckptlib.load(tmp_path / "ck")
    with pytest.raises(ckptlib.CheckpointNotFoundError, match="no manifest"):
        ckptlib.load(tmp_path / "missing")


@pytest.mark.parametrize(("step", "exc", "message"), [
    ("3", TypeError, "step must be an int, got '3'"),
    (3.0, TypeError, "step must be an int, got 3.0"),
    (True, TypeError, "step must be an int, got True"),
    (-1, ValueError, "step must be from 0 to 99999999999999999999, got -1"),
    (10**20, ValueError, "step must be from 0 to 99999999999999999999, got 100000000000000000000"),
])
def test_step_numbers_are_ints_a_folder_name_can_hold(tmp_path: Path, step: Any, exc: type[Exception],
                                                      message: str) -> None:
    """A step is an int from 0 to 10**20 - 1 (the 20 digits a step folder's name holds): a
    string, a float or a bool is refused by name, and a step too large to list again is refused
    when saved rather than written and never seen."""
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(3, {"w": torch.ones(2)})
        with pytest.raises(exc, match=message.replace("(", r"\(")):
            ckptlib.open(tmp_path, step=step)
        with pytest.raises(ValueError, match="step must be an int from 0 to 99999999999999999999"):
            mgr.save(step, {"w": torch.ones(2)})
    assert layout.step_dir(layout.MAX_STEP) == "step-" + "9" * 20
    assert [i.step for i in ckptlib.CheckpointManager(tmp_path).steps()] == [3]


def test_should_save_and_drain_rate_are_checked(tmp_path: Path) -> None:
    """``should_save(step)`` takes the steps ``save`` takes (it used to answer True for -5 and
    raise a raw TypeError for None); ``drain_rate`` is None (no limit) or a positive finite
    number of bytes/s (0 and -1 used to mean "no limit" silently)."""
    with ckptlib.CheckpointManager(tmp_path / "a", async_save=False, save_interval_steps=5) as mgr:
        with pytest.raises(ValueError, match="step must be from 0"):
            mgr.should_save(-5)
        with pytest.raises(TypeError, match="step must be an int, got None"):
            mgr.should_save(None)  # type: ignore[arg-type]
        assert [s for s in range(12) if mgr.should_save(s)] == [0, 5, 10]
    for rate in (0, -1, float("inf"), float("nan"), "1e6", True):
        with pytest.raises(ValueError, match="drain_rate must be None"):
            ckptlib.CheckpointManager(tmp_path / "b", local=tmp_path / "local", drain_rate=rate)
    ckptlib.CheckpointManager(tmp_path / "b", local=tmp_path / "local", drain_rate=1e9).close()


def test_tier_settings_without_a_tier_are_refused(tmp_path: Path) -> None:
    """``persist_every``, ``replicas`` and the other tier settings mean nothing without
    ``local=``: passing one used to be ignored silently (a job meant to drain every 10th save
    wrote every save to the persistent tier, with no node-local copy). Now it is refused, naming
    each setting; the defaults alone are accepted."""
    with pytest.raises(ValueError, match=r"replicas=2, persist_every=10: these set the node-local tier"):
        ckptlib.CheckpointManager(tmp_path / "a", persist_every=10, replicas=2)
    for kw in ({"local_keep_last": 5}, {"replica_jump": 2}, {"drain_rate": 1e9}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}=.*pass local="):
            ckptlib.CheckpointManager(tmp_path / "a", **kw)
    ckptlib.CheckpointManager(tmp_path / "a", persist_every=1, replicas=1, local_keep_last=2).close()
