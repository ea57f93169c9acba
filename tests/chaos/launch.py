"""Start a multi-rank gloo job of tests/workers/chaos_worker.py with a per-rank environment.

A copy of tests/distributed/launch.py's ``start`` with one addition: ``rank_env`` adds variables
to one rank's process only (e.g. ``CKPTLIB_TEST_KILL_AT`` for the victim).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "workers" / "chaos_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Outcome:
    """How one rank's process ended."""

    rank: int
    returncode: int
    result: dict | None  # ROOT/result-<scenario>-<rank>.json, None if it wrote none
    log: str


def start(
    scenario: str,
    world: int,
    root: Path,
    args: dict | None = None,
    env: dict | None = None,
    rank_env: dict[int, dict] | None = None,
) -> list[subprocess.Popen]:
    for rank in range(world):  # results of an earlier job in the same root
        (root / f"result-{scenario}-{rank}.json").unlink(missing_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        full_env = {**os.environ, **(env or {}), **((rank_env or {}).get(rank, {}))}
        if rank not in (rank_env or {}):
            full_env.pop("CKPTLIB_TEST_KILL_AT", None)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    scenario,
                    str(rank),
                    str(world),
                    str(port),
                    str(root),
                    json.dumps(args or {}),
                ],
                env=full_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def finish(
    scenario: str, procs: list[subprocess.Popen], root: Path, timeout: float
) -> list[Outcome]:
    """Wait for every rank; kill them all and fail if any is still running after ``timeout``."""
    end = time.monotonic() + timeout
    logs = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.communicate(timeout=30)
            raise AssertionError(
                f"{scenario}: rank {rank} did not finish within {timeout}s (hang)"
            ) from None
        logs.append(out.decode(errors="replace"))
    outcomes = []
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        path = root / f"result-{scenario}-{rank}.json"
        result = json.loads(path.read_text()) if path.exists() else None
        outcomes.append(Outcome(rank, p.returncode, result, log))
    return outcomes
