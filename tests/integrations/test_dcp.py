"""torch.distributed.checkpoint through ckptlib (the package ckptlib/integrations/dcp/).

In-process tests (no process group: DCP runs single-process) cover the format, the backends,
the bytes policy and corruption handling. The multi-process tests run real gloo jobs of
tests/workers/dcp_worker.py: FSDP2 training on 2 ranks and plain training on 1 rank, a real
SIGKILL of a rank in the middle of writing a save, resume with ``load_latest``, and bitwise
comparison of parameters and optimizer state with uninterrupted runs; the 2-rank checkpoint is
also loaded into an unsharded model in this process (2 -> 1 ranks, DCP resharding). A rank
frozen with SIGSTOP inside ``load_latest`` fails the other within the coordinator's deadline.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptlib
from ckptlib.format import manifest as mf
from ckptlib.integrations.dcp import (
    CkptlibReader,
    CkptlibWriter,
    latest_checkpoint,
    load_latest,
    metadata_from_json,
    step_url,
)

pytestmark = [
    # DCP announces that it runs single-process when no process group exists (this module).
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

WORKER = Path(__file__).resolve().parents[1] / "workers" / "dcp_worker.py"
sys.path.insert(0, str(WORKER.parent))
import dcp_worker  # noqa: E402
import launcher  # noqa: E402


def _model_opt(seed: int = 0, lr: float = 1e-3):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    return m, opt


def _state(m, opt, **extra):
    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd, "extra": extra}


def _assert_same(m_a, o_a, m_b, o_b) -> None:
    for (k, a), (_, b) in zip(m_a.state_dict().items(), m_b.state_dict().items(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), k
    sa, sb = o_a.state_dict(), o_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, v in sa["state"].items():
        for kk, t in v.items():
            assert torch.equal(t, sb["state"][k][kk]), (k, kk)


def _roundtrip(url: str, storage_options=None) -> None:
    m, opt = _model_opt(0)
    dcp.save(
        _state(m, opt, step=7, name="run", blob=b"\x00\xff", dt=torch.bfloat16, t=(1, 2.5)),
        storage_writer=CkptlibWriter(url, step=3, storage_options=storage_options),
    )
    m2, opt2 = _model_opt(1, lr=0.5)
    st = _state(m2, opt2, step=0, name="", blob=b"", dt=None, t=None)
    assert load_latest(st, url, storage_options=storage_options) == 3
    set_state_dict(m2, opt2, model_state_dict=st["model"], optim_state_dict=st["optim"])
    _assert_same(m, opt, m2, opt2)
    assert st["extra"] == {
        "step": 7,
        "name": "run",
        "blob": b"\x00\xff",
        "dt": torch.bfloat16,
        "t": (1, 2.5),
    }


def test_roundtrip_bitwise_posix_no_pickle(tmp_path):
    _roundtrip(str(tmp_path))
    folder = tmp_path / "step-000000000003"
    m = mf.decode((folder / "manifest.json").read_bytes())
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    # Nothing but the manifest, the ownership marker (both JSON) and the listed payloads of
    # raw element bytes: no pickled ``.metadata``, no pickled values anywhere.
    assert files == {"manifest.json", ".ckptlib"} | {f.path for f in m.files}
    json.loads((folder / ".ckptlib").read_text())
    assert not any(name.startswith("extra.") for name in m.tensors)  # plain values live in JSON
    dcp_meta = m.extra["dcp"]
    assert dcp_meta["state_dict_metadata"]["model.0.weight"]["size"] == [16, 8]
    assert dcp_meta["state_dict_metadata"]["extra.step"] == {"kind": "bytes"}
    # A plain ckptlib checkpoint too: ckptlib.load reads it, the CLI verifies it.
    flat = ckptlib.load(str(folder))
    assert flat["extra.step"] == 7 and flat["model.0.weight"].shape == (16, 8)
    from ckptlib.cli.main import main as cli

    assert cli(["verify", str(tmp_path), "--all"]) == 0  # every chunk's checksum checks out


def test_roundtrip_memory_backend(memory_url):
    _roundtrip(memory_url)


def test_roundtrip_s3_moto():
    from backends.servers import MotoServer

    server = MotoServer()
    try:
        server.create_bucket("dcp-tests")
        _roundtrip(f"s3://dcp-tests/{uuid.uuid4().hex[:8]}", server.storage_options())
    finally:
        server.stop()


def test_metadata_json_rebuilds_dcp_metadata(tmp_path):
    m, opt = _model_opt(0)
    md = dcp.save(_state(m, opt, step=1), storage_writer=CkptlibWriter(tmp_path / "c"))
    man = mf.decode((tmp_path / "c" / "manifest.json").read_bytes())
    back, values = metadata_from_json(man.extra["dcp"], man)
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.planner_data == md.planner_data
    assert set(back.storage_data) == set(md.storage_data)
    assert values["extra.step"] == 1
    # Tampering that keeps the manifest checksum valid is still caught by the cross-checks.
    bad = json.loads(json.dumps(man.extra["dcp"]))
    bad["state_dict_metadata"]["model.0.weight"]["size"] = [17, 8]
    with pytest.raises(ckptlib.CorruptCheckpointError, match="does not match"):
        metadata_from_json(bad, man)
    bad = json.loads(json.dumps(man.extra["dcp"]))
    bad["state_dict_metadata"]["model.0.weight"]["chunks"][0][1] = [99, 8]
    with pytest.raises(ckptlib.CorruptCheckpointError, match="outside"):
        metadata_from_json(bad, man)
    with pytest.raises(ckptlib.CorruptCheckpointError):
        metadata_from_json({"schema": 1, "state_dict_metadata": [], "storage_data": []}, man)


class Opaque:
    def __init__(self, v: int) -> None:
        self.v = v

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.v == self.v


def test_bytes_policy(tmp_path):
    state = {"w": torch.arange(4.0), "obj": Opaque(5)}
    with pytest.raises(CheckpointException) as ei:
        dcp.save(state, storage_writer=CkptlibWriter(tmp_path / "a"))
    assert any(isinstance(f[0], ckptlib.UnsupportedValueError) for f in ei.value.failures.values())
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob("a.tmp-*"))  # nothing published

    dcp.save(state, storage_writer=CkptlibWriter(tmp_path / "b", allow_pickled_objects=True))
    target = {"w": torch.zeros(4), "obj": None}
    reader = CkptlibReader(tmp_path / "b")
    with pytest.raises(CheckpointException) as ei:
        dcp.load(target, storage_reader=reader)  # refused before any payload read
    assert isinstance(reader.last_error, ckptlib.UnsupportedValueError)
    assert target["obj"] is None and torch.equal(target["w"], torch.zeros(4))
    dcp.load(target, storage_reader=CkptlibReader(tmp_path / "b", allow_pickled_objects=True))
    assert target["obj"] == Opaque(5) and torch.equal(target["w"], torch.arange(4.0))


def test_bytesio_values_without_pickle(tmp_path):
    """io.BytesIO values (DCP's own tests put them in state dicts): their bytes are stored as
    they are (inline JSON when small, a payload of exactly those bytes when large), no
    pickle anywhere, and they load back as io.BytesIO without allow_pickled_objects."""
    big = os.urandom(300_000)
    small = io.BytesIO(b"\x00small\xff")
    small.seek(3)  # the whole buffer is stored, whatever the position
    state = {"w": torch.arange(4.0), "small": small, "big": io.BytesIO(big), "raw": big[:9000],
             "nested": {"b": b"x" * 20_000}, "listed": [b"z" * 20_000]}
    dcp.save(state, storage_writer=CkptlibWriter(tmp_path / "c"))
    m = mf.decode((tmp_path / "c" / "manifest.json").read_bytes())
    kinds = {fqn: kind for fqn, _, kind in m.extra["dcp"]["storage_data"]}
    assert kinds == {"w": "tensor", "small": "json", "big": "bytes", "raw": "bytes", "nested.b": "bytes",
                     "listed": "json"}  # DCP flattens dicts, not lists: 20 KB inside a list is inline
    with ckptlib.open(tmp_path / "c") as view:  # the payload is the value's own bytes, not a pickle of it
        assert view.read("big").numpy().tobytes() == big
        assert view.load("big").getvalue() == big and isinstance(view.load("raw"), bytes)
    target = {"w": torch.zeros(4), "small": None, "big": io.BytesIO(b"old"), "raw": b"", "nested": {"b": b""},
              "listed": None}
    dcp.load(target, storage_reader=CkptlibReader(tmp_path / "c"))  # allow_pickled_objects=False
    assert isinstance(target["small"], io.BytesIO) and target["small"].getvalue() == b"\x00small\xff"
    assert target["small"].tell() == 0
    assert isinstance(target["big"], io.BytesIO) and target["big"].getvalue() == big
    assert target["raw"] == big[:9000] and target["nested"]["b"] == b"x" * 20_000
    assert target["listed"] == [b"z" * 20_000]
    assert torch.equal(target["w"], torch.arange(4.0))
    # A plain value too large to inline in a container is refused at save time (it would be
    # pickled), never committed as a checkpoint no reader can decode.
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"w": torch.ones(1), "v": [b"y" * 1_000_000]}, storage_writer=CkptlibWriter(tmp_path / "d"))
    assert any(isinstance(f[0], ckptlib.UnsupportedValueError) for f in ei.value.failures.values())


def _flip_in_payload(folder: Path, fqn: str) -> None:
    """Flip one bit inside the stored bytes of tensor ``fqn`` (the manifest stays valid)."""
    m = mf.decode((folder / "manifest.json").read_bytes())
    t = m.tensors[fqn]
    if t.chunks:
        c = t.chunks[0]
        path, pos = m.files[c.file].path, c.start + c.length // 2
    else:
        p = t.pieces[0]
        pack = m.packs[p.pack]
        path, pos = m.files[pack.file].path, pack.start + p.raw_offset + 2
    f = folder / path
    data = bytearray(f.read_bytes())
    data[pos] ^= 0x10
    f.write_bytes(bytes(data))


def test_corrupt_newest_falls_back_where_dcp_filesystem_loads_garbage(tmp_path, caplog):
    m1, o1 = _model_opt(0)
    root = tmp_path / "ck"
    dcp.save(_state(m1, o1, step=1), storage_writer=CkptlibWriter(root, step=1))
    m2, o2 = _model_opt(1)
    dcp.save(_state(m2, o2, step=2), storage_writer=CkptlibWriter(root, step=2))
    _flip_in_payload(root / "step-000000000002", "model.0.weight")

    assert latest_checkpoint(root).step == 2  # sizes are fine: only reading finds the damage
    m3, o3 = _model_opt(2, lr=0.5)
    st = _state(m3, o3, step=-1)
    assert load_latest(st, root) == 1
    assert "step 2 is corrupt" in caplog.text and "checksum mismatch" in caplog.text
    set_state_dict(m3, o3, model_state_dict=st["model"], optim_state_dict=st["optim"])
    _assert_same(m1, o1, m3, o3)
    assert st["extra"]["step"] == 1
    with pytest.raises(CheckpointException) as ei:  # a direct load of the damaged step refuses
        dcp.load(_state(*_model_opt(3), step=0), storage_reader=CkptlibReader(step_url(root, 2)))
    assert any(isinstance(f[0], ckptlib.CorruptCheckpointError) for f in ei.value.failures.values())

    # The same bit flip in DCP's own FileSystemWriter checkpoint: loaded silently, wrong values.
    plain = tmp_path / "plain"
    dcp.save(_state(m2, o2, step=2), storage_writer=dcp.FileSystemWriter(plain))
    md = dcp.FileSystemReader(plain).read_metadata()
    info = md.storage_data[next(k for k in md.storage_data if k.fqn == "model.0.weight")]
    f = plain / info.relative_path
    data = bytearray(f.read_bytes())
    raw = m2.state_dict()["0.weight"].numpy().tobytes()
    pos = data.find(raw, info.offset, info.offset + info.length)  # the element bytes in DCP's file
    assert pos >= 0
    data[pos + 100] ^= 0x10
    f.write_bytes(bytes(data))
    m4, o4 = _model_opt(3)
    st = _state(m4, o4, step=-1)
    dcp.load(st, storage_reader=dcp.FileSystemReader(plain))  # no error
    w_loaded, w_saved = st["model"]["0.weight"], m2.state_dict()["0.weight"]
    assert not torch.equal(w_loaded, w_saved)
    assert (w_loaded != w_saved).sum() == 1  # one silently wrong element


def _count_payload_sizes(monkeypatch) -> list[str]:
    """Every ``Storage.size`` request for a payload file (``.bin``) from now on, by path."""
    from ckptlib.backends.posix import PosixStorage

    asked: list[str] = []
    inner = PosixStorage.size

    def counting(self, p):  # type: ignore[no-untyped-def]
        if p.endswith(".bin"):
            asked.append(p)
        return inner(self, p)

    monkeypatch.setattr(PosixStorage, "size", counting)
    return asked


def test_sizes_are_checked_once_per_load_and_a_file_cut_after_the_judge_is_found(tmp_path, monkeypatch):
    """``load_latest``: the resume loop's judge checks every payload file's size, and the load
    that follows does not check them again (it did: twice per file in all). A plain
    ``dcp.load`` checks them once, on DCP's coordinator. A payload file cut by a byte right after
    the judge is found by the reader that opens it, and ``load_latest`` falls back to step 1."""
    from ckptlib.integrations.dcp import resume as dresume

    root = tmp_path / "ck"
    for step in (1, 2):
        dcp.save({"w": torch.arange(64.0) * step, "step": step}, storage_writer=CkptlibWriter(root, step=step))
    payload = sorted((root / "step-000000000002").rglob("*.bin"))
    assert payload
    asked = _count_payload_sizes(monkeypatch)

    st = {"w": torch.zeros(64), "step": -1}
    assert load_latest(st, root) == 2 and torch.equal(st["w"], torch.arange(64.0) * 2) and st["step"] == 2
    assert sorted(asked) == sorted(str(p.relative_to(root)) for p in payload)  # the judge's, once each
    asked.clear()
    st = {"w": torch.zeros(64), "step": -1}
    dcp.load(st, storage_reader=CkptlibReader(root, step=2))
    assert len(asked) == len(payload) and torch.equal(st["w"], torch.arange(64.0) * 2)

    judge = dresume._judge

    def judge_then_cut(info):  # type: ignore[no-untyped-def]
        out = judge(info)
        if info.step == 2:
            os.truncate(payload[0], payload[0].stat().st_size - 1)
        return out

    monkeypatch.setattr(dresume, "_judge", judge_then_cut)
    st = {"w": torch.zeros(64), "step": -1}
    assert load_latest(st, root) == 1
    assert torch.equal(st["w"], torch.arange(64.0)) and st["step"] == 1
    with pytest.raises(CheckpointException) as ei:  # a plain load of the cut step: refused before reading
        dcp.load({"w": torch.zeros(64), "step": -1}, storage_reader=CkptlibReader(root, step=2))
    errs = [f[0] for f in ei.value.failures.values()]
    assert any(isinstance(e, ckptlib.CorruptCheckpointError) and "size" in str(e) for e in errs), errs


def test_no_checkpoint_and_incomplete_only(tmp_path):
    st = {"w": torch.zeros(2)}
    assert load_latest(st, tmp_path / "nothing") is None
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "step-000000000005.tmp-0123456789abcdef").mkdir()
    assert load_latest(st, tmp_path / "r") is None
    assert latest_checkpoint(tmp_path / "r") is None


def test_existing_step_is_kept_unless_overwrite(tmp_path):
    dcp.save({"w": torch.ones(3)}, storage_writer=CkptlibWriter(tmp_path, step=1))
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"w": torch.zeros(3)}, storage_writer=CkptlibWriter(tmp_path, step=1))
    assert any(isinstance(f[0], ckptlib.StepExistsError) for f in ei.value.failures.values())
    assert "Checkpoint already exists" in str(ei.value)  # DCP's own writer's words, which DCP users look for
    assert all("Checkpoint already exists" in str(f[0]) for f in ei.value.failures.values())
    st = {"w": torch.empty(3)}
    load_latest(st, tmp_path)
    assert torch.equal(st["w"], torch.ones(3))
    dcp.save({"w": torch.zeros(3)}, storage_writer=CkptlibWriter(tmp_path, step=1, overwrite=True))
    load_latest(st, tmp_path)
    assert torch.equal(st["w"], torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000000001"]


def test_writer_pickles_for_process_based_async(tmp_path):
    w = CkptlibWriter(tmp_path, step=1, compression="zstd")
    w2 = pickle.loads(pickle.dumps(w))
    dcp.save({"w": torch.arange(10.0)}, storage_writer=w2)
    st = {"w": torch.zeros(10)}
    dcp.load(st, storage_reader=CkptlibReader(tmp_path, step=1))
    assert torch.equal(st["w"], torch.arange(10.0))


def test_writer_stages_for_async_save_in_a_turn_of_its_own(tmp_path):
    # stage() (dcp.async_save, the training thread) reserves the save's turn on ckptlib's
    # coordinator and copies the state; every way out of the save ends that turn, or later
    # flows of the process would wait behind it. (One process: the turns of a local
    # coordinator, which every multi-rank job's TorchCoordinator has too.)
    src = {"w": torch.arange(4.0), "n": 3}
    w = CkptlibWriter(tmp_path, step=1)
    staged = w.stage(src)
    src["w"].add_(1)  # training goes on: the staged copy does not change
    assert torch.equal(staged["w"], torch.arange(4.0)) and staged["n"] == 3
    turn = w._turn
    assert turn is not None and turn.line.pending() == 1
    pickle.dumps(w)  # into DCP's upload process: the save meets there
    assert w._turn is None and turn.line.pending() == 0
    w.stage(src)  # then a plain dcp.save on this thread: that turn is stale
    turn = w._turn
    assert turn is not None and turn.line.pending() == 1
    dcp.save({"w": torch.arange(4.0) * 2}, storage_writer=w)
    assert w._turn is None and turn.line.pending() == 0
    seen = []

    class Watched(CkptlibWriter):
        def prepare_local_plan(self, plan):  # the upload thread: in the turn stage() reserved
            turn = self._turn
            out = super().prepare_local_plan(plan)
            assert turn is not None and turn.line.held() is turn and turn.line.pending() == 1
            seen.append(turn)
            return out

    w2 = Watched(tmp_path, step=2)
    dcp.async_save({"w": torch.arange(4.0) * 3}, storage_writer=w2).result()
    assert len(seen) == 1 and w2._turn is None and seen[0].line.pending() == 0
    for step, k in ((1, 2), (2, 3)):
        st = {"w": torch.zeros(4)}
        dcp.load(st, storage_reader=CkptlibReader(tmp_path, step=step))
        assert torch.equal(st["w"], torch.arange(4.0) * k)


# --------------------------------------------------------------------------- real processes

STEPS, KILL_AT = 4, 3


def _launch(
    root: Path, world: int, args: dict, scenario: str = "train", extra_env: dict | None = None,
    rank_env: dict[int, dict] | None = None,
) -> list[subprocess.Popen]:
    root.mkdir(parents=True, exist_ok=True)

    def argv(rank: int, port: str) -> list[str]:
        return [str(WORKER), scenario, str(rank), str(world), port, str(root), json.dumps(args)]

    return launcher.start(argv, world, env=extra_env, rank_env=rank_env)


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """``(exit status, output)`` per rank; a hang kills every rank. Results: :func:`_result`."""
    outcomes = launcher.finish("dcp_worker job", procs, lambda r: Path(os.devnull, "none"), timeout)
    return [(o.returncode, o.log) for o in outcomes]


def _result(root: Path, tag: str, rank: int, scenario: str = "train") -> dict:
    p = root / f"result-{scenario}-{tag}-{rank}.json"
    return json.loads(p.read_text()) if p.exists() else {"crash": "no result"}


def _npz_equal(a: Path, b: Path) -> None:
    with np.load(a, allow_pickle=False) as x, np.load(b, allow_pickle=False) as y:
        assert sorted(x.files) == sorted(y.files)
        for k in x.files:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
            assert x[k].tobytes() == y[k].tobytes(), k  # bitwise


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Phase 1: uninterrupted 2-rank run, 2-rank run whose rank 1 is SIGKILLed while writing
    step 3 (async saves; rank 0 then fails that save), 1-rank run SIGKILLed the same way.
    Phase 2: both resumed."""
    base = tmp_path_factory.mktemp("dcpjobs")
    ref2, k2, k1 = base / "ref2", base / "k2", base / "k1"
    p_ref = _launch(ref2, 2, {"steps": STEPS, "tag": "ref"})
    p_k2 = _launch(k2, 2, {"steps": STEPS, "tag": "kill", "kill_at": KILL_AT, "async": True})
    p_k1 = _launch(k1, 1, {"steps": STEPS, "tag": "kill", "kill_at": KILL_AT})
    ref_logs, k2_logs, k1_logs = _wait(p_ref, 240), _wait(p_k2, 240), _wait(p_k1, 240)
    after_kill = {
        "k2": (
            k2_logs,
            latest_checkpoint(k2 / "ckpt"),
            sorted(p.name for p in (k2 / "ckpt").iterdir()),
        ),
        "k1": (
            k1_logs,
            latest_checkpoint(k1 / "ckpt"),
            sorted(p.name for p in (k1 / "ckpt").iterdir()),
        ),
    }
    r2 = _launch(k2, 2, {"steps": STEPS, "tag": "resume", "resume": True, "async": True})
    r1 = _launch(k1, 1, {"steps": STEPS, "tag": "resume", "resume": True})
    resume_logs = {"k2": _wait(r2, 240), "k1": _wait(r1, 240)}
    return {
        "base": base,
        "ref_logs": ref_logs,
        "after_kill": after_kill,
        "resume_logs": resume_logs,
    }


def test_async_saves_beside_a_manager_on_the_same_coordinator(jobs, tmp_path):
    # dcp.async_save's upload thread opens its session whenever it gets there, and a manager's
    # save right after it reserves its turn on the training thread: without a turn of its own,
    # reserved when DCP stages on the training thread, the DCP save met the manager's save under
    # each other's keys on a rank where the upload thread came second.
    root = tmp_path / "both"
    logs = _wait(_launch(root, 2, {"steps": STEPS, "tag": "both", "async": True, "manager": True}), 240)
    for rank, (rc, log) in enumerate(logs):
        r = _result(root, "both", rank)
        assert rc == 0 and "crash" not in r, log
        assert r["side"] == [STEPS, True], r
    assert latest_checkpoint(root / "ckpt").step == STEPS
    assert dcp_worker.reshard(root, root / "loaded.npz") == STEPS
    _npz_equal(root / "loaded.npz", root / "final-both.npz")  # the newest DCP step, bitwise
    _npz_equal(root / "final-both.npz", jobs["base"] / "ref2" / "final-ref.npz")


def test_reference_run_completes(jobs):
    for rank, (rc, log) in enumerate(jobs["ref_logs"]):
        assert rc == 0 and "crash" not in _result(jobs["base"] / "ref2", "ref", rank), log


@pytest.mark.parametrize("world", [1, 2])
def test_sigkill_mid_save_then_resume_is_bitwise_equal(jobs, world):
    base = jobs["base"]
    root = base / f"k{world}"
    logs, latest, listing = jobs["after_kill"][f"k{world}"]
    victim = world - 1
    assert logs[victim][0] == -9, (logs, _result(root, "kill", victim), listing)  # a real SIGKILL
    assert latest is not None and latest.step == KILL_AT - 1, listing
    assert "step-000000000003" not in listing  # never visible...
    if world == 1:  # ...though begun: the killed coordinator leaves its staging folder
        assert any(n.startswith("step-000000000003.tmp-") for n in listing), listing
    else:  # the survivor failed (no hang): its save fails, or its training step first (a race);
        # the staging folder is removed by the save's abort, or left as debris when rank 0 exits first
        assert "crash" in _result(root, "kill", 0) and logs[0][0] == 3, logs[0]

    for rank, (rc, log) in enumerate(jobs["resume_logs"][f"k{world}"]):
        res = _result(root, "resume", rank)
        assert rc == 0 and "crash" not in res, log
        assert res["start"] == KILL_AT - 1
        assert res["debris"] == []  # the crashed save's staging folder was cleaned after a commit
    if world == 1:
        dcp_worker.reference(STEPS, base / "ref1.npz")
        ref = base / "ref1.npz"
    else:
        ref = base / "ref2" / "final-ref.npz"
    _npz_equal(root / "final-resume.npz", ref)


def test_two_rank_fsdp_checkpoint_loads_on_one_rank(jobs):
    base = jobs["base"]
    assert jobs["ref_logs"][0][0] == 0
    assert dcp_worker.reshard(base / "ref2", base / "reshard.npz") == STEPS
    _npz_equal(base / "reshard.npz", base / "ref2" / "final-ref.npz")
    shutil.rmtree(base / "ref2" / "ckpt", ignore_errors=True)


COORD_TIMEOUT = 5.0


def test_frozen_rank_during_load_latest_fails_the_others_within_the_deadline(tmp_path):
    """load_latest agrees through ckptlib's coordinator: a rank frozen (SIGSTOP) inside the
    resume loop makes the other rank raise a ckptlib error within the coordinator's deadline,
    instead of waiting in DCP's collectives on the training group (20 s here) or forever."""
    dcp.save({"w": torch.arange(8.0), "step": 1}, storage_writer=CkptlibWriter(tmp_path / "ckpt", step=1))
    env = {"CKPTLIB_COORD_TIMEOUT": str(COORD_TIMEOUT)}

    # Control: nobody frozen, both ranks load the step.
    for rc, log in _wait(_launch(tmp_path, 2, {"tag": "ok"}, "load", env), 240):
        assert rc == 0, log
    for rank in range(2):
        res = _result(tmp_path, "ok", rank, "load")
        assert res.get("step") == 1 and res["state_step"] == 1, res
        assert res["w"] == list(map(float, range(8)))

    kill_log = tmp_path / "kill.log"
    env.update(CKPTLIB_TEST_KILL_LOG=str(kill_log))
    procs = _launch(tmp_path, 2, {"tag": "stop"}, "load", env, {1: {"CKPTLIB_TEST_KILL_AT": "restore:1:STOP"}})
    try:
        try:
            log0, _ = procs[0].communicate(timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 hung although rank 1 was frozen")
        frozen = procs[1].poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too; only the processes started here
            p.communicate(timeout=30)
    assert procs[0].returncode == 0, log0.decode(errors="replace")
    fired = [json.loads(line) for line in kill_log.read_text().splitlines()]
    assert [(f["phase"], f["rank"]) for f in fired] == [("restore", 1)], fired
    assert frozen, "rank 1 should still be frozen when rank 0 gave up"
    res = _result(tmp_path, "stop", 0, "load")
    assert res.get("ckptlib") is True, res  # a typed ckptlib error, not a hang or a raw gloo error
    elapsed = res["t_error"] - fired[0]["time"]
    assert 0 < elapsed < 3 * COORD_TIMEOUT + 5, (elapsed, res)
    assert not (tmp_path / "result-load-stop-1.json").exists()


def test_two_ranks_restore_with_one_size_check_per_file_for_the_job(tmp_path):
    """2 real ranks, each holding a tensor of its own (so each reads only its own payload file).
    ``load_latest``: the coordinator's judge checks every payload file's size and the other rank
    asks none (it asked every one before). A plain ``dcp.load``: the coordinator checks them,
    the other rank asks none. Rank 1's file of step 2 cut by a byte after the judge passed it is
    found by rank 1's reader, and both ranks fall back to step 1 together, bitwise."""
    for rc, log in _wait(_launch(tmp_path, 2, {"tag": "s"}, "sizes"), 240):
        assert rc == 0, log
    res = [_result(tmp_path, "s", r, "sizes") for r in range(2)]
    assert all("crash" not in r for r in res), res
    files = res[0]["files"]
    assert len(files) == 2 and any("r00001" in f for f in files), files
    for rank, r in enumerate(res):
        for phase, step in (("resume", 2), ("plain", 2), ("cut", 1)):
            assert r[phase]["step"] == step and r[phase]["state_step"] == step and r[phase]["bitwise"], (rank, phase, r)
    asked = {phase: [sorted(p.split("/", 1)[1] for p in r[phase]["asked"]) for r in res] for phase in ("resume", "plain")}
    assert asked == {"resume": [files, []], "plain": [files, []]}, asked
