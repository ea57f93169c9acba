"""The commit's look at a manifest key after it lost or gave up on it (``committed_id``, a fenced
or taken key) read whatever stood there whole: a manifest-sized limit is now checked first, as
every other manifest read does, so a huge file there (a sparse one just over the limit here) is
refused without reading a byte of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptlib.backends import open_storage
from ckptlib.engine import commit
from ckptlib.engine.scan import read_capped
from ckptlib.errors import CorruptCheckpointError
from ckptlib.format import layout
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.format.schema import MAX_MANIFEST_BYTES


@pytest.fixture
def huge_manifest(tmp_path: Path) -> tuple[Path, str]:
    folder = tmp_path / layout.step_dir(3)
    folder.mkdir()
    with open(folder / MANIFEST_NAME, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: no disk, no memory until read
    return tmp_path, layout.step_dir(3)


def test_read_capped_refuses_before_reading(huge_manifest: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    root, step = huge_manifest
    storage = open_storage(str(root))
    monkeypatch.setattr(storage, "read", lambda *a, **k: pytest.fail("read a file over the manifest limit"))
    with pytest.raises(CorruptCheckpointError, match="over the"):
        read_capped(storage, f"{step}/{MANIFEST_NAME}")
    assert commit.committed_id(storage, step) is None


def test_read_capped_reads_a_manifest_sized_file(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    (tmp_path / "m.json").write_bytes(b"{}")
    assert read_capped(storage, "m.json") == b"{}"
    with pytest.raises(FileNotFoundError):
        read_capped(storage, "missing.json")
