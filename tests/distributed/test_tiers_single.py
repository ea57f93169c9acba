"""Tiers in one process: scheduling of drains, their failures, retention, restore sources,
peer placement and the ``ls`` tier column. (Multi-process cases: test_tiers.py.)"""

from __future__ import annotations

import io
import json
import logging
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.cli.main import main as cli_main
from ckptlib.errors import CheckpointError, CommitError
from ckptlib.tiers.node import Topology, local_root, node_index


def state(step: int) -> dict:
    return {"w": torch.arange(12, dtype=torch.float32) * step, "n": step}


def zeros() -> dict:
    return {"w": torch.zeros(12), "n": -1}


def persisted(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if "." not in p.name and (p / "manifest.json").exists())


def tiers_of(mgr: ckptlib.CheckpointManager) -> dict[int, dict]:
    return {i.step: i.tiers for i in mgr.steps()}


def test_persist_every_and_persist_flag(tmp_path: Path) -> None:
    mgr = ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}"), persist_every=3,
                                    local_keep_last=10)
    for step in range(1, 7):
        mgr.save(step, state(step), persist=True if step == 1 else None).wait()
    h = mgr.save(7, state(7), persist=False)
    h.wait()
    with pytest.raises(CheckpointError, match="persist=True"):
        h.wait_persisted()
    mgr.close()
    assert persisted(tmp_path / "p") == [1, 3, 6]  # save calls 3 and 6, and the forced one
    assert sorted((tmp_path / "n0").glob("step-*")) == sorted((tmp_path / "n0").glob("step-*[0-9]"))
    again = ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}"))
    t = tiers_of(again)
    assert t[6] == {"local": "committed", "persistent": "committed"}
    assert t[7] == {"local": "committed", "persistent": None}
    out = zeros()
    assert again.restore(out) == 7 and torch.equal(out["w"], state(7)["w"]) and out["n"] == 7
    with pytest.raises(ckptlib.CheckpointNotFoundError, match=r"no step 99 .*`ckptlib ls \S+ --local "):
        again.restore(zeros(), step=99)  # the command that lists both tiers (it named "A or B" as one URL)
    again.close()


def test_restore_with_empty_local_folder_reads_persistent(tmp_path: Path) -> None:
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}"), persist_every=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    shutil.rmtree(tmp_path / "n0")  # a replaced node
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}")) as mgr:
        out = zeros()
        assert mgr.restore(out) == 2
        assert torch.equal(out["w"], state(2)["w"])


def test_corrupt_local_copy_falls_to_persistent_copy(tmp_path: Path) -> None:
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}")) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    (payload,) = (tmp_path / "n0" / "step-000000000002").glob("[0-9a-f]*/r00000-*.bin")
    data = bytearray(payload.read_bytes())
    data[-5] ^= 0x40
    payload.write_bytes(bytes(data))
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}")) as mgr:
        out = zeros()
        assert mgr.restore(out) == 2  # the persistent copy of the same step, not an older step
        assert torch.equal(out["w"], state(2)["w"])
    # ... and written back over the bad local copy
    (good,) = (tmp_path / "p" / "step-000000000002").glob("[0-9a-f]*/r00000-*.bin")
    assert payload.read_bytes() == good.read_bytes()


@pytest.mark.parametrize("version", ["1", "2"])
def test_restore_writes_back_what_it_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """A replaced node (empty local folder) restores the persisted step and gets it back in its
    folder, byte for byte, so the local tier alone restores it next time."""
    monkeypatch.setenv("CKPTLIB_FORMAT_VERSION", version)
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}"), persist_every=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    shutil.rmtree(tmp_path / "n0")
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}")) as mgr:
        out = zeros()
        assert mgr.restore(out) == 2 and torch.equal(out["w"], state(2)["w"])
        assert tiers_of(mgr)[2] == {"local": "committed", "persistent": "committed"}
    def files(root: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in (root / "step-000000000002").rglob("*") if p.is_file()}

    back, there = files(tmp_path / "n0"), files(tmp_path / "p")
    assert set(back) == set(there) and len(back) == (4 if version == "2" else 3)  # marker, manifest, payload(, index)
    assert {k: v for k, v in back.items() if k != ".ckptlib"} == {k: v for k, v in there.items() if k != ".ckptlib"}
    assert not list((tmp_path / "n0").rglob("*.partial"))
    shutil.rmtree(tmp_path / "p")  # the shared tier gone: the written-back copy is enough
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}")) as mgr:
        out = zeros()
        assert mgr.restore(out) == 2 and torch.equal(out["w"], state(2)["w"]) and out["n"] == 2


def test_failed_write_back_is_logged_and_the_restore_still_succeeds(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}"), persist_every=1) as mgr:
        mgr.save(1, state(1))
    shutil.rmtree(tmp_path / "n0")
    (tmp_path / "n0").mkdir()
    (tmp_path / "n0" / "step-000000000001").write_text("a file where the step folder would go")
    with (caplog.at_level(logging.WARNING, logger="ckptlib"),
          ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}")) as mgr):
        out = zeros()
        assert mgr.restore(out) == 1 and torch.equal(out["w"], state(1)["w"])
    assert "write-back" in caplog.text
    assert (tmp_path / "n0" / "step-000000000001").read_text() == "a file where the step folder would go"


def test_failed_drain_raised_once_and_step_stays_local(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    mgr = ckptlib.CheckpointManager(blocker / "p", local=str(tmp_path / "n{node}"), local_keep_last=1)
    h = mgr.save(1, state(1))
    h.wait()  # committed locally
    with pytest.raises(CommitError):
        h.wait_persisted()
    assert tiers_of(mgr)[1] == {"local": "committed", "persistent": "failed"}
    mgr.save(2, state(2), persist=False).wait()  # the failure was raised once, not again
    mgr.save(3, state(3), persist=False).wait()
    # local_keep_last=1, but the failed drain's step is not pending: only newest steps are kept
    assert sorted(p.name for p in (tmp_path / "n0").glob("step-*")) == ["step-000000000003"]
    mgr.close()


def test_pending_drain_is_not_deleted_by_local_retention(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from ckptlib.tiers import drain

    gate = threading.Event()
    real = drain.drain_step

    def held(*args: object, **kwargs: object) -> bool:
        assert gate.wait(60), "test gate never opened"
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(drain, "drain_step", held)  # step 1's drain stays pending until the gate opens
    mgr = ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}"), local_keep_last=1,
                                    persist_every=100)
    h = mgr.save(1, state(1), persist=True)
    mgr.save(2, state(2)).wait()
    mgr.save(3, state(3)).wait()
    names = sorted(p.name for p in (tmp_path / "n0").glob("step-*"))
    assert names == ["step-000000000001", "step-000000000003"]
    assert tiers_of(mgr)[1] == {"local": "committed", "persistent": "pending"}
    gate.set()
    h.wait_persisted()
    mgr.close(drain=True)
    assert persisted(tmp_path / "p") == [1]


def test_drains_falling_behind_are_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Local retention keeps every step whose drain is pending, so drains slower than saves
    grow the local tier without bound (on a memory tier, the node's RAM): the manager warns
    once more than ``local_keep_last`` steps wait, and again when the backlog doubles, not at
    every save."""
    import threading

    from ckptlib.tiers import drain

    gate = threading.Event()
    real = drain.drain_step

    def held(*args: object, **kwargs: object) -> bool:
        assert gate.wait(60), "test gate never opened"
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(drain, "drain_step", held)
    mgr = ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}"), local_keep_last=1)
    warned = []
    with caplog.at_level(logging.WARNING, logger="ckptlib"):
        for step in range(1, 7):
            last = mgr.save(step, state(step))
            last.wait()
            warned.append(caplog.text.count("drains fall behind saves"))
    assert warned == [0, 1, 1, 2, 2, 2], warned  # at 2 waiting steps, then at 4
    assert "4 steps wait to be drained" in caplog.text and "local_keep_last=1" in caplog.text
    assert len(list((tmp_path / "n0").glob("step-*"))) == 6  # all kept: their drains are pending
    gate.set()
    last.wait_persisted()  # drains run in order: 1-5 are persisted too
    assert persisted(tmp_path / "p") == [1, 2, 3, 4, 5, 6]
    gate.clear()  # a second episode is warned about afresh, at 2 waiting steps again
    with caplog.at_level(logging.WARNING, logger="ckptlib"):
        for step in (7, 8):
            mgr.save(step, state(step)).wait()
    assert caplog.text.count("drains fall behind saves") == 3
    assert sorted(mgr._drainer.history) == [7, 8]  # persisted drains are not kept for the run's life
    gate.set()
    mgr.close(drain=True)
    assert persisted(tmp_path / "p") == [1, 2, 3, 4, 5, 6, 7, 8]


def test_node_index_and_placement() -> None:
    assert node_index({}) == 0
    assert node_index({"GROUP_RANK": "3"}) == 3
    assert node_index({"CKPTLIB_NODE": "1", "GROUP_RANK": "3"}) == 1
    with pytest.raises(ValueError, match="CKPTLIB_NODE"):
        node_index({"CKPTLIB_NODE": "x"})
    assert local_root("/nvme/run/node{node}", 7) == "/nvme/run/node7"
    topo = Topology((0, 0, 1, 1, 2, 2))
    assert topo.peers(0, 1) == [2] and topo.peers(3, 1) == [5] and topo.peers(5, 1) == [1]
    assert topo.peers(0, 2) == [2, 4] and topo.peers(0, 1, jump=2) == [4]
    assert all(topo.nodes[p] != topo.nodes[r] for r in range(6) for p in topo.peers(r, 5))
    assert Topology((0, 0)).peers(1, 1) == []  # one node: nowhere else to put a replica
    assert topo.is_leader(2) and not topo.is_leader(3)


def test_fewer_replicas_than_asked_are_named() -> None:
    """``fewest_replicas`` is what ``peers`` places (checked against it on every rank of many
    layouts), and a layout that places fewer than asked gets a warning saying why (the manager
    logs it once, on rank 0, when its tier learns the nodes); one node gets none."""
    for nodes in [(0, 1), (0, 0, 1, 1), (0, 1, 2), (0, 0, 1, 1, 2, 2, 3, 3), (0, 1, 1, 2, 2, 2), (0, 1, 2, 3, 4, 5)]:
        topo = Topology(nodes)
        for replicas in range(0, 5):
            for jump in range(1, 7):
                placed = min(len(topo.peers(r, replicas, jump)) for r in range(len(nodes)))
                assert topo.fewest_replicas(replicas, jump) == placed, (nodes, replicas, jump)
                assert (topo.short_of_replicas(replicas, jump) is None) == (placed >= replicas), (nodes, replicas, jump)
    two = Topology((0, 1))
    assert "replica_jump=2 brings the ring of 2 nodes back" in str(two.short_of_replicas(1, 2))
    assert "3 nodes hold at most 2 other-node copies" in str(Topology((0, 1, 2)).short_of_replicas(3))
    assert Topology((0, 0)).short_of_replicas(1) is None  # one node: nothing a replica could save


def test_ls_tier_column(tmp_path: Path) -> None:
    with ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}"), persist_every=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli_main(["ls", str(tmp_path / "p"), "--local", str(tmp_path / "n{node}"), "--json"]) == 0
    rows = {r["step"]: r["tiers"] for r in json.loads(buf.getvalue())["steps"]}
    assert rows == {3: {"persistent": None, "local_nodes": 1}, 2: {"persistent": "committed", "local_nodes": 1}}
    # A drain abandoned by close(drain=False) leaves step 3's .tmp- folder on the persistent tier:
    # step 3 is still listed as committed locally (it used to show only as the debris row).
    work = tmp_path / "p" / "step-000000000003.tmp-0123456789abcdef"
    work.mkdir()
    (work / ".ckptlib").write_text('{"save_id": "0123456789abcdef", "created": 0}')
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli_main(["ls", str(tmp_path / "p"), "--local", str(tmp_path / "n{node}"), "--json"]) == 0
    doc = json.loads(buf.getvalue())
    three = [(r["kind"], r["status"], r["tiers"]) for r in doc["steps"] if r["step"] == 3]
    assert ("step", "committed", {"persistent": None, "local_nodes": 1}) in three and len(three) == 2, three


def test_wait_persisted_after_the_failure_was_raised_still_says_not_persisted(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    mgr = ckptlib.CheckpointManager(blocker / "p", local=str(tmp_path / "n{node}"))
    h = mgr.save(1, state(1))
    h.wait()
    with pytest.raises(CommitError):
        mgr.close()  # waits for the drain and raises its failure (once)
    with pytest.raises(CheckpointError, match="not on the persistent tier"):
        h.wait_persisted()


def test_preemption_save_is_drained(tmp_path: Path) -> None:
    import os
    import signal

    mgr = ckptlib.CheckpointManager(tmp_path / "p", local=str(tmp_path / "n{node}"), persist_every=100)
    mgr.save_on_signal(signals=(signal.SIGUSR2,), deadline=60.0)
    mgr.save(1, state(1)).wait()
    os.kill(os.getpid(), signal.SIGUSR2)
    with pytest.raises(SystemExit) as exit_info:
        mgr.maybe_save_on_preemption(2, state(2))
    assert exit_info.value.code == 0
    assert persisted(tmp_path / "p") == [2]  # the final save went to the persistent tier; step 1 did not


def test_restore_fetches_only_the_files_a_rank_reads() -> None:
    from ckptlib.format.schema import Chunk, FileEntry, Manifest, Pack, Piece, TensorEntry
    from ckptlib.tiers.restore_plan import needed_files

    files = [FileEntry("id/r00000-0.bin", 100), FileEntry("id/r00001-0.bin", 100), FileEntry("id/r00002-0.bin", 8)]
    w = TensorEntry("float32", (10, 4), [Chunk(0, 0, 80, "x", (0, 0), (5, 4)), Chunk(1, 0, 80, "x", (5, 0), (5, 4))])
    b = TensorEntry("float32", (2,), [], [Piece(0, 0, (0,), (2,))])
    m = Manifest(1, "id", 0.0, 3, "rename", files, {"w": w, "b": b}, None, packs=[Pack(2, 0, 8, "x", "raw", 8)])
    assert needed_files(m, [("w", (0, 0), (3, 4))]) == {"r00000-0.bin"}
    assert needed_files(m, [("w", (4, 0), (2, 4))]) == {"r00000-0.bin", "r00001-0.bin"}
    assert needed_files(m, [("w", (7, 2), (3, 2))]) == {"r00001-0.bin"}
    assert needed_files(m, [("b", (0,), (2,)), ("nope", (0,), (1,))]) == {"r00002-0.bin"}


@pytest.mark.parametrize("local", ["{root}", "{root}/local", "{root}/local/n{{node}}", "{up}"])
def test_local_folder_overlapping_the_persistent_root_is_refused(tmp_path: Path, local: str) -> None:
    """Each tier prunes its own folder: a local folder that is the persistent root, inside it,
    or holding it would let local retention delete persisted steps. Refused when the manager
    is made, before anything is written; a folder beside the root is fine."""
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:  # persisted steps a local tier must not touch
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    folder = local.format(root=root, up=tmp_path)
    with pytest.raises(ValueError, match=r"(is|is inside|holds) the persistent root .*must not overlap"):
        ckptlib.CheckpointManager(root, local=folder, local_keep_last=1, persist_every=2)
    assert persisted(root) == [1, 2, 3]
    with ckptlib.CheckpointManager(root, local=tmp_path / "beside", local_keep_last=1, persist_every=1) as mgr:
        mgr.save(4, state(4)).wait_persisted()
    assert persisted(root) == [1, 2, 3, 4]
