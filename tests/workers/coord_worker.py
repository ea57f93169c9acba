"""One rank of a coordinator conformance case (ckptlib/testing/coord_suite.py) on a real
TCPStore hosted by rank 0's process, with the library's own transport (TorchKV, the process's
Pulse). Driven by tests/coord/test_conformance.py.

argv: CASE RANK WORLD PORT T OUT. Writes OUT/<rank>.json (an Outcome); a rank that dies
(``Control.die``) writes nothing; a rank that freezes writes OUT/<rank>.frozen (the seconds it
asks to stay stopped) and stops itself with SIGSTOP: the test resumes it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ckptlib.coord.kv import TorchKV
from ckptlib.coord.liveness import Pulse, heartbeat_period
from ckptlib.coord.session import Session
from ckptlib.errors import CommitError
from ckptlib.testing.coord_suite import Outcome, case


class Control:
    def __init__(self, rank: int, out: Path) -> None:
        self.rank, self.out = rank, out

    def die(self) -> None:
        os._exit(17)

    def freeze(self, seconds: float) -> None:
        (self.out / f"{self.rank}.frozen").write_text(str(seconds))
        os.kill(os.getpid(), signal.SIGSTOP)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def main() -> None:
    name, rank, world, port, T, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        float(sys.argv[5]), Path(sys.argv[6])
    c = case(name)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    pulse = Pulse.of(store, rank, heartbeat_period(T), T)  # its heartbeat key exists before the barrier
    kv = TorchKV(store, T, pulse)  # its connection too
    store.add("ready", 1)
    while store.add("ready", 0) < world:
        time.sleep(0.01)
    start = time.monotonic()
    s = Session(kv, "ckptlib/conformance/s1/", rank, world, deadline=time.monotonic() + 60.0, dead_after=T,
                label=name)
    try:
        with s:
            result = c.body(s, Control(rank, out))
        o = Outcome.of(rank, time.monotonic() - start, result)
    except (CommitError, OSError) as e:
        o = Outcome.of(rank, time.monotonic() - start, error=e)
    (out / f"{rank}.json").write_text(json.dumps(asdict(o)))
    if c.exit_after:
        os._exit(0)  # at once: rank 0's store goes with it
    # Rank 0 hosts the store: it stays until the others are done with it.
    if rank == 0:
        end = time.monotonic() + 4 * T + 30
        while time.monotonic() < end and len(list(out.glob("*.json"))) + len(list(out.glob("*.died"))) < world:
            time.sleep(0.05)
    pulse.stop()
    os._exit(0)


if __name__ == "__main__":
    main()
