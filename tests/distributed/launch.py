"""Start a multi-process gloo job of tests/workers/dist_worker.py and collect its results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "workers" / "dist_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(scenario: str, world: int, root: Path, args: dict | None = None, env: dict | None = None):
    port = free_port()
    procs = []
    for rank in range(world):
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(rank), str(world), str(port), str(root),
                 json.dumps(args or {})],
                env={**os.environ, **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def results(scenario: str, world: int, root: Path) -> list[dict | None]:
    out = []
    for rank in range(world):
        p = root / f"result-{scenario}-{rank}.json"
        out.append(json.loads(p.read_text()) if p.exists() else None)
    return out


def run(scenario: str, world: int, root: Path, args: dict | None = None, timeout: float = 120,
        env: dict | None = None) -> list[dict]:
    procs = start(scenario, world, root, args, env)
    end = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{scenario} on {world} ranks did not finish in {timeout}s") from None
        logs.append(out.decode(errors="replace"))
    res = results(scenario, world, root)
    for rank, (r, log) in enumerate(zip(res, logs, strict=True)):
        assert r is not None, f"rank {rank} wrote no result; output:\n{log}"
        assert "crash" not in r, f"rank {rank} crashed:\n{r['crash']}\n{log}"
    return res  # type: ignore[return-value]
