"""``CheckpointManager(folder).restore(state)`` on a folder written by ``ckptlib.save`` (a single
checkpoint, not a run root) returned None, "nothing was ever committed": the loop trained from
scratch beside the checkpoint. It now raises ``CheckpointNotFoundError`` saying what the folder
is and how to load it, on every rank of a real 2-process gloo job (rank 0, which lists the root, raises it; the
others a ``CommitError`` quoting it, as for any failure of the coordinator's listing).
"""

from __future__ import annotations

import json
from pathlib import Path

import launcher
import pytest
import torch

import ckptlib

WORKER = """
import json, sys, torch, torch.distributed as dist, ckptlib
rank, folder, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=2)
mgr = ckptlib.CheckpointManager(folder, save_timeout=60)
try:
    got = mgr.restore({"w": torch.zeros(4)})
    result = {"returned": got}
except ckptlib.CheckpointError as e:
    result = {"error": type(e).__name__, "message": str(e)}
open(out, "w").write(json.dumps(result))
dist.destroy_process_group()
"""


def message(folder: Path) -> str:
    return (f"{folder} is a single checkpoint written by ckptlib.save() (it holds manifest.json), not a "
            f"CheckpointManager run root: load it with ckptlib.load({str(folder)!r}, into=state)")


def test_restore_on_a_one_shot_folder_says_what_it_is(tmp_path: Path) -> None:
    w = torch.arange(4, dtype=torch.float32)
    ckptlib.save({"w": w}, tmp_path / "one")
    before = sorted(p.name for p in (tmp_path / "one").iterdir())
    with ckptlib.CheckpointManager(tmp_path / "one") as mgr:
        with pytest.raises(ckptlib.CheckpointNotFoundError) as info:
            mgr.restore({"w": torch.zeros(4)})
        assert message(tmp_path / "one") in str(info.value)
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == before
    assert torch.equal(ckptlib.load(tmp_path / "one", into={"w": torch.zeros(4)})["w"], w)
    with ckptlib.CheckpointManager(tmp_path / "fresh") as mgr:  # a new root: first run, None
        assert mgr.restore({"w": torch.zeros(4)}) is None


def test_every_rank_raises_it(tmp_path: Path) -> None:
    ckptlib.save({"w": torch.ones(4)}, tmp_path / "one")
    procs = launcher.start(lambda r, port: ["-c", WORKER, str(r), str(tmp_path / "one"),
                                            str(tmp_path / f"r{r}.json")], 2)
    out = launcher.finish("one-shot restore", procs, lambda r: tmp_path / f"r{r}.json", timeout=180)
    for o in out:
        assert o.returncode == 0 and o.result is not None, o.log
        assert message(tmp_path / "one") in o.result.get("message", ""), json.dumps(o.result)
    assert out[0].result["error"] == "CheckpointNotFoundError"  # the coordinator lists the root
    # rank 1 learns it from the coordinator at once, as any failure of the listing
    assert out[1].result["message"].startswith("coordination failed during restore: rank 0: CheckpointNotFoundError")
