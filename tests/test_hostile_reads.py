"""Hostile checkpoints as resource attacks on the read paths other than ``load``.

``tests/test_safe_loading.py`` runs the corpus (``tests/chaos/corpus.py``) through ``load``;
this file takes the same entries (and a few roots built here) through the read view
(``ckptlib.open``: ``read``, ``blocks``), and through ``prune``'s clean-up: a declared size
must be refused with a typed error before anything that large is allocated, and no clean-up
may follow a symlink out of the root. Everything runs in-process on the test's thread.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chaos.corpus import ENTRIES, build, make_templates

import ckptlib


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_templates(tmp_path_factory.mktemp("hostile-read-templates"))


def entry(name: str, tmp_path: Path, templates: dict[str, Path]) -> Path:
    """The step folder of corpus entry ``name``, built under ``tmp_path``."""
    (e,) = [e for e in ENTRIES if e.name == name]
    return build(e, tmp_path, templates) / "step-000000000007"


@pytest.mark.timeout(60, func_only=True)
def test_read_view_of_a_terabyte_declared_tensor_is_a_typed_error(tmp_path: Path, templates: dict[str, Path]) -> None:
    """``/big`` declares 1 TiB (one zstd chunk over a sparse file). ``read`` of the whole of it,
    of a 16-byte slice (whose chunk still decodes to 1 TiB) and ``blocks`` raised torch's
    ``RuntimeError`` / numpy's ``MemoryError``; now ``CheckpointError``, as ``load`` does."""
    ck = entry("giant-sparse-1tib", tmp_path, templates)
    with ckptlib.open(ck) as view:
        with pytest.raises(ckptlib.CheckpointError, match="cannot allocate tensor '/big'"):
            view.read("/big")
        with pytest.raises(ckptlib.CheckpointError, match="out of memory while reading"):
            view.read("/big", slice(0, 16))
        with pytest.raises(ckptlib.CheckpointError, match="out of memory while reading"):
            next(iter(view.blocks("/big")))
        assert view.read("/small").numel()  # the other tensors still read


@pytest.mark.timeout(60, func_only=True)
def test_prune_local_never_sweeps_an_arena_folder_that_is_a_symlink(tmp_path: Path, shm_node: Path) -> None:
    """A memory tier's ``.ckptlib-arena`` that is a symlink to a folder outside the root: ``ckptlib
    prune --local`` (and a training job's first arena / room check, through the same sweep)
    deleted every unlocked regular file in the folder it points at, as a dead process's snapshot.
    Now the link is not followed: the outside files stay, byte for byte."""
    from ckptlib.cli.main import main as cli

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.bin").write_bytes(b"precious" * 100)
    (shm_node / ".ckptlib-arena").symlink_to(victim)
    (tmp_path / "persist").mkdir()
    assert cli(["prune", str(tmp_path / "persist"), "--local", str(shm_node), "--tier", "local"]) == 0
    assert (victim / "data.bin").read_bytes() == b"precious" * 100
    assert (shm_node / ".ckptlib-arena").is_symlink()


@pytest.mark.timeout(60, func_only=True)
def test_a_deeply_nested_marker_in_debris_does_not_stop_ls_prune_or_retention(tmp_path: Path) -> None:
    """A ``.tmp-`` folder whose ``.ckptlib`` marker is 10 KB of nested brackets: ``ckptlib ls``
    and ``ckptlib prune`` failed with ``RecursionError`` and the manager's retention failed
    after every save (old steps were never deleted). Now the marker counts as unreadable: the
    folder is listed (age unknown, left alone) and retention deletes what it should."""
    import torch

    from ckptlib.cli.main import main as cli

    root = tmp_path / "root"
    with ckptlib.CheckpointManager(root, async_save=False, keep_last=1) as m:
        m.save(1, {"a": torch.arange(4)})
    debris = root / "step-000000000002.tmp-0123456789abcdef"
    debris.mkdir()
    (debris / ".ckptlib").write_text("[" * 5000 + "]" * 5000)
    assert cli(["ls", str(root)]) == 0
    assert cli(["prune", str(root), "--keep-last", "1"]) == 0
    assert debris.is_dir()  # of unknown age: prune leaves it alone
    with ckptlib.CheckpointManager(root, async_save=False, keep_last=1) as m:
        m.save(3, {"a": torch.arange(4) + 3})
        assert [s.step for s in m.steps() if s.status == "committed"] == [3]
    assert torch.equal(ckptlib.load(root / "step-000000000003")["a"], torch.arange(4) + 3)


@pytest.mark.timeout(60, func_only=True)
def test_debris_deeper_than_path_max_does_not_stop_ls_or_prune(tmp_path: Path) -> None:
    """A crashed save's ``.tmp-`` folder holding folders nested past PATH_MAX (60 levels of
    200-character names): ``ckptlib ls`` and ``ckptlib prune`` exited 2 with ENAMETOOLONG while
    sizing it, so the debris could never be removed with the CLI. Now its size is unknown
    ('-'), ``ls`` lists it and ``prune`` removes it; the committed step is intact."""
    import json
    import os

    import torch

    from ckptlib.cli.main import main as cli

    root = tmp_path / "root"
    with ckptlib.CheckpointManager(root, async_save=False) as m:
        m.save(1, {"a": torch.arange(4)})
    debris = root / "step-000000000002.tmp-0123456789abcdef"
    debris.mkdir()
    (debris / ".ckptlib").write_text(json.dumps({"save_id": "0123456789abcdef", "created": 0}))
    fd = os.open(debris, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(60):
        os.mkdir("x" * 200, dir_fd=fd)
        deeper = os.open("x" * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    assert cli(["ls", str(root)]) == 0
    assert cli(["prune", str(root), "--keep-last", "1"]) == 0
    assert sorted(p.name for p in root.iterdir()) == ["step-000000000001"]
    assert torch.equal(ckptlib.load(root / "step-000000000001")["a"], torch.arange(4))
