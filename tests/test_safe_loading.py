"""Hostile and damaged checkpoints: every bad input is a typed error naming the file.

The cases are the entries of ``tests/chaos/corpus.py`` (one list, also run in subprocesses
under memory limits by ``tests/chaos/test_malicious.py``). Each starts from a real small
checkpoint and tampers with it. Loading must raise
``CorruptCheckpointError`` (``CheckpointNotFoundError`` for a missing manifest) whose message
names the file that is wrong -- never another exception type, never a hang, never wrong data,
and never unbounded memory. Manifest edits re-compute the manifest's self-checksum
(``helpers.rewrite_manifest``) so they reach the validation behind it.

Library bugs found here are kept as strict xfails whose reason starts with ``BUG:``.

The per-test time limits bound the test function only (``func_only=True``): they prove our
reader never hangs, and must not count pytest's own ``tmp_path`` set-up, which once stalled
for two minutes in an ``unlink`` on a busy CI machine (stop 31).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from chaos.corpus import (
    CORRUPT,
    ENTRIES,
    Entry,
    big_as_stored,
    build,
    flip_payload,
    huge_uint8_tensor,
    judge,
    make_templates,
    overlapping_tensors,
    set_cell,
    set_tree,
    symlink_payload,
    table_edit,
)
from chaos.load_one import check
from helpers import (
    add_row,
    assert_same,
    base_state,
    body_of,
    chunk0,
    encode_manifest,
    manifest_path,
    packed_location,
    rewrite_manifest,
    row_to_dict_form,
    table_rows,
    write_manifest_bytes,
    zstd_bomb,
)

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.engine import scan
from ckptlib.engine.scan import check_step

MANIFEST = "manifest.json"


_TEMPLATES: dict[str | None, Path] = {}


@pytest.fixture(scope="module", autouse=True)
def _templates(tmp_path_factory: pytest.TempPathFactory):
    """Save the base checkpoints once per module; each test tampers with its own copy
    (copying is much cheaper than a save, which fsyncs)."""
    root = tmp_path_factory.mktemp("templates")
    for compression in (None, "zstd"):
        path = root / str(compression)
        path.mkdir()
        ckptlib.save(base_state(), path / "ck", compression=compression)
        _TEMPLATES[compression] = path / "ck"
    yield
    _TEMPLATES.clear()


def make_checkpoint(root: Path, compression: str | None = None) -> Path:
    """A fresh copy of a real checkpoint of ``base_state()`` at ``root/ck``."""
    path = root / "ck"
    shutil.copytree(_TEMPLATES[compression], path, symlinks=True)
    return path


# --------------------------------------------------------------------------- sanity


def test_untampered_rewrite_still_loads(tmp_path: Path) -> None:
    """The tampering helper itself writes valid manifests (so the cases below test what they
    claim to test, not the checksum)."""
    ck = make_checkpoint(tmp_path)
    before = manifest_path(ck).read_bytes()
    rewrite_manifest(ck, lambda body: None)
    assert manifest_path(ck).read_bytes() == before
    assert_same(ckptlib.load(ck), base_state())
    info = check_step(open_storage(str(tmp_path)), "ck", deep=True)
    assert info.status == "committed", info.reason


def test_chunked_and_packed_layout(tmp_path: Path) -> None:
    """The base checkpoint has the shapes of data the cases rely on."""
    body = body_of(make_checkpoint(tmp_path))
    assert len(body["tensors"]["/big"]["chunks"]) == 1
    assert len(body["tensors"]["/big2"]["chunks"]) == 1
    assert chunk0(body, "/big")[2] == chunk0(body, "/big2")[2] == 256 * 1024
    assert chunk0(body, "/big")[0] == chunk0(body, "/big2")[0]  # same payload file
    # small tensors are rows of the packed table, in one pack, back to back
    assert table_rows(body) == ["/small", "/small2", "/blob"]
    assert not {"/small", "/small2", "/blob"} & set(body["tensors"])
    assert len(body["packs"]) == 1
    assert [packed_location(body, n) for n in table_rows(body)] == [(0, 0), (0, 64), (0, 96)]
    assert body["packs"][0][5] == 64 + 32 + 5120  # raw length: nothing else in the pack


def test_legacy_packed_dict_form_still_loads(tmp_path: Path) -> None:
    """Rows moved back to the older ``tensors[name]["packed"]`` form load the same data (the
    decoder accepts both), including a checkpoint mixing both forms."""
    ck = make_checkpoint(tmp_path)

    def edit(body: dict[str, Any]) -> None:
        row_to_dict_form(body, "/small2")
        row_to_dict_form(body, "/blob")

    body = rewrite_manifest(ck, edit)
    assert table_rows(body) == ["/small"] and body["tensors"]["/small2"]["packed"] == [[0, 64]]
    assert_same(ckptlib.load(ck), base_state())
    rewrite_manifest(ck, lambda b: row_to_dict_form(b, "/small"))
    assert_same(ckptlib.load(ck), base_state())
    info = check_step(open_storage(str(tmp_path)), "ck", deep=True)
    assert info.status == "committed", info.reason


# --------------------------------------------------------------------------- the hostile list
# One list (``chaos.corpus.ENTRIES``) for this file and tests/chaos/test_malicious.py. The unit
# entries (``match`` set) are checked here for their message and the file it names.

UNIT = [pytest.param(e, id=e.name) for e in ENTRIES if e.match]


def _apply(tmp_path: Path, entry: Entry) -> tuple[Path, str]:
    ck = make_checkpoint(tmp_path, None if entry.template == "raw" else entry.template)
    named = entry.tamper(ck)
    return ck, named or MANIFEST


@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize("entry", UNIT)
def test_load_refuses(tmp_path: Path, entry: Entry) -> None:
    ck, named = _apply(tmp_path, entry)
    with pytest.raises(getattr(ckptlib, entry.expect[0]), match=entry.match) as ei:
        ckptlib.load(ck)
    assert named in str(ei.value), f"error does not name {named}: {ei.value}"


def test_value_tree_errors_name_the_manifest(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path)
    set_tree("name", {"t": "pickle"})(ck)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="unknown node kind") as ei:
        ckptlib.load(ck)
    assert MANIFEST in str(ei.value)


@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize("entry", UNIT)
def test_no_foreign_exception_anywhere(tmp_path: Path, entry: Entry) -> None:
    """Every entry point that reads a checkpoint raises only CheckpointError subclasses (or
    succeeds, where damage is legitimately invisible, e.g. ``verify=False``)."""
    ck, _ = _apply(tmp_path, entry)
    calls: dict[str, Callable[[], Any]] = {
        "load": lambda: ckptlib.load(ck),
        "load(verify=False)": lambda: ckptlib.load(ck, verify=False),
        "load(into=)": lambda: ckptlib.load(ck, into=base_state()),
        "load_metadata": lambda: ckptlib.load_metadata(ck),
        "check_step(deep)": lambda: check_step(open_storage(str(tmp_path)), "ck", deep=True),
    }
    foreign = {}
    for what, call in calls.items():
        try:
            call()
        except ckptlib.CheckpointError:
            pass
        except Exception as e:
            foreign[what] = f"{type(e).__name__}: {e}"
    assert not foreign, foreign


@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize(
    "entry",
    # the value tree is decoded by load() only: check_step judges manifest, sizes and checksums
    [p for p in UNIT if p.values[0].expect == CORRUPT and not p.values[0].tree_only
     and p.values[0].tamper is not huge_uint8_tensor],
)
def test_check_step_deep_reports_corrupt(tmp_path: Path, entry: Entry) -> None:
    _, named = _apply(tmp_path, entry)
    info = check_step(open_storage(str(tmp_path)), "ck", deep=True)
    assert info.status == "corrupt", (info.status, info.reason)
    assert named in info.reason, info.reason


# --------------------------------------------------------------------------- the corpus, in-process


@pytest.fixture(scope="module")
def corpus_templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_templates(tmp_path_factory.mktemp("corpus-templates"))


@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e.isolated], ids=lambda e: e.name)
def test_corpus_entry_in_process(tmp_path: Path, corpus_templates: dict[str, Path], entry: Entry) -> None:
    """Every entry, judged as tests/chaos/test_malicious.py judges it, but in this process and
    without memory or CPU limits (the ``isolated`` bombs run only there)."""
    root = build(entry, tmp_path, corpus_templates)
    assert not judge(entry, {"ops": check(root)})


# --------------------------------------------------------------------------- specific checks


def test_bit_flip_with_verify_false_is_not_detected_but_loads(tmp_path: Path) -> None:
    """verify=False skips checksums by design: the flip shows up in the data (documented)."""
    ck = make_checkpoint(tmp_path)
    flip_payload("/big")(ck)
    loaded = ckptlib.load(ck, verify=False)
    assert not torch.equal(loaded["big"], base_state()["big"])


def test_overlapping_ranges_would_be_wrong_data(tmp_path: Path) -> None:
    """The overlap case is real: with the overlap check gone, /big2 would silently load /big's
    bytes (the checksum matches). The manifest check is what prevents it."""
    ck = make_checkpoint(tmp_path)
    overlapping_tensors(ck)
    body = body_of(ck)
    assert chunk0(body, "/big")[:4] == chunk0(body, "/big2")[:4]
    with pytest.raises(ckptlib.CorruptCheckpointError, match="overlap"):
        ckptlib.load(ck, verify=False)


def test_symlink_target_is_a_valid_copy(tmp_path: Path) -> None:
    """The symlinked payload points at a byte-identical copy: refusing is about the link."""
    ck = make_checkpoint(tmp_path)
    name = symlink_payload(ck)
    link = next(p for p in (ck).rglob(name))
    assert link.is_symlink() and link.resolve().read_bytes() == (tmp_path / "outside.bin").read_bytes()
    with pytest.raises(ckptlib.CorruptCheckpointError, match="symlink"):
        ckptlib.load(ck)


def test_huge_manifest_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = make_checkpoint(tmp_path)
    size = manifest_path(ck).stat().st_size
    monkeypatch.setattr(scan, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="limit") as ei:
        ckptlib.load(ck)
    assert MANIFEST in str(ei.value)
    with pytest.raises(ckptlib.CorruptCheckpointError, match="limit"):
        ckptlib.load_metadata(ck)
    info = check_step(open_storage(str(tmp_path)), "ck")
    assert info.status == "corrupt" and "limit" in info.reason
    monkeypatch.setattr(scan, "MAX_MANIFEST_BYTES", size)
    assert_same(ckptlib.load(ck), base_state())


@pytest.mark.parametrize(
    ("node", "match"),
    [
        ({"t": "pickle", "v": "x"}, "unknown node kind"),
        ({"t": "tensor", "ref": "/big"}, "tensor"),
        ({"t": "dict", "items": [["a", {"t": "bytes", "b64": "%%%"}]]}, "base64"),
    ],
    ids=["unknown-kind", "tensor-ref", "bad-base64"],
)
def test_tampered_metadata(tmp_path: Path, node: Any, match: str) -> None:
    ck = make_checkpoint(tmp_path)
    rewrite_manifest(ck, lambda b: b.__setitem__("metadata", node))
    with pytest.raises(ckptlib.CorruptCheckpointError, match=match) as ei:
        ckptlib.load_metadata(ck)
    assert MANIFEST in str(ei.value)


def test_manifest_version_error_is_corrupt() -> None:
    assert issubclass(ckptlib.ManifestVersionError, ckptlib.CorruptCheckpointError)


def test_future_version_in_manager_steps(tmp_path: Path) -> None:
    with ckptlib.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        folder = next((tmp_path / "run").glob("step-*1"))
        write_manifest_bytes(folder, encode_manifest(body_of(folder), format_version=2))
        (info,) = mgr.steps()
        assert info.status == "corrupt" and "newer" in info.reason
        assert mgr.latest_step() is None
        with pytest.raises(ckptlib.CorruptCheckpointError, match="newer"):
            mgr.restore({"w": torch.zeros(2)})


def test_step_mismatch_between_folder_and_manifest(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(5, {"w": torch.ones(2)})
        mgr.save(7, {"w": torch.full((2,), 7.0)})
        (root / "step-000000000005").rename(root / "step-000000000006")  # folder says 6
        rewrite_manifest(root / "step-000000000007", lambda b: b.__setitem__("step", 8))  # manifest says 8
        infos = {i.step: i for i in mgr.steps()}
        assert infos[6].status == "corrupt"
        assert "manifest says step 5" in infos[6].reason
        assert infos[7].status == "corrupt"
        assert "manifest says step 8" in infos[7].reason
        assert mgr.latest_step() is None
        with pytest.raises(ckptlib.CorruptCheckpointError, match="step"):
            mgr.restore({"w": torch.zeros(2)})


def test_manager_skips_corrupt_newest_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(70_000)})
        mgr.save(2, {"w": torch.full((70_000,), 2.0)})
        flip_payload("/w")(root / "step-000000000002")
        quick = {i.step: i.status for i in mgr.steps()}
        assert quick == {1: "committed", 2: "committed"}  # sizes are fine: quick scan passes
        deep = {i.step: i for i in mgr.steps(deep=True)}
        assert deep[2].status == "corrupt" and "checksum mismatch" in deep[2].reason
        target = {"w": torch.zeros(70_000)}
        assert mgr.restore(target) == 1
        assert torch.equal(target["w"], torch.ones(70_000))


# --------------------------------------------------------------------------- memory bound

_MEMORY_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import ckptlib
    from ckptlib.backends import open_storage
    from ckptlib.engine.scan import check_step

    root, name = sys.argv[1], sys.argv[2]
    out = {}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        ckptlib.load(f"{root}/{name}")
        out["load"] = "no error"
    except Exception as e:
        out["load"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
    info = check_step(open_storage(root), name, deep=True)
    out["deep"] = [info.status, info.reason]
    out["rss_growth_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps(out))
    """
)


def _probe_in_fresh_process(root: Path) -> dict[str, Any]:
    """Run ``_MEMORY_PROBE`` on ``root/ck`` in a new interpreter (so its peak RSS is its own)."""
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(root), "ck"],
        capture_output=True, text=True, timeout=100, check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("content_size", [True, False], ids=["declared", "undeclared"])
def test_zstd_bomb_memory_stays_small(tmp_path: Path, content_size: bool) -> None:
    """A 1 GiB zstd bomb with a manifest claiming 4 KiB: refused, and the process that reads it
    (a fresh one, so its peak RSS is its own) grows by far less than the bomb."""
    ck = make_checkpoint(tmp_path, "zstd")
    big_as_stored(zstd_bomb(1 << 30, declared=content_size))(ck)
    out = _probe_in_fresh_process(tmp_path)
    assert out["load"].startswith("ckptlib.errors.CorruptCheckpointError"), out
    assert "evil.bin" in out["load"]
    assert out["deep"][0] == "corrupt", out
    assert out["rss_growth_mb"] < 300, out  # the bomb is 1024 MB; a capped decode needs ~0


def many_rows(n: int, last: dict[str, Any]) -> Callable[[Path], None]:
    """``n`` extra one-byte rows in the packed table (overlapping the real members: refused),
    the last row's cells replaced by ``last``."""

    def fn(t: dict[str, Any], body: dict[str, Any]) -> None:
        for i in range(n):
            add_row(body, f"/pad/{i}", "uint8", [1], 0, i % 5216)
        for column, value in last.items():
            t[column][-1] = value

    return table_edit(fn)


TABLE_MEMORY_CASES = {
    "rows-overlap": (many_rows(200_000, {}), "overlap"),
    "rows-last-dim-2**64": (many_rows(200_000, {"dims": 2**64}), "dims holds an integer outside"),
    "rows-last-dtype-list": (many_rows(200_000, {"dtype": ["uint8"]}), "not in the dtype allowlist"),
    "row-2**62-elements": (set_cell("dims", 0, 2**62), "declares more than 2\\^62 bytes"),
}


@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("which", sorted(TABLE_MEMORY_CASES))
def test_table_refusal_memory_stays_small(tmp_path: Path, which: str) -> None:
    """A packed table of 200,000 hostile rows, or a row declaring 2^64 bytes: refused by the
    column checks, quickly, and the reading process (a fresh one, so its peak RSS is its own)
    grows by far less than anything the rows declare."""
    tamper, match = TABLE_MEMORY_CASES[which]
    ck = make_checkpoint(tmp_path)
    tamper(ck)
    out = _probe_in_fresh_process(tmp_path)
    assert out["load"].startswith("ckptlib.errors.CorruptCheckpointError"), out
    assert MANIFEST in out["load"] and re.search(match, out["load"]), out
    assert out["deep"][0] == "corrupt" and re.search(match, out["deep"][1]), out
    assert out["rss_growth_mb"] < 250, out  # a 200,000-row manifest is about 7 MB of JSON
