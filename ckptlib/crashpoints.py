"""Named crash points for real-process chaos tests (tests reach them as ckptlib.testing.hooks too).

The engine calls :func:`point` at each phase of a save, on the thread doing that phase. With
``CKPTLIB_TEST_KILL_AT=<phase>:<rank>[:<signal>][:<nth>]`` the process sends itself ``signal``
(``KILL`` default, or ``STOP``) the ``nth`` time (default 1) rank ``<rank>`` reaches ``<phase>``
(``<signal>`` may be empty: ``write:1::3``). ``CKPTLIB_TEST_KILL_LOG=<path>``: one JSON line is
appended just before the signal; ``CKPTLIB_TEST_HOOK_TRACE=<path>``: every reach appends
``<phase> <rank>``. Unset, a point costs one comparison. Tests parametrize over :data:`PHASES`.
"""

from __future__ import annotations

import json
import os
import signal
import time

SAVE_PHASES = (
    "snapshot",  # save() on the caller's thread, after flattening, before staging copies
    "write",  # a rank has opened its first payload file and written part of it
    "before_commit",  # every byte of this rank is durable, before the coordinator publishes
    "manifest",  # coordinator: manifest file written in the staging folder, not yet renamed
    "retention",  # coordinator: after the commit, while deleting old steps
    "cleanup",  # coordinator: after the commit, while removing crashed saves' debris
    "restore",  # while loading a checkpoint
)
"""The phases of a single-tier save and restore (tests/chaos/test_phase_kills.py)."""

TIER_PHASES = (
    # tiers (ckptlib/tiers): a local tier in front of the persistent one
    "local_write",  # a rank's payload is durable in its node's local folder, before replicas
    "replica_transfer",  # a holder has written part of a peer's replica, not yet durable
    "local_commit",  # node leaders: every byte and replica durable, before the node's manifest
    "drain_upload",  # drain thread: part of a payload file copied to the persistent tier
    "drain_commit",  # drain thread, coordinator: every file uploaded, before the persistent commit
    "local_retention",  # node leaders: after a local commit, while deleting old local steps
    "write_back",  # after a restore: a rank has written part of a file back into its node's folder
)
"""The phases only a tiered manager reaches (tests/chaos/test_tier_kills.py)."""

OVERWRITE_PHASES = (
    # object stores, overwrite=True (engine/commit.py _publish_claimed); "manifest" comes before
    "claimed",  # coordinator: its claim (the commit point) created, the old manifest still in place
    "replaced",  # coordinator: the new manifest put over the old one, the claim not yet removed
)
"""The phases only an overwrite save on an object store reaches (tests/test_overwrite_object_store.py)."""

PHASES = SAVE_PHASES + TIER_PHASES + OVERWRITE_PHASES

SIGNALS = {"": signal.SIGKILL, "KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


def parse(spec: str) -> tuple[str, int, int, int]:
    """``<phase>:<rank>[:<signal>][:<nth>]`` -> (phase, rank, signal number, nth)."""
    parts = spec.split(":")
    if len(parts) < 2 or len(parts) > 4:
        raise ValueError(f"bad CKPTLIB_TEST_KILL_AT {spec!r}")
    sig = SIGNALS[parts[2].upper()] if len(parts) > 2 else signal.SIGKILL
    nth = int(parts[3]) if len(parts) > 3 and parts[3] else 1
    if nth < 1:
        raise ValueError(f"bad CKPTLIB_TEST_KILL_AT {spec!r}: nth must be >= 1")
    return parts[0], int(parts[1]), sig, nth


# (phase, rank, signal[, nth]); some test workers assign a 3-tuple directly (nth 1).
_target: tuple[str, int, int] | tuple[str, int, int, int] | None = None
_seen: dict[tuple, int] = {}  # reaches of each target so far
_trace: str | None = None


def configure() -> None:
    """(Re)read the environment variables. Runs at import; a test process that imported
    ckptlib before it knew its environment (a pre-started worker) calls it again."""
    global _target, _trace
    spec = os.environ.get("CKPTLIB_TEST_KILL_AT")
    _target = parse(spec) if spec else None
    _seen.clear()
    _trace = os.environ.get("CKPTLIB_TEST_HOOK_TRACE") or None


configure()


def _append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def point(phase: str, rank: int = 0) -> None:
    """Crash here if the test asked for it (see the module docstring)."""
    global _target
    if _trace is not None:
        _append(_trace, f"{phase} {rank}\n")
    target = _target
    if target is None or target[0] != phase or target[1] != rank:
        return
    nth = target[3] if len(target) > 3 else 1
    _seen[target] = _seen.get(target, 0) + 1
    if _seen[target] != nth:
        return
    _target = None
    sig = target[2]
    log = os.environ.get("CKPTLIB_TEST_KILL_LOG")
    if log:
        rec = {"phase": phase, "rank": rank, "nth": nth, "signal": int(sig), "pid": os.getpid()}
        _append(log, json.dumps({**rec, "time": time.time()}) + "\n")
    os.kill(os.getpid(), sig)
