"""The node folders of a run's local tier, for ``ckptlib verify/prune --local TEMPLATE``.

Called on the command's worker thread (cli/deadline.py) by :mod:`ckptlib.cli.verify` and
:mod:`ckptlib.cli.prune`, before they judge anything: :func:`open_nodes` finds the folders as
``ls --local`` does (:func:`ckptlib.tiers.inventory.node_folders`: ``{node}`` matched against the
folders that exist, or replaced by each ``--node N``) and opens each under the command's
storage deadline. The caller closes them (:func:`close_nodes`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from ckptlib.backends import Storage, open_storage
from ckptlib.engine.scan import StepInfo

from . import deadline
from .output import CliError


@dataclass
class NodeFolder:
    """One node's local folder."""

    node: int | None
    path: str
    storage: Storage
    exists: bool

    @property
    def label(self) -> str:
        return f"node {self.node}" if self.node is not None else f"node folder {self.path}"


def open_nodes(template: str, nodes: Sequence[int] | None) -> list[NodeFolder]:
    """Every node folder ``template`` names (``nodes``: exactly these node indices, a missing
    folder included, as for a replaced node). A :class:`CliError` when none matches."""
    from ckptlib.tiers.inventory import node_folders

    found = node_folders(template, nodes)
    if not found:
        raise no_match(template)
    out = []
    for node, folder in found:
        storage = deadline.watched(open_storage(folder), folder)
        out.append(NodeFolder(node, folder, storage, storage.size("") is None and _is_dir(storage)))
    return out


def no_match(template: str) -> CliError:
    """The error of ``--local TEMPLATE`` matching no folder (``ls``, ``verify``, ``prune``): a
    mistyped template must not read as an empty local tier."""
    return CliError(f"no node folders match --local {template!r} ('{{node}}' matches each node's index; "
                    "pass the template the run gave CheckpointManager(local=...), or --node N)")


def _is_dir(storage: Storage) -> bool:
    try:
        storage.listdir("")
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def close_nodes(nodes: Sequence[NodeFolder]) -> None:
    for n in nodes:
        n.storage.close()


def check_tier_args(args: argparse.Namespace) -> str:
    """The ``--tier`` asked for (default: ``all`` with ``--local``, else ``persistent``); a
    :class:`CliError` when it needs ``--local`` and has none, or ``--node`` comes without it."""
    tier = args.tier or ("all" if args.local is not None else "persistent")
    if args.local is None and (tier != "persistent" or args.node):
        what = "--node" if args.node else f"--tier {tier}"
        raise CliError(f"{what} needs --local TEMPLATE: the run's node-local folders "
                       "(CheckpointManager(local=...), e.g. --local '/nvme/ckpt/n{node}')")
    return tier


def newest_committed(infos: Sequence[StepInfo]) -> dict[int, StepInfo]:
    """step -> its committed entry, among the persistent tier's steps."""
    return {i.step: i for i in infos if i.status == "committed"}

