"""Load hostile checkpoints under a memory and CPU limit; print one JSON line per checkpoint.

Run as a script by ``tests/chaos/test_malicious.py`` (and by hand)::

    python tests/chaos/load_one.py [--as-mb 2048] [--cpu-s 60] ROOT [ROOT ...]

Each ROOT is a corpus entry (a CheckpointManager root holding ``step-000000000007``, see
``tests/chaos/corpus.py``). Before importing torch the process caps its address space
(``RLIMIT_AS``) and CPU time (``RLIMIT_CPU``; past it the kernel kills the process, which the
parent sees as a missing line). Then, on the main thread, for each ROOT in order it runs every
entry point that reads a checkpoint:

- ``load``: ``ckptlib.load(step folder)``; a success is compared byte for byte with the state
  the corpus saved (``exact``) and with what the folder's manifest declares, decoded by the
  test's own decoder (``declared``: :func:`chaos.declared.declared`; ``undeclared`` says why a
  manifest declares no value);
- ``load_metadata``: ``ckptlib.load_metadata(step folder)`` (compared with the saved metadata);
- ``verify``: ``check_step(..., deep=True)`` (what ``ckptlib verify`` and ``steps(deep=True)`` use);
- ``steps``: ``CheckpointManager(root).steps()`` and ``latest_step()``;
- ``restore``: ``CheckpointManager(root).restore({})``.

and prints ``{"entry", "ops", "rss_before_mb", "rss_peak_mb", "seconds"}``: each op is
``{"outcome": "error", "cls", "mro", "ckptlib", "msg", "s"}`` or ``{"outcome": "ok", ...}``;
``rss_*`` come from ``getrusage(RUSAGE_SELF).ru_maxrss`` (the process's peak so far), so the
growth an entry caused is ``rss_peak_mb - rss_before_mb``. A first line ``{"ready": ...}``
reports the baseline after imports. Lines are flushed one by one so that the parent can put a
deadline on every entry.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import struct
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _limit(as_mb: int, cpu_s: int) -> None:
    if as_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (as_mb << 20, as_mb << 20))
    if cpu_s > 0:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 5))


def _rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _same(a: Any, b: Any) -> bool:
    """Exact equality: types, dict key order, float bits, tensor dtype/shape/bytes."""
    import torch

    if isinstance(b, torch.Tensor):
        return (
            type(a) is torch.Tensor
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
            )
        )
    if type(a) is not type(b):
        return False
    if isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def _run(fn: Any, expected: Any = None, folder: Path | None = None) -> dict[str, Any]:
    """``fn()``'s outcome; a value is compared with ``expected`` (``exact``) and, given
    ``folder``, with what its manifest declares (``declared``)."""
    import ckptlib

    t0 = time.monotonic()
    try:
        value = fn()
    except Exception as e:
        mro = [c.__name__ for c in type(e).__mro__ if c.__module__ == "ckptlib.errors"]
        return {
            "outcome": "error",
            "cls": type(e).__name__,
            "mro": mro,
            "ckptlib": isinstance(e, ckptlib.CheckpointError),
            "msg": str(e)[:300],
            "s": round(time.monotonic() - t0, 3),
        }
    out: dict[str, Any] = {"outcome": "ok", "s": round(time.monotonic() - t0, 3)}
    if expected is not None:
        out["exact"] = _same(value, expected)
    elif isinstance(value, int | str | type(None)):
        out["value"] = value
    if folder is not None:
        from chaos.declared import Undeclared, declared

        try:
            out["declared"] = _same(value, declared(folder))
        except Undeclared as e:
            out["declared"], out["undeclared"] = False, str(e)[:300]
    return out


def check(root: Path) -> dict[str, Any]:
    import ckptlib
    from chaos.corpus import METADATA, STEP, STEP_DIR, base_state
    from ckptlib.backends import open_storage
    from ckptlib.engine.scan import check_step

    ck = root / STEP_DIR
    ops: dict[str, Any] = {}
    ops["load"] = _run(lambda: ckptlib.load(ck), base_state(), ck)
    ops["load_metadata"] = _run(lambda: ckptlib.load_metadata(ck), METADATA)

    def verify() -> dict[str, Any]:
        info = check_step(open_storage(str(root)), STEP_DIR, STEP, deep=True)
        return {"status": info.status, "reason": info.reason[:300]}

    t0 = time.monotonic()
    try:
        ops["verify"] = {"outcome": "ok", **verify(), "s": round(time.monotonic() - t0, 3)}
    except Exception:
        ops["verify"] = _run(verify)

    def steps() -> str:
        with ckptlib.CheckpointManager(root, async_save=False) as mgr:
            infos = mgr.steps()
            return json.dumps(
                {"steps": [[i.step, i.status] for i in infos], "latest": mgr.latest_step()}
            )

    ops["steps"] = _run(steps)

    def restore() -> int | None:
        with ckptlib.CheckpointManager(root, async_save=False) as mgr:
            return mgr.restore({})

    ops["restore"] = _run(restore)
    return ops


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--as-mb", type=int, default=2048, help="RLIMIT_AS in MiB (0: none)")
    ap.add_argument("--cpu-s", type=int, default=60, help="RLIMIT_CPU in seconds (0: none)")
    ap.add_argument("roots", nargs="+")
    args = ap.parse_args(argv)
    _limit(args.as_mb, args.cpu_s)
    sys.path.insert(0, str(REPO / "tests"))
    t0 = time.monotonic()
    import chaos.corpus  # noqa: F401
    import ckptlib  # noqa: F401  (imports counted in the baseline)

    print(
        json.dumps(
            {"ready": True, "rss_mb": _rss_mb(), "import_s": round(time.monotonic() - t0, 2)}
        ),
        flush=True,
    )
    for r in args.roots:
        root = Path(r)
        before, t = _rss_mb(), time.monotonic()
        ops = check(root)
        print(
            json.dumps(
                {
                    "entry": root.name,
                    "ops": ops,
                    "rss_before_mb": before,
                    "rss_peak_mb": _rss_mb(),
                    "seconds": round(time.monotonic() - t, 3),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
