"""Format v2: a plain save puts each rank's piece index at the end of its payload file (one file
to create and sync per rank per save, docs/format.md 7.1); where a rank writes several files the
index keeps a file of its own, and both layouts load. Ranks are simulated in one process
(``test_scan_reads.on_ranks``); the files are real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from chaos.corpus import _index_to_own_file, body_of, v2_index_edit, v2_write
from test_scan_reads import ROWS, WORLD, on_ranks, rank_state, values

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.engine import resume, writer
from ckptlib.engine import save as save_flow
from ckptlib.engine.scan import check_step, read_manifest
from ckptlib.errors import CorruptCheckpointError
from ckptlib.format import layout

STEP = 3
FOLDER = layout.step_dir(STEP)


def save(root: Path) -> Path:
    """Every rank saves ``rank_state(rank, STEP)`` in format v2; the step folder."""
    storage = open_storage(str(root))
    on_ranks(lambda r, c: save_flow.persist(storage, FOLDER, save_flow.prepare(rank_state(r, STEP), r),
                                            step=STEP, coordinator=c))
    return root / FOLDER


def restored(root: Path) -> list[dict[str, Any]]:
    """Every rank restores into a zeroed state; the states."""
    def one(rank: int, coord: Any) -> dict[str, Any]:
        state = rank_state(rank, 0, zero=True)
        assert resume.restore(open_storage(str(root)), state, coord, timeout=60) == STEP
        return state

    return on_ranks(one)


def assert_restored(root: Path) -> None:
    n = ROWS // WORLD
    for rank, state in enumerate(restored(root)):
        assert torch.equal(state["w"].local, values(STEP)[rank * n:(rank + 1) * n]), rank
        assert torch.equal(state["plain"], torch.full((5,), float(STEP)))
        assert torch.equal(state["rng"].value, torch.full((3,), rank, dtype=torch.int64))


@pytest.fixture(autouse=True)
def v2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTLIB_FORMAT_VERSION", "2")


def test_each_rank_writes_one_file_holding_its_index(tmp_path: Path) -> None:
    ck = save(tmp_path)
    body = body_of(ck)
    names = sorted(p.name for p in (ck / body["save_id"]).iterdir())
    assert names == [f"r{r:05d}-0.bin" for r in range(WORLD)], names  # no r*-index.bin
    m = read_manifest(open_storage(str(tmp_path)), FOLDER, pieces=False)
    assert [ix.tail for ix in m.indexes] == [True] * WORLD
    for ix in m.indexes:  # the index is the last bytes of the rank's own (last) payload file
        holder = m.files[ix.first_file + ix.num_files - 1]
        assert ix.path == holder.path and layout.payload_name(ix.rank, "", 0) in ix.path
        assert (ck / holder.path).read_bytes()[holder.size - ix.size:].startswith(b"CKPTIDX2")
    assert check_step(open_storage(str(tmp_path)), FOLDER, STEP, deep=True).status == "committed"
    assert_restored(tmp_path)


def test_a_rank_writing_several_files_keeps_an_index_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = writer.plan_files
    monkeypatch.setattr(writer, "PACK_MEMBER_MAX", 0)  # every piece a unit of its own, to split over files
    monkeypatch.setattr(writer, "plan_files", lambda units, n: [units[:1], units[1:]] if len(units) > 1
                        else plan(units, n))
    ck = save(tmp_path)
    m = read_manifest(open_storage(str(tmp_path)), FOLDER, pieces=False)
    several = [ix for ix in m.indexes if ix.num_files > 1]
    assert several and not any(ix.tail for ix in several)
    assert all((ck / ix.path).name == layout.index_name(ix.rank) for ix in several)
    assert all(ix.tail for ix in m.indexes if ix.num_files == 1)
    assert check_step(open_storage(str(tmp_path)), FOLDER, STEP, deep=True).status == "committed"
    assert_restored(tmp_path)


def test_an_index_file_of_its_own_still_loads(tmp_path: Path) -> None:
    """The layout of checkpoints written before the tail (and of tier saves) reads as before."""
    ck = save(tmp_path)
    body = body_of(ck)
    _index_to_own_file(ck, body)
    v2_write(ck, body)
    m = read_manifest(open_storage(str(tmp_path)), FOLDER, pieces=False)
    assert not any(ix.tail for ix in m.indexes)
    assert len(list((ck / body["save_id"]).glob("r*-index.bin"))) == WORLD
    assert check_step(open_storage(str(tmp_path)), FOLDER, STEP, deep=True).status == "committed"
    assert_restored(tmp_path)


def test_a_stored_range_reaching_into_the_index_is_refused(tmp_path: Path) -> None:
    ck = save(tmp_path)
    body = body_of(ck)
    ix = body["indexes"][0]
    size = body["files"][ix[4] + ix[5] - 1][1]  # the rank's last payload file, holding its index
    room = size - ix[1]  # where the index begins

    def into_index(cols: dict[str, Any]) -> None:  # the last stored range now ends one byte into the index
        kind = "chunk" if len(cols["chunk_start"]) else "pack"  # a small state: packs only
        last = int(cols[f"{kind}_start"].argmax())
        cols[f"{kind}_length"][last] = room - int(cols[f"{kind}_start"][last]) + 1

    v2_index_edit(into_index)(ck)  # checksum, counts and sizes re-recorded: the range check must act
    assert body_of(ck)["files"][0][1] == size
    with pytest.raises(CorruptCheckpointError, match="ends past the end of payload file"):
        ckptlib.load(ck, per_rank="rank0")


def test_an_index_row_naming_another_ranks_payload_file_is_refused(tmp_path: Path) -> None:
    ck = save(tmp_path)
    body = body_of(ck)
    rows = {ix[3]: ix for ix in body["indexes"]}
    rows[0][0] = rows[1][0]  # rank 0's index "at the end of" rank 1's file
    v2_write(ck, body)
    with pytest.raises(CorruptCheckpointError, match="shadows the manifest or another rank's payload file"):
        read_manifest(open_storage(str(tmp_path)), FOLDER, pieces=False)


def test_two_index_rows_claiming_one_payload_file_are_refused(tmp_path: Path) -> None:
    ck = save(tmp_path)
    body = body_of(ck)
    rows = {ix[3]: ix for ix in body["indexes"]}
    rows[0][0], rows[0][4], rows[0][5] = rows[1][0], rows[1][4], rows[1][5]  # rank 0 claims rank 1's file, tail and all
    v2_write(ck, body)
    with pytest.raises(CorruptCheckpointError, match="each payload file belongs to one rank"):
        read_manifest(open_storage(str(tmp_path)), FOLDER, pieces=False)


def test_inspect_calls_a_step_with_a_damaged_tail_index_damaged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The scan checks the manifest and file sizes only: the step lists as committed. inspect,
    # which reads the piece index, must not then call it "committed" in its error.
    from ckptlib.cli.main import main

    ck = save(tmp_path)
    m = read_manifest(open_storage(str(tmp_path)), FOLDER, pieces=False)
    ix = m.indexes[0]
    payload = ck / ix.path
    data = bytearray(payload.read_bytes())
    data[len(data) - ix.size + 20] ^= 0x01  # a bit inside rank 0's index, past its magic
    payload.write_bytes(bytes(data))
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"step {STEP} is damaged: " in err and "checksum" in err and "is committed" not in err
    assert "verify" in err and "--step N" in err
