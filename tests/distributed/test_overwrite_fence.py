"""A 2-rank gloo job on the real SeaweedFS server saves a step again with ``overwrite=True``
while its coordinator is frozen (SIGSTOP) in its publish: the other rank fences the save and
reports failure, the woken coordinator raises "fenced" too, and the step it was replacing is
still committed and loads (engine/commit.py: the claim of an overwrite save).

Workers: tests/workers/overwrite_worker.py; the helpers of tests/distributed/test_fence.py.
"""

from __future__ import annotations

import json
import os
import signal

import torch
from backends.conftest import s3_root

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.engine import retire
from ckptlib.engine.scan import scan
from ckptlib.format import layout

from . import launch
from .launch import start
from .test_fence import ENV, T, _kill, _poll

WORKER = launch.WORKER.with_name("overwrite_worker.py")
STEP = 7


def test_frozen_coordinator_of_an_overwrite_cannot_lose_the_old_step(seaweed, tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "WORKER", WORKER)
    url, opts = s3_root(seaweed)
    log = tmp_path / "kills.jsonl"
    env = {**ENV, "CKPTLIB_TEST_KILL_LOG": str(log)}
    procs = start("overwrite", 2, tmp_path, {"url": url, "options": opts, "step": STEP}, env)
    storage = open_storage(url, opts)
    try:
        r1 = _poll(tmp_path / "result-overwrite-1.json", procs, 1, 240)
        assert r1["error"] == "CommitError", r1
        assert "rank 0" in r1["message"] and "fenced" in r1["message"], r1
        stopped = json.loads(log.read_text().splitlines()[0])
        assert (stopped["phase"], stopped["nth"]) == ("manifest", 2), stopped
        assert r1["time"] - stopped["time"] < 3 * T + 10, (r1, stopped)  # bounded; loose on purpose
        assert procs[0].poll() is None and not (tmp_path / "result-overwrite-0.json").exists()
        infos = scan(storage)
        assert [(i.step, i.status, i.save_id) for i in infos] == [(STEP, "committed", r1["first"])], infos

        os.kill(procs[0].pid, signal.SIGCONT)
        r0 = _poll(tmp_path / "result-overwrite-0.json", procs, 0, 120)
    finally:
        _kill(procs)
    assert r0["error"] == "CommitError" and "fenced" in r0["message"], r0
    assert r0["first"] == r1["first"]
    infos = scan(storage, deep=True)
    assert [(i.step, i.status, i.save_id) for i in infos] == [(STEP, "committed", r1["first"])], infos
    back = ckptlib.load(f"{url}/{layout.step_dir(STEP)}", storage_options=opts)
    assert back["gen"] == 1 and torch.equal(back["w"], torch.arange(5000, dtype=torch.float32))
    # The woken coordinator removed its payloads and the fence's claim (a fenced save's abort).
    assert retire.find_debris(storage, None) == []
    assert [e.name for e in storage.listdir(layout.step_dir(STEP))] == sorted([r1["first"], "manifest.json"])
    assert [(i.step, i.status) for i in scan(storage, deep=True)] == [(STEP, "committed")]
