"""``check_replicas=True`` with DTensor copies (HSDP: ``Replicate`` over one mesh dimension,
``Shard`` over the other), in real gloo processes: a flipped bit in one rank's rows fails the
save on every rank, naming the tensor and the two ranks that hold those rows (two copies: no
majority), while the ranks holding other rows, with different bytes, are no false mismatch;
the failed step is not committed and the steps around it are. Also: a replicated tensor
streamed in row slabs (a staging budget smaller than the state) is compared whole."""

from __future__ import annotations

from .launch import run


def test_a_flipped_bit_in_one_hsdp_replica_fails_the_save_on_every_rank(tmp_path):
    results = run("hsdp_replicas", 4, tmp_path, {"flip": 3}, timeout=240)
    for r in results:
        out = r["outcomes"]
        assert out["1"] == out["3"] == "ok", out
        assert out["2"].startswith("ReplicaMismatchError") and "/w@[" in out["2"], out
        assert out["2"].endswith("failures=[1, 3]"), out  # rows held by ranks 1 and 3 (mesh [[0, 1], [2, 3]])
        assert [tuple(s) for s in r["steps"]] == [(1, "committed"), (3, "committed")], r["steps"]


def test_a_flipped_bit_in_the_first_rows_of_a_streamed_replica_fails_the_save(tmp_path):
    """A staging budget smaller than the state streams the tensors in row slabs; each slab's
    checksum replaced the last one's, so only a tensor's last rows were compared and a bit
    flipped in its first rows was committed. Now the slabs are hashed as one."""
    results = run("streamed_replicas", 2, tmp_path, {"flip": 1}, timeout=240)
    for r in results:
        out = r["outcomes"]
        assert out["1"] == out["3"] == "ok", out
        assert out["2"].startswith("ReplicaMismatchError") and "/rep" in out["2"], out
        assert [tuple(s) for s in r["steps"]] == [(1, "committed"), (3, "committed")], r["steps"]
