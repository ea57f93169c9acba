"""What a command's URL names, and the step helpers the commands share.

Every command (``ls``, ``inspect``, ``verify``, ``prune``; the command's worker thread) starts with
:func:`open_target`, closes ``target.storage`` when done, and judges steps with
:mod:`ckptlib.engine.scan` exactly as ``CheckpointManager`` does, so the command line and a
resuming job always agree on which steps are usable.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from ckptlib.backends import Storage, open_storage
from ckptlib.engine.scan import StepInfo, check_step, read_manifest, scan
from ckptlib.errors import CheckpointError, CheckpointNotFoundError
from ckptlib.format import layout
from ckptlib.format.manifest import MANIFEST_NAME

from . import deadline
from .output import CliError

EXIT_OK = 0
EXIT_BAD = 1
EXIT_USAGE = 2

ROOT_HINT = "pass the run's checkpoint root (the folder holding step-* folders)"
ANY_HINT = ROOT_HINT[:-1] + ", or a folder written by ckptlib.save())"


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

    def short(self, reason: str) -> str:
        """``reason`` with the root's URL prefix dropped, for humans (JSON keeps it whole)."""
        prefix = self.where() + "/"
        return reason.replace(prefix, "") if prefix != "/" else reason


def open_target(url: str, storage_options: dict[str, Any] | None, hint: str = ANY_HINT) -> Target:
    """Open ``url`` and tell whether it is a root or a single checkpoint folder.

    A URL naming a ``manifest.json`` file is taken as its folder. A URL that is a file
    (or, for roots, does not exist) is a :class:`CliError` with a hint.
    """
    storage = deadline.watched(open_storage(url, storage_options), url.rstrip("/"))
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


def list_steps(target: Target, hint: str = ROOT_HINT, *, unreadable: bool = False) -> list[StepInfo]:
    """Every step under a root, oldest first (a missing root is a :class:`CliError`);
    ``unreadable``: see :func:`ckptlib.engine.scan.scan` (``ls`` only)."""
    try:
        infos = scan(target.storage, unreadable=unreadable)
    except CheckpointNotFoundError:
        raise CliError(f"no such folder {target.where()} — {hint}") from None
    return sorted(infos, key=lambda i: (i.step, i.status == "committed", i.path))


def pick(infos: list[StepInfo], step: int, target: Target) -> StepInfo:
    """The entry for ``step``: its ``step-N`` folder if there is one, else a leftover."""
    found = [i for i in infos if i.step == step]
    if not found:
        have = ", ".join(str(i.step) for i in infos[-10:]) or "none"
        raise CliError(f"no step {step} under {target.where()} (newest steps: {have})")
    for i in found:
        if layout.parse_step(i.path) is not None:
            return i
    return found[-1]


def single(target: Target) -> StepInfo:
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


def single_for(args: argparse.Namespace, target: Target) -> StepInfo:
    """:func:`single`, for ``inspect``/``verify`` on a checkpoint folder (``--step`` refused)."""
    if args.step is not None:
        raise CliError(f"{args.url} is a single checkpoint folder; --step applies to roots")
    return single(target)


def step_or_none(step: int | None) -> int | None:
    return None if step is None or step < 0 else step


def step_label(step: int | None) -> str:
    return "-" if step is None or step < 0 else str(step)
