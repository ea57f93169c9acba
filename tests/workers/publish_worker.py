"""dist_worker.py plus the ``publish`` and ``fence`` scenarios: the coordinator's publish is
slow (an injected ``slow`` fault), frozen (crash point ``manifest:0:STOP``) or killed.

usage: publish_worker.py publish|fence RANK WORLD PORT ROOT JSON-ARGS
(started by tests/distributed/test_failures.py and test_fence.py through the common launcher).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import dist_worker  # same folder: this file's folder is sys.path[0]

import ckptlib
from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import default_coordinator
from ckptlib.engine import retire
from ckptlib.engine import save as save_flow
from ckptlib.engine.scan import scan
from ckptlib.format import layout
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.testing.faults import Fault, FaultyStorage


def sc_publish(rank: int, world: int, root: str, args: dict) -> dict:
    """One save; ``args["delay"]``: seconds rank 0's manifest put sleeps; ``args["signal"]``
    (``STOP`` or ``KILL``): rank 0 sends it to itself right after writing the manifest."""
    if args.get("signal") and rank == 0:
        os.environ["CKPTLIB_TEST_KILL_AT"] = f"manifest:0:{args['signal']}"
        from ckptlib import crashpoints

        crashpoints.configure()
    faults = [Fault("put_atomic", "*manifest*", kind="slow", delay=args.get("delay", 0.0))]
    storage = FaultyStorage(open_storage(root), faults if rank == 0 else [])
    coord = default_coordinator()
    flat = save_flow.prepare(dist_worker.make_state(world, rank, {}), rank)
    t0 = time.monotonic()
    try:
        save_flow.persist(storage, "ck", flat, step=None, coordinator=coord)
    except ckptlib.CommitError as e:
        return {
            "error": type(e).__name__,
            "message": str(e),
            "elapsed": time.monotonic() - t0,
            "time": time.time(),
        }
    storage.injector.verify()
    return {"error": None, "elapsed": time.monotonic() - t0, "time": time.time()}


class KillAfterCommit(FaultyStorage):
    """Rank 0's storage in the ``kill`` mode of :func:`sc_fence`: the process SIGKILLs itself
    right after the commit point succeeded (the rename into ``step-N``, or the create-only put
    of its manifest), before it can tell any other rank (a crash point inside the commit)."""

    def __init__(self, inner, log: str) -> None:
        super().__init__(inner, [])
        self.log = log

    def _die(self) -> None:
        with open(self.log, "a") as f:
            f.write(json.dumps({"phase": "committed", "rank": 0, "time": time.time()}) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        if layout.parse_step(dst) is not None and ".tmp-" in src:
            self._die()

    def put_if_absent(self, path: str, data: bytes) -> None:
        super().put_if_absent(path, data)
        if path.endswith(MANIFEST_NAME):
            self._die()


def _report(root: str, rank: int, name: str, out: dict) -> None:
    """A mid-scenario result file (the test polls for it while the job still runs)."""
    tmp = Path(root) / f"part-{name}-{rank}.json.tmp"
    tmp.write_text(json.dumps(out))
    tmp.rename(Path(root) / f"part-{name}-{rank}.json")


def _save(mgr: ckptlib.CheckpointManager, step: int, state: dict) -> dict:
    t0 = time.monotonic()
    try:
        mgr.save(step, state).wait()
    except ckptlib.CommitError as e:
        return {"error": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0, "time": time.time()}
    return {"error": None, "elapsed": time.monotonic() - t0, "time": time.time()}


def sc_fence(rank: int, world: int, root: str, args: dict) -> dict:
    """Saves of step ``args["step"]`` through a CheckpointManager (sync) at ``args["url"]``
    (``args["options"]``), rank 0's publish made ``slow`` (``args["delay"]`` seconds on its
    first ``args["slow_op"]`` under a step folder), ``stop`` (SIGSTOP at the ``manifest``
    crash point) or ``kill`` (SIGKILL right after its commit point).

    ``stop``: after the first save each rank reports ``part-first-<rank>.json`` and waits for
    ``ROOT/go`` (the test SIGCONTs rank 0 first), then saves the same step again and the next
    one; rank 0 returns what is on storage then (steps, debris)."""
    mode, step = args["mode"], args["step"]
    if mode == "stop" and rank == 0:
        os.environ["CKPTLIB_TEST_KILL_AT"] = "manifest:0:STOP"
        from ckptlib import crashpoints

        crashpoints.configure()
    mgr = ckptlib.CheckpointManager(args["url"], storage_options=args.get("options"), async_save=False)
    if rank == 0 and mode == "slow":
        faults = [Fault(args["slow_op"], "step-*", kind="slow", delay=args["delay"])]
        mgr.storage = FaultyStorage(mgr.storage, faults)
    elif rank == 0 and mode == "kill":
        mgr.storage = KillAfterCommit(mgr.storage, os.environ["CKPTLIB_TEST_KILL_LOG"])
    state = dist_worker.make_state(world, rank, {})
    first = _save(mgr, step, state)
    if mode == "slow" and rank == 0:
        mgr.storage.injector.verify()  # the slow fault really fired
    if mode != "stop":
        return first
    _report(root, rank, "first", first)
    end = time.monotonic() + 300
    while not (Path(root) / "go").exists():
        if time.monotonic() > end:
            raise TimeoutError("the test never created ROOT/go")
        time.sleep(0.05)
    again, later = _save(mgr, step, state), _save(mgr, step + 1, state)
    out = {"first": first, "again": again, "later": later}
    if rank == 0:
        out["steps"] = [[i.step, i.status, i.path] for i in scan(mgr.storage)]
        out["debris"] = [d.name for d in retire.find_debris(mgr.storage, None)]
    mgr.close()
    return out


dist_worker.sc_publish = sc_publish  # type: ignore[attr-defined]  # dist_worker.main looks it up
dist_worker.sc_fence = sc_fence  # type: ignore[attr-defined]

if __name__ == "__main__":
    sys.exit(dist_worker.main())
