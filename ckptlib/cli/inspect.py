"""``ckptlib inspect URL [--step N]``: one checkpoint's header (step, save id, world size,
commit mode, metadata, ...) and its tensors (name, dtype, shape, sharding, bytes).

Called by :func:`ckptlib.cli.main.main` on the command's worker thread (cli/deadline.py).
"""

from __future__ import annotations

import argparse
import math
import re
import time
from typing import Any

from rich.table import Table
from rich.text import Text

from ckptlib.backends import join
from ckptlib.engine.scan import read_manifest
from ckptlib.errors import CheckpointError
from ckptlib.format import tree as tree_codec
from ckptlib.format.manifest import MANIFEST_NAME, Manifest, TensorEntry

from .output import (
    CliError,
    Output,
    human_age,
    human_bytes,
    iso_time,
    jsonable,
    status_text,
    summarize,
    table,
)
from .target import ANY_HINT, EXIT_OK, list_steps, open_target, pick, single_for, step_label

_RANK_FILE = re.compile(r"^r(\d+)-")


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
    packs = m.packs
    pieces = t.pieces
    itemsize = t.nbytes // max(1, math.prod(t.shape)) if t.nbytes else 0
    files = {c.file for c in t.chunks} | {packs[p.pack].file for p in pieces}
    ranks = _ranks_of(m, files)
    parts = len(t.chunks) + len(pieces)
    sharded = len(files) > 1 or any(any(c.offset) for c in t.chunks) or any(any(p.offset) for p in pieces)
    stored = sum(c.length for c in t.chunks)
    codecs = {c.codec for c in t.chunks}
    for p in pieces:
        pack = packs[p.pack]
        raw = math.prod(p.shape) * itemsize
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


def _metadata(m: Manifest, where: str) -> tuple[Any, str]:
    try:
        value = tree_codec.decode(m.metadata, (), where)
    except CheckpointError as e:
        return None, f"<cannot decode: {e}>"
    return value, summarize(value)



_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders numbers by value: ``layers.2`` before ``layers.10``."""
    return tuple((0, int(p)) if _DIGITS.fullmatch(p) else (1, p) for p in _DIGITS.split(name) if p)

def cmd_inspect(args: argparse.Namespace, out: Output) -> int:
    """Describe one checkpoint: header (step, save id, world size, ...) and its tensors."""
    target = open_target(args.url, args.storage_options)
    try:
        if target.kind == "checkpoint":
            info = single_for(args, target)
            folder = ""
        else:
            infos = list_steps(target, ANY_HINT)
            if args.step is not None:
                info = pick(infos, args.step, target)
            else:
                committed = [i for i in infos if i.status == "committed"]
                if not committed:
                    what = f"{len(infos)} step(s), none committed" if infos else "no steps"
                    raise CliError(f"no committed step under {target.where()} ({what}); "
                                   "use --step N to inspect a damaged one")
                info = committed[-1]
            folder = info.path
        m = info.manifest
        if m is None or not m.complete:  # v2: the status scan reads no piece index file
            try:
                m = read_manifest(target.storage, folder)
            except CheckpointError as e:
                label = step_label(info.step)
                if info.status != "committed":
                    raise CliError(f"step {label} is {info.status}: {e}") from None
                # Its manifest and file sizes passed the scan; a piece index did not: damaged.
                raise CliError(f"step {label} is damaged: {e} (`ckptlib verify {args.url} --all` lists every "
                               "damaged step; --step N inspects another one)") from None
    finally:
        target.storage.close()

    where = target.where(join(folder, MANIFEST_NAME))
    metadata, meta_summary = _metadata(m, where)
    tensors = [tensor_row(name, m.tensors[name], m) for name in sorted(m.tensors, key=natural_key)]
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
    header.add_row("step", step_label(m.step))
    status = status_text(info.status)
    if info.reason:
        status.append(f"  {target.short(info.reason)}")
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
    extra = ("stored", "ratio") if compressed else ()
    t_out = table("name", "dtype", "shape", "sharding", "bytes", *extra,
                  right=("bytes", *extra), fold=("name",))
    for t in tensors:
        cells: list[str | Text] = [
            t["name"], t["dtype"], str(tuple(t["shape"])),
            t["sharding"], human_bytes(t["bytes"]),
        ]
        if compressed:
            ratio = t["ratio"]
            cells += [human_bytes(t["stored_bytes"]), "-" if ratio is None else f"{ratio:.2f}x"]
        t_out.add_row(*cells)
    out.print(t_out)
    return EXIT_OK


