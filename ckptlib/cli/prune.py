"""``ckptlib prune URL --keep-last N [--keep-every K] [--verify] [--dry-run]``: delete the
committed steps the retention policy does not keep, and remove debris that is provably not in
use (crashed saves, interrupted deletions, superseded damaged or quarantined step folders,
manifest-less step folders, abandoned uploads).

Called by :func:`ckptlib.cli.main.main` on the command's worker thread (cli/deadline.py). The rules are not here:
:func:`ckptlib.plan.retention.decide` says which steps to keep,
:func:`ckptlib.engine.retire.verified_retention` deep-checks the kept ones (``--verify``) so a
corrupt step never counts as kept, and :func:`ckptlib.engine.retire.find_debris` judges debris
(as a caller outside any job: only marked folders, ``.tmp-`` ones older than
``--debris-min-age``); this module deletes through :mod:`ckptlib.engine.retire` and formats.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.text import Text

from ckptlib.backends import Storage
from ckptlib.engine import retire
from ckptlib.engine.scan import StepInfo
from ckptlib.errors import CheckpointError
from ckptlib.format import layout
from ckptlib.plan import retention

from .output import CliError, Output, Progress, human_bytes, status_text, table
from .target import EXIT_OK, EXIT_USAGE, ROOT_HINT, list_steps, open_target, step_label
from .verify import stored_bytes


def _debris_row(d: retire.Debris, size: int | None) -> dict[str, Any]:
    name = d.path.split("/", 1)[0]
    m = layout.TMP_RE.match(name) or layout.CORRUPT_RE.match(name)
    step = layout.parse_step(m.group(1) if m else name)
    return {"path": d.path, "step": step, "kind": d.kind, "bytes": size, "age_seconds": d.age_seconds,
            "removable": d.removable, "why": d.why, "upload_id": d.upload_id or None}


def cmd_prune(args: argparse.Namespace, out: Output) -> int:
    """Delete committed steps the retention policy does not keep, and removable debris; with
    ``--local``, on each node's local folder too (:func:`_prune_local`).

    The newest committed (with ``--verify``: verified) step is never deleted; a damaged step
    is removed only once a newer committed step supersedes it; ``--dry-run`` deletes nothing
    and prints what would go.
    """
    tier = "persistent"
    if getattr(args, "local", None) is not None or getattr(args, "node", None) or getattr(args, "tier", None):
        from .nodes import check_tier_args

        tier = check_tier_args(args)
    if tier != "local" and args.keep_last is None:
        raise CliError("prune needs a retention policy for the persistent tier: --keep-last N (the newest N "
                       "committed steps stay; add --keep-every K to keep every K-th too), or --tier local")
    local = _prune_local(args) if tier != "persistent" else None
    if tier == "local":
        assert local is not None
        return _report_local_only(args, out, local)
    return _prune_persistent(args, out, local)


def _prune_persistent(args: argparse.Namespace, out: Output, local: dict[str, Any] | None) -> int:
    """The persistent tier (the root at ``args.url``), as without ``--local``; ``local``: the
    local tier's result, added to the JSON document and printed after the root's table."""
    target = open_target(args.url, args.storage_options, ROOT_HINT)
    errors: list[str] = []
    deleted: list[dict[str, Any]] = []
    removed: list[str] = []
    verify = bool(getattr(args, "verify", False))
    try:
        if target.kind == "checkpoint":
            raise CliError(f"{args.url} is a single checkpoint folder, not a root — {ROOT_HINT}")
        infos = list_steps(target)
        committed_before = {i.step for i in infos if i.status == "committed"}

        def policy(steps: list[int]) -> list[retention.Decision]:
            return retention.decide(steps, args.keep_last, args.keep_every)

        first = {d.step for d in policy(sorted(committed_before)) if d.keep}
        total = sum(stored_bytes(i.manifest) for i in infos if i.status == "committed" and i.step in first)
        with Progress(out, total if verify else 0, "verifying") as progress:

            def on_check(info: StepInfo) -> None:
                if info.step not in first:
                    progress.add_total(stored_bytes(info.manifest))
                progress.describe(f"verifying step {info.step}")

            decisions, infos = retire.verified_retention(
                target.storage, infos, policy, deep=verify, progress=progress.advance, on_check=on_check
            )
        by_step = {i.step: i for i in infos if i.status == "committed"}
        failed = [i for i in infos if i.step in committed_before and i.status != "committed"
                  and layout.parse_step(i.path) == i.step]
        plan: list[dict[str, Any]] = [
            {"step": d.step, "path": by_step[d.step].path, "keep": d.keep,
             "why": d.why + (" (verified)" if verify and d.keep else ""), "bytes": by_step[d.step].bytes}
            for d in sorted(decisions, key=lambda d: d.step)
        ]
        min_age = max(args.debris_min_age, 0.0)
        debris = retire.find_debris(target.storage, None, min_age=min_age, grace=min_age, steps=infos)
        sizes = {d.path: None if d.kind == "upload" else retire.tree_bytes(target.storage, d.path) for d in debris}
        if not args.dry_run:
            deleted.extend(_delete_steps(target.storage, plan, errors, ""))
            try:
                removed = retire.remove_debris(target.storage, debris)
            except (OSError, CheckpointError) as e:
                errors.append(f"could not remove debris: {e}")
    finally:
        target.storage.close()

    debris_rows = [_debris_row(d, sizes[d.path]) for d in debris]
    debris_paths = {d.path for d in debris}
    left_alone: list[dict[str, Any]] = [
        {"step": i.step, "path": i.path, "status": i.status, "reason": i.reason}
        for i in infos if i.status != "committed"
    ]
    code = EXIT_USAGE if errors or (local is not None and local["errors"]) else EXIT_OK
    out.exit_code = code
    out.emit({
        "url": args.url,
        "dry_run": args.dry_run,
        "keep_last": args.keep_last,
        "keep_every": args.keep_every,
        "verify": verify,
        "steps": plan,
        "to_delete": [p["step"] for p in plan if not p["keep"]],
        "deleted": [p["step"] for p in deleted],
        "failed_verify": [{"step": i.step, "path": i.path, "status": i.status, "reason": i.reason}
                          for i in failed],
        "not_committed": left_alone,
        "debris": debris_rows,
        "debris_removed": removed,
        "bytes_freed": _freed(plan, deleted, debris_rows, removed, args.dry_run),
        "errors": errors,
        **({"local": local} if local is not None else {}),
    })
    for message in errors + (local["errors"] if local is not None else []):
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
    for s in left_alone:
        if s["path"] in debris_paths:  # listed with its verdict below
            continue
        t.add_row(step_label(s["step"]), status_text(s["status"]), "-",
                  f"not committed, left alone: {target.short(s['reason'])}")
    gone = set(removed)
    for r in debris_rows:
        name = f"{r['path']} (upload {r['upload_id']})" if r["upload_id"] else r["path"]
        if not r["removable"]:
            action = Text("left alone", style="yellow")
        elif args.dry_run or name in gone:
            action = Text("would remove" if args.dry_run else "removed", style="red")
        else:
            action = Text("failed", style="bold red")
        t.add_row(step_label(r["step"]), action, human_bytes(r["bytes"]),
                  f"{r['kind']} {name}: {target.short(r['why'])}")
    if plan or left_alone or debris_rows:
        out.print(t)
    else:
        out.print(f"no checkpoints under {target.where()}")
    for i in failed:
        out.print(Text(f"step {i.step} failed verification and was not kept: {target.short(i.reason)}",
                       style="bold red"))
    n = len([p for p in plan if not p["keep"]]) if args.dry_run else len(deleted)
    n_debris = sum(r["removable"] for r in debris_rows) if args.dry_run else len(removed)
    freed = _freed(plan, deleted, debris_rows, removed, args.dry_run)
    out.print(f"{verb} {n} step(s) and {n_debris} debris folder(s), {human_bytes(freed)}"
              + (" (dry run: nothing was deleted)" if args.dry_run else ""))
    if local is not None:
        _print_local(args, out, local)
    return code


def _freed(plan: list[dict[str, Any]], deleted: list[dict[str, Any]], debris: list[dict[str, Any]],
           removed: list[str], dry_run: bool) -> int:
    steps = plan if dry_run else deleted
    total = sum(p["bytes"] for p in steps if not p["keep"])
    gone = set(removed)
    for r in debris:
        name = f"{r['path']} (upload {r['upload_id']})" if r["upload_id"] else r["path"]
        if r["removable"] and (dry_run or name in gone):
            total += r["bytes"] or 0
    return total


# ---------------------------------------------------------------- the local tier (--local TEMPLATE)


def _pending_drains(args: argparse.Namespace, min_age: float) -> set[int]:
    """Steps whose drain may be running: a staging folder of that step on the persistent tier
    that ``prune`` would not remove (younger than ``--debris-min-age``, so maybe in use)."""
    from ckptlib.backends import open_storage

    from . import deadline

    storage = deadline.watched(open_storage(args.url, args.storage_options), args.url.rstrip("/"))
    try:
        found = retire.find_debris(storage, None, min_age=min_age, grace=min_age)
    finally:
        storage.close()
    out: set[int] = set()
    for d in found:
        m = layout.TMP_RE.match(d.path.split("/", 1)[0])
        step = layout.parse_step(m.group(1)) if m else None
        if d.kind == "tmp" and not d.removable and step is not None:
            out.add(step)
    return out


def _prune_local(args: argparse.Namespace) -> dict[str, Any]:
    """Each node folder of ``--local``: local retention (``--local-keep-last``, by
    :func:`ckptlib.tiers.inventory.retired_by_local_retention`, the manager's rule: never a step
    whose drain may be pending, never the newest) and debris (:func:`ckptlib.engine.retire.find_debris`
    as for the root, outside any job). Deletes unless ``--dry-run``. Prints nothing."""
    from ckptlib.tiers import inventory

    from .nodes import close_nodes, open_nodes

    min_age = max(args.debris_min_age, 0.0)
    keep = args.local_keep_last
    folders = open_nodes(args.local, args.node)
    nodes: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        pending = _pending_drains(args, min_age)
        for f in folders:
            node: dict[str, Any] = {"node": f.node, "path": f.path, "exists": f.exists, "steps": [], "debris": [],
                                    "deleted": [], "debris_removed": [], "bytes_freed": 0}
            nodes.append(node)
            if not f.exists:
                continue
            steps = inventory.local_steps(f.storage)
            plain = set(inventory.retired_by_local_retention(steps, keep, ()))
            gone = set(inventory.retired_by_local_retention(steps, keep, pending))
            for s in sorted(steps):
                if s in gone:
                    why = f"older than the newest {keep} locally committed step(s)"
                elif s in plain:
                    why = "drain may be pending (a staging folder of this step on the persistent tier)"
                else:
                    why = f"newest {keep} locally committed"
                node["steps"].append({"step": s, "path": layout.step_dir(s), "keep": s not in gone, "why": why,
                                      "bytes": retire.tree_bytes(f.storage, layout.step_dir(s))})
            debris = retire.find_debris(f.storage, None, min_age=min_age, grace=min_age)
            debris += inventory.write_back_debris(f.storage, None, min_age=min_age)  # crashed write-backs
            debris += inventory.arena_debris(f.storage)  # a memory tier's snapshot files of dead processes
            node["debris"] = [_debris_row(d, retire.tree_bytes(f.storage, d.path)) for d in debris]
            if args.dry_run:
                node["bytes_freed"] = sum(p["bytes"] or 0 for p in node["steps"] if not p["keep"]) + sum(
                    r["bytes"] or 0 for r in node["debris"] if r["removable"])
                continue
            for p in _delete_steps(f.storage, node["steps"], errors, f"{f.path}: "):
                node["deleted"].append(p["step"])
                node["bytes_freed"] += p["bytes"] or 0
            try:
                node["debris_removed"] = retire.remove_debris(f.storage, debris)
                f.storage.release_spares()  # a memory tier's recycled pages (docs/tiers.md)
            except (OSError, CheckpointError) as e:
                errors.append(f"{f.path}: could not remove debris: {e}")
            node["bytes_freed"] += sum(r["bytes"] or 0 for r in node["debris"] if r["path"] in node["debris_removed"])
    finally:
        close_nodes(folders)
    return {"template": args.local, "local_keep_last": keep, "pending_drains": sorted(pending), "nodes": nodes,
            "errors": errors}


def _report_local_only(args: argparse.Namespace, out: Output, local: dict[str, Any]) -> int:
    code = EXIT_USAGE if local["errors"] else EXIT_OK
    out.exit_code = code
    out.emit({"url": args.url, "dry_run": args.dry_run, "tier": "local", "local": local})
    for message in local["errors"]:
        out.note(f"ckptlib: {message}", style="red")
    if not out.json_mode:
        _print_local(args, out, local)
    return code


def _print_local(args: argparse.Namespace, out: Output, local: dict[str, Any]) -> None:
    """The local tier's table: one row per step and debris folder of each node."""
    verb = "would delete" if args.dry_run else "deleted"
    t = table("node", "step", "action", "size", "why", right=("step", "size"), fold=("why",))
    for node in local["nodes"]:
        label = str(node["node"]) if node["node"] is not None else node["path"]
        if not node["exists"]:
            t.add_row(label, "-", Text("no folder", style="yellow"), "-", f"{node['path']} does not exist")
        for p in node["steps"]:
            if p["keep"]:
                action = Text("keep", style="green")
            elif args.dry_run or p["step"] in node["deleted"]:
                action = Text(verb, style="red")
            else:
                action = Text("failed", style="bold red")
            t.add_row(label, str(p["step"]), action, human_bytes(p["bytes"]), p["why"])
        for r in node["debris"]:
            if not r["removable"]:
                action = Text("left alone", style="yellow")
            elif args.dry_run or r["path"] in node["debris_removed"]:
                action = Text("would remove" if args.dry_run else "removed", style="red")
            else:
                action = Text("failed", style="bold red")
            t.add_row(label, step_label(r["step"]), action, human_bytes(r["bytes"]), f"{r['kind']} {r['path']}: {r['why']}")
    out.print(Text(f"local tier {local['template']} (keep the newest {local['local_keep_last']} per node):",
                   style="bold"))
    out.print(t)
    n = sum(len([p for p in nd["steps"] if not p["keep"]]) if args.dry_run else len(nd["deleted"])
            for nd in local["nodes"])
    n_debris = sum(sum(r["removable"] for r in nd["debris"]) if args.dry_run else len(nd["debris_removed"])
                   for nd in local["nodes"])
    freed = sum(nd["bytes_freed"] for nd in local["nodes"])
    out.print(f"local tier: {verb} {n} step(s) and {n_debris} debris folder(s) on {len(local['nodes'])} node(s), "
              f"{human_bytes(freed)}" + (" (dry run: nothing was deleted)" if args.dry_run else ""))


def _delete_steps(storage: Storage, plan: list[dict[str, Any]], errors: list[str], where: str,
                  ) -> list[dict[str, Any]]:
    """Delete the steps of ``plan`` not marked ``keep`` (one storage: the run root, or one node's
    local folder); return the rows deleted. A step already gone is noted in its ``why``; a failed
    deletion is appended to ``errors`` (prefixed by ``where``) and the step is left as it is."""
    deleted: list[dict[str, Any]] = []
    for p in plan:
        if p["keep"]:
            continue
        try:
            retire.delete_step(storage, p["path"])
        except FileNotFoundError:
            p["why"] += " (already gone)"
        except (OSError, CheckpointError) as e:
            errors.append(f"{where}could not delete step {p['step']}: {e}")
            continue
        deleted.append(p)
    return deleted
