"""``ckptlib prune URL --keep-last N [--keep-every K] [--dry-run]``: delete the committed steps
the retention policy does not keep, and remove crashed-save debris.

Called by :func:`ckptlib.cli.main.main` on the caller's thread. The rules are not here:
:func:`ckptlib.plan.retention.decide` says which steps to keep, and
:func:`ckptlib.engine.retire.find_debris` judges debris (as a caller outside any job: only
marked folders, ``.tmp-`` ones older than ``--debris-min-age``); this module deletes through
:mod:`ckptlib.engine.retire` and formats the outcome.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.text import Text

from ckptlib.engine import retire
from ckptlib.errors import CheckpointError
from ckptlib.plan import retention

from .output import CliError, Output, human_bytes, status_text, table
from .target import EXIT_OK, EXIT_USAGE, ROOT_HINT, list_steps, open_target


def cmd_prune(args: argparse.Namespace, out: Output) -> int:
    """Delete committed steps the retention policy does not keep, and crashed-save debris.

    The newest committed step is never deleted; corrupt and incomplete steps are left alone
    (``ls`` shows them); ``--dry-run`` deletes nothing and prints what would go.
    """
    target = open_target(args.url, args.storage_options, ROOT_HINT)
    errors: list[str] = []
    deleted: list[dict[str, Any]] = []
    removed: list[str] = []
    try:
        if target.kind == "checkpoint":
            raise CliError(f"{args.url} is a single checkpoint folder, not a root — {ROOT_HINT}")
        infos = list_steps(target)
        committed = {i.step: i for i in infos if i.status == "committed"}
        decisions = retention.decide(list(committed), args.keep_last, args.keep_every)
        plan: list[dict[str, Any]] = [
            {"step": d.step, "path": committed[d.step].path, "keep": d.keep, "why": d.why,
             "bytes": committed[d.step].bytes}
            for d in sorted(decisions, key=lambda d: d.step)
        ]
        min_age = max(args.debris_min_age, 0.0)
        debris = retire.find_debris(target.storage, None, min_age=min_age, grace=min_age)
        if not args.dry_run:
            for p in plan:
                if p["keep"]:
                    continue
                try:
                    retire.delete_step(target.storage, p["path"])
                except FileNotFoundError:
                    p["why"] += " (already gone)"
                except (OSError, CheckpointError) as e:
                    errors.append(f"could not delete step {p['step']}: {e}")
                    continue
                deleted.append(p)
            try:
                removed = retire.remove_debris(target.storage, debris)
            except (OSError, CheckpointError) as e:
                errors.append(f"could not remove debris: {e}")
    finally:
        target.storage.close()

    left_alone: list[dict[str, Any]] = [
        {"step": i.step, "path": i.path, "status": i.status, "reason": i.reason}
        for i in infos if i.status != "committed"
    ]
    code = EXIT_USAGE if errors else EXIT_OK
    out.exit_code = code
    out.emit({
        "url": args.url,
        "dry_run": args.dry_run,
        "keep_last": args.keep_last,
        "keep_every": args.keep_every,
        "steps": plan,
        "to_delete": [p["step"] for p in plan if not p["keep"]],
        "deleted": [p["step"] for p in deleted],
        "not_committed": left_alone,
        "debris": [
            {"path": d.path, "kind": d.kind, "age_seconds": d.age_seconds,
             "removable": d.removable, "why": d.why}
            for d in debris
        ],
        "debris_removed": removed,
        "errors": errors,
    })
    for message in errors:
        out.note(f"ckptlib: {message}", style="red")
    if out.json_mode:
        return code

    verb = "would delete" if args.dry_run else "deleted"
    t = table("step", "action", "size", "why", right=("step", "size"), fold=("why",))
    done = {p["step"] for p in deleted}
    for p in plan:
        if p["keep"]:
            action = Text("keep", style="green")
        elif args.dry_run or p["step"] in done:
            action = Text(verb, style="red")
        else:
            action = Text("failed", style="bold red")
        t.add_row(str(p["step"]), action, human_bytes(p["bytes"]), p["why"])
    debris_paths = {d.path for d in debris}
    for s in left_alone:
        if s["path"] not in debris_paths:  # debris is listed below
            t.add_row(str(s["step"]), status_text(s["status"]), "-",
                      f"not committed, left alone: {target.short(s['reason'])}")
    if plan or left_alone:
        out.print(t)
    else:
        out.print(f"no checkpoints under {target.where()}")
    for d in debris:
        if not d.removable:
            out.print(f"kept debris {d.name}: {d.why}")
        elif args.dry_run:
            out.print(f"would remove debris {d.name} ({d.why})")
    for name in removed:
        out.print(f"removed debris {name}")
    n = len([p for p in plan if not p["keep"]]) if args.dry_run else len(deleted)
    freed = sum(p["bytes"] for p in (plan if args.dry_run else deleted) if not p["keep"])
    out.print(f"{verb} {n} step(s), {human_bytes(freed)}"
              + (" (dry run: nothing was deleted)" if args.dry_run else ""))
    return code
