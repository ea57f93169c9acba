"""The coordinator conformance suite (ckptlib/testing/coord_suite.py) on real processes: every
case's ranks run the library's session over a real TCPStore hosted by rank 0's process, with
real deaths (``os._exit``), real freezes (SIGSTOP, resumed by this test) and a coordinator whose
process exits the instant its session closes. The same cases run on simulated ranks here too,
so the simulation and the real transport are held to one specification."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptlib.testing.coord_suite import CASES, Case, Outcome, run_sim

WORKER = Path(__file__).resolve().parents[1] / "workers" / "coord_worker.py"
T = 3.0  # the coordination timeout of these runs (heartbeat every 0.3 s)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_real(c: Case, out: Path) -> list[Outcome]:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), c.name, str(r), str(c.world), str(port), str(T), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(c.world)]
    resume: dict[int, float] = {}
    end = time.monotonic() + 90
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            for r in range(c.world):
                marker = out / f"{r}.frozen"
                if marker.exists() and r not in resume:
                    resume[r] = time.monotonic() + float(marker.read_text())
                if r in resume and time.monotonic() >= resume[r] and procs[r].poll() is None:
                    procs[r].send_signal(signal.SIGCONT)
                    resume[r] = float("inf")
                if procs[r].poll() is not None and procs[r].returncode == 17:
                    (out / f"{r}.died").touch()
            time.sleep(0.05)
    finally:
        logs = []
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            logs.append(p.communicate()[0].decode(errors="replace")[-3000:])
    assert time.monotonic() < end, "case did not finish:\n" + "\n".join(logs)
    outcomes = []
    for r in range(c.world):
        f = out / f"{r}.json"
        outcomes.append(Outcome(**json.loads(f.read_text())) if f.exists() else Outcome(r, error="Died"))
    return outcomes


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_real_processes_conform(c: Case, tmp_path):
    out = run_real(c, tmp_path)
    assert not c.check(out, T), (c.check(out, T), out)


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_simulated_ranks_conform(c: Case):
    out = run_sim(c, dead_after=T)
    assert not c.check(out, T), (c.check(out, T), out)
