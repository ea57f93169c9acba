"""``ckptlib ls URL``: one row per step under a root (step, status, size, ranks, age, reason).

Called by :func:`ckptlib.cli.main.main` on the caller's thread.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ckptlib.engine.scan import StepInfo

from .output import Output, has_rows, human_age, human_bytes, status_text, table
from .target import EXIT_OK, ROOT_HINT, list_steps, open_target, single, step_label, step_or_none


def _ls_row(info: StepInfo, now: float) -> dict[str, Any]:
    committed = info.status == "committed"
    return {
        "step": step_or_none(info.step),
        "status": info.status,
        "bytes": info.bytes if committed else None,
        "world_size": info.world_size or None,
        "num_tensors": info.num_tensors if info.save_id else None,
        "created": info.created,
        "age_seconds": None if info.created is None else round(now - info.created, 3),
        "save_id": info.save_id or None,
        "metrics": info.metrics or None,
        "path": info.path,
        "reason": info.reason,
    }


def cmd_ls(args: argparse.Namespace, out: Output) -> int:
    """List every step under a root: status, size, ranks, age, and why unusable ones are."""
    target = open_target(args.url, args.storage_options, ROOT_HINT)
    try:
        infos = [single(target)] if target.kind == "checkpoint" else list_steps(target)
    finally:
        target.storage.close()
    now = time.time()
    rows = [_ls_row(i, now) for i in infos]
    out.emit({"url": args.url, "kind": target.kind, "steps": rows})
    if not has_rows(out, rows, f"no checkpoints under {target.where()} (no step-* folders yet)"):
        return EXIT_OK
    t = table("step", "status", "size", "ranks", "age", "reason",
              right=("step", "size", "ranks", "age"), fold=("reason",))
    for r in rows:
        t.add_row(
            step_label(r["step"]),
            status_text(r["status"]),
            human_bytes(r["bytes"]),
            str(r["world_size"] or "-"),
            human_age(r["age_seconds"]),
            target.short(r["reason"]),
        )
    out.print(t)
    good = sum(r["status"] == "committed" for r in rows)
    out.print(f"{len(rows)} step(s), {good} committed")
    return EXIT_OK
