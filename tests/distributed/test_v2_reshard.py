"""Format v2 with real processes (gloo): saves by several ranks, resharding loads (4->2,
2->3 uneven) compared byte for byte, each loading rank reading only the index files its boxes
need, and v1 checkpoints written by several ranks still loading. Jobs: tests/workers/v2_worker.py
on the shared launcher (tests/launcher.py)."""

from __future__ import annotations

import json
from pathlib import Path

import launcher
import pytest

from ckptlib.backends import open_storage
from ckptlib.engine.scan import read_manifest

WORKER = Path(__file__).resolve().parents[1] / "workers" / "v2_worker.py"


def run(scenario: str, world: int, root: Path, args: dict, env: dict | None = None) -> list[dict]:
    def argv(rank: int, port: str) -> list[str]:
        return [str(WORKER), scenario, str(rank), str(world), port, str(root), json.dumps(args)]

    procs = launcher.start(argv, world, env=env)
    outs = launcher.finish(f"v2 {scenario} on {world} ranks", procs,
                           lambda r: root / f"result-{scenario}-{r}.json", 180)
    for o in outs:
        assert o.result is not None, f"rank {o.rank} wrote no result; output:\n{o.log}"
        assert "crash" not in o.result, f"rank {o.rank} crashed:\n{o.result['crash']}\n{o.log}"
    return [o.result for o in outs]


def manifest_doc(root: Path, name: str) -> dict:
    return json.loads((root / name / "manifest.json").read_bytes())


def check_loads(root: Path, name: str, res: list[dict]) -> None:
    """Exact bytes everywhere, and each rank read exactly the index files its boxes overlap."""
    m = read_manifest(open_storage(str(root)), name, pieces=False)
    for rank, r in enumerate(res):
        assert r["bad"] == [], (rank, r)
        need = set()
        for tname, (off, shape) in r["boxes"].items():
            need |= m.sharding[f"/{tname}"].ranks_for(tuple(off), tuple(shape))
        for tname in ("/plain", "/rng/@rank0", "/lr"):
            if tname in m.sharding:
                need |= m.sharding[tname].ranks_for((0,) * len(m.tensors[tname].shape), m.tensors[tname].shape)
        assert r["stats"]["index_files_read"] == len(need), (rank, r["stats"], sorted(need))


def test_v2_reshard_4_to_2(tmp_path: Path) -> None:
    run("save", 4, tmp_path, {})
    doc = manifest_doc(tmp_path, "ck")
    body = doc["body"]
    assert doc["format_version"] == 2 and len(body["indexes"]) == 4
    assert body["tensors"]["/w"]["grid"] == [10, 8] and body["tensors"]["/w"]["ranks"] == [0, 1]
    assert body["tensors"]["/col"]["grid"] == [6, 8]
    assert "boxes" in body["tensors"]["/u"]  # 41 rows as 11, 10, 10, 10: no grid
    assert body["tensors"]["/plain"]["ranks"][1] == 0  # written once, by one rank
    res = run("load", 2, tmp_path, {})
    check_loads(tmp_path, "ck", res)  # /u and /col are loaded across the saved cut: every file


def test_v2_reshard_2_to_3_uneven_and_own_cells_only(tmp_path: Path) -> None:
    run("save", 2, tmp_path, {})
    check_loads(tmp_path, "ck", run("load", 3, tmp_path, {}))
    # the same grid on both sides: every rank reads its own index file and no other
    run("save", 4, tmp_path, {"name": "grid", "tensors": ["w", "v"]})
    res = run("load", 4, tmp_path, {"name": "grid", "tensors": ["w", "v"]})
    check_loads(tmp_path, "grid", res)
    plain_writer = read_manifest(open_storage(str(tmp_path)), "grid", pieces=False).sharding["/plain"].first
    for rank, r in enumerate(res):  # its own cells, plus the one file holding /plain and rank 0's /rng
        assert r["stats"]["index_files_read"] == len({rank, plain_writer, 0}), (rank, r["stats"])


def test_public_load_reads_only_the_index_files_it_needs(tmp_path: Path) -> None:
    """``ckptlib.load`` on one rank's boxes never opens another rank's index file: a damaged
    one it does not need does not fail it; a load that needs it does."""
    import torch
    from workers.v2_worker import full, make

    import ckptlib
    from ckptlib.errors import CorruptCheckpointError

    layout = {"w": (0, "chunk"), "v": (0, "chunk")}
    run("save", 4, tmp_path, {"name": "grid", "tensors": list(layout)})
    m = read_manifest(open_storage(str(tmp_path)), "grid", pieces=False)
    plain_writer = m.sharding["/plain"].first
    other = max({1, 2, 3} - {plain_writer})
    damaged = tmp_path / "grid" / next(ix.path for ix in m.indexes if ix.rank == other)
    damaged.write_bytes(b"x" * damaged.stat().st_size)
    target = make(4, 0, layout, zero=True)
    ckptlib.load(tmp_path / "grid", into=target, per_rank="rank0")
    for k in layout:
        assert torch.equal(target[k].local, full(k).narrow(0, 0, target[k].local.shape[0])), k
    with pytest.raises(CorruptCheckpointError, match=r"index .*checksum mismatch"):
        ckptlib.load(tmp_path / "grid", into=make(4, other, layout, zero=True), per_rank="rank0")


def test_v1_checkpoint_of_several_ranks_still_loads(tmp_path: Path) -> None:
    run("save", 2, tmp_path, {}, env={"CKPTLIB_FORMAT_VERSION": "1"})
    doc = manifest_doc(tmp_path, "ck")
    assert doc["format_version"] == 1 and "indexes" not in doc["body"]
    res = run("load", 3, tmp_path, {})
    for rank, r in enumerate(res):
        assert r["bad"] == [], (rank, r)
        assert r["stats"]["index_files_read"] == 0
