"""DeepSpeed integration with the real package on CPU (DS_BUILD_OPS=0, gloo, real processes).

One module-scoped run of three jobs (tests/workers/ds_worker.py), then assertions on what they
recorded and left on disk:

1. ``train`` (2 ranks): ZeRO stages 0, 2 and 3 save global_step2 and global_step4 through
   ``engine.save_checkpoint``; stage 0 also saves global_step4 with DeepSpeed's own engine;
   then rank 1 is SIGKILLed while writing stage 3's global_step6.
2. The test flips one payload bit in every global_step4 (and in the torch copy).
3. ``single`` (1 rank): DeepSpeed's own load of the flipped torch file; the unchanged
   ``engine.load_checkpoint`` over ckptlib (via DeepSpeed's ``latest``); the resume helper on
   a different data-parallel size (2 -> 1) for stage 0 (full state) and stage 2 (weights only).
4. ``resume`` (2 ranks): stages 2 and 3 resume with the helper, bitwise-equal to global_step2
   (stage 0 resumed bitwise in step 3, on one rank).

Then, on its own (``test_frozen_rank_during_resume_fails_within_the_deadline``): ``freeze``
(2 ranks), one rank SIGSTOPped inside ``ckds.resume``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import launcher
import pytest

import ckptlib
from ckptlib.integrations import deepspeed as ckds
from ckptlib.integrations.deepspeed import codec

WORKER = Path(__file__).resolve().parents[1] / "workers" / "ds_worker.py"
STAGES = [0, 2, 3]

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed"
)


def _job(
    scenario: str,
    world: int,
    root: Path,
    args: dict,
    timeout: float = 150,
    survivors: list[int] | None = None,
) -> tuple[list[int | None], list[dict]]:
    """Run ``scenario`` on ``world`` ranks (output in ``root/log-<scenario>-<rank>.txt``); wait
    for the ``survivors`` (default: all), then SIGKILL any rank still there (a frozen one: its
    code is None)."""

    def argv(rank: int, port: str) -> list[str]:
        return [str(WORKER), scenario, str(rank), str(world), port, str(root), json.dumps(args)]

    def spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(root / f"log-{scenario}-{env['RANK']}.txt", "w") as log:
            return subprocess.Popen([sys.executable, *cmd], env=env, stdout=log, stderr=subprocess.STDOUT)

    env = {"DS_ACCELERATOR": "cpu", "CKPTLIB_COORD_TIMEOUT": "6", "PYTHONWARNINGS": "ignore"}
    procs = launcher.start(argv, world, env=env, spawn=spawn)
    waited = list(range(world)) if survivors is None else survivors
    if not launcher.wait_exit(procs, waited, timeout):
        launcher.kill_all(procs)
        raise AssertionError(f"{scenario} did not finish in {timeout}s; logs in {root}")
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    results = []
    for rank in range(world):
        path = root / f"result-{scenario}-{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    for rank, r in enumerate(results):
        assert "crash" not in r, f"{scenario} rank {rank} crashed:\n{r['crash']}"
    return codes, results


def _flip_payload_bit(step_dir: Path, writer_rank: int) -> str:
    """Flip one bit inside the largest checksummed range of a payload file written by
    ``writer_rank``; returns the file's path relative to the step folder."""
    from ckptlib.backends import open_storage
    from ckptlib.engine.scan import read_manifest

    m = read_manifest(open_storage(str(step_dir.parent)), step_dir.name)  # v1, or v2 with its index files
    files = [[f.path, f.size] for f in m.files]
    want = f"r{writer_rank:05d}-"
    ranges = [(p.length, p.file, p.start) for p in m.packs]  # (length, file index, start)
    ranges += [(c.length, c.file, c.start) for t in m.tensors.values() for c in t.chunks]
    ranges = [r for r in ranges if os.path.basename(files[r[1]][0]).startswith(want)]
    assert ranges, f"no payload written by rank {writer_rank} in {step_dir}"
    length, fidx, start = max(ranges)
    path = step_dir / files[fidx][0]
    data = bytearray(path.read_bytes())
    data[start + length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return files[fidx][0]


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    t0 = time.monotonic()
    train_codes, train = _job("train", 2, root, {"stages": STAGES})
    t_train = time.monotonic() - t0
    z3_latest = (root / "z3" / "latest").read_text().strip()
    z3_steps = {i.step: i.status for i in ckptlib.CheckpointManager(root / "z3").steps()}
    flipped = {}
    for stage in STAGES:
        steps = sorted((root / f"z{stage}").glob("step-000000000004"))
        assert steps, f"stage {stage}: global_step4 was not committed"
        flipped[stage] = _flip_payload_bit(steps[0], 0 if stage == 0 else 1)
    probe = bytes.fromhex(train[0]["z0"]["torch_probe"])
    tfile = root / "torch_z0" / "global_step4" / "mp_rank_00_model_states.pt"
    data = bytearray(tfile.read_bytes())
    at = data.find(probe)
    assert at >= 0, "the probe weights are not in DeepSpeed's torch file"
    data[at + 7] ^= 0x40  # exponent bit of weight[0, 1]
    tfile.write_bytes(bytes(data))
    t1 = time.monotonic()
    single_codes, single = _job("single", 1, root, {})
    t2 = time.monotonic()
    resume_codes, resume = _job("resume", 2, root, {"stages": [2, 3]})
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"deepspeed jobs: train {t_train:.1f}s, single {t2 - t1:.1f}s, resume {time.monotonic() - t2:.1f}s "
        f"(wall); children CPU {cpu.ru_utime + cpu.ru_stime:.1f}s"
    )
    return {
        "root": root,
        "train_codes": train_codes,
        "train": train,
        "single_codes": single_codes,
        "single": single[0],
        "resume_codes": resume_codes,
        "resume": resume,
        "flipped": flipped,
        "z3_latest": z3_latest,
        "z3_steps": z3_steps,
    }


@needs_deepspeed
def test_kill_mid_save_leaves_previous_tag(ds_run):
    train = ds_run["train"]
    assert ds_run["train_codes"][1] == -9, "rank 1 was to be SIGKILLed while writing global_step6"
    assert "CommitError" in train[0]["killed_save"]["error"]  # the survivor's save failed, typed
    for rank in (0, 1):
        for stage in STAGES:
            assert set(train[rank][f"z{stage}"]) >= {"2", "4"}
    # DeepSpeed writes `latest` only after our commit returned: it still names global_step4.
    assert ds_run["z3_latest"] == "global_step4"
    # The failed global_step6 left no committed step (its staging folder was aborted).
    z3 = ds_run["z3_steps"]
    assert z3[2] == z3[4] == "committed" and z3.get(6) != "committed", z3


@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])  # stage 0: test_resume_on_other_data_parallel_size
def test_resume_helper_bitwise_after_kill_and_bitflip(ds_run, stage):
    """Both ranks resume global_step2: global_step4 has a flipped bit (and stage 3's
    global_step6 was killed mid-write). Parameters and optimizer state are bitwise equal;
    the flip in one rank's payload is found by the rank that verifies it, and every rank
    skips the step together."""
    assert ds_run["resume_codes"] == [0, 0]
    for rank in (0, 1):
        saved = ds_run["train"][rank][f"z{stage}"]["2"]
        got = ds_run["resume"][rank][f"z{stage}"]
        assert got["tag"] == "global_step2"
        assert any(s.startswith("step 4: corrupt") for s in got["skipped"]), got["skipped"]
        d = got["digest"]
        assert d["n_params"] > 0 and d["n_optim"] > 0
        assert (d["params"], d["optim"]) == (saved["params"], saved["optim"])
        assert (d["global_steps"], d["lr"]) == (2, saved["lr"])
        assert got["client"] == {
            "data_pos": 8,
            "args": "Namespace(lr=0.01, name='run')",
            "seen": [1, 2, 3],
        }
        assert got["after"] == 3  # training and saving go on after the resume


@needs_deepspeed
def test_deepspeed_own_path_vs_ckptlib_on_bitflip(ds_run):
    single = ds_run["single"]
    torch_flip = single["torch_flip"]
    saved4 = ds_run["train"][0]["z0"]["4"]
    # DeepSpeed's default engine either crashes or silently loads the flipped weights.
    assert torch_flip["error"] is not None or torch_flip["digest"]["params"] != saved4["params"]
    # The same unchanged load_checkpoint call over ckptlib refuses with a typed error.
    assert single["ckptlib_flip"]["error"].startswith("CorruptCheckpointError"), single[
        "ckptlib_flip"
    ]


@needs_deepspeed
def test_unsupported_client_state_value_fails_the_save(ds_run):
    bad = ds_run["single"]["bad_value"]
    assert (
        bad["error"].startswith("UnsupportedValueError") and "builtins.object at " in bad["error"]
    ), bad
    assert not any(n.startswith("step-") for n in bad["left"]), bad["left"]  # nothing committed


@needs_deepspeed
def test_resume_on_other_data_parallel_size(ds_run):
    """Saved on 2 ranks, resumed on 1: stage 0 fully (bitwise); ZeRO-2 with optimizer state is
    refused by DeepSpeed itself; ZeRO-2 weights only (load_optimizer_states=False) work."""
    single = ds_run["single"]
    assert ds_run["single_codes"] == [0]
    z0, saved = single["z0"], ds_run["train"][0]["z0"]["2"]
    assert z0["tag"] == "global_step2"
    assert any(s.startswith("step 4: corrupt") for s in z0["skipped"]), z0["skipped"]
    assert (z0["digest"]["params"], z0["digest"]["optim"]) == (saved["params"], saved["optim"])
    assert z0["client"]["data_pos"] == 8
    assert "ZeRORuntimeException" in single["z2_optim"]["error"]
    assert single["z2"]["tag"] == "global_step2"
    assert single["z2"]["digest"]["params"] == ds_run["train"][0]["z2"]["2"]["params"]


@needs_deepspeed
def test_frozen_rank_during_resume_fails_within_the_deadline(ds_run):
    """Rank 1 freezes (SIGSTOP) inside ``ckds.resume``, before its first attempt: rank 0
    raises a ckptlib error within the coordinator's deadline instead of hanging in a gloo
    collective; rank 1 was frozen (still alive), not dead, until the test killed it."""
    root, deadline = ds_run["root"], 6.0  # CKPTLIB_COORD_TIMEOUT in _job
    codes, res = _job("freeze", 2, root, {}, survivors=[0])
    assert codes == [0, None], codes  # rank 1 was still there (frozen) when rank 0 was done
    assert "freeze" not in res[1]
    got = res[0]["freeze"]
    assert got["error"] is not None and got["error"].startswith(("CommitError", "CheckpointError")), got
    sent = [json.loads(line) for line in (root / "freeze-signal.jsonl").read_text().splitlines()]
    assert [(s["phase"], s["rank"]) for s in sent] == [("restore", 1)], sent
    waited = got["at"] - sent[0]["time"]
    assert 0 < waited < deadline + 20.0, f"rank 0 raised {waited:.1f}s after rank 1 froze"


# --------------------------------------------------------------------------- in-process units


def test_import_does_not_import_deepspeed():
    code = (
        "import sys, ckptlib, ckptlib.integrations.deepspeed; assert 'deepspeed' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_value_conversion_roundtrip():
    import argparse
    import collections

    import torch

    od = collections.OrderedDict(w=torch.ones(2))
    od._metadata = collections.OrderedDict({"": {"version": 1}})
    value = {
        "module": od,
        "shape": torch.Size([2, 3]),
        "names": {"a", "b"},
        "frozen": frozenset([1]),
        "dev": torch.device("cpu"),
        "args": argparse.Namespace(lr=0.1, tags=("x",)),
        ckds.MARK: "user data that looks like a marker",
        3: [1.5, None, b"\x00", torch.float16],
    }
    enc = ckds.encode_value(value)
    dec = ckds.decode_value(enc)
    assert type(dec["module"]) is collections.OrderedDict and dec["module"]._metadata == {
        "": {"version": 1}
    }
    assert torch.equal(dec["module"]["w"], od["w"])
    assert type(dec["shape"]) is torch.Size and dec["shape"] == (2, 3)
    assert dec["names"] == {"a", "b"} and dec["frozen"] == frozenset([1])
    assert dec["dev"] == torch.device("cpu") and dec["args"] == argparse.Namespace(
        lr=0.1, tags=("x",)
    )
    assert dec[ckds.MARK] == value[ckds.MARK] and dec[3] == value[3]
    import numpy as np

    back = ckds.decode_value(ckds.encode_value([np.float64(0.1), np.int64(7), np.float32(1.5)]))
    assert back == [0.1, 7, 1.5] and [type(v) for v in back] == [float, int, float]


def test_unsupported_and_hostile_values():
    class Opaque:
        pass

    with pytest.raises(ckptlib.UnsupportedValueError, match="Opaque at /x/0"):
        ckds.encode_value({"x": [Opaque()]})
    # A checkpoint naming a type that is not allow-listed is refused, never imported.
    with pytest.raises(ckptlib.CorruptCheckpointError, match="not allow-listed"):
        ckds.decode_value({ckds.MARK: "object", "type": "os.system", "v": {}})
    with pytest.raises(ckptlib.CorruptCheckpointError, match="unknown value kind"):
        ckds.decode_value({ckds.MARK: "pickle", "v": "..."})
    ckds.register_type(Opaque)
    try:
        o = Opaque()
        o.n = 3
        back = ckds.decode_value(ckds.encode_value(o))
        assert type(back) is Opaque and back.n == 3
    finally:
        codec._registered.pop(codec._qualname(Opaque))
