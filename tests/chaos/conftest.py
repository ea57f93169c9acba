"""Relaunch harness and fixtures for the storage, corruption and async-race chaos tests.

The harness runs ``tests/workers/chaos_storage_worker.py`` jobs as subprocesses (1 or 2 gloo
ranks), every one under a deadline (a job past it is killed and the case fails as a hang),
and reads back what each job logged: the hash of every leaf at each ``save()``, each save's
outcome, the restored step and its hashes, the final digest. The expected trajectory comes
from :func:`reference_hashes`, which trains the same model in this process without any
checkpointing, so "the job finishes with exactly the weights of an uninterrupted run" and
"restored bytes equal the hashes logged when that step was saved" are both checked against
an independent source.

The session-wide S3 fixtures of ``tests/conftest.py`` (one SeaweedFS server per session) are
shared with tests/backends: one server, whatever directories the session runs.

Seeds: ``CKPTLIB_TEST_SEED`` (default 1234) picks the cases of the CI sample and every random
choice inside a case; ``CKPTLIB_CHAOS_FULL=1`` runs every case.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import launcher
import pytest

SEED = int(os.environ.get("CKPTLIB_TEST_SEED", "1234"))
FULL = os.environ.get("CKPTLIB_CHAOS_FULL", "") not in ("", "0")
WORKER = Path(__file__).resolve().parents[1] / "workers" / "chaos_storage_worker.py"
JOB_TIMEOUT = 150.0
"""One job, torch import on a loaded 2-core machine included; past it the case is a hang."""


def rng(*salt: object) -> random.Random:
    """A generator seeded by the suite seed and the case (stable across runs and orderings)."""
    return random.Random(f"{SEED}:" + ":".join(map(str, salt)))


def sampled(cases: Sequence[Any], ids: Sequence[str], k: int, salt: str) -> list[Any]:
    """``pytest.param`` for every case; all but a seeded sample of ``k`` skip unless FULL."""
    keep = set(rng("sample", salt).sample(range(len(cases)), min(k, len(cases))))
    out = []
    for i, (case, case_id) in enumerate(zip(cases, ids, strict=True)):
        marks = []
        if not FULL and i not in keep:
            marks.append(
                pytest.mark.skip(reason=f"not in the CI sample (seed {SEED}); CKPTLIB_CHAOS_FULL=1")
            )
        out.append(
            pytest.param(*case if isinstance(case, tuple) else (case,), id=case_id, marks=marks)
        )
    return out


# --------------------------------------------------------------------------- the model


@functools.cache
def worker_module() -> Any:
    spec = importlib.util.spec_from_file_location("ckptlib_chaos_storage_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def reference_hashes(steps: int, ballast: int = 0) -> dict[int, dict[str, str]]:
    """Leaf hashes after every step of an uninterrupted, checkpoint-free run (in process,
    one thread, as the jobs run)."""
    import torch

    w = worker_module()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state, model, opt = w.build(ballast)
        out = {0: w.leaf_hashes(state)}
        for step in range(1, steps + 1):
            w.train_step(state, model, opt, step)
            out[step] = w.leaf_hashes(state)
    finally:
        torch.set_num_threads(threads)
    return out


def ref_digest(steps: int, ballast: int = 0) -> str:
    return worker_module().digest(reference_hashes(steps, ballast)[steps])


# --------------------------------------------------------------------------- jobs


@dataclass
class JobRun:
    name: str
    returncodes: list[int]
    results: list[dict | None]
    log: str

    @property
    def returncode(self) -> int:
        return max(self.returncodes, key=abs)

    @property
    def result(self) -> dict:
        r = self.results[0]
        assert r is not None, (
            f"job {self.name} wrote no result (exit {self.returncodes}):\n{self.log[-4000:]}"
        )
        assert "crash" not in r, f"job {self.name} crashed:\n{r['crash']}\n{self.log[-4000:]}"
        return r


@dataclass
class Harness:
    """Starts jobs on one checkpoint root and keeps what they logged."""

    dir: Path
    url: str
    base: dict[str, Any] = field(default_factory=dict)
    jobs: list[JobRun] = field(default_factory=list)
    storage_verdicts: dict[tuple[str, int], str] = field(default_factory=dict)
    """(job, step) -> ``absent``/``committed``: what storage showed for a failed save right
    after its job (tests/chaos/test_storage_faults.py ``not_committed``/``newest_after_kill``)."""

    def start(self, name: str, world: int = 1, **args: Any) -> tuple[str, list[subprocess.Popen]]:
        """One process per rank (tests/launcher.py; the rendezvous comes by environment)."""
        full = json.dumps({"url": self.url, **self.base, **args, "job": name})
        return name, launcher.start(lambda rank, port: [str(WORKER), str(self.dir), full], world)

    def finish(
        self, started: tuple[str, list[subprocess.Popen]], timeout: float = JOB_TIMEOUT
    ) -> JobRun:
        """Wait for every rank (a :class:`~launcher.Hang` past ``timeout``); keep the run."""
        name, procs = started
        suffix = (lambda r: f"-r{r}") if len(procs) > 1 else (lambda r: "")
        out = launcher.finish(f"job {name}", procs, lambda r: self.dir / f"result-{name}{suffix(r)}.json", timeout)
        run = JobRun(name, [o.returncode for o in out], [o.result for o in out], "\n".join(o.log for o in out))
        self.jobs.append(run)
        return run

    def run(self, name: str, world: int = 1, timeout: float = JOB_TIMEOUT, **args: Any) -> JobRun:
        return self.finish(self.start(name, world, **args), timeout)

    # -- what the jobs logged
    def events(self, ev: str | None = None, job: str | None = None) -> list[dict]:
        path = self.dir / "events.jsonl"
        if not path.exists():
            return []
        out = []
        # A job appends each event with one write; a read beside it can see a long line (a save's
        # hashes) cut short. The piece after the last newline is that line, or nothing: skip it.
        for line in path.read_text().split("\n")[:-1]:
            if not line.strip():
                continue
            e = json.loads(line)
            if (ev is None or e["ev"] == ev) and (job is None or e["job"] == job):
                out.append(e)
        return out

    def saved_hashes(self, step: int, before_job: str | None = None) -> dict[str, str]:
        """Hashes logged by the last ``save()`` of ``step`` (by a job before ``before_job``)."""
        found = None
        for e in self.events():
            if before_job is not None and e["job"] == before_job:
                break
            if e["ev"] == "save" and e["step"] == step:
                found = e["hashes"]
        assert found is not None, f"no save of step {step} was logged"
        return found

    def committed(self, job: str | None = None) -> list[int]:
        return sorted({e["step"] for e in self.events("committed", job)})

    def counts(self) -> tuple[int, int, int]:
        """(saves attempted, committed, failed) over every job so far."""
        return len(self.events("save")), len(self.events("committed")), len(self.events("failed"))

    def retries(self) -> tuple[int, int]:
        """(retries, give-ups) over every job's processes so far."""
        r = g = 0
        for run in self.jobs:
            for res in run.results:
                if res and "retry" in res:
                    r += res["retry"]["retries"]
                    g += res["retry"]["giveups"]
        return r, g


def newest_retained(committed: Iterable[int], keep_last: int = 2) -> list[int]:
    return sorted(set(committed))[-keep_last:]


def wait_for(cond: Callable[[], bool], timeout: float, what: str, poll: float = 0.01) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f}s")
        time.sleep(poll)
