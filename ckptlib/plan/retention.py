"""Retention: which committed steps to keep. Pure.

Called by the manager after each successful commit (and by ``ckptlib prune``). Only
committed steps are ever candidates for deletion, and the newest committed step is always
kept, whatever the policy says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Decision:
    step: int
    keep: bool
    why: str


def decide(committed: Sequence[int], keep_last: int | None, keep_every: int | None) -> list[Decision]:
    """One decision per committed step, newest first. ``None`` policies keep everything."""
    if keep_last is not None and keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    if keep_every is not None and keep_every < 1:
        raise ValueError("keep_every must be >= 1")
    steps = sorted(set(committed), reverse=True)
    out = []
    for i, s in enumerate(steps):
        if i == 0:
            out.append(Decision(s, True, "newest committed step"))
        elif keep_last is None:
            out.append(Decision(s, True, "no keep_last policy"))
        elif i < keep_last:
            out.append(Decision(s, True, f"among the newest {keep_last}"))
        elif keep_every is not None and s % keep_every == 0:
            out.append(Decision(s, True, f"divisible by keep_every={keep_every}"))
        else:
            out.append(Decision(s, False, f"older than the newest {keep_last}"))
    return out
