"""``ckptlib verify URL [--step N|--all]``: deep-check steps, every chunk's checksum (and zstd
frame size) against the manifest; exit 0 only if everything checked is good.

Called by :func:`ckptlib.cli.main.main` on the command's worker thread (cli/deadline.py); the rich progress bar (on a
terminal only) is advanced from that thread by :func:`ckptlib.engine.scan.check_step`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rich.text import Text

from ckptlib.engine.scan import StepInfo, check_step
from ckptlib.format import layout
from ckptlib.format.manifest import Manifest

from .output import CliError, Output, Progress, has_rows, human_bytes, status_text, table
from .target import (
    ANY_HINT,
    EXIT_BAD,
    EXIT_OK,
    ROOT_HINT,
    Target,
    list_steps,
    open_target,
    pick,
    single_for,
    step_label,
    step_or_none,
)


def stored_bytes(m: Manifest | None) -> int:
    """Bytes a deep check of ``m`` reads (chunks and packs as stored)."""
    if m is None:
        return 0
    if not m.complete:  # v2 from the status scan, pieces not loaded: its payload files' sizes
        return m.payload_bytes
    chunks = sum(c.length for t in m.tensors.values() for c in t.chunks)
    return chunks + sum(p.length for p in m.packs)


@dataclass
class _Check:
    info: StepInfo
    folder: str
    step: int | None
    result: StepInfo | None = None
    checked_bytes: int = 0


def _plan_verify(args: argparse.Namespace, target: Target) -> tuple[list[_Check], list[dict[str, Any]]]:
    """The steps to check, and (default ``verify ROOT`` only) the step folders newer than the
    one checked that the quick check already found unusable: a save in progress is not one (its
    ``.tmp-`` folder is no step folder). They leave the exit status as it is: the step checked
    is the one a resume loads; the caller notes them."""
    if target.kind == "checkpoint":
        return [_Check(single_for(args, target), "", None)], []
    infos = list_steps(target, ANY_HINT)
    newer: list[dict[str, Any]] = []
    if args.all:
        chosen = infos
    elif args.step is not None:
        chosen = [pick(infos, args.step, target)]
    else:
        committed = [i for i in infos if i.status == "committed"]
        # No committed step at all: judge the newest one, so the failure is explained.
        chosen = committed[-1:] or infos[-1:]
        if committed:
            newer = [{"step": i.step, "path": i.path, "status": i.status, "reason": i.reason} for i in infos
                     if i.step > committed[-1].step and i.status != "committed" and layout.parse_step(i.path) is not None]
    return [_Check(i, i.path, i.step) for i in chosen], newer


NOT_FAILURES = ("committed", "gone", "in progress", "debris")
"""Row statuses that do not fail ``verify``: a save's staging folder is not a checkpoint."""


def _judge_leftovers(target: Target, checks: list[_Check], min_age: float) -> None:
    """Re-label the not-committed rows that are a save's staging rather than a step (a
    ``.tmp-``/``.abort-`` folder; on object stores a step folder without manifest), by the
    verdict ``ckptlib prune`` gives (:func:`ckptlib.engine.retire.find_debris`, same
    ``--debris-min-age``): ``in progress`` while its save may still run, else ``debris``, with
    what to do. A POSIX step folder without manifest is never a save of ours: it stays
    ``incomplete``. Caller: :func:`cmd_verify`, before any deep check."""
    from ckptlib.engine import retire

    todo = [c for c in checks if c.info.status == "incomplete" and c.folder]
    if not todo:
        return
    found = {d.path: d for d in retire.find_debris(target.storage, None, min_age=min_age, grace=min_age,
                                                   steps=[c.info for c in checks])}
    for c in todo:
        d = found.get(c.folder)
        if d is None or d.kind not in ("tmp", "abort", "step") or (
                d.kind == "step" and target.storage.supports_atomic_rename):
            continue
        if not d.removable and (d.live or (d.age_seconds is not None and d.age_seconds < min_age)):
            status, reason = "in progress", f"a save in progress, not a checkpoint yet ({d.why})"
        elif d.removable:
            status, reason = "debris", f"not a checkpoint: {d.why}; `ckptlib prune` removes it"
        else:
            status, reason = "debris", f"not a checkpoint: {d.why}; remove it by hand once no save writes it"
        c.info = dataclasses.replace(c.info, status=status, reason=reason)


def _verify_row(c: _Check) -> dict[str, Any]:
    r = c.result or c.info
    return {
        "step": step_or_none(c.info.step),
        "path": c.folder,
        "status": r.status,
        "ok": r.status == "committed",
        "bytes": r.bytes if r.status == "committed" else None,
        "checked_bytes": c.checked_bytes,
        "reason": r.reason,
    }


def cmd_verify(args: argparse.Namespace, out: Output) -> int:
    """Deep-check steps: every chunk's checksum (and zstd frame size) against the manifest.
    With ``--local``: per tier (:func:`_verify_tiers`)."""
    if getattr(args, "local", None) is not None or getattr(args, "node", None) or getattr(args, "tier", None):
        from .nodes import check_tier_args

        tier = check_tier_args(args)
        if tier != "persistent":
            return _verify_tiers(args, out, tier)
    target = open_target(args.url, args.storage_options)
    try:
        checks, newer = _plan_verify(args, target)
        if target.kind == "root":
            _judge_leftovers(target, checks, max(getattr(args, "debris_min_age", 3600.0), 0.0))
        total = sum(stored_bytes(c.info.manifest) for c in checks if c.info.status == "committed")
        with Progress(out, total, "verifying") as progress:
            for c in checks:
                if c.info.status != "committed":
                    c.result = c.info  # the quick check already failed: say why
                    continue
                progress.describe(f"step {step_label(c.info.step)}")
                before = progress.done
                c.result = check_step(target.storage, c.folder, c.step, deep=True,
                                      progress=progress.advance)
                c.checked_bytes = progress.done - before
                if c.result.status == "committed":
                    continue
                # Finished bar even when a step failed early.
                progress.advance(max(0, stored_bytes(c.info.manifest) - c.checked_bytes))
                if c.folder and not target.storage.exists(c.folder):
                    c.result.status = "gone"
                    c.result.reason = "deleted while being verified (retention of a running job?)"
    finally:
        target.storage.close()

    rows = [_verify_row(c) for c in checks]
    failed = [r for r in rows if r["status"] not in NOT_FAILURES]
    verified = any(r["status"] == "committed" for r in rows)  # an empty or wrong folder is not "all good"
    code = EXIT_BAD if failed or not verified else EXIT_OK
    out.exit_code = code
    out.emit({"url": args.url, "kind": target.kind, "ok": code == EXIT_OK, "exit_code": code,
              "steps": rows, "newer_unusable": newer})
    for n in newer:
        out.note(f"ckptlib: note: step {n['step']}, newer than the step verified, is {n['status']} "
                 f"({target.short(n['reason'])}): a resume skips it")
    if not has_rows(out, rows, f"no checkpoints under {target.where()}: nothing verified (exit 1; "
                               "is this the run's root folder?)"):
        return code
    t = table("step", "result", "checked", "reason", right=("step", "checked"), fold=("reason",))
    for r in rows:
        t.add_row(
            step_label(r["step"]),
            status_text("ok" if r["ok"] else r["status"]),
            human_bytes(r["checked_bytes"]),
            target.short(r["reason"]),
        )
    out.print(t)
    checked = sum(r["checked_bytes"] for r in rows)
    if failed:
        names = "; ".join(f"step {step_label(r['step'])} ({r['status']}: {target.short(r['reason'])})"
                          for r in failed)
        out.print(Text(f"FAILED: {names}", style="bold red"))
    elif not verified:  # only saves in progress or their debris: no checkpoint to vouch for
        out.print(Text("FAILED: nothing verified: no committed step (only saves in progress or their debris)",
                       style="bold red"))
    else:
        n = sum(r["status"] == "committed" for r in rows)
        out.print(Text(f"OK: {n} step(s) verified, {human_bytes(checked)} checked", style="green"))
    return code


# ---------------------------------------------------------------- per tier (--local TEMPLATE)


@dataclass
class _NodeStep:
    """One node folder's copy of one step."""

    node: Any  # nodes.NodeFolder
    step: int
    save_id: str
    status: str = "ok"
    """``ok``, ``damaged`` (a copy is corrupt or missing), ``other save`` (the folder holds
    another save of this step number: not a source), ``unreadable`` (its manifest)."""
    reason: str = ""
    copies: list[Any] = field(default_factory=list)  # inventory.Copy
    files: list[str] | None = None
    checked_bytes: int = 0


def _choose_steps(args: argparse.Namespace, local: dict[int, set[str]], pers: dict[int, StepInfo],
                  any_pers: list[StepInfo], where: str) -> list[int]:
    """The steps to check: ``--step N``, ``--all`` (every step either tier holds), else the
    newest step committed on a tier."""
    known = set(local) | set(pers)
    if args.step is not None:
        if args.step not in known and all(i.step != args.step for i in any_pers):
            have = ", ".join(str(s) for s in sorted(known)[-10:]) or "none"
            raise CliError(f"no step {args.step} on any tier of {where} (newest steps: {have})")
        return [args.step]
    if args.all:
        return sorted(known | {i.step for i in any_pers if i.step >= 0})
    return sorted(known)[-1:]


def _verify_tiers(args: argparse.Namespace, out: Output, tier: str) -> int:
    """``verify --local TEMPLATE``: the persistent tier as without it (``--tier all``), every
    node folder's copies of each step (own files and replicas, every chunk's checksum), and
    whether every piece still has a good copy on some tier (the rule restore uses:
    :func:`ckptlib.tiers.inventory.unrestorable`)."""
    from ckptlib.backends import join
    from ckptlib.engine.scan import read_manifest
    from ckptlib.errors import CheckpointError
    from ckptlib.tiers import inventory

    from .nodes import close_nodes, open_nodes

    target: Target | None = None
    folders = open_nodes(args.local, args.node)
    try:
        infos: list[StepInfo] = []
        if tier == "all":
            target = open_target(args.url, args.storage_options, ROOT_HINT)
            if target.kind == "checkpoint":
                raise CliError(f"{args.url} is a single checkpoint folder, not a root — {ROOT_HINT}")
            if target.storage.exists(""):  # no root yet: nothing drained so far
                infos = list_steps(target)
        pers = {i.step: i for i in infos if i.status == "committed"}
        held_ids: dict[int, set[str]] = {}
        node_steps: dict[Any, dict[int, str]] = {}
        for f in folders:
            node_steps[f.path] = inventory.local_steps(f.storage) if f.exists else {}
            for s, sid in node_steps[f.path].items():
                held_ids.setdefault(s, set()).add(sid)
        where = f"{args.local} and {target.where()}" if target is not None else args.local
        steps = _choose_steps(args, held_ids, pers, infos, where)
        # The save of each step the tiers agree on: the persisted one's, else the most held.
        chosen: dict[int, str] = {}
        for s in steps:
            pm = pers[s].manifest if s in pers else None
            if pm is not None:
                chosen[s] = inventory.local_save_id(pm)
            else:
                counts = [sid for f in folders for st, sid in node_steps[f.path].items() if st == s]
                chosen[s] = max(sorted(set(counts)), key=counts.count) if counts else ""
        checks = [_Check(i, i.path, i.step) for i in infos if i.step in steps and (
            args.all or ((args.step is not None or i.status == "committed") and layout.parse_step(i.path) is not None))]
        if target is not None:  # a drain's staging folder on the persistent tier is no failure
            _judge_leftovers(target, checks, max(args.debris_min_age, 0.0))
        todo: list[_NodeStep] = []
        for f in folders:
            for s in steps:
                if s not in node_steps[f.path]:
                    continue
                ns = _NodeStep(f, s, node_steps[f.path][s])
                if ns.save_id != chosen[s]:
                    ns.status, ns.reason = "other save", (f"holds save {ns.save_id}, not the step's save "
                                                          f"{chosen[s]}: not a source")
                todo.append(ns)
        manifests: dict[tuple[str, int], Manifest] = {}
        for ns in todo:
            if ns.status != "ok":
                continue
            try:
                manifests[(ns.node.path, ns.step)] = read_manifest(ns.node.storage, layout.step_dir(ns.step), pieces=False)
            except (CheckpointError, OSError) as e:
                ns.status, ns.reason = "unreadable", str(e)
        total = sum(stored_bytes(c.info.manifest) for c in checks if c.info.status == "committed")
        for (path, step), m in manifests.items():  # the copies each node folder holds
            node = next(f for f in folders if f.path == path)
            final = layout.step_dir(step)
            total += sum(fe.size for fe in inventory.step_files(m) for folder in (final, join(final, inventory.REPLICA_DIR))
                         if node.storage.size(join(folder, fe.path)) is not None)
        with Progress(out, total, "verifying") as progress:
            for c in checks:
                if c.info.status != "committed":
                    c.result = c.info
                    continue
                assert target is not None
                progress.describe(f"persistent step {c.info.step}")
                before = progress.done
                c.result = check_step(target.storage, c.folder, c.step, deep=True, progress=progress.advance)
                c.checked_bytes = progress.done - before
            for ns in todo:
                got = manifests.get((ns.node.path, ns.step))
                if got is None:
                    continue
                progress.describe(f"{ns.node.label} step {ns.step}")
                before = progress.done
                ns.copies = inventory.check_copies(ns.node.storage, layout.step_dir(ns.step), got,
                                                   progress=progress.advance)
                ns.checked_bytes = progress.done - before
                ns.files = [fe.name for fe in inventory.step_files(got)]
                bad = [c for c in ns.copies if c.status != "ok"]
                if bad:
                    ns.status = "damaged"
                    ns.reason = "; ".join(f"{c.name} ({c.copy}): {c.status}: {c.reason}" for c in bad)
    finally:
        close_nodes(folders)
        if target is not None:
            target.storage.close()
    return _report_tiers(args, out, tier, target, steps, checks, todo, manifests)


def _report_tiers(args: argparse.Namespace, out: Output, tier: str, target: Target | None, steps: list[int],
                  checks: list[_Check], todo: list[_NodeStep], manifests: dict[tuple[str, int], Manifest]) -> int:
    from ckptlib.tiers import inventory

    pers_rows = [_verify_row(c) for c in checks]
    verdicts: list[dict[str, Any]] = []
    for s in steps:
        mine = [ns for ns in todo if ns.step == s and ns.files is not None]
        files = next((ns.files for ns in mine), None)
        good_pers = any(r["step"] == s and r["ok"] for r in pers_rows)
        if files is None and good_pers:
            m = next(c.result.manifest for c in checks if c.step == s and c.result and c.result.manifest)
            files = [fe.name for fe in inventory.step_files(m)]
        holders = [(f"{ns.node.label}{' replica' if c.copy == 'replica' else ''}", c)
                   for ns in mine for c in ns.copies if c.status == "ok"]
        sources: dict[str, list[str]] = {name: [] for name in files or []}
        for label, c in holders:
            sources.setdefault(c.name, []).append(label)
        held = [{c.name for c in ns.copies if c.status == "ok"} for ns in mine]
        why = inventory.unrestorable(files, held, good_pers)
        if good_pers:
            for name in sources:
                sources[name].append("persistent")
        damaged = [{"name": c.name, "node": ns.node.node, "path": ns.node.path, "copy": c.copy,
                    "status": c.status, "reason": c.reason, "still_from": sources.get(c.name, [])}
                   for ns in mine for c in ns.copies if c.status != "ok"]
        verdicts.append({"step": s, "restorable": why is None, "reason": why, "persisted": good_pers,
                         "lost": [] if why is None else inventory.lost_pieces(files or [], held),
                         "single_copy": sorted(n for n, src in sources.items() if len(src) == 1),
                         "sources": sources, "damaged": damaged})
    nodes_doc: dict[str, dict[str, Any]] = {}
    for ns in todo:
        entry = nodes_doc.setdefault(ns.node.path, {"node": ns.node.node, "path": ns.node.path, "steps": []})
        entry["steps"].append({
            "step": ns.step, "save_id": ns.save_id, "status": ns.status, "ok": ns.status == "ok",
            "checked_bytes": ns.checked_bytes, "reason": ns.reason,
            "copies": [{"name": c.name, "rank": c.rank, "copy": c.copy, "status": c.status, "reason": c.reason}
                       for c in ns.copies],
        })
    pers_bad = [r for r in pers_rows if r["status"] not in NOT_FAILURES]
    node_bad = [ns for ns in todo if ns.status in ("damaged", "unreadable")]  # "other save": stale, not bad
    lost = [v for v in verdicts if not v["restorable"]]
    code = EXIT_BAD if pers_bad or node_bad or lost or not verdicts else EXIT_OK
    out.exit_code = code
    out.emit({"url": args.url, "local": args.local, "tier": tier, "ok": code == EXIT_OK, "exit_code": code,
              "steps": pers_rows, "nodes": list(nodes_doc.values()), "restorable": verdicts})
    if not has_rows(out, verdicts, f"no steps on the local tier {args.local}"
                    + (f" nor under {target.where()}" if target is not None else "") + ": nothing verified (exit 1)"):
        return code
    short = target.short if target is not None else (lambda s: s)
    t = table("tier", "step", "result", "checked", "problems", right=("step", "checked"), fold=("problems",))
    for r in pers_rows:
        t.add_row("persistent", step_label(r["step"]), status_text("ok" if r["ok"] else r["status"]),
                  human_bytes(r["checked_bytes"]), short(r["reason"]))
    for ns in todo:
        where = ns.node.storage.url.rstrip("/") + "/"  # humans: paths inside the node folder
        t.add_row(ns.node.label, str(ns.step), status_text(ns.status), human_bytes(ns.checked_bytes),
                  ns.reason.replace(where, ""))
    out.print(t)
    for v in verdicts:
        if not v["restorable"]:
            out.print(Text(f"step {v['step']}: NOT RESTORABLE: {v['reason']}", style="bold red"))
            continue
        for d in v["damaged"]:
            out.print(Text(f"step {v['step']}: {d['name']} {d['status']} ({d['copy']} copy on node {d['node']}); "
                           f"still restorable from {', '.join(d['still_from'])}", style="yellow"))
        extra = " (persisted)" if v["persisted"] else ""
        out.print(Text(f"step {v['step']}: restorable{extra}: every piece has a verified copy", style="green"))
    if code != EXIT_OK:
        out.print(Text("FAILED: " + ("a step is not restorable" if lost else "damaged copies found"
                                     if node_bad or pers_bad else "nothing verified"), style="bold red"))
    return code
