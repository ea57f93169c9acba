"""DeepSpeed integration with the real package on CPU (DS_BUILD_OPS=0, gloo, real processes).

One module-scoped run of three jobs (tests/workers/ds_worker.py), then assertions on what they
recorded and left on disk:

1. ``train`` (2 ranks): ZeRO stages 0, 2 and 3 save global_step2 and global_step4 through
   ``engine.save_checkpoint``; stage 0 also saves global_step4 with DeepSpeed's own engine;
   then rank 1 is SIGKILLed while writing stage 3's global_step6.
2. The test flips one payload bit in every global_step4 (and in the torch copy).
3. ``single`` (1 rank): DeepSpeed's own load of the flipped torch file; the unchanged
   ``engine.load_checkpoint`` over ckptlib (via DeepSpeed's ``latest``); the resume helper on
   a different data-parallel size (2 -> 1) for stage 0 (full state) and stage 2 (with and
   without optimizer state).
4. ``resume`` (2 ranks): stages 2 and 3 resume with the helper, bitwise-equal to global_step2
   (stage 0 resumed bitwise in step 3, on one rank).

Each job first runs resharding jobs (tests/workers/ds_reshard.py) on its own process group:
``train`` saves ZeRO 1, 2, 3 (fp32) and, in bf16, ZeRO 1 (DeepSpeed's ``BF16_Optimizer``) and
ZeRO 3 at 2 ranks; the test flips one bit in rank 1's saved ``exp_avg_sq`` of ZeRO 2's
global_step4; ``single`` resumes each at 1 rank (ZeRO 2 first with DeepSpeed's own
``load_checkpoint``, which must refuse the flipped step) and saves ZeRO 2, 3 (fp32) and 1
(bf16) at 1 rank; ``resume`` resumes those at 2 ranks. Per-parameter fp32 weights, both Adam
moments (DeepSpeed's ``safe_get_full_*``) and the model's weights are compared bitwise with
what was saved; the partition arithmetic itself is tested in test_deepspeed_partitions.py.

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
# Resharding jobs (ds_reshard.py): key -> (ZeRO stage, bf16).
SAVED_AT_2 = {"z1": (1, False), "z2": (2, False), "z3": (3, False), "b1": (1, True), "b3": (3, True)}
SAVED_AT_1 = {"z2s": (2, False), "z3s": (3, False), "b1s": (1, True)}
FLIPPED = "z2"  # its global_step4 gets a flipped bit: loads fall back to global_step2
FLIP_SUFFIX = "zero_pp_rank_1_mp_rank_00_optim_states.pt/optimizer_state_dict/base_optimizer_state/state/0/exp_avg_sq"
ELEMENTS = 845  # ds_reshard.make_engine's model: Linear(16, 31), LayerNorm(31), Linear(31, 8)
STEP_BYTES = 4  # Adam's `step`: one float32 scalar per partition, read whole
OPTIMIZERS = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}

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

    tmp = root / f"tmp-{scenario}"  # the ranks' temporary files (killed ranks' too) stay in the test's folder
    tmp.mkdir(exist_ok=True)
    env = {"DS_ACCELERATOR": "cpu", "CKPTLIB_COORD_TIMEOUT": "6", "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp)}
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


def _flip_tensor_bit(step_dir: Path, suffix: str) -> str:
    """Flip one bit in the stored bytes of the saved tensor whose name ends with ``suffix``
    (uncompressed: a chunk, or its piece of a pack); returns the tensor's name."""
    from ckptlib.backends import open_storage
    from ckptlib.engine.scan import read_manifest

    m = read_manifest(open_storage(str(step_dir.parent)), step_dir.name)
    names = [n for n in m.tensors if n.endswith(suffix)]
    assert len(names) == 1, f"{suffix!r} matches {names}"
    t = m.tensors[names[0]]
    if t.chunks:
        file, at = t.chunks[0].file, t.chunks[0].start + t.chunks[0].length // 2
    else:
        pack = m.packs[t.pieces[0].pack]
        assert pack.codec == "raw", pack.codec
        file, at = pack.file, pack.start + t.pieces[0].raw_offset + 2
    path = step_dir / m.files[file].path
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    return names[0]


def _reshard_jobs(do: str, configs: dict[str, tuple[int, bool]], **extra) -> list[dict]:
    return [{"do": do, "key": k, "stage": s, "bf16": b, "dir": f"reshard-{k}", **extra}
            for k, (s, b) in configs.items()]


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    t0 = time.monotonic()
    train_codes, train = _job("train", 2, root, {"stages": STAGES, "reshard": _reshard_jobs("save", SAVED_AT_2)})
    t_train = time.monotonic() - t0
    reshard_flipped = _flip_tensor_bit(root / f"reshard-{FLIPPED}" / "step-000000000004", FLIP_SUFFIX)
    shrink = _reshard_jobs("load", SAVED_AT_2, how="resume")
    flip = next(j for j in shrink if j["key"] == FLIPPED)
    shrink.insert(0, {**flip, "key": "flip", "how": "load_checkpoint"})  # `latest`: global_step4
    shrink += _reshard_jobs("save", SAVED_AT_1)
    grow = _reshard_jobs("load", SAVED_AT_1, how="resume")
    grow[0]["how"] = "load_checkpoint"  # z2s: DeepSpeed's own call, `latest` = global_step4
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
    single_codes, single = _job("single", 1, root, {"reshard": shrink})
    t2 = time.monotonic()
    resume_codes, resume = _job("resume", 2, root, {"stages": [2, 3], "reshard": grow})
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
        "reshard_flipped": reshard_flipped,
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
    skips the step together. After a save, DeepSpeed's own ``load_checkpoint`` brings the state
    back bitwise, with the payload sizes asked by rank 0 alone, and a payload file cut by a byte
    fails it on both ranks with the same error."""
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
        # DeepSpeed's own load_checkpoint after that save: the state back bitwise.
        assert got["plain"]["bitwise"], got["plain"]
    # Payload sizes are asked on rank 0 alone, which shares its verdict: in the resume (its
    # judge, then its load_checkpoint's check) and in a plain load_checkpoint. Before, every
    # rank's load_checkpoint asked every file's size (N² requests for a job of N ranks).
    res = [ds_run["resume"][rank][f"z{stage}"] for rank in (0, 1)]
    assert [r["asked"] > 0 for r in res] == [True, False], [r["asked"] for r in res]
    assert [r["plain"]["asked"] > 0 for r in res] == [True, False], [r["plain"] for r in res]
    # Rank 1's payload file cut by a byte: both ranks raise the same typed error, naming it,
    # before either reads.
    cut = [r["plain_cut"] for r in res]
    assert [c["error"] for c in cut] == ["CorruptCheckpointError"] * 2, cut
    assert cut[0]["message"] == cut[1]["message"] and "r00001" in cut[0]["message"], cut
    assert "size" in cut[0]["message"] and [c["asked"] > 0 for c in cut] == [True, False], cut


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
    """Saved on 2 ranks, resumed on 1: stage 0 fully (bitwise); ZeRO-2 with optimizer state
    (ckptlib serves the partitions at the new size) and weights only
    (load_optimizer_states=False), weights bitwise."""
    single = ds_run["single"]
    assert ds_run["single_codes"] == [0]
    z0, saved = single["z0"], ds_run["train"][0]["z0"]["2"]
    assert z0["tag"] == "global_step2"
    assert any(s.startswith("step 4: corrupt") for s in z0["skipped"]), z0["skipped"]
    assert (z0["digest"]["params"], z0["digest"]["optim"]) == (saved["params"], saved["optim"])
    assert z0["client"]["data_pos"] == 8
    z2_optim, saved_z2 = single["z2_optim"], ds_run["train"][0]["z2"]["2"]
    assert z2_optim["error"] is None and z2_optim["tag"] == "global_step2", z2_optim
    assert z2_optim["digest"]["params"] == saved_z2["params"]
    assert (z2_optim["digest"]["global_steps"], z2_optim["digest"]["lr"]) == (2, saved_z2["lr"])
    assert single["z2"]["tag"] == "global_step2"
    assert single["z2"]["digest"]["params"] == ds_run["train"][0]["z2"]["2"]["params"]


def _check_resharded(got: dict, saved: dict, tag: str, stage: int, bf16: bool, saved_dp: int, dp: int) -> None:
    """``got``: one rank's record of a resharding load; ``saved``: a saving rank's record."""
    assert got["error"] is None, got["error"]
    assert got["tag"] == tag
    d, want = got["digest"], saved[tag.removeprefix("global_step")]
    assert d["optimizer"] == ("BF16_Optimizer" if (bf16 and stage == 1) else OPTIMIZERS[stage])
    assert d["dtype"] == ("torch.bfloat16" if bf16 else "torch.float32")
    assert set(d["params"]) == set(want["params"]) and len(d["params"]) == 6
    for name, h in want["params"].items():  # bitwise, parameter by parameter
        assert d["params"][name] == h, f"{name}: {[k for k in h if d['params'][name][k] != h[k]]} differ"
    assert (d["adam_step"], d["global_steps"], d["lr"]) == (want["adam_step"], want["global_steps"], want["lr"])
    assert got["client"] == {"data_pos": want["global_steps"] * 4}
    assert (got["reshard"]["saved_dp"], got["reshard"]["dp"]) == (saved_dp, dp), got["reshard"]
    # Training goes on from the saved optimizer state (not from scratch: Adam's step continues).
    assert got["after"] == {"adam_step": [want["adam_step"][0] + 1], "global_steps": want["global_steps"] + 1}


@needs_deepspeed
@pytest.mark.parametrize("key", sorted(SAVED_AT_2))
def test_zero_saved_at_2_ranks_resumed_at_1(ds_run, key):
    """ZeRO 1/2/3 (fp32; bf16 ZeRO 1 and 3) saved at 2 ranks, resumed at 1 with optimizer state:
    per-parameter fp32 weights and Adam moments bitwise equal; training continues."""
    stage, bf16 = SAVED_AT_2[key]
    got = ds_run["single"][f"reshard/{key}"]
    tag = "global_step2" if key == FLIPPED else "global_step4"
    for saved in ds_run["train"]:  # both saving ranks recorded the same full digests
        _check_resharded(got, saved[f"reshard/{key}"], tag, stage, bf16, saved_dp=2, dp=1)
    # The one loading rank asked for every element once, plus Adam's step.
    assert got["reshard"]["bytes_needed"] == 3 * 4 * ELEMENTS + STEP_BYTES


@needs_deepspeed
@pytest.mark.parametrize("key", sorted(SAVED_AT_1))
def test_zero_saved_at_1_rank_resumed_at_2(ds_run, key):
    """ZeRO 2, 3 (fp32) and bf16 ZeRO 1 saved at 1 rank, resumed at 2: bitwise on both ranks,
    and each rank read only its own partition's ranges."""
    stage, bf16 = SAVED_AT_1[key]
    saved = ds_run["single"][f"reshard/{key}"]
    needed = []
    for res in ds_run["resume"]:
        got = res[f"reshard/{key}"]
        _check_resharded(got, saved, "global_step4", stage, bf16, saved_dp=1, dp=2)
        needed.append(got["reshard"]["bytes_needed"] - STEP_BYTES)
    # Together the ranks asked for every element exactly once.
    assert sum(needed) == 3 * 4 * ELEMENTS and all(0 < n < 3 * 4 * ELEMENTS for n in needed), needed


@needs_deepspeed
def test_flipped_bit_in_a_resharded_read_is_caught(ds_run):
    """DeepSpeed's own ``load_checkpoint`` (``latest`` = global_step4) over ckptlib reads the
    flipped range while resharding 2 -> 1 and refuses it; ``ckds.resume`` skips that step
    (resumed bitwise from global_step2 in test_zero_saved_at_2_ranks_resumed_at_1)."""
    assert ds_run["reshard_flipped"].endswith(FLIP_SUFFIX)
    err = ds_run["single"]["reshard/flip"]["error"]
    assert err is not None and err.startswith("CorruptCheckpointError") and "checksum mismatch" in err, err
    skipped = ds_run["single"][f"reshard/{FLIPPED}"]["skipped"]
    assert any(s.startswith("step 4: corrupt") for s in skipped), skipped


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


def test_load_tokens_leave_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """The empty files standing for a tag's files during ``load_checkpoint`` are removed with
    their folder when the load ends, not at interpreter exit (which a process killed or leaving
    with ``os._exit`` after a load never reaches)."""
    import tempfile

    from ckptlib.coord.coordinator import LocalCoordinator
    from ckptlib.integrations.deepspeed.engine import EngineMixin

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ce = EngineMixin(None, coordinator=LocalCoordinator(), step_fn=int, previous=None, manager_options={},
                     storage_options=None)
    for _load in range(2):
        ce.forget_views()  # as at the start of load_checkpoint
        tokens = [ce.token(str(tmp_path / "ckpt"), "global_step4", f"mp_rank_0{i}_model_states.pt") for i in range(2)]
        assert all(os.path.isfile(t) for t in tokens)
        assert all(Path(t).is_relative_to(tmp_path) and "ckptlib-deepspeed-" in t for t in tokens)
        ce.forget_views()  # as at the end
        assert not list(tmp_path.glob("ckptlib-deepspeed-*")), "a load left its token folder behind"


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


@pytest.mark.parametrize("world", [1, 3, 6])
def test_the_resume_check_reads_only_the_index_files_of_each_rank_s_share(tmp_path, world):
    """Format v2: each rank of the DeepSpeed resume loop checksums a share of the step's payload
    files and now reads the piece index files of that share only (each rank read every one: N²
    index reads at N ranks). Every index row is read by exactly one rank, and a flipped byte is
    found by the rank whose share holds the file. No DeepSpeed needed: a step of 6 ranks made by
    ckptlib's save flow on simulated ranks."""
    from helpers import wide_step

    from ckptlib.backends import open_storage
    from ckptlib.engine.index_io import load_indexes
    from ckptlib.engine.scan import read_manifest
    from ckptlib.engine.verify import verify_chunks
    from ckptlib.errors import CorruptCheckpointError
    from ckptlib.format import layout
    from ckptlib.integrations.deepspeed.resume import share, share_indexes

    for path, data in wide_step(6).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    storage, folder = open_storage(str(tmp_path)), layout.step_dir(1)

    def check(rank: int) -> list[int]:  # what verify_share runs on this rank; the rows it read
        m = read_manifest(storage, folder, pieces=False)
        mine = set(share([(f.path, f.size) for f in m.files], world)[rank])
        rows = share_indexes(m, mine, rank, world)
        assert load_indexes(storage, folder, m, rows) == len(rows)
        verify_chunks(storage, folder, m, files=mine)
        return rows

    m = read_manifest(storage, folder, pieces=False)
    assert m.version == 2 and len(m.indexes) == 6
    read = [check(r) for r in range(world)]
    assert sorted(i for rows in read for i in rows) == list(range(6)), read  # each row once
    victim = m.files[m.indexes[4].first_file]
    with open(tmp_path / folder / victim.path, "r+b") as f:
        f.seek(8)
        b = f.read(1)
        f.seek(8)
        f.write(bytes([b[0] ^ 0xFF]))
    owner = next(r for r in range(world) if m.indexes[4].first_file in share([(f.path, f.size) for f in m.files],
                                                                              world)[r])
    for r in range(world):
        if r == owner:
            with pytest.raises(CorruptCheckpointError, match="checksum"):
                check(r)
        else:
            check(r)


def test_a_rank_s_load_reads_the_piece_indexes_of_its_own_files_only(tmp_path):
    """Format v2, ``load_checkpoint``'s path: ``open_tag`` read every rank's piece index (every
    rank reading every index: N² reads at N ranks); now it reads none, and loading one rank's
    file reads the index of the rank that saved it, and only that one. A step of 6 ranks made by
    ckptlib's save flow on simulated ranks, each saving one DeepSpeed file of its own."""
    import torch
    from helpers import wide_step

    from ckptlib.backends import open_storage
    from ckptlib.engine.load import Merge, resolve_lazy, run_plan
    from ckptlib.format.leaves import PerRank
    from ckptlib.integrations.deepspeed.tags import FORMAT, open_tag

    def name(rank: int) -> str:
        return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"

    def files(rank: int, world: int) -> dict:
        return {"files": PerRank({name(rank): {"w": torch.full((4,), float(rank))}})}

    for path, data in wide_step(6, files, {"deepspeed": {"format": FORMAT, "tag": "global_step1"}}).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    view = open_tag(open_storage(str(tmp_path)), "global_step1")
    m = view.manifest
    assert m.version == 2 and len(m.indexes) == 6 and sorted(view.files) == sorted(name(r) for r in range(6))
    assert m.loaded == set(), m.loaded  # no index read yet (all 6 before)
    stats: dict[str, int] = {}
    plan = Merge(m, where="test")
    value = plan.fresh(view.files[name(4)])
    run_plan(plan, view.storage, view.folder, m, verify=True, stats=stats)
    assert torch.equal(resolve_lazy(value)["w"], torch.full((4,), 4.0))
    assert stats["index_files_read"] == 1 and [m.indexes[i].rank for i in m.loaded] == [4], (stats, m.loaded)


def test_a_tag_not_named_like_a_step_is_found_newest_first(tmp_path, monkeypatch):
    """``load_checkpoint(dir, tag="best")``: a tag that does not name its step is looked up in
    the steps' metadata. That judged every step of the root first (a manifest read and a size
    check per payload file each); now it reads manifests newest first, stops at the step holding
    it, and checks the payload sizes of that step alone (every rank of a job checked every step
    it passed: N² size requests per step at N ranks). A payload file of that step cut short is a
    ``CorruptCheckpointError`` naming it. A tag no step holds still names the damaged steps it
    passed over."""
    import torch
    from helpers import CountingStorage

    import ckptlib
    from ckptlib.backends import open_storage
    from ckptlib.engine import scan
    from ckptlib.integrations.deepspeed.tags import FORMAT, open_tag

    with ckptlib.CheckpointManager(tmp_path, async_save=False) as mgr:
        for step in range(1, 7):
            mgr.save(step, {"files": ckptlib.PerRank({"mp_rank_00_model_states.pt": {"w": torch.full((4,), float(step))}})},
                     metadata={"deepspeed": {"format": FORMAT, "tag": f"run-a-{step}"}})
    (tmp_path / "step-000000000006" / "manifest.json").write_text("{")  # damaged
    judged: list[str] = []
    inner = scan.check_step

    def counting(storage, folder, step=None, **kw):  # type: ignore[no-untyped-def]
        judged.append(folder)
        return inner(storage, folder, step, **kw)

    monkeypatch.setattr(scan, "check_step", counting)
    storage = CountingStorage(open_storage(str(tmp_path)), kinds=("size",))
    view = open_tag(storage, "run-a-4")
    assert view.step == 4 and list(view.files) == ["mp_rank_00_model_states.pt"]
    assert judged == ["step-000000000006", "step-000000000005", "step-000000000004"], judged  # not 3, 2, 1
    asked = sorted(p for p in storage.calls if p.endswith(".bin"))
    assert asked and all(p.startswith("step-000000000004/") for p in asked), asked  # not step 5's too
    payload = sorted((tmp_path / "step-000000000004").rglob("*.bin"))
    os.truncate(payload[0], payload[0].stat().st_size - 1)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="size") as cut:
        open_tag(open_storage(str(tmp_path)), "run-a-4")
    assert cut.value.path.endswith(payload[0].name), cut.value.path
    with pytest.raises(ckptlib.CheckpointNotFoundError, match=r"'run-a-9' is not a committed .*step 6: "):
        open_tag(open_storage(str(tmp_path)), "run-a-9")
