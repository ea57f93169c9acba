"""``ckptlib ls URL``: one row per step under a root (step, status, size, ranks, age, reason),
then the debris beside them (crashed saves, quarantined ``.corrupt-`` folders, interrupted
deletions, abandoned uploads) with sizes and whether ``ckptlib prune`` would remove each.

Called by :func:`ckptlib.cli.main.main` on the command's worker thread (cli/deadline.py). Steps are judged by
:func:`ckptlib.engine.scan.scan` and debris by :func:`ckptlib.engine.retire.find_debris` (with
the defaults ``prune`` uses), so ``ls`` shows exactly what ``prune`` would do with each.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from ckptlib.engine import retire
from ckptlib.engine.scan import StepInfo
from ckptlib.format import layout

from .output import Output, has_rows, human_age, human_bytes, status_text, table
from .target import (
    EXIT_OK,
    EXIT_USAGE,
    ROOT_HINT,
    Target,
    list_steps,
    open_target,
    single,
    step_label,
    step_or_none,
)


def _ls_row(info: StepInfo, now: float, size: int | None) -> dict[str, Any]:
    committed = info.status == "committed"
    return {
        "step": step_or_none(info.step),
        "status": info.status,
        "bytes": info.bytes if committed else size,
        "world_size": info.world_size or None,
        "num_tensors": info.num_tensors if info.save_id else None,
        "created": info.created,
        "age_seconds": None if info.created is None else round(now - info.created, 3),
        "save_id": info.save_id or None,
        "metrics": info.metrics or None,
        "path": info.path,
        "reason": info.reason,
    }


def _debris_step(path: str) -> int | None:
    name = path.split("/", 1)[0]
    m = layout.TMP_RE.match(name) or layout.CORRUPT_RE.match(name)
    return layout.parse_step(m.group(1) if m else name)


def _rows(target: Target, infos: list[StepInfo], now: float) -> list[dict[str, Any]]:
    """Step rows, each with the debris verdict when it is debris, then the other debris. With an
    ``unreadable`` step, ``prune`` stops before it judges anything: every verdict says so."""
    blocked = [i.path for i in infos if i.status == "unreadable"]
    judged = [i for i in infos if i.status != "unreadable"]
    debris = retire.find_debris(target.storage, None, min_age=retire.DEFAULT_GRACE, now=now, steps=judged)
    if blocked:
        why = f"prune stops while {', '.join(blocked)} cannot be read (fix its permissions first)"
        debris = [dataclasses.replace(d, removable=False, why=why) for d in debris]
    by_path = {d.path: d for d in debris}
    rows = []
    for i in infos:
        d = by_path.pop(i.path, None)
        size = None if i.status in ("committed", "unreadable") else retire.tree_bytes(target.storage, i.path)
        row = _ls_row(i, now, size)
        row["kind"] = "step" if layout.parse_step(i.path) is not None else "debris"
        row["prune"] = _verdict(d)
        rows.append(row)
    for d in by_path.values():
        rows.append({
            "step": _debris_step(d.path),
            "status": "quarantined" if d.kind == "quarantined" else "debris",
            "bytes": None if d.kind == "upload" else retire.tree_bytes(target.storage, d.path),
            "world_size": None, "num_tensors": None, "created": None,
            "age_seconds": None if d.age_seconds is None else round(d.age_seconds, 3),
            "save_id": d.save_id or None,
            "path": d.name,
            "reason": f"{d.kind}: {d.path}" + (f" (upload {d.upload_id})" if d.upload_id else ""),
            "kind": d.kind,
            "prune": _verdict(d),
        })
    rows.sort(key=lambda r: (-1 if r["step"] is None else r["step"], r["kind"] != "step", r["path"]))
    return rows


def _verdict(d: retire.Debris | None) -> dict[str, Any] | None:
    """What ``ckptlib prune`` (default ``--debris-min-age``) would do with a leftover."""
    return None if d is None else {"removes": d.removable, "why": d.why}


def _local_nodes(template: str) -> dict[int, int]:
    """Tier column: step -> how many node folders matching ``template`` hold it committed."""
    from ckptlib.backends import open_storage
    from ckptlib.tiers.inventory import local_steps, node_folders

    from .nodes import no_match

    found = node_folders(template)
    if not found:
        raise no_match(template)
    counts: dict[int, int] = {}
    for _node, folder in found:
        for step in local_steps(open_storage(folder)):
            counts[step] = counts.get(step, 0) + 1
    return counts


def _add_tiers(rows: list[dict[str, Any]], local: dict[int, int]) -> list[dict[str, Any]]:
    """``tiers`` of every row (persistent status, local node count); local-only steps added: a
    step committed in node folders and not committed on the persistent tier (absent there, or
    only an abandoned drain's ``.tmp-`` folder or a damaged copy) gets a row of its own."""
    seen = {r["step"] for r in rows if r["kind"] == "step" and r["status"] == "committed"}
    for step in sorted(set(local) - seen, reverse=True):
        rows.append({"step": step, "status": "committed", "bytes": None, "world_size": None, "num_tensors": None,
                     "created": None, "age_seconds": None, "save_id": None, "path": "", "reason": "local tier only",
                     "local_only": True, "kind": "step", "prune": None})
    for r in rows:
        pers = None if r.get("local_only") or r["kind"] != "step" else r["status"]
        r["tiers"] = {"persistent": pers, "local_nodes": local.get(r["step"], 0)}
    rows.sort(key=lambda r: (-1 if r["step"] is None else r["step"], r["kind"] != "step", r["path"]))
    return rows


def _tiers_text(t: dict[str, Any]) -> str:
    parts = [f"local x{t['local_nodes']}"] if t["local_nodes"] else []
    if t["persistent"] == "committed":
        parts.append("persistent")
    return ", ".join(parts) or "-"


def cmd_ls(args: argparse.Namespace, out: Output) -> int:
    """List every step under a root: status, size, ranks, age, and why unusable ones are;
    then the debris, with sizes and what ``prune`` would do with it."""
    target = open_target(args.url, args.storage_options, ROOT_HINT)
    now = time.time()
    try:
        if target.kind == "checkpoint":
            rows = [_ls_row(single(target), now, None)]
        else:
            rows = _rows(target, list_steps(target, unreadable=True), now)
    finally:
        target.storage.close()
    tiered = getattr(args, "local", None) is not None
    if tiered:
        rows = _add_tiers(rows, _local_nodes(args.local))
    out.emit({"url": args.url, "kind": target.kind, "steps": rows})
    if not has_rows(out, rows, f"no checkpoints under {target.where()} (no step-* folders yet)"):
        return _unreadable_exit(out, rows)
    t = table("step", "status", "size", "ranks", "age", *(["tiers"] if tiered else []), "reason",
              right=("step", "size", "ranks", "age"), fold=("reason",))
    for r in rows:
        reason = target.short(r["reason"])
        if r.get("prune") is not None:
            verdict = "prune removes it" if r["prune"]["removes"] else "prune leaves it"
            reason = f"{reason}; {verdict}: {target.short(r['prune']['why'])}" if reason else \
                f"{verdict}: {target.short(r['prune']['why'])}"
        t.add_row(
            step_label(r["step"]),
            status_text(r["status"]),
            human_bytes(r["bytes"]),
            str(r["world_size"] or "-"),
            human_age(r["age_seconds"]),
            *([_tiers_text(r["tiers"])] if tiered else []),
            reason,
        )
    out.print(t)
    steps = [r for r in rows if r.get("kind", "step") == "step"]
    good = sum(r["status"] == "committed" for r in steps)
    summary = f"{len(steps)} step(s), {good} committed"
    unusable = [r for r in rows if r["status"] != "committed"]
    if unusable:
        removable = sum(bool(r.get("prune") and r["prune"]["removes"]) for r in unusable)
        size = human_bytes(sum(r["bytes"] or 0 for r in unusable))
        summary += f"; {len(unusable)} not usable ({size}), {removable} of them removable by prune"
    out.print(summary)
    return _unreadable_exit(out, rows)


def _unreadable_exit(out: Output, rows: list[dict[str, Any]]) -> int:
    """Exit 2 (an access error) after the listing when a step could not be read, with its
    reason on stderr: it may be the newest good step, and restore stops on it too."""
    bad = [r for r in rows if r["status"] == "unreadable"]
    for r in bad:
        out.note(f"ckptlib: {r['reason']}", style="red")
    out.exit_code = EXIT_USAGE if bad else EXIT_OK
    return out.exit_code
