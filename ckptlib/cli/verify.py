"""``ckptlib verify URL [--step N|--all]``: deep-check steps, every chunk's checksum (and zstd
frame size) against the manifest; exit 0 only if everything checked is good.

Called by :func:`ckptlib.cli.main.main` on the command's worker thread (cli/deadline.py); the rich progress bar (on a
terminal only) is advanced from that thread by :func:`ckptlib.engine.scan.check_step`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from rich.text import Text

from ckptlib.engine.scan import StepInfo, check_step
from ckptlib.format.manifest import Manifest

from .output import Output, Progress, has_rows, human_bytes, status_text, table
from .target import (
    ANY_HINT,
    EXIT_BAD,
    EXIT_OK,
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


def _plan_verify(args: argparse.Namespace, target: Target) -> list[_Check]:
    if target.kind == "checkpoint":
        return [_Check(single_for(args, target), "", None)]
    infos = list_steps(target, ANY_HINT)
    if args.all:
        chosen = infos
    elif args.step is not None:
        chosen = [pick(infos, args.step, target)]
    else:
        committed = [i for i in infos if i.status == "committed"]
        # No committed step at all: judge the newest one, so the failure is explained.
        chosen = committed[-1:] or infos[-1:]
    return [_Check(i, i.path, i.step) for i in chosen]


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
    """Deep-check steps: every chunk's checksum (and zstd frame size) against the manifest."""
    target = open_target(args.url, args.storage_options)
    try:
        checks = _plan_verify(args, target)
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
    failed = [r for r in rows if r["status"] not in ("committed", "gone")]
    verified = any(r["status"] == "committed" for r in rows)  # an empty or wrong folder is not "all good"
    code = EXIT_BAD if failed or not verified else EXIT_OK
    out.exit_code = code
    out.emit({"url": args.url, "kind": target.kind, "ok": code == EXIT_OK, "exit_code": code,
              "steps": rows})
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
    else:
        out.print(Text(f"OK: {len(rows)} step(s) verified, {human_bytes(checked)} checked",
                       style="green"))
    return code


