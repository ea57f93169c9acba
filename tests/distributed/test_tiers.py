"""Tiers across processes: 2 simulated nodes (CKPTLIB_NODE per rank, one local folder per node),
gloo, persistent tier on POSIX and on the real SeaweedFS server. Every resume checks the
restored bytes against the pure function that made them (tests/workers/tiers_worker.py)."""

from __future__ import annotations

import io
import json
import shutil
import uuid
from contextlib import redirect_stdout
from pathlib import Path

import launcher
from backends.servers import S3_BUCKET

from ckptlib.cli.main import main as cli_main

WORKER = Path(__file__).resolve().parents[1] / "workers" / "tiers_worker.py"
JOB_TIMEOUT = 150.0


def start_job(out: Path, nodes: list[int], args: dict, env: dict | None = None,
              rank_env: dict[int, dict] | None = None) -> tuple[list, Path]:
    """Start one rank per entry of ``nodes`` (its CKPTLIB_NODE); results go to a fresh folder."""
    res = out / f"job-{uuid.uuid4().hex[:8]}"
    res.mkdir(parents=True)
    world = len(nodes)
    renv = {r: {"CKPTLIB_NODE": str(n), **(rank_env or {}).get(r, {})} for r, n in enumerate(nodes)}
    procs = launcher.start(lambda r, port: [str(WORKER), str(r), str(world), port, str(res), json.dumps(args)],
                           world, env=env, rank_env=renv)
    return procs, res


def finish_job(procs: list, res: Path, timeout: float = JOB_TIMEOUT) -> list[launcher.Outcome]:
    return launcher.finish("tiers job", procs, lambda r: res / f"result-{r}.json", timeout)


def run_job(out: Path, nodes: list[int], args: dict) -> list[dict]:
    """A job every rank of which must finish cleanly; their results."""
    outcomes = finish_job(*start_job(out, nodes, args))
    for o in outcomes:
        assert o.result is not None, f"rank {o.rank} wrote no result:\n{o.log}"
        assert "crash" not in o.result, f"rank {o.rank} crashed:\n{o.result['crash']}\n{o.log}"
    return [o.result for o in outcomes if o.result is not None]


def resumed(out: Path, nodes: list[int], args: dict) -> int:
    """Resume on ``nodes``; every rank restored the same step, bitwise; that step."""
    res = run_job(out, nodes, {**args, "mode": "resume"})
    assert all(r["bitwise"] for r in res), res
    steps = {r["restored"] for r in res}
    assert len(steps) == 1, res
    return steps.pop()


def payload(folder: Path, step: int, rank: int, replica: bool = False, index: bool = False) -> Path:
    """The payload file of ``rank`` in a node's local step folder (own copy or replica);
    ``index``: its format v2 piece index file instead."""
    base = folder / f"step-{step:012d}"
    if replica:
        base = base / "replicas"
    (found,) = list(base.glob(f"[0-9a-f]*/r{rank:05d}-{'index' if index else '[0-9]*'}.bin"))
    return found


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "manifest.json").exists()
                  and "." not in p.name)


def step_files(folder: Path, step: int) -> dict[str, bytes]:
    """A node's files of ``step``: relative path (save id folder left out) -> bytes."""
    base = folder / f"step-{step:012d}"
    return {"/".join((*p.relative_to(base).parts[:-2], p.name)): p.read_bytes()
            for p in base.rglob("*.bin")}


def mirrored(a: dict[str, bytes], b: dict[str, bytes]) -> bool:
    """Two nodes' step files are each other's replicas: own files on one, replicas on the other."""
    def flip(k: str) -> str:
        return k[len("replicas/"):] if k.startswith("replicas/") else "replicas/" + k

    return bool(a) and {flip(k): v for k, v in a.items()} == b


def verified(url: str) -> list[int]:
    """The steps ``ckptlib verify URL --json`` checked (every chunk) and found whole."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = cli_main(["verify", url, "--json"])
    assert code == 0, buf.getvalue()
    rep = json.loads(buf.getvalue())
    assert rep["ok"], rep
    return sorted(s["step"] for s in rep["steps"] if s["ok"] and s["checked_bytes"] == s["bytes"] > 0)


def manifest_version(folder: Path, step: int) -> int:
    return int(json.loads((folder / f"step-{step:012d}" / "manifest.json").read_bytes())["format_version"])


def test_node_lost_then_both_holders_lost_posix(tmp_path: Path) -> None:
    """2 nodes x 1 rank, format v2; step 2 drained (persist_every=2), step 3 local only."""
    args = {"url": str(tmp_path / "persist"), "local": str(tmp_path / "node{node}"), "persist_every": 2}
    res = run_job(tmp_path, [0, 1], {**args, "mode": "save", "steps": [1, 2, 3]})
    tiers = {s: t for s, _, t in res[0]["steps"]}
    assert tiers[2] == {"local": "committed", "persistent": "committed"}
    assert tiers[3] == {"local": "committed", "persistent": None}
    assert committed_steps(tmp_path / "persist") == [2]  # only what was drained, whole
    assert manifest_version(tmp_path / "persist", 2) == manifest_version(tmp_path / "node1", 3) == 2
    assert verified(str(tmp_path / "persist")) == [2]  # index files and payloads drained, every chunk checked
    saved = step_files(tmp_path / "node1", 3)
    assert {"r00001-index.bin", "replicas/r00000-index.bin"} <= set(saved)
    assert mirrored(step_files(tmp_path / "node0", 3), saved)
    # Node 1 lost: its ranks' bytes come back from the replica on node 0 ...
    shutil.rmtree(tmp_path / "node1")
    assert resumed(tmp_path, [0, 1], args) == 3
    # ... and are written back to node 1, with its replicas of node 0: the set is whole again.
    assert step_files(tmp_path / "node1", 3) == saved
    assert committed_steps(tmp_path / "node1") == [3]
    # So losing the OTHER node now is survivable too, from the written-back copies.
    shutil.rmtree(tmp_path / "node0")
    assert resumed(tmp_path, [0, 1], args) == 3
    assert mirrored(step_files(tmp_path / "node0", 3), saved)
    # Both holders of rank 1's step-3 bytes gone (node 1, and the replica on node 0 damaged):
    # the newest step with a source for every piece is the persisted one.
    shutil.rmtree(tmp_path / "node1", ignore_errors=True)
    flip(payload(tmp_path / "node0", 3, 1, replica=True))
    assert resumed(tmp_path, [0, 1], args) == 2


def test_corrupt_local_copy_and_other_world_size_posix(tmp_path: Path) -> None:
    """2 nodes x 2 ranks save (format v2, nothing drained); node 1 lost: resume and write-back;
    corrupt own copies on node 0 (a payload, an index file); resume on 2 nodes x 1 rank: the
    copies on node 1 (replicas) are used."""
    args = {"url": str(tmp_path / "persist"), "local": str(tmp_path / "node{node}"), "persist_every": 100}
    # Small replica pieces: many rounds, and ranks with different numbers of pieces.
    outcomes = finish_job(*start_job(tmp_path, [0, 0, 1, 1], {**args, "mode": "save", "steps": [1, 2]},
                                     env={"CKPTLIB_REPLICA_PIECE": "100"}))
    assert all(o.result and o.result.get("ok") for o in outcomes), [o.result or o.log for o in outcomes]
    assert committed_steps(tmp_path / "persist") == []
    for node, own, held in ((0, (0, 1), (2, 3)), (1, (2, 3), (0, 1))):
        for r in held:  # replicas land on the other node, byte for byte
            mine = payload(tmp_path / f"node{1 - node}", 2, r).read_bytes()
            assert len(mine) > 100 and payload(tmp_path / f"node{node}", 2, r, replica=True).read_bytes() == mine
        assert not [p for r in own for p in (tmp_path / f"node{node}" / "step-000000000002" / "replicas").rglob(
            f"r{r:05d}-*")]  # never a replica of its own ranks
    saved = step_files(tmp_path / "node1", 2)
    # Node 1 lost (2 x 2): from node 0's replicas, then written back on node 1.
    shutil.rmtree(tmp_path / "node1")
    assert resumed(tmp_path, [0, 0, 1, 1], args) == 2
    assert step_files(tmp_path / "node1", 2) == saved
    # A corrupt own payload copy (rank 0) and a corrupt own INDEX file (rank 1) on node 0,
    # resumed on another world size (2 x 1): the replicas on node 1 are used.
    flip(payload(tmp_path / "node0", 2, 0))
    flip(payload(tmp_path / "node0", 2, 1, index=True))
    assert resumed(tmp_path, [0, 1], args) == 2


def test_seaweedfs_persistent_tier(seaweed, tmp_path: Path) -> None:
    """Drain to the real SeaweedFS server (format v2); one node lost: the replica; every node
    lost: resume from S3, also in one process."""
    url = f"s3://{S3_BUCKET}/tiers-{uuid.uuid4().hex[:8]}"
    args = {"url": url, "local": str(tmp_path / "node{node}"), "persist_every": 2,
            "storage_options": seaweed.storage_options()}
    res = run_job(tmp_path, [0, 1], {**args, "mode": "save", "steps": [1, 2, 3]})
    assert {s: t["persistent"] for s, _, t in res[0]["steps"]} == {2: "committed", 3: None}
    saved = step_files(tmp_path / "node0", 3)
    shutil.rmtree(tmp_path / "node0")
    assert resumed(tmp_path, [0, 1], args) == 3
    assert step_files(tmp_path / "node0", 3) == saved  # written back from node 1's replicas
    shutil.rmtree(tmp_path / "node0")
    shutil.rmtree(tmp_path / "node1")
    assert resumed(tmp_path, [0], args) == 2


def test_local_folder_shared_by_two_nodes_is_refused(tmp_path: Path) -> None:
    """``local`` without ``{node}`` on a shared disk: the save fails on every rank, saying why."""
    args = {"url": str(tmp_path / "persist"), "local": str(tmp_path / "shared"), "mode": "save", "steps": [1]}
    outcomes = finish_job(*start_job(tmp_path, [0, 1], args))
    for o in outcomes:
        assert o.result is not None and "crash" in o.result, o.log
        assert "shared with another node" in o.result["crash"], o.result["crash"]
    assert committed_steps(tmp_path / "shared") == []
