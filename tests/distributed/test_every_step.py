"""Every step on a memory tier (issue "Every step"): 2 ranks as 2 simulated nodes, the local
tier under /dev/shm (a unique folder, removed after each test), a replica of each rank's files
on the other node, the persistent tier on disk. Real processes, real files, bytes compared."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import launcher

WORKER = Path(__file__).resolve().parents[1] / "workers" / "every_step_worker.py"


def job(scenario: str, root: Path, args: dict) -> list[dict]:
    rank_env = {r: {"CKPTLIB_NODE": str(r)} for r in range(2)}
    env = {"CKPTLIB_COORD_TIMEOUT": "20", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"}
    procs = launcher.start(lambda r, port: [str(WORKER), scenario, str(r), "2", port, str(root), json.dumps(args)], 2,
                           env=env, rank_env=rank_env)
    outs = launcher.finish(scenario, procs, lambda r: root / f"result-{scenario}-{r}.json", 600)
    for o in outs:
        assert o.result is not None and "crash" not in o.result, (o.result or {}).get("crash", o.log[-3000:])
    return [o.result for o in outs]  # type: ignore[misc]


def test_every_step_in_memory_then_node_loss_then_all_nodes_lost(tmp_path, shm):
    args = {"shm": str(shm), "steps": 7, "persist_every": 3, "local_keep_last": 2}
    trained = job("train", tmp_path, args)
    for r in trained:
        assert set(r["outcomes"].values()) == {"ok"}, r["outcomes"]
        # Local retention in memory: after each save a node's tier holds its newest two steps, and
        # at most one older step whose drain to disk is still pending (persist_every=3).
        for step, held in r["held"].items():
            newest = [s for s in (int(step) - 1, int(step)) if s >= 1]
            assert held[-len(newest):] == newest and all(s % 3 == 0 for s in held[:-len(newest)]), r["held"]
            assert len(held) <= 3, r["held"]
    assert not [p for n in range(2) for p in (shm / f"node{n}").glob("*.tmp-*")]  # no staging debris
    # Only the bytes that exist on one node cross the network: each rank sends its shard, per-rank
    # value and index files; the replicated tensor (written once, by one rank, into its rep file)
    # is rebuilt by the other node from its own copy, never sent.
    for step in trained[0]["traffic"]:
        t = [r["traffic"][step] for r in trained]
        assert t[0]["replicated"] + t[1]["replicated"] > 0 and t[0]["single"] > 0 and t[1]["single"] > 0, (step, t)
        for me, peer in ((0, 1), (1, 0)):
            assert t[me]["sent"] == t[me]["single"] == t[peer]["received"], (step, t)
            assert t[me]["rebuilt"] == t[peer]["replicated"], (step, t)
    # Node 1 is lost (its memory is gone): every rank restores step 7, node 1's part from node 0.
    shutil.rmtree(shm / "node1")
    restored = job("restore", tmp_path, args)
    assert [r["step"] for r in restored] == [7, 7] and all(r["bitwise"] for r in restored), restored
    # Every node is lost: the newest step drained to the persistent tier (persist_every=3: 6).
    shutil.rmtree(shm / "node0")
    shutil.rmtree(shm / "node1", ignore_errors=True)  # the restore wrote node 1's copy back
    restored = job("restore", tmp_path, args)
    assert [r["step"] for r in restored] == [6, 6] and all(r["bitwise"] for r in restored), restored


def test_a_flipped_bit_in_one_replica_fails_that_save_on_every_rank(tmp_path, shm):
    args = {"shm": str(shm), "steps": 3, "persist_every": 100, "check_replicas": True, "flip": 3, "flip_rank": 1}
    trained = job("train", tmp_path, args)
    for r in trained:
        assert r["outcomes"]["1"] == r["outcomes"]["2"] == "ok"
        assert r["outcomes"]["3"].startswith("ReplicaMismatchError") and "rank 1" in r["outcomes"]["3"]
        assert "/emb" in r["outcomes"]["3"]
    restored = job("restore", tmp_path, args)
    assert [r["step"] for r in restored] == [2, 2] and all(r["bitwise"] for r in restored), restored


def test_a_nan_in_one_shard_with_refuse_keeps_the_last_good_step(tmp_path, shm):
    args = {"shm": str(shm), "steps": 3, "persist_every": 1, "keep_last": 1, "local_keep_last": 1,
            "nonfinite": "refuse", "nan": 3, "nan_rank": 0}
    trained = job("train", tmp_path, args)
    for r in trained:
        assert r["outcomes"]["2"] == "ok"
        assert r["outcomes"]["3"].startswith("NonFiniteError") and "rank 0" in r["outcomes"]["3"], r["outcomes"]
        # The refused step left nothing, and removed nothing: the last good step is still held.
        assert 2 in r["held"]["3"] and 3 not in r["held"]["3"], r["held"]
    steps = sorted(p.name for p in (tmp_path / "persist").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-000000000002"], steps
    restored = job("restore", tmp_path, args)
    assert [r["step"] for r in restored] == [2, 2] and all(r["bitwise"] for r in restored), restored


def test_the_every_step_example_loses_at_most_one_step_and_resumes_bitwise(tmp_path):
    """examples/every_step.py as a user runs it: a reference run, a run whose rank 1 is killed
    mid-step with its node's memory tier gone, the resume; its exit status is the verdict."""
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "every_step.py"
    out = subprocess.run([sys.executable, str(example), "--steps", "14", "--kill-at", "9", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "bitwise equal to the reference" in out.stdout
    lost = int(out.stdout.split("steps lost: ")[1].split(")")[0])
    assert lost <= 1, out.stdout


def test_replicated_tensors_over_several_files_are_rebuilt_not_refused(tmp_path):
    """144 MiB of replicated tensors, 72 MiB written by each rank: the writer spreads a rank's
    replicated file over two files, balanced by size, so the records' order is not the order
    the tensors came in. The peer rebuilds
    them in the writer's order: every save commits (no false ReplicaMismatchError), none of
    those bytes is sent, and a lost node restores them bitwise. A disk tier under tmp_path
    (the bytes are too many for /dev/shm in a test)."""
    args = {"shm": str(tmp_path / "tiers"), "steps": 2, "persist_every": 10, "local_keep_last": 1,
            "big_rep": True}
    trained = job("train", tmp_path, args)
    for r in trained:
        assert set(r["outcomes"].values()) == {"ok"}, r["outcomes"]
    t = [r["traffic"]["2"] for r in trained]
    assert t[0]["replicated"] > 64 << 20 and t[1]["replicated"] > 64 << 20, t
    for me, peer in ((0, 1), (1, 0)):
        assert t[me]["sent"] == t[me]["single"] and t[me]["rebuilt"] == t[peer]["replicated"], t
    shutil.rmtree(tmp_path / "tiers" / "node1")
    restored = job("restore", tmp_path, args)
    assert [r["step"] for r in restored] == [2, 2] and all(r["bitwise"] for r in restored), restored
