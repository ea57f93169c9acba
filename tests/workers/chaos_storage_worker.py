"""One training job (or one rank of one) for the storage-fault chaos tests.

usage: chaos_storage_worker.py JOB_DIR JSON-ARGS   (RANK/WORLD/PORT in the environment for gloo)

Started by ``tests/chaos/test_storage_faults.py`` (and ``test_corruption.py`` for its source
steps) as a subprocess; the test is the relaunch harness: it starts a job, injects or waits for
a fault, and starts a fresh job after every failure. The job:

1. builds a small deterministic model (Linear -> BatchNorm -> Tanh -> Linear, AdamW, an
   optional "ballast" tensor to make payloads big enough for multipart uploads);
2. ``CheckpointManager(url, keep_last=2)`` (async saves by default), optionally behind a
   :class:`~ckptlib.testing.faults.FaultyStorage` built from ``args["faults"]``;
3. ``mgr.restore(state)``, logging the restored step and the hashes of every restored leaf;
4. trains to ``args["steps"]``, saving every ``save_every`` steps; before each ``save()`` it
   logs the hash of every leaf of the state being saved; each save's outcome (committed or
   failed, with the error type) is logged when the next save or the final ``wait`` learns it;
5. a failed save ends the job with exit code 3 (a job that lost its checkpoint crashes and is
   relaunched); a finished job logs the digest of its final state and exits 0.

Logs go to ``JOB_DIR/events.jsonl`` (one JSON object per line, appended and fsynced by the
main thread; every job of a scenario appends to the same file, tagged with ``args["job"]``)
and the summary to ``JOB_DIR/result-<job>[-r<rank>].json``.

Faults (``args``): ``faults``: list of ``Fault`` field dicts (``errno`` makes the error a
``StorageError(errno, ...)`` like the POSIX backend raises; ``listing`` is ``[[name, is_dir]]``);
``faults_at``: ``{"step": s, "faults": [...]}`` adds faults just before the save of step ``s``
(so ``calls=(1,)`` means the first matching call of that save);
``fsize``: ``{"at": step, "limit": bytes}`` lowers ``RLIMIT_FSIZE`` (SIGXFSZ ignored, so writes
past it fail with EFBIG) just before that step's save, until the save's failure is seen.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

FAIL_EXIT = 3


class Job:
    def __init__(self, job_dir: str, args: dict[str, Any]) -> None:
        self.dir = job_dir
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.name = str(args.get("job", "job"))
        self.events = os.path.join(job_dir, "events.jsonl")

    # ------------------------------------------------------------------ logging
    def log(self, ev: str, **kw: Any) -> None:
        """Append one event (main thread); rank 0 only unless ``all_ranks``."""
        if self.rank != 0 and not kw.pop("all_ranks", False):
            return
        kw.pop("all_ranks", None)
        line = (
            json.dumps({"job": self.name, "rank": self.rank, "ev": ev, "t": time.time(), **kw})
            + "\n"
        )
        fd = os.open(self.events, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def result(self, out: dict[str, Any]) -> None:
        from ckptlib.backends import retry

        out["retry"] = retry.stats()
        suffix = f"-r{self.rank}" if self.world > 1 else ""
        path = os.path.join(self.dir, f"result-{self.name}{suffix}.json")
        with open(path, "w") as f:
            json.dump(out, f)


def build(ballast: int) -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Tanh(), torch.nn.Linear(64, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optim": opt, "step": 0}
    if ballast:
        g = torch.Generator().manual_seed(7)
        state["ballast"] = torch.randn(ballast, generator=g)
    return state, model, opt


def train_step(
    state: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer, step: int
) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 32, generator=g)
    y = torch.randn(16, 8, generator=g)
    model.train()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if "ballast" in state:
        state["ballast"].add_(0.5)
    state["step"] = step


def leaf_hashes(state: dict[str, Any]) -> dict[str, str]:
    """sha256 of every leaf of the state as it is now (tensors by their bytes)."""
    out: dict[str, str] = {}

    def add(name: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            out[name] = (
                f"{t.dtype}{tuple(t.shape)}:"
                + hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            )
        elif isinstance(v, dict):
            for k, x in v.items():
                add(f"{name}.{k}", x)
        elif isinstance(v, list | tuple):
            for i, x in enumerate(v):
                add(f"{name}.{i}", x)
        else:
            out[name] = repr(v)

    for key, v in state.items():
        add(key, v.state_dict() if hasattr(v, "state_dict") else v)
    return out


def digest(hashes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def make_faults(specs: list[dict[str, Any]]) -> list[Any]:
    from ckptlib.backends import Entry
    from ckptlib.errors import StorageError
    from ckptlib.testing.faults import Fault

    faults = []
    for spec in specs:
        spec = dict(spec)
        code = spec.pop("errno", None)
        if code is not None:
            code = int(code)
            spec["error"] = lambda code=code: StorageError(code, f"injected: {os.strerror(code)}")
        if spec.get("listing") is not None:
            spec["listing"] = [Entry(name, bool(is_dir)) for name, is_dir in spec["listing"]]
        if spec.get("calls") is not None:
            spec["calls"] = tuple(spec["calls"])
        faults.append(Fault(**spec))
    return faults


def run(job: Job) -> int:
    import ckptlib
    from ckptlib.errors import CheckpointError, StepExistsError
    from ckptlib.testing.faults import FaultyStorage

    a = job.args
    state, model, opt = build(int(a.get("ballast", 0)))
    mgr = ckptlib.CheckpointManager(
        a["url"],
        keep_last=a.get("keep_last", 2),
        async_save=a.get("async", True),
        storage_options=a.get("storage_options"),
        save_timeout=float(a.get("save_timeout", 60.0)),
        compression=a.get("compression"),
    )
    faulty = None
    late = a.get("faults_at")
    if a.get("faults") or late:
        faulty = FaultyStorage(mgr.storage, make_faults(a.get("faults") or []))
        mgr.storage = faulty
    out: dict[str, Any] = {"job": job.name}
    fsize = a.get("fsize")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def finish(pending: tuple[int, Any] | None) -> bool:
        """Learn the outcome of the save in flight; False if it failed (the job then ends)."""
        if pending is None:
            return True
        step, handle = pending
        try:
            handle.wait()
        except StepExistsError as e:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            job.log("exists", step=step, error=str(e))
            return True
        except CheckpointError as e:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            job.log("failed", step=step, type=type(e).__name__, error=str(e)[:2000])
            out["failed"] = {"step": step, "type": type(e).__name__, "error": str(e)[:2000]}
            return False
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        job.log("committed", step=step)
        return True

    t0 = time.monotonic()
    start = mgr.restore(state)
    out["restore_s"] = time.monotonic() - t0
    out["restored"] = start
    if start is not None:
        job.log("restored", step=start, hashes=leaf_hashes(state))
    else:
        job.log("restored", step=None)
    pending: tuple[int, Any] | None = None
    ok = True
    for step in range(int(state["step"]) + 1, int(a["steps"]) + 1):
        train_step(state, model, opt, step)
        if a.get("save_every") and step % a["save_every"] == 0:
            if not finish(pending):
                ok = False
                break
            pending = None
            job.log("save", step=step, hashes=leaf_hashes(state))
            if late and late["step"] == step:
                assert faulty is not None
                for f in make_faults(late["faults"]):
                    faulty.injector.add(f)
            if fsize and fsize["at"] == step:  # after the log line: the limit applies to it too
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize["limit"]), hard))
            try:
                pending = (step, mgr.save(step, state))
            except CheckpointError as e:  # a synchronous save, or a snapshot failure
                pending = None
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
                job.log("failed", step=step, type=type(e).__name__, error=str(e)[:2000])
                out["failed"] = {"step": step, "type": type(e).__name__, "error": str(e)[:2000]}
                ok = False
                break
        if a.get("step_sleep"):
            time.sleep(float(a["step_sleep"]))
    if ok:
        ok = finish(pending)
    if faulty is not None:
        out["faults_fired"] = [repr(f) for f in faulty.injector.faults]
        out["faults_unfired"] = [repr(f) for f in faulty.injector.faults if f.fired == 0]
    if not ok:
        try:
            mgr.close(timeout=30)
        except CheckpointError:
            pass
        job.result(out)
        return FAIL_EXIT
    mgr.close()
    final = leaf_hashes(state)
    out["digest"] = digest(final)
    job.log("done", digest=out["digest"], steps=int(state["step"]))
    job.result(out)
    return 0


def main() -> int:
    job_dir, args = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    job = Job(job_dir, args)
    dist = None
    if job.world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
            rank=job.rank,
            world_size=job.world,
            timeout=timedelta(seconds=60),
        )
    try:
        code = run(job)
    except Exception:
        job.result({"job": job.name, "crash": traceback.format_exc()})
        code = 4
    sys.stdout.flush()
    sys.stderr.flush()
    if dist is not None:
        if code == 0:
            dist.barrier()
            dist.destroy_process_group()
        else:
            os._exit(code)  # the group may be broken: leave without gloo teardown
    return code


if __name__ == "__main__":
    sys.exit(main())
