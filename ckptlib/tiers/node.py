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
    """The node-local root: ``{node}`` in ``template`` replaced by the node index (a leading
    ``~``: the home folder, as for every local path)."""
    return os.path.expanduser(template).replace("{node}", str(node))


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

    def fewest_replicas(self, replicas: int, jump: int = 1) -> int:
        """The fewest replicas any rank's files get (:meth:`peers`: one per other node reached),
        counted per node: ``replicas`` unless the ring of nodes is too small for it or ``jump``
        brings a rank back to its own node."""
        n = len(set(self.nodes))
        return min(len({(i + k * jump) % n for k in range(1, replicas + 1)} - {i}) for i in range(n))

    def short_of_replicas(self, replicas: int, jump: int = 1) -> str | None:
        """Why fewer replicas than ``replicas`` are placed, for a warning; None when all are, and
        on one node (no other node to hold a copy: nothing a replica could save)."""
        nodes = len(set(self.nodes))
        if replicas < 1 or nodes < 2:
            return None
        got = self.fewest_replicas(replicas, jump)
        if got >= replicas:
            return None
        why = (f"{nodes} nodes hold at most {nodes - 1} other-node copies" if replicas >= nodes else
               f"replica_jump={jump} brings the ring of {nodes} nodes back to a rank's own node")
        return (f"local tier: {replicas} replica(s) per rank asked for, {got} placed for some ranks ({why}); "
                "a step whose only copies were on a lost node cannot be restored from the local tier. "
                "Use a replica_jump that shares no factor with the node count, or fewer replicas")

    def pairs(self, replicas: int, jump: int = 1) -> list[tuple[int, int]]:
        """Every (source rank, holder rank) pair, sorted: the same on every rank."""
        return sorted((r, p) for r in range(len(self.nodes)) for p in self.peers(r, replicas, jump))
