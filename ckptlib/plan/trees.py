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


# -- format v2: trees compared by digest, per-rank values gathered alone ----------------------


def split(tree: Any) -> tuple[Any, list[Any]]:
    """Every rank (v2 save): ``tree`` with each outermost ``per_rank`` node replaced by a
    numbered slot, and the values of those nodes in slot order. Ranks whose states agree outside
    ``PerRank`` values have equal skeletons, so the coordinator compares digests, not trees."""
    values: list[Any] = []

    def walk(n: Any) -> Any:
        if isinstance(n, dict):
            kind = n.get("t")
            if kind == "per_rank":
                values.append(n["v"])
                return {"t": "per_rank", "slot": len(values) - 1}
            if kind in ("dict", "list", "tuple"):
                if kind == "dict":
                    return {"t": kind, "items": [[k, walk(v)] for k, v in n["items"]]}
                return {"t": kind, "items": [walk(v) for v in n["items"]]}
            if kind == "stateful":
                return {**n, "v": walk(n["v"])}
        return n

    return walk(tree), values


def join(skeleton: Any, digests: list[str], values: list[list[Any]]) -> Any:
    """Coordinator (v2 save): the merged tree from rank 0's skeleton, every rank's skeleton
    digest and per-rank values: O(ranks) checks plus the per-rank values themselves."""
    for r, d in enumerate(digests):
        if d != digests[0] or len(values[r]) != len(values[0]):
            raise TreeMismatch(
                f"rank {r}'s state differs from rank 0's outside ckptlib.PerRank values (its structure "
                "or a plain value); wrap per-rank values in ckptlib.PerRank"
            )

    def walk(n: Any) -> Any:
        if isinstance(n, dict):
            kind = n.get("t")
            if kind == "per_rank":
                return {"t": "per_rank", "ranks": [vs[n["slot"]] for vs in values]}
            if kind in ("dict", "list", "tuple"):
                if kind == "dict":
                    return {"t": kind, "items": [[k, walk(v)] for k, v in n["items"]]}
                return {"t": kind, "items": [walk(v) for v in n["items"]]}
            if kind == "stateful":
                return {**n, "v": walk(n["v"])}
        return n

    return walk(skeleton)
