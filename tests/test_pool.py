"""The I/O pool used by the writer and reader: one deadline, first failure raised."""

from __future__ import annotations

import threading
import time

import pytest

from ckptlib.engine.pool import run_all
from ckptlib.errors import StorageTimeoutError


def test_results_in_order():
    assert run_all([lambda i=i: i * i for i in range(5)], threads=2, name="t") == [0, 1, 4, 9, 16]


def test_first_failure_is_raised():
    def boom():
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output"):
        run_all([lambda: time.sleep(0.05), boom], threads=2, name="t", timeout=10)


def test_stuck_task_hits_the_deadline():
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="still running"):
        run_all([lambda: release.wait(30), lambda: None], threads=2, name="t", timeout=0.3)
    assert time.monotonic() - t0 < 10
    release.set()
