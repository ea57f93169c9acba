"""The four ``ckptlib`` subcommands. Each takes parsed arguments and an :class:`Output`,
prints (or emits one JSON document) and returns the exit status.

All of them read storage through :func:`ckptlib.backends.open_storage` and judge steps with
:mod:`ckptlib.engine.scan`, exactly as ``CheckpointManager`` does, so the command line and a
resuming job always agree on which steps are usable.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table
from rich.text import Text

from ckptlib.backends import Storage, join, open_storage
from ckptlib.engine import retire
from ckptlib.engine.scan import StepInfo, check_step, read_manifest, scan
from ckptlib.errors import CheckpointError, CheckpointNotFoundError
from ckptlib.format import layout
from ckptlib.format import tree as tree_codec
from ckptlib.format.manifest import MANIFEST_NAME, Manifest, TensorEntry
from ckptlib.plan import retention

from .output import (
    CliError,
    Output,
    human_age,
    human_bytes,
    iso_time,
    jsonable,
    status_text,
    summarize,
)

EXIT_OK = 0
EXIT_BAD = 1
EXIT_USAGE = 2

ROOT_HINT = "pass the run's checkpoint root (the folder holding step-* folders)"
ANY_HINT = ROOT_HINT[:-1] + ", or a folder written by ckptlib.save())"
_RANK_FILE = re.compile(r"^r(\d+)-")
MAX_MARKER_BYTES = 1 << 16


# --------------------------------------------------------------------------- targets

@dataclass
class Target:
    """What a URL names: a CheckpointManager ``root`` or one ``checkpoint`` folder."""

    url: str
    storage: Storage
    kind: str
    """``root`` or ``checkpoint`` (a folder holding ``manifest.json``)."""

    def where(self, folder: str = "") -> str:
        base = self.storage.url.rstrip("/")
        return f"{base}/{folder}" if folder else base


def open_target(url: str, storage_options: dict[str, Any] | None, hint: str = ANY_HINT) -> Target:
    """Open ``url`` and tell whether it is a root or a single checkpoint folder.

    A URL naming a ``manifest.json`` file is taken as its folder. A URL that is a file
    (or, for roots, does not exist) is a :class:`CliError` with a hint.
    """
    storage = open_storage(url, storage_options)
    if storage.size("") is not None:
        storage.close()
        stripped = url.rstrip("/")
        if stripped.endswith("/" + MANIFEST_NAME) or stripped == MANIFEST_NAME:
            parent = stripped[: -len(MANIFEST_NAME)].rstrip("/") or "."
            return open_target(parent, storage_options, hint)
        raise CliError(f"{url} is a file, not a folder — {hint}")
    if storage.size(MANIFEST_NAME) is not None:
        return Target(url, storage, "checkpoint")
    return Target(url, storage, "root")


def list_steps(target: Target, hint: str = ROOT_HINT) -> list[StepInfo]:
    """Every step under a root, oldest first (a missing root is a :class:`CliError`)."""
    try:
        infos = scan(target.storage)
    except CheckpointNotFoundError:
        raise CliError(f"no such folder {target.where()} — {hint}") from None
    return sorted(infos, key=lambda i: (i.step, i.status == "committed", i.path))


def _pick(infos: list[StepInfo], step: int, target: Target) -> StepInfo:
    """The entry for ``step``: its ``step-N`` folder if there is one, else a leftover."""
    found = [i for i in infos if i.step == step]
    if not found:
        have = ", ".join(str(i.step) for i in infos[-10:]) or "none"
        raise CliError(f"no step {step} under {target.where()} (newest steps: {have})")
    for i in found:
        if layout.parse_step(i.path) is not None:
            return i
    return found[-1]


def _single(target: Target) -> StepInfo:
    """Shallow judgement of a single checkpoint folder (its step read from the manifest)."""
    info = check_step(target.storage, "")
    m = info.manifest
    if m is None:
        try:
            m = read_manifest(target.storage, "")
        except (CheckpointError, OSError):
            m = None
    info.step = m.step if m is not None and m.step is not None else -1
    return info


def _short(reason: str, target: Target) -> str:
    """``reason`` with the root's URL prefix dropped, for humans (JSON keeps it whole)."""
    prefix = target.where() + "/"
    return reason.replace(prefix, "") if prefix != "/" else reason


def _step_or_none(step: int | None) -> int | None:
    return None if step is None or step < 0 else step


def _step_label(step: int | None) -> str:
    return "-" if step is None or step < 0 else str(step)


# --------------------------------------------------------------------------- ls

def _ls_row(info: StepInfo, now: float) -> dict[str, Any]:
    committed = info.status == "committed"
    return {
        "step": _step_or_none(info.step),
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


def cmd_ls(args: argparse.Namespace, out: Output) -> int:
    """List every step under a root: status, size, ranks, age, and why unusable ones are."""
    target = open_target(args.url, args.storage_options, ROOT_HINT)
    try:
        infos = [_single(target)] if target.kind == "checkpoint" else list_steps(target)
    finally:
        target.storage.close()
    now = time.time()
    rows = [_ls_row(i, now) for i in infos]
    out.emit({"url": args.url, "kind": target.kind, "steps": rows})
    if out.json_mode:
        return EXIT_OK
    if not rows:
        out.print(f"no checkpoints under {target.where()} (no step-* folders yet)")
        return EXIT_OK
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("step", justify="right")
    table.add_column("status")
    table.add_column("size", justify="right")
    table.add_column("ranks", justify="right")
    table.add_column("age", justify="right")
    table.add_column("reason", overflow="fold")
    for r in rows:
        table.add_row(
            _step_label(r["step"]),
            status_text(r["status"]),
            human_bytes(r["bytes"]),
            str(r["world_size"] or "-"),
            human_age(r["age_seconds"]),
            _short(r["reason"], target),
        )
    out.print(table)
    good = sum(r["status"] == "committed" for r in rows)
    out.print(f"{len(rows)} step(s), {good} committed")
    return EXIT_OK


# --------------------------------------------------------------------------- inspect

def _ranks_of(m: Manifest, file_indices: set[int]) -> set[int]:
    ranks = set()
    for f in file_indices:
        name = m.files[f].path.rsplit("/", 1)[-1]
        match = _RANK_FILE.match(name)
        ranks.add(int(match.group(1)) if match else -1 - f)
    return ranks


def tensor_row(name: str, t: TensorEntry, m: Manifest) -> dict[str, Any]:
    """One tensor's description: dtype, shape, chunk layout, raw and stored bytes.

    A tensor is stored as chunks of its own and/or pieces of packs (small tensors packed
    together); it counts as ``sharded`` when its parts come from several files (ranks) or a
    part does not start at the tensor's origin.
    """
    packs = list(getattr(m, "packs", ()))
    pieces = list(getattr(t, "pieces", ()))
    itemsize = t.nbytes // max(1, _volume(t.shape)) if t.nbytes else 0
    files = {c.file for c in t.chunks} | {packs[p.pack].file for p in pieces}
    ranks = _ranks_of(m, files)
    parts = len(t.chunks) + len(pieces)
    sharded = len(files) > 1 or any(any(x.offset) for x in [*t.chunks, *pieces])
    stored = sum(c.length for c in t.chunks)
    codecs = {c.codec for c in t.chunks}
    for p in pieces:
        pack = packs[p.pack]
        raw = _volume(p.shape) * itemsize
        stored += round(raw * pack.length / pack.raw_length) if pack.raw_length else 0
        codecs.add(pack.codec)
    compressed = any(c != "raw" for c in codecs)
    if sharded:
        sharding = f"sharded: {parts} chunks"
        if len(ranks) > 1:
            sharding += f", {len(ranks)} ranks"
        elif len(files) > 1:
            sharding += f", {len(files)} files"
    elif pieces and not t.chunks:
        sharding = "packed" if parts == 1 else f"packed: {parts} pieces"
    else:
        sharding = "whole" if parts <= 1 else f"{parts} chunks"
    return {
        "name": name,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "chunks": parts,
        "packed": bool(pieces),
        "files": len(files),
        "ranks": len(ranks),
        "sharded": sharded,
        "sharding": sharding,
        "bytes": t.nbytes,
        "stored_bytes": stored,
        "codecs": sorted(codecs),
        "ratio": round(t.nbytes / stored, 3) if compressed and stored else None,
    }


def _volume(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _metadata(m: Manifest, where: str) -> tuple[Any, str]:
    try:
        value = tree_codec.decode(m.metadata, (), where)
    except CheckpointError as e:
        return None, f"<cannot decode: {e}>"
    return value, summarize(value)


def cmd_inspect(args: argparse.Namespace, out: Output) -> int:
    """Describe one checkpoint: header (step, save id, world size, ...) and its tensors."""
    target = open_target(args.url, args.storage_options)
    try:
        if target.kind == "checkpoint":
            if args.step is not None:
                raise CliError(f"{args.url} is a single checkpoint folder; --step applies to roots")
            info = _single(target)
            folder = ""
        else:
            infos = list_steps(target, ANY_HINT)
            if args.step is not None:
                info = _pick(infos, args.step, target)
            else:
                committed = [i for i in infos if i.status == "committed"]
                if not committed:
                    what = f"{len(infos)} step(s), none committed" if infos else "no steps"
                    raise CliError(f"no committed step under {target.where()} ({what}); "
                                   "use --step N to inspect a damaged one")
                info = committed[-1]
            folder = info.path
        m = info.manifest
        if m is None:
            try:
                m = read_manifest(target.storage, folder)
            except CheckpointError as e:
                raise CliError(f"step {_step_label(info.step)} is {info.status}: {e}") from None
    finally:
        target.storage.close()

    where = target.where(join(folder, MANIFEST_NAME))
    metadata, meta_summary = _metadata(m, where)
    tensors = [tensor_row(name, t, m) for name, t in sorted(m.tensors.items())]
    raw_total = sum(t["bytes"] for t in tensors)
    stored_total = sum(t["stored_bytes"] for t in tensors)
    doc = {
        "url": args.url,
        "kind": target.kind,
        "path": folder,
        "step": m.step,
        "status": info.status,
        "reason": info.reason,
        "save_id": m.save_id,
        "created": m.created,
        "created_iso": iso_time(m.created),
        "world_size": m.world_size,
        "commit": m.commit,
        "library": m.library,
        "checksum_algorithm": m.checksum_algorithm,
        "payload_bytes": m.payload_bytes,
        "num_files": len(m.files),
        "files": [{"path": f.path, "size": f.size} for f in m.files],
        "metadata": jsonable(metadata),
        "num_tensors": len(tensors),
        "tensor_bytes": raw_total,
        "stored_bytes": stored_total,
        "tensors": tensors,
    }
    out.emit(doc)
    if out.json_mode:
        return EXIT_OK

    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold")
    header.add_column(overflow="fold")
    header.add_row("checkpoint", target.where(folder))
    header.add_row("step", _step_label(m.step))
    status = status_text(info.status)
    if info.reason:
        status.append(f"  {_short(info.reason, target)}")
    header.add_row("status", status)
    header.add_row("save id", m.save_id)
    header.add_row("created", f"{iso_time(m.created) or '-'} ({human_age(time.time() - m.created)})")
    header.add_row("world size", str(m.world_size))
    header.add_row("commit", m.commit)
    header.add_row("library", m.library or "-")
    header.add_row("payload", f"{human_bytes(m.payload_bytes)} in {len(m.files)} file(s)")
    compressed = stored_total != raw_total or any(t["ratio"] is not None for t in tensors)
    line = f"{len(tensors)} ({human_bytes(raw_total)}"
    if compressed and stored_total:
        line += f", stored {human_bytes(stored_total)}, {raw_total / stored_total:.2f}x"
    header.add_row("tensors", line + ")")
    header.add_row("metadata", meta_summary)
    out.print(header)
    if not tensors:
        return EXIT_OK
    out.print()
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("name", overflow="fold")
    table.add_column("dtype")
    table.add_column("shape")
    table.add_column("sharding")
    table.add_column("bytes", justify="right")
    if compressed:
        table.add_column("stored", justify="right")
        table.add_column("ratio", justify="right")
    for t in tensors:
        cells: list[str | Text] = [
            t["name"], t["dtype"], str(tuple(t["shape"])),
            t["sharding"], human_bytes(t["bytes"]),
        ]
        if compressed:
            ratio = t["ratio"]
            cells += [human_bytes(t["stored_bytes"]), "-" if ratio is None else f"{ratio:.2f}x"]
        table.add_row(*cells)
    out.print(table)
    return EXIT_OK


# --------------------------------------------------------------------------- verify

def _stored_bytes(m: Manifest | None) -> int:
    if m is None:
        return 0
    chunks = sum(c.length for t in m.tensors.values() for c in t.chunks)
    return chunks + sum(p.length for p in getattr(m, "packs", ()))


@dataclass
class _Check:
    info: StepInfo
    folder: str
    step: int | None
    result: StepInfo | None = None
    checked_bytes: int = 0


@dataclass
class _Progress:
    """A rich progress bar with bytes, or nothing (``--json``, or stdout not a terminal)."""

    out: Output
    total: int
    bar: Any = None
    task: Any = None
    done: int = field(default=0)

    def __enter__(self) -> _Progress:
        if self.out.interactive and self.total:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                TransferSpeedColumn(), TimeRemainingColumn(),
                console=self.out.console, transient=True,
            )
            self.bar.__enter__()
            self.task = self.bar.add_task("verifying", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=text)

    def advance(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.advance(self.task, n)


def _plan_verify(args: argparse.Namespace, target: Target) -> list[_Check]:
    if target.kind == "checkpoint":
        if args.step is not None:
            raise CliError(f"{args.url} is a single checkpoint folder; --step applies to roots")
        info = _single(target)
        return [_Check(info, "", None)]
    infos = list_steps(target, ANY_HINT)
    if args.all:
        chosen = infos
    elif args.step is not None:
        chosen = [_pick(infos, args.step, target)]
    else:
        committed = [i for i in infos if i.status == "committed"]
        # No committed step at all: judge the newest one, so the failure is explained.
        chosen = committed[-1:] or infos[-1:]
    return [_Check(i, i.path, i.step) for i in chosen]


def _verify_row(c: _Check) -> dict[str, Any]:
    r = c.result or c.info
    return {
        "step": _step_or_none(c.info.step),
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
        total = sum(_stored_bytes(c.info.manifest) for c in checks if c.info.status == "committed")
        with _Progress(out, total) as progress:
            for c in checks:
                if c.info.status != "committed":
                    c.result = c.info  # the quick check already failed: say why
                    continue
                progress.describe(f"step {_step_label(c.info.step)}")
                before = progress.done
                c.result = check_step(target.storage, c.folder, c.step, deep=True,
                                      progress=progress.advance)
                c.checked_bytes = progress.done - before
                if c.result.status == "committed":
                    continue
                # Finished bar even when a step failed early.
                progress.advance(max(0, _stored_bytes(c.info.manifest) - c.checked_bytes))
                if c.folder and not target.storage.exists(c.folder):
                    c.result.status = "gone"
                    c.result.reason = "deleted while being verified (retention of a running job?)"
    finally:
        target.storage.close()

    rows = [_verify_row(c) for c in checks]
    failed = [r for r in rows if r["status"] not in ("committed", "gone")]
    code = EXIT_BAD if failed else EXIT_OK
    out.exit_code = code
    out.emit({"url": args.url, "kind": target.kind, "ok": not failed, "exit_code": code,
              "steps": rows})
    if out.json_mode:
        return code
    if not rows:
        out.print(f"no checkpoints under {target.where()}: nothing to verify")
        return code
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("step", justify="right")
    table.add_column("result")
    table.add_column("checked", justify="right")
    table.add_column("reason", overflow="fold")
    for r in rows:
        table.add_row(
            _step_label(r["step"]),
            status_text("ok" if r["ok"] else r["status"]),
            human_bytes(r["checked_bytes"]),
            _short(r["reason"], target),
        )
    out.print(table)
    checked = sum(r["checked_bytes"] for r in rows)
    if failed:
        names = ", ".join(f"step {_step_label(r['step'])} ({r['status']})" for r in failed)
        out.print(Text(f"FAILED: {names}", style="bold red"))
    else:
        out.print(Text(f"OK: {len(rows)} step(s) verified, {human_bytes(checked)} checked",
                       style="green"))
    return code


# --------------------------------------------------------------------------- prune

@dataclass
class Debris:
    """A leftover folder of a crashed save (``.tmp-``) or deletion (``.del-``)."""

    path: str
    save_id: str
    kind: str
    age_seconds: float | None
    removable: bool
    why: str


def _marker_created(storage: Storage, folder: str) -> float | None:
    path = join(folder, layout.MARKER)
    try:
        size = storage.size(path)
        if size is None or size > MAX_MARKER_BYTES:
            return None
        created = json.loads(storage.read(path)).get("created")
    except (OSError, CheckpointError, ValueError, AttributeError):
        return None
    return float(created) if isinstance(created, int | float) else None


class _AllExcept(Collection[str]):
    """Every save id except ``removable``, for membership tests only (it iterates as empty).

    Passed to ``clean_debris`` as its ``active_ids`` on rename-capable storage, so that it
    removes exactly the folders vetted by :func:`find_debris` and never a save that started
    after the listing."""

    def __init__(self, removable: set[str]) -> None:
        self.removable = removable

    def __contains__(self, save_id: object) -> bool:
        return save_id not in self.removable

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def find_debris(storage: Storage, min_age: float, now: float) -> list[Debris]:
    """The folders :func:`retire.clean_debris` would consider, and whether prune may remove
    them. Mirrors its rules (``*.tmp-<id>``/``*.del-<id>`` holding the ``.ckptlib`` marker);
    additionally a ``.tmp-`` folder younger than ``min_age`` (by its marker's time) may be a
    save still running in another process, so it is kept."""
    found = []
    try:
        entries = storage.listdir("")
    except FileNotFoundError:
        return found
    for e in sorted(entries, key=lambda e: e.name):
        m = layout.TMP_RE.match(e.name)
        if not (m and e.is_dir):
            continue
        kind, save_id = m.group(2), m.group(3)
        if layout.parse_step(m.group(1)) is None and kind == "tmp":
            continue  # clean_debris never touches these
        if storage.size(join(e.name, layout.MARKER)) is None:
            found.append(Debris(e.name, save_id, kind, None, False,
                                f"no {layout.MARKER} marker: not provably ours, left alone"))
            continue
        created = _marker_created(storage, e.name)
        age = None if created is None else now - created
        if kind == "tmp" and min_age > 0 and (age is None or age < min_age):
            when = "of unknown age" if age is None else f"started {human_age(age)}"
            found.append(Debris(e.name, save_id, kind, age, False,
                                f"save {when}: may still be running (see --debris-min-age)"))
            continue
        why = "crashed save" if kind == "tmp" else "interrupted deletion"
        found.append(Debris(e.name, save_id, kind, age, True, why))
    return found


def _clean_debris(storage: Storage, debris: list[Debris], min_age: float) -> list[str]:
    """Remove debris through ``retire.clean_debris``.

    Rename-capable storage (POSIX): only the ``.tmp-``/``.del-`` folders vetted by
    :func:`find_debris`. Object stores: ``clean_debris``'s own rules, which judge a save in
    progress by the age of its newest object (``grace``, set from ``--debris-min-age``).
    """
    if storage.supports_atomic_rename:
        vetted = {d.save_id for d in debris if d.removable}
        return retire.clean_debris(storage, _AllExcept(vetted)) if vetted else []
    if "grace" in inspect.signature(retire.clean_debris).parameters:
        return retire.clean_debris(storage, (), grace=max(min_age, 0.0))
    return retire.clean_debris(storage, ())


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
        plan = [
            {"step": d.step, "path": committed[d.step].path, "keep": d.keep, "why": d.why,
             "bytes": committed[d.step].bytes}
            for d in sorted(decisions, key=lambda d: d.step)
        ]
        debris = find_debris(target.storage, args.debris_min_age, time.time())
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
                removed = _clean_debris(target.storage, debris, args.debris_min_age)
            except (OSError, CheckpointError) as e:
                errors.append(f"could not remove debris: {e}")
    finally:
        target.storage.close()

    left_alone = [
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
    for e in errors:
        out.note(f"ckptlib: {e}", style="red")
    if out.json_mode:
        return code

    verb = "would delete" if args.dry_run else "deleted"
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("step", justify="right")
    table.add_column("action")
    table.add_column("size", justify="right")
    table.add_column("why", overflow="fold")
    done = {p["step"] for p in deleted}
    for p in plan:
        if p["keep"]:
            action = Text("keep", style="green")
        elif args.dry_run or p["step"] in done:
            action = Text(verb, style="red")
        else:
            action = Text("failed", style="bold red")
        table.add_row(str(p["step"]), action, human_bytes(p["bytes"]), p["why"])
    debris_paths = {d.path for d in debris}
    for s in left_alone:
        if s["path"] not in debris_paths:  # debris is listed below
            table.add_row(str(s["step"]), status_text(s["status"]), "-",
                          f"not committed, left alone: {_short(s['reason'], target)}")
    if plan or left_alone:
        out.print(table)
    else:
        out.print(f"no checkpoints under {target.where()}")
    for d in debris:
        if not d.removable:
            out.print(f"kept debris {d.path}: {d.why}")
        elif args.dry_run:
            out.print(f"would remove debris {d.path} ({d.why})")
    for name in removed:
        out.print(f"removed debris {name}")
    n = len([p for p in plan if not p["keep"]]) if args.dry_run else len(deleted)
    freed = sum(p["bytes"] for p in (plan if args.dry_run else deleted) if not p["keep"])
    out.print(f"{verb} {n} step(s), {human_bytes(freed)}"
              + (" (dry run: nothing was deleted)" if args.dry_run else ""))
    return code
