"""keep_best retention: metrics in the manifest, StepInfo and `ckptlib ls --json`; the best k
kept with keep_last/keep_every; the newest committed step never deleted; argument errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import ckptlib
from ckptlib.cli.main import main as cli_main
from ckptlib.format import build, decode
from ckptlib.plan import retention


def state(v: float) -> dict:
    return {"w": torch.full((4,), float(v))}


def committed_steps(mgr: ckptlib.CheckpointManager) -> list[int]:
    return [i.step for i in mgr.steps() if i.status == "committed"]


LOSSES = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.1, 5: 0.8, 6: 0.7, 7: 0.95}


@pytest.mark.parametrize("async_save", [False, True])
def test_keep_best_min_with_keep_last(tmp_path, async_save):
    with ckptlib.CheckpointManager(tmp_path, keep_last=2, keep_best=2, best_metric="val_loss",
                                   async_save=async_save) as mgr:
        for step, loss in LOSSES.items():
            mgr.save(step, state(step), metrics={"val_loss": loss, "acc": 1 - loss}).wait(timeout=60)
        # newest 2 (6, 7) + best 2 by val_loss (4: 0.1, 2: 0.3)
        assert committed_steps(mgr) == [2, 4, 6, 7]
        infos = {i.step: i for i in mgr.steps()}
        assert infos[4].metrics == {"val_loss": 0.1, "acc": 0.9}
    # the kept best step restores its own bytes
    target = state(0.0)
    assert ckptlib.CheckpointManager(tmp_path).restore(target, step=4) == 4
    assert torch.equal(target["w"], torch.full((4,), 4.0))


def test_keep_best_max_alone_keeps_newest_even_if_worst(tmp_path):
    with ckptlib.CheckpointManager(tmp_path, keep_best=1, best_metric="acc", best_mode="max",
                                   async_save=False) as mgr:
        for step, loss in LOSSES.items():
            mgr.save(step, state(step), metrics={"acc": 1 - loss})
        # best acc is step 4; step 7 is the worst but the newest committed: never deleted
        assert committed_steps(mgr) == [4, 7]


def test_steps_without_metric_rank_worst_and_keep_every(tmp_path):
    with ckptlib.CheckpointManager(tmp_path, keep_best=2, best_metric="val_loss", keep_every=3,
                                   async_save=False) as mgr:
        mgr.save(1, state(1), metrics={"val_loss": 5.0})
        mgr.save(2, state(2))  # no metrics at all
        mgr.save(3, state(3), metrics={"other": 0.0})  # other metric only: worst, but keep_every
        mgr.save(4, state(4), metrics={"val_loss": 7.0})
        mgr.save(5, state(5))
        # best 2 with the metric: 1 and 4; 3 by keep_every; 5 newest; 2 deleted
        assert committed_steps(mgr) == [1, 3, 4, 5]
        mgr.save(6, state(6), metrics={"val_loss": 1.0})
        # best 2 now 6 and 1; 4 loses; 3 and 6 by keep_every
        assert committed_steps(mgr) == [1, 3, 6]


def test_missing_metric_fills_best_when_too_few_have_it():
    ds = retention.decide([1, 2, 3, 4], None, None, keep_best=3, best_metric="m",
                          metrics={1: {"m": 1.0}, 2: {}, 3: {}})
    kept = sorted(d.step for d in ds if d.keep)
    # 1 (has it), then newer metric-less first: 3, and 4 is newest anyway
    assert kept == [1, 3, 4]
    ties = retention.best_steps([1, 2, 3], {1: {"m": 0.0}, 2: {"m": 0.0}, 3: {"m": 1.0}}, 1, "m", "min")
    assert ties == [2]  # a tie goes to the newer step


def test_metrics_in_manifest_and_ls_json(tmp_path, capsys):
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state(1), metrics={"val_loss": np.float32(0.25), "epoch": 3, "t": torch.tensor(2.5)})
        mgr.save(2, state(2))
    m = ckptlib.CheckpointManager(tmp_path).steps()[0].manifest
    assert m is not None and m.metrics == {"val_loss": 0.25, "epoch": 3.0, "t": 2.5}
    assert all(type(v) is float for v in m.metrics.values())
    assert cli_main(["ls", str(tmp_path), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows[1]["metrics"] == {"val_loss": 0.25, "epoch": 3.0, "t": 2.5}
    assert rows[2]["metrics"] is None


@pytest.mark.parametrize(
    "metrics, match",
    [
        ([("a", 1.0)], "metrics must be a dict"),
        ({"a": math.nan}, r"metrics\['a'\] must be finite"),
        ({"a": math.inf}, r"metrics\['a'\] must be finite"),
        ({"a": "1.0"}, r"metrics\['a'\] must be a number"),
        ({"a": True}, r"metrics\['a'\] must be a number"),
        ({"a": {"b": 1.0}}, r"metrics\['a'\] must be a number"),
        ({"a": torch.ones(2)}, r"metrics\['a'\] must be a single number"),
        ({1: 1.0}, "metrics key 1 must be a non-empty str"),
        ({"": 1.0}, "metrics key '' must be a non-empty str"),
    ],
)
def test_bad_metrics_refused_before_saving(tmp_path, metrics, match):
    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(ValueError, match=match):
            mgr.save(1, state(1), metrics=metrics)
        assert mgr.steps() == []


def test_decode_refuses_bad_metrics_in_manifest():
    m = decode.decode(build.encode_body(build.build_body([{"files": [], "chunks": [], "shapes": {}}], 1,
                                                         "ab" * 8, 0.0, "rename", None, "x", tree={})))
    assert m.metrics == {}
    body = build.build_body([{"files": [], "chunks": [], "shapes": {}}], 1, "ab" * 8, 0.0, "rename", None, "x",
                            tree={}, metrics={"a": 1.0})
    assert decode.decode(build.encode_body(body)).metrics == {"a": 1.0}
    for bad in ({"a": "x"}, {"a": [1.0]}, [1.0]):
        body["metrics"] = bad
        with pytest.raises(ckptlib.CorruptCheckpointError, match="metrics"):
            decode.decode(build.encode_body(body))
    del body["metrics"]  # manifests written before metrics existed
    assert decode.decode(build.encode_body(body)).metrics == {}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"keep_best": 0, "best_metric": "m"}, "keep_best must be an int >= 1"),
        ({"keep_best": "2", "best_metric": "m"}, "keep_best must be an int >= 1"),
        ({"keep_best": True, "best_metric": "m"}, "keep_best must be an int >= 1"),
        ({"keep_best": 2}, "keep_best=2 needs best_metric="),
        ({"keep_best": 2, "best_metric": ""}, "keep_best=2 needs best_metric="),
        ({"keep_best": 2, "best_metric": "m", "best_mode": "lowest"}, "best_mode must be 'min' or 'max'"),
    ],
)
def test_bad_keep_best_arguments_name_the_argument(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ckptlib.CheckpointManager(tmp_path, **kwargs)


def test_docs_training_examples_run(tmp_path):
    """docs/training.md's examples run as written (paths moved under tmp_path) and print what
    the page says they print."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 2
    env = {"PYTHONPATH": str(Path(ckptlib.__file__).parents[1]), "PATH": "/usr/bin:/bin"}
    for i, code in enumerate(blocks):
        code = code.replace('"/tmp/', f'"{tmp_path}/')
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, f"example {i}:\n{out.stderr}"
        expected = re.findall(r"^# (\[.*\])$", code, re.M)
        if expected:
            assert out.stdout.strip() == expected[0]
