"""Writer threads sized for this process's share of the CPUs when ranks share a machine
(``LOCAL_WORLD_SIZE``): ``pool.cpu_share`` and the payload files ``write_files`` makes."""

from __future__ import annotations

import os

import pytest
import torch

from ckptlib.backends.posix import PosixStorage
from ckptlib.engine import pool
from ckptlib.engine.writer import split_chunks, write_files


@pytest.fixture
def two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.mark.parametrize(("local", "wanted", "expected"), [
    (None, 2, 2), (None, 8, 8), ("1", 8, 8), ("2", 8, 1), ("2", 2, 1), ("4", 2, 1), ("4", 1, 1),
    ("", 8, 8), ("four", 8, 8), ("0", 8, 8), ("-3", 8, 8),
])
def test_cpu_share(two_cpus: None, monkeypatch: pytest.MonkeyPatch, local: str | None, wanted: int,
                   expected: int) -> None:
    if local is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert pool.cpu_share(wanted) == expected


def _files(tmp_path, name: str) -> int:
    storage = PosixStorage(str(tmp_path))
    storage.makedirs(name)
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 255, (80, 1 << 20), dtype=torch.uint8, generator=g)  # 80 MiB: 2 files if allowed
    jobs = split_chunks("w", t, (0, 0), 8 << 20)
    files, written = write_files(storage, name, 0, jobs, num_files=2)
    back = torch.empty_like(t)
    for c in written:
        with open(os.path.join(tmp_path, c.file), "rb") as f:
            f.seek(c.start)
            back[c.offset[0]: c.offset[0] + c.shape[0]] = torch.frombuffer(bytearray(f.read(c.length)),
                                                                           dtype=torch.uint8).view(c.shape)
    assert torch.equal(back, t)
    return len(files)


def test_ranks_sharing_the_cpus_write_one_file_each(two_cpus: None, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path) -> None:
    alone = _files(tmp_path, "alone")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    shared = _files(tmp_path, "shared")
    assert (alone, shared) == (2, 1)
