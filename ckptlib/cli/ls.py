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
        "path": info.path,
        "reason": info.reason,
    }


def _local_nodes(template: str) -> dict[int, int]:
    """Tier column: step -> how many node folders matching ``template`` hold it committed."""
    import glob

    from ckptlib.backends import open_storage
    from ckptlib.tiers.local import local_steps

    counts: dict[int, int] = {}
    for folder in sorted(glob.glob(template.replace("{node}", "*"))):
        for step in local_steps(open_storage(folder)):
            counts[step] = counts.get(step, 0) + 1
    return counts


def _add_tiers(rows: list[dict[str, Any]], local: dict[int, int]) -> list[dict[str, Any]]:
    """``tiers`` of every row (persistent status, local node count); local-only steps added."""
    seen = {r["step"] for r in rows}
    for step in sorted(set(local) - seen, reverse=True):
        rows.append({"step": step, "status": "committed", "bytes": None, "world_size": None, "num_tensors": None,
                     "created": None, "age_seconds": None, "save_id": None, "path": "", "reason": "local tier only",
                     "local_only": True})
    for r in rows:
        pers = None if r.get("local_only") else r["status"]
        r["tiers"] = {"persistent": pers, "local_nodes": local.get(r["step"], 0)}
    rows.sort(key=lambda r: -1 if r["step"] is None else r["step"], reverse=True)
    return rows


def _tiers_text(t: dict[str, Any]) -> str:
    parts = [f"local x{t['local_nodes']}"] if t["local_nodes"] else []
    if t["persistent"] == "committed":
        parts.append("persistent")
    return ", ".join(parts) or "-"


def cmd_ls(args: argparse.Namespace, out: Output) -> int:
    """List every step under a root: status, size, ranks, age, and why unusable ones are."""
    target = open_target(args.url, args.storage_options, ROOT_HINT)
    try:
        infos = [single(target)] if target.kind == "checkpoint" else list_steps(target)
    finally:
        target.storage.close()
    now = time.time()
    rows = [_ls_row(i, now) for i in infos]
    tiered = getattr(args, "local", None) is not None
    if tiered:
        rows = _add_tiers(rows, _local_nodes(args.local))
    out.emit({"url": args.url, "kind": target.kind, "steps": rows})
    if not has_rows(out, rows, f"no checkpoints under {target.where()} (no step-* folders yet)"):
        return EXIT_OK
    t = table("step", "status", "size", "ranks", "age", *(["tiers"] if tiered else []), "reason",
              right=("step", "size", "ranks", "age"), fold=("reason",))
    for r in rows:
        t.add_row(
            step_label(r["step"]),
            status_text(r["status"]),
            human_bytes(r["bytes"]),
            str(r["world_size"] or "-"),
            human_age(r["age_seconds"]),
            *([_tiers_text(r["tiers"])] if tiered else []),
            target.short(r["reason"]),
        )
    out.print(t)
    good = sum(r["status"] == "committed" for r in rows)
    out.print(f"{len(rows)} step(s), {good} committed")
    return EXIT_OK
