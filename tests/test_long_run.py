"""What a long job does many times in one process must not grow with the count."""

from __future__ import annotations

import gc
import os

import pytest
import torch

import ckptlib


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_view_dropped_without_close_gives_its_file_descriptors_back(tmp_path):
    # Before: each view read and dropped unclosed kept its payload file open for good (a raw
    # descriptor with no finalizer): a job that peeks at its checkpoints ran out of them.
    root = tmp_path / "ck"
    with ckptlib.CheckpointManager(root) as mgr:
        mgr.save(1, {"a": torch.arange(1000.0)})
    ckptlib.open(root).read("/a")  # the first open imports what it needs
    gc.collect()
    before = _fds()
    for _ in range(30):
        view = ckptlib.open(root)
        assert torch.equal(view.read("/a"), torch.arange(1000.0))
        del view
    gc.collect()
    assert _fds() == before
