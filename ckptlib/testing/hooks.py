"""Named crash points for real-process chaos tests.

The engine calls :func:`point` at each phase of a save. When the environment variable
``CKPTLIB_TEST_KILL_AT`` is ``<phase>:<rank>[:<signal>]`` (signal ``KILL`` by default, or
``STOP``), the process sends itself that signal the first time rank ``<rank>`` reaches
``<phase>``. Unset (the normal case) it costs one comparison. Phases are listed in
:data:`PHASES`; tests parametrize over it so a new phase without a test fails.
"""

from __future__ import annotations

import os
import signal

PHASES = (
    "snapshot",  # save() on the caller's thread, after flattening, before staging copies
    "write",  # a rank has opened its first payload file and written part of it
    "before_commit",  # every byte of this rank is durable, before the coordinator publishes
    "manifest",  # coordinator: manifest file written in the staging folder, not yet renamed
    "retention",  # coordinator: after the commit, while deleting old steps
    "cleanup",  # coordinator: after the commit, while removing crashed saves' debris
    "restore",  # while loading a checkpoint
)

_spec = os.environ.get("CKPTLIB_TEST_KILL_AT")
_target: tuple[str, int, int] | None = None
if _spec:
    _parts = _spec.split(":")
    _sig = signal.SIGSTOP if len(_parts) > 2 and _parts[2].upper() == "STOP" else signal.SIGKILL
    _target = (_parts[0], int(_parts[1]), _sig)


def point(phase: str, rank: int = 0) -> None:
    """Crash here if the test asked for it (see the module docstring)."""
    global _target
    if _target is None or _target[0] != phase or _target[1] != rank:
        return
    sig = _target[2]
    _target = None
    os.kill(os.getpid(), sig)
