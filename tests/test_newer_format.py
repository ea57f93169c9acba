"""A step written by a newer ckptlib (a manifest of a higher ``format_version``) found by an
older one: reads refuse it with ``ManifestVersionError``, and saves never take its place."""

from __future__ import annotations

import pytest
import torch
from helpers import frame

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.format import layout


def _make_newer(url: str, step: int) -> bytes:
    """Reframe step ``step``'s manifest as format_version 3 (body and checksum unchanged
    otherwise, as a future ckptlib could write it). Returns the bytes written."""
    s = open_storage(url)
    path = f"{layout.step_dir(step)}/manifest.json"
    data = s.read(path)
    body = data[data.index(b'"body":') + len(b'"body":'): -1]
    newer = frame(body, format_version=3)
    s.put_atomic(path, newer)
    return newer


@pytest.mark.parametrize("kind", ["posix", "memory"])
def test_a_save_never_replaces_a_step_a_newer_ckptlib_wrote(kind, tmp_path, memory_url):
    """Before: restore() fell back to step 1, and save(2) moved the newer step 2 aside as
    ``step-2.corrupt-<id>`` (POSIX; prune then deleted it) or deleted its manifest (object
    stores). Now save(2) raises StepExistsError saying a newer ckptlib wrote it, untouched."""
    url = str(tmp_path / "run") if kind == "posix" else memory_url
    state = {"w": torch.randn(300, 70), "n": 5}
    with ckptlib.CheckpointManager(url, async_save=False) as m:
        m.save(1, state)
        m.save(2, state)
    newer = _make_newer(url, 2)
    s = open_storage(url)
    with ckptlib.CheckpointManager(url, async_save=False) as m:
        into = {"w": torch.zeros(300, 70), "n": 0}
        assert m.restore(into) == 1
        assert torch.equal(into["w"].view(torch.uint8), state["w"].view(torch.uint8))
        with pytest.raises(ckptlib.StepExistsError, match="newer ckptlib"):
            m.save(2, state)
        m.save(3, state)
    assert s.read(f"{layout.step_dir(2)}/manifest.json") == newer
    assert sorted(e.name for e in s.listdir("")) == [layout.step_dir(i) for i in (1, 2, 3)]
    with pytest.raises(ckptlib.ManifestVersionError, match="upgrade ckptlib"):
        ckptlib.load(f"{url}/{layout.step_dir(2)}")
    with pytest.raises(ckptlib.StepExistsError, match="newer ckptlib"):
        ckptlib.save(state, f"{url}/{layout.step_dir(2)}")
    assert s.read(f"{layout.step_dir(2)}/manifest.json") == newer


def _edit_dtype(b: dict) -> None:
    b["tensors"]["/w"]["dtype"] = "float4_e2m1fn_x2"


def _edit_codec(b: dict) -> None:
    b["tensors"]["/w"]["chunks"][0][6] = "lz4"


def _edit_node(b: dict) -> None:
    b["tree"]["items"].append(["sparse", {"t": "sparse_coo", "v": 1}])


def _edit_algorithm(b: dict) -> None:
    b["checksum_algorithm"] = "blake3"


@pytest.mark.parametrize("edit", [_edit_dtype, _edit_codec, _edit_node, _edit_algorithm])
def test_unknown_names_are_a_newer_format_and_never_replaced(edit, tmp_path):
    """Before: a dtype, codec, checksum algorithm or value-tree node kind this ckptlib does not
    know was plain corruption: restore marked the step damaged (a node kind) or a save moved it
    aside, so the next save of that step replaced a newer ckptlib's checkpoint. Now it is
    ManifestVersionError (saying to upgrade) and the step is left as it is."""
    from helpers import rewrite_manifest

    run = tmp_path / "run"
    state = {"w": torch.randn(300, 70), "n": 5}
    with ckptlib.CheckpointManager(run, async_save=False) as m:
        m.save(1, state)
        m.save(2, state)
    step2 = run / layout.step_dir(2)
    rewrite_manifest(step2, edit)
    before = (step2 / "manifest.json").read_bytes()
    with pytest.raises(ckptlib.ManifestVersionError, match="newer ckptlib wrote it; upgrade ckptlib"):
        ckptlib.load(step2)
    with ckptlib.CheckpointManager(run, async_save=False) as m:
        into = {"w": torch.zeros(300, 70), "n": 0}
        assert m.restore(into) == 1
        assert torch.equal(into["w"].view(torch.uint8), state["w"].view(torch.uint8))
        with pytest.raises(ckptlib.StepExistsError):
            m.save(2, state)
    assert (step2 / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == [layout.step_dir(1), layout.step_dir(2)]
