"""Multi-process gloo jobs of tests/workers/dist_worker.py, on the shared launcher
(tests/launcher.py). Called from the pytest thread."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import launcher

WORKER = Path(__file__).resolve().parents[1] / "workers" / "dist_worker.py"


def start(scenario: str, world: int, root: Path, args: dict | None = None, env: dict | None = None
          ) -> list[subprocess.Popen]:
    def argv(rank: int, port: str) -> list[str]:
        return [str(WORKER), scenario, str(rank), str(world), port, str(root), json.dumps(args or {})]

    return launcher.start(argv, world, env=env)


def results(scenario: str, world: int, root: Path) -> list[dict | None]:
    out = []
    for rank in range(world):
        p = root / f"result-{scenario}-{rank}.json"
        out.append(json.loads(p.read_text()) if p.exists() else None)
    return out


def wait(scenario: str, procs: list[subprocess.Popen], root: Path, timeout: float = 120
         ) -> list[launcher.Outcome]:
    """Every rank's outcome; a rank still running after ``timeout`` is a hang (all killed)."""
    return launcher.finish(
        f"{scenario} on {len(procs)} ranks", procs, lambda r: root / f"result-{scenario}-{r}.json", timeout
    )


def run(scenario: str, world: int, root: Path, args: dict | None = None, timeout: float = 120,
        env: dict | None = None) -> list[dict]:
    """Start, wait (``timeout`` for the whole job), and require a clean result from every rank."""
    procs = start(scenario, world, root, args, env)
    for o in wait(scenario, procs, root, timeout):
        assert o.result is not None, f"rank {o.rank} wrote no result; output:\n{o.log}"
        assert "crash" not in o.result, f"rank {o.rank} crashed:\n{o.result['crash']}\n{o.log}"
    return results(scenario, world, root)  # type: ignore[return-value]
