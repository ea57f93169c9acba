"""The one multi-process launcher of the tests: N ranks as real processes on a fresh port.

Called from the pytest thread only. A job is ``start`` (one process per rank, each with its
own environment) then ``finish`` (wait for every rank under one deadline; past it, dump the
stacks of what still runs, kill it by PID and fail as a hang), which returns one
:class:`Outcome` per rank: exit status, the JSON result the rank wrote, its output.

Used by tests/distributed/launch.py (dist_worker.py jobs), tests/chaos/launch.py
(chaos_worker.py jobs from a pool of pre-started processes: ``spawn=``) and
tests/chaos/conftest.py (chaos_storage_worker.py jobs: ``argv=`` per rank).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Spawn = Callable[[list[str], dict[str, str]], subprocess.Popen]
"""Starts one rank: (argv, full environment) -> its process (stdout+stderr piped)."""

KEEP_LOG = 6000  # characters of each rank's output kept in a hang report


class Hang(AssertionError):
    """A job did not finish within its deadline (every rank was killed)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the rendezvous of one job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def popen(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """The plain :data:`Spawn`: a fresh Python process running ``argv``."""
    return subprocess.Popen(
        [sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


@dataclass
class Outcome:
    """How one rank's process ended."""

    rank: int
    returncode: int
    result: dict | None  # the JSON result file the rank wrote; None if it wrote none, or a torn one (its log says)
    log: str


def start(
    argv: Callable[[int, str], list[str]],
    world: int,
    *,
    env: dict | None = None,
    rank_env: dict[int, dict] | None = None,
    spawn: Spawn = popen,
) -> list[subprocess.Popen]:
    """One process per rank on a fresh port: ``argv(rank, port)`` under ``os.environ`` +
    the rendezvous variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) +
    ``env`` + ``rank_env[rank]``. ``CKPTLIB_TEST_KILL_AT`` reaches only ranks given a
    ``rank_env`` (a fault hook is aimed at its victim)."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": rank, "WORLD_SIZE": world}
        full = {**os.environ, **rendezvous, **(env or {}), **(rank_env or {}).get(rank, {})}
        if rank not in (rank_env or {}):
            full.pop("CKPTLIB_TEST_KILL_AT", None)
        procs.append(spawn(argv(rank, port), {k: str(v) for k, v in full.items()}))
    return procs


def kill_all(procs: list[subprocess.Popen]) -> str:
    """Wake (SIGCONT) and ask for stacks (SIGUSR1, where the worker registered faulthandler)
    every live process, kill it by PID, and return what every rank printed."""
    live = [q for q in procs if q.poll() is None]
    for q in live:
        q.send_signal(signal.SIGCONT)
        q.send_signal(signal.SIGUSR1)
    time.sleep(1.0 if live else 0.0)
    for q in live:
        q.kill()
    logs = []
    for rank, q in enumerate(procs):
        try:
            out, _ = q.communicate(timeout=30)
        except ValueError:  # output already read by an earlier communicate()
            out = b""
        logs.append(
            f"--- rank {rank} (exit {q.returncode}):\n"
            + (out or b"").decode(errors="replace")[-KEEP_LOG:]
        )
    return "\n".join(logs)


def finish(
    name: str,
    procs: list[subprocess.Popen],
    result_path: Callable[[int], Path],
    timeout: float,
) -> list[Outcome]:
    """Wait for every rank under one deadline; :class:`Hang` (every rank killed, their output
    in the message) if one is still running after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    logs = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise Hang(
                f"{name}: rank {rank} did not finish within {timeout:.0f}s (hang)\n{kill_all(procs)}"
            ) from None
        logs.append(out.decode(errors="replace"))
    outcomes = []
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        path = result_path(rank)
        result = None
        if path.exists():
            text = path.read_text()
            try:
                result = json.loads(text)
            except ValueError:  # the rank died while writing it: judged as no result, with its output
                log += f"\n[launcher] {path.name} is not JSON ({len(text)} bytes; exit {p.returncode}): {text[:200]!r}"
        outcomes.append(Outcome(rank, p.returncode, result, log))
    return outcomes


def wait_exit(procs: list[subprocess.Popen], ranks: list[int], timeout: float) -> bool:
    """True once every process in ``ranks`` has exited (False at ``timeout``). Their output
    stays in the pipe for :func:`finish`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(procs[r].poll() is not None for r in ranks):
            return True
        time.sleep(0.05)
    return False
