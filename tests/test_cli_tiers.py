"""``ckptlib verify`` and ``ckptlib prune`` per tier (``--local TEMPLATE``), on the folders of a
real tiered run: 2 simulated nodes x 1 rank over gloo (tests/workers/tiers_worker.py through the
one launcher), steps 1-3, step 2 drained (persist_every=2), every step kept locally. Each test
works on its own copy of those folders and damages or prunes it."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from distributed.test_tiers import flip, payload, resumed, run_job

from ckptlib.backends import open_storage
from ckptlib.cli.main import main as cli_main
from ckptlib.engine import commit
from ckptlib.format import layout


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("tiers-run")
    args = {"url": str(where / "persist"), "local": str(where / "node{node}"), "persist_every": 2,
            "local_keep_last": 10}
    run_job(where, [0, 1], {**args, "mode": "save", "steps": [1, 2, 3]})
    return where


@pytest.fixture
def tree(run: Path, tmp_path: Path) -> Path:
    for name in ("persist", "node0", "node1"):
        shutil.copytree(run / name, tmp_path / name)
    return tmp_path


def cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = cli_main(list(argv))
    return code, buf.getvalue()


def verify(tree: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code, text = cli("verify", str(tree / "persist"), "--local", str(tree / "node{node}"), "--json", *extra)
    return code, json.loads(text)


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def verdict(doc: dict[str, Any], step: int) -> dict[str, Any]:
    (v,) = [v for v in doc["restorable"] if v["step"] == step]
    return v


def test_verify_intact_run_every_tier(tree: Path) -> None:
    code, doc = verify(tree, "--all")
    assert code == 0 and doc["ok"] and doc["tier"] == "all"
    assert [(r["step"], r["ok"]) for r in doc["steps"]] == [(2, True)]  # the persistent tier, as without --local
    assert [(n["node"], [s["step"] for s in n["steps"]]) for n in doc["nodes"]] == [(0, [1, 2, 3]), (1, [1, 2, 3])]
    for n in doc["nodes"]:
        for s in n["steps"]:
            # Each node holds its own rank's files (payloads -- its replicated pieces, if it wrote
            # any, in a file of their own -- and its format v2 index file) and the other rank's
            # replicas of them (received, or rebuilt from this rank's own copy), all good.
            kinds = {(c["rank"], c["copy"], c["status"], c["name"].endswith("-index.bin")) for c in s["copies"]}
            assert kinds == {(n["node"], "own", "ok", False), (n["node"], "own", "ok", True),
                             (1 - n["node"], "replica", "ok", False), (1 - n["node"], "replica", "ok", True)}, s
            own = sorted(c["name"] for c in s["copies"] if c["copy"] == "own")
            theirs = sorted(c["name"] for c in s["copies"] if c["copy"] == "replica")
            assert len(own) == len({c["name"] for c in s["copies"] if c["rank"] == n["node"]}) and theirs, s
    v = verdict(doc, 2)
    assert v["restorable"] and v["persisted"] and v["damaged"] == [] and v["single_copy"] == []
    assert all(sorted(src) == ["node 0", "node 1 replica", "persistent"] or
               sorted(src) == ["node 0 replica", "node 1", "persistent"] for src in v["sources"].values())
    # Default: the newest step; --tier local: no persistent rows; --node: that node only.
    code, doc = verify(tree, "--tier", "local", "--node", "1")
    assert code == 0 and doc["steps"] == [] and [n["node"] for n in doc["nodes"]] == [1]
    assert [v["step"] for v in doc["restorable"]] == [3]
    # Nothing drained yet (no persistent root): the local tier alone.
    shutil.rmtree(tree / "persist")
    code, doc = verify(tree)
    assert code == 0 and doc["steps"] == [] and verdict(doc, 3)["restorable"] and not verdict(doc, 3)["persisted"]


def test_verify_corrupt_local_copy_is_still_restorable(tree: Path) -> None:
    bad = payload(tree / "node0", 3, 0)
    flip(bad)
    code, doc = verify(tree)
    assert code == 1 and not doc["ok"]  # a damaged copy is a failed check...
    (node0,) = [n for n in doc["nodes"] if n["node"] == 0]
    (s3,) = node0["steps"]
    assert s3["status"] == "damaged" and bad.name in s3["reason"]
    assert [(c["name"], c["copy"]) for c in s3["copies"] if c["status"] == "corrupt"] == [(bad.name, "own")]
    v = verdict(doc, 3)  # ...but the piece still has a good copy: the replica on node 1
    assert v["restorable"] and not v["persisted"] and v["lost"] == []
    assert [(d["name"], d["node"], d["still_from"]) for d in v["damaged"]] == [(bad.name, 0, ["node 1 replica"])]
    assert v["single_copy"] == [bad.name]
    code, text = cli("verify", str(tree / "persist"), "--local", str(tree / "node{node}"))
    assert code == 1 and "still restorable from node 1 replica" in text and "NOT RESTORABLE" not in text
    # The restore path agrees: the job resumes step 3, bitwise.
    args = {"url": str(tree / "persist"), "local": str(tree / "node{node}"), "persist_every": 2}
    assert resumed(tree, [0, 1], args) == 3


def test_verify_corrupt_local_index_file(tree: Path) -> None:
    """Format v2: a damaged copy of a rank's index file is reported, that rank's payload on the
    same node cannot be vouched for, and both still have good copies in node 1's replicas."""
    bad = payload(tree / "node0", 3, 0, index=True)
    flip(bad)
    code, doc = verify(tree)
    assert code == 1
    (node0,) = [n for n in doc["nodes"] if n["node"] == 0]
    corrupt = {c["name"]: c["reason"] for c in node0["steps"][0]["copies"] if c["status"] == "corrupt"}
    own = {p.name for p in bad.parent.glob("r00000*.bin") if not p.name.endswith("-index.bin")}
    assert payload(tree / "node0", 3, 0).name in own  # every payload file of rank 0 (its replicated pieces' too)
    assert set(corrupt) == {bad.name} | own
    assert "checksum" in corrupt[bad.name] and all("cannot be checked" in corrupt[n] for n in own)
    v = verdict(doc, 3)
    assert v["restorable"] and {d["name"]: d["still_from"] for d in v["damaged"]} == {
        name: ["node 1 replica"] for name in corrupt}


def test_verify_both_copies_corrupt_is_not_restorable(tree: Path) -> None:
    for step in (2, 3):  # rank 1's own copy on node 1 and its replica on node 0
        flip(payload(tree / "node1", step, 1))
        flip(payload(tree / "node0", step, 1, replica=True))
    name = payload(tree / "node1", 3, 1).name
    code, doc = verify(tree, "--all")
    assert code == 1
    v3 = verdict(doc, 3)
    assert not v3["restorable"] and v3["lost"] == [name] and name in v3["reason"]
    assert sorted((d["node"], d["copy"], d["still_from"] == []) for d in v3["damaged"]) == [
        (0, "replica", True), (1, "own", True)]
    v2 = verdict(doc, 2)  # the same damage on a persisted step: the persistent copy remains
    assert v2["restorable"] and v2["persisted"]
    assert {d["copy"]: d["still_from"] for d in v2["damaged"]} == {"own": ["persistent"], "replica": ["persistent"]}
    code, text = cli("verify", str(tree / "persist"), "--local", str(tree / "node{node}"), "--step", "3")
    assert code == 1 and f"step 3: NOT RESTORABLE: no verified copy of {name}" in text
    # The persistent copy damaged too: step 2 has no good copy of that piece either.
    (pfile,) = list((tree / "persist" / layout.step_dir(2)).glob(f"*/{name.split('-')[0]}-[0-9]*.bin"))
    flip(pfile)
    code, doc = verify(tree, "--step", "2")
    assert code == 1 and not verdict(doc, 2)["restorable"] and not doc["steps"][0]["ok"]


def test_prune_local_retention_and_debris(tree: Path) -> None:
    local = str(tree / "node{node}")
    # A crashed local save's staging folder on node 0 (marker and all), and a drain of step 1
    # that may be running: its staging folder on the persistent tier, just created.
    commit.begin(open_storage(str(tree / "node0")), layout.step_dir(4), "deadbeef00")
    commit.begin(open_storage(str(tree / "persist")), layout.step_dir(1), "cafe0001")
    before = {n: digest(tree / n) for n in ("node0", "node1", "persist")}
    code, text = cli("prune", str(tree / "persist"), "--local", local, "--tier", "local", "--local-keep-last", "1",
                     "--dry-run", "--json")
    doc = json.loads(text)
    assert code == 0 and {n: digest(tree / n) for n in before} == before  # a dry run deletes nothing
    assert doc["local"]["pending_drains"] == [1]
    for node in doc["local"]["nodes"]:
        assert [(p["step"], p["keep"]) for p in node["steps"]] == [(1, True), (2, False), (3, True)], node
    # The staging folder is young: left alone unless --debris-min-age says otherwise.
    (d,) = doc["local"]["nodes"][0]["debris"]
    assert d["kind"] == "tmp" and not d["removable"]
    prune = ["prune", str(tree / "persist"), "--local", local, "--tier", "local", "--local-keep-last", "1", "--json"]
    code, text = cli(*prune)
    doc = json.loads(text)
    assert code == 0 and [n["deleted"] for n in doc["local"]["nodes"]] == [[2], [2]]
    assert doc["local"]["nodes"][0]["debris_removed"] == []
    for n in ("node0", "node1"):
        kept = {k: v for k, v in before[n].items() if not k.startswith(layout.step_dir(2) + "/")}
        assert digest(tree / n) == kept  # what stays is byte-identical
    # --debris-min-age 0: the staging folders count as crashed, so no drain is pending any more.
    code, text = cli(*prune, "--debris-min-age", "0")
    doc = json.loads(text)
    assert code == 0 and doc["local"]["pending_drains"] == []
    assert [n["deleted"] for n in doc["local"]["nodes"]] == [[1], [1]]
    assert doc["local"]["nodes"][0]["debris_removed"] == [d["path"]]
    for n in ("node0", "node1"):
        assert sorted(p.name for p in (tree / n).iterdir()) == [layout.step_dir(3)]
        assert digest(tree / n) == {k: v for k, v in before[n].items() if k.startswith(layout.step_dir(3) + "/")}
    assert digest(tree / "persist") == before["persist"]  # --tier local never touches the root


def test_prune_every_tier_and_bad_input(tree: Path) -> None:
    code, text = cli("prune", str(tree / "persist"), "--local", str(tree / "node{node}"), "--keep-last", "1",
                     "--local-keep-last", "2", "--json")
    doc = json.loads(text)
    assert code == 0 and doc["deleted"] == [] and doc["to_delete"] == []  # one persisted step: kept
    assert [n["deleted"] for n in doc["local"]["nodes"]] == [[1], [1]]
    assert doc["local"]["pending_drains"] == []
    for argv, message in (
        (["prune", str(tree / "persist")], "--keep-last N"),
        (["prune", str(tree / "persist"), "--tier", "local"], "needs --local TEMPLATE"),
        (["verify", str(tree / "persist"), "--node", "0"], "needs --local TEMPLATE"),
        (["verify", str(tree / "persist"), "--local", str(tree / "nope{node}")], "no node folders match"),
        (["ls", str(tree / "persist"), "--local", str(tree / "nope{node}")], "no node folders match"),
        (["verify", str(tree / "persist"), "--local", str(tree / "node{node}"), "--step", "9"], "no step 9"),
    ):
        code, text = cli(*argv, "--json")
        assert code == 2 and message in json.loads(text)["error"], (argv, text)
