"""A Hugging Face safetensors folder (two shard files + index) loaded on 2 real ranks (gloo):
into an FSDP2 model (DTensor targets) and into uneven ``ckptlib.Shard`` row targets, bitwise,
each rank reading only about its own rows. What a rank read is counted by the kernel (``rchar``
of /proc/self/io around each ``ckptlib.load``) and by ckptlib's reader. Jobs:
tests/workers/st_worker.py on the shared launcher (tests/launcher.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import launcher
import pytest
import torch

st = pytest.importorskip("safetensors.torch")
WORKER = Path(__file__).resolve().parents[1] / "workers" / "st_worker.py"
sys.path.insert(0, str(WORKER.parent))
import st_worker  # noqa: E402

HEADERS = 16 << 10
"""Bytes a load reads besides tensor data: the two headers, the index, /proc files."""
COALESCED = 64 << 10
"""The reader fetches small neighbours in one read when at most this far apart (COALESCE_GAP)."""


def test_two_ranks_read_only_their_rows(tmp_path: Path) -> None:
    sd = st_worker.make_model(seed=0).state_dict()
    keys = sorted(sd)
    folder = tmp_path / "hf"
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate((keys[:3], keys[3:])):  # emb.weight, norm.* | proj.*
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        st.save_file({k: sd[k].contiguous() for k in part}, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    total = sum(t.nbytes for t in sd.values())

    def argv(rank: int, port: str) -> list[str]:
        return [str(WORKER), "load", str(rank), "2", port, str(tmp_path), json.dumps({"folder": str(folder)})]

    outs = launcher.finish("safetensors load on 2 ranks", launcher.start(argv, 2),
                           lambda r: tmp_path / f"result-load-{r}.json", 180)
    res = []
    for o in outs:
        assert o.result is not None, f"rank {o.rank} wrote no result; output:\n{o.log}"
        assert "crash" not in o.result, f"rank {o.rank} crashed:\n{o.result['crash']}\n{o.log}"
        res.append(o.result)
    for rank, r in enumerate(res):
        print(f"rank {rank}: folder {total} B; FSDP2 read {r['fsdp_read']} B for {r['fsdp_own']} B of its own; "
              f"Shard targets read {r['shard_read']} B for {r['shard_own']} B (reader: {r['reader_read']} B)")
        assert r["bad"] == [], (rank, r)
        # Every byte a rank read is its own rows, plus headers and small coalesced gaps.
        assert r["fsdp_own"] <= r["fsdp_read"] <= r["fsdp_own"] + HEADERS + 2 * COALESCED, (rank, r)
        assert r["shard_own"] <= r["shard_read"] <= r["shard_own"] + HEADERS + 2 * COALESCED, (rank, r)
        assert r["reader_needed"] == r["shard_own"] <= r["reader_read"] <= r["shard_own"] + 2 * COALESCED
        assert r["fsdp_read"] < 0.6 * total and r["shard_read"] < 0.6 * total
    assert res[0]["shard_own"] != res[1]["shard_own"]  # uneven rows: each rank its own amount


def test_fsdp2_tied_model_loads_strictly_from_the_one_name_written(tmp_path: Path) -> None:
    """A tied FSDP2 model (DTensor parameters) and a folder holding the tied weight once, as
    Hugging Face writes it: strict=True raised "/lm_head.weight" missing on every rank; the
    tied name is the same memory, loaded through its twin."""
    folder = tmp_path / "hf"
    folder.mkdir()
    torch.manual_seed(0)
    st.save_file({"embed.weight": torch.randn(64, 16)}, str(folder / "model.safetensors"), metadata={"format": "pt"})

    def argv(rank: int, port: str) -> list[str]:
        return [str(WORKER), "tied", str(rank), "2", port, str(tmp_path), json.dumps({"folder": str(folder)})]

    outs = launcher.finish("tied FSDP2 load on 2 ranks", launcher.start(argv, 2),
                           lambda r: tmp_path / f"result-tied-{r}.json", 180)
    for o in outs:
        assert o.result is not None and "crash" not in o.result, o.log[-3000:]
        assert o.result == {"error": None, "embed": True, "lm_head": True}, o.result
