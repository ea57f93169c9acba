"""Nodes and peer placement. Pure apart from reading the environment.

:func:`node_index` runs on the training thread when the manager is made; :class:`Topology` is
built once per manager by :meth:`Topology.discover` (collective, on the thread of the first save
or restore, inside its session) and then answered locally on any
thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ckptlib.coord.session import Session


def node_index(env: Mapping[str, str] = os.environ) -> int:
    """This process's node: ``CKPTLIB_NODE``, else torchrun's ``GROUP_RANK``, else 0."""
    for key in ("CKPTLIB_NODE", "GROUP_RANK"):
        value = env.get(key, "").strip()
        if value:
            try:
                node = int(value)
            except ValueError:
                raise ValueError(f"{key}={value!r} is not a node index (a non-negative integer)") from None
            if node < 0:
                raise ValueError(f"{key}={value!r} is not a node index (a non-negative integer)")
            return node
    return 0


def local_root(template: str, node: int) -> str:
    """The node-local root: ``{node}`` in ``template`` replaced by the node index."""
    return template.replace("{node}", str(node))


@dataclass(frozen=True, slots=True)
class Topology:
    """The node of every rank, in rank order (the same list on every rank)."""

    nodes: tuple[int, ...]

    @classmethod
    def discover(cls, s: Session, node: int, timeout: float) -> Topology:
        """Every rank (collective): learn every rank's node, in one :meth:`Session.exchange` of
        the caller's session (a slow-but-alive rank is waited for up to ``timeout``, a dead or
        frozen one fails the others within the coordination timeout)."""
        if s.world <= 1:
            return cls((node,))
        return cls(tuple(int(n) for n in s.exchange(node, deadline=s.now() + timeout)))

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def is_leader(self, rank: int) -> bool:
        """The lowest rank of its node: it opens and commits the node's local step folder."""
        return self.ranks_on(self.nodes[rank])[0] == rank

    def peers(self, rank: int, replicas: int, jump: int = 1) -> list[int]:
        """The ranks holding ``rank``'s replicas: the k-th (k = 1..replicas) on the node
        ``k * jump`` places further round the ring of nodes, at the same position within it
        (modulo its size). Never a rank of the same node; at most one per other node."""
        order = sorted(set(self.nodes))
        here = order.index(self.nodes[rank])
        position = self.ranks_on(self.nodes[rank]).index(rank)
        out: list[int] = []
        for k in range(1, replicas + 1):
            node = order[(here + k * jump) % len(order)]
            if node == self.nodes[rank]:
                continue
            ranks = self.ranks_on(node)
            peer = ranks[position % len(ranks)]
            if peer not in out:
                out.append(peer)
        return out

    def pairs(self, replicas: int, jump: int = 1) -> list[tuple[int, int]]:
        """Every (source rank, holder rank) pair, sorted: the same on every rank."""
        return sorted((r, p) for r in range(len(self.nodes)) for p in self.peers(r, replicas, jump))
