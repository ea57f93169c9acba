"""Merge the value trees of all ranks into the one the manifest records. Pure.

Called by the coordinator with every rank's tree (see :mod:`ckptlib.format.tree`). Outside
``per_rank`` nodes the trees must be identical: a value that differs between ranks and is not
wrapped in ``ckptlib.PerRank`` would otherwise be saved from rank 0 only and silently wrong
on the others. ``per_rank`` nodes become ``{"t": "per_rank", "ranks": [node_0, node_1, ...]}``.
"""

from __future__ import annotations

from typing import Any


class TreeMismatch(ValueError):
    pass


def merge(trees: list[Any]) -> Any:
    return _merge(trees, "")


def _merge(nodes: list[Any], path: str) -> Any:
    first = nodes[0]
    if isinstance(first, dict):
        kind = first.get("t")
        if kind == "per_rank":
            for r, n in enumerate(nodes):
                if not (isinstance(n, dict) and n.get("t") == "per_rank"):
                    raise TreeMismatch(f"{path or '<root>'}: PerRank on rank 0 but not on rank {r}")
            return {"t": "per_rank", "ranks": [n["v"] for n in nodes]}
        if kind in ("dict", "list", "tuple") or (kind == "stateful"):
            for r, n in enumerate(nodes[1:], 1):
                if not isinstance(n, dict) or n.get("t") != kind:
                    raise TreeMismatch(f"{path or '<root>'}: structure differs between rank 0 and rank {r}")
            if kind == "stateful":
                return {**first, "v": _merge([n["v"] for n in nodes], path)}
            items0 = first["items"]
            for r, n in enumerate(nodes[1:], 1):
                if len(n["items"]) != len(items0):
                    raise TreeMismatch(f"{path or '<root>'}: rank {r} has {len(n['items'])} entries, rank 0 has {len(items0)}")
            if kind == "dict":
                merged = []
                for j, (k, _) in enumerate(items0):
                    for r, n in enumerate(nodes[1:], 1):
                        if n["items"][j][0] != k:
                            raise TreeMismatch(f"{path or '<root>'}: key {k!r} on rank 0 vs {n['items'][j][0]!r} on rank {r}")
                    merged.append([k, _merge([n["items"][j][1] for n in nodes], f"{path}/{k}")])
                return {"t": "dict", "items": merged}
            return {"t": kind, "items": [_merge([n["items"][j] for n in nodes], f"{path}/{j}") for j in range(len(items0))]}
    for r, n in enumerate(nodes[1:], 1):
        if n != first:
            raise TreeMismatch(
                f"{path or '<root>'}: value differs between rank 0 and rank {r}; "
                "wrap per-rank values in ckptlib.PerRank"
            )
    return first
