"""Retention: which committed steps to keep. Pure.

Called by the manager after each successful commit (and by ``ckptlib prune``). Only
committed steps are ever candidates for deletion, and the newest committed step is always
kept, whatever the policy says; so is the step the manager has just saved (``just_saved``).

``keep_best=k`` (with ``best_metric`` and ``best_mode``) also keeps the k best steps by the
metric each step recorded (``save(..., metrics=)``). A step without that metric ranks after
every step that has it (worst), newer before older among those; ties go to the newer step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Decision:
    step: int
    keep: bool
    why: str


BEST_MODES = ("min", "max")


def check_best(keep_best: int | None, best_metric: str | None, best_mode: str) -> None:
    """Validate the keep_best policy (the manager's constructor and :func:`decide`)."""
    if keep_best is None:
        return
    if type(keep_best) is not int or keep_best < 1:
        raise ValueError(f"keep_best must be an int >= 1 or None, got {keep_best!r}")
    if not isinstance(best_metric, str) or not best_metric:
        raise ValueError(f"keep_best={keep_best} needs best_metric= (the metrics key to rank by), got "
                         f"{best_metric!r}")
    if best_mode not in BEST_MODES:
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")


def best_steps(
    steps: Sequence[int], metrics: Mapping[int, Mapping[str, float]], k: int, metric: str, mode: str
) -> list[int]:
    """The ``k`` best of ``steps`` by ``metrics[step][metric]`` (see the module doc)."""
    sign = 1.0 if mode == "min" else -1.0

    def rank(s: int) -> tuple[int, float, int]:
        value = metrics.get(s, {}).get(metric)
        return (1, 0.0, -s) if value is None else (0, sign * value, -s)

    return sorted(steps, key=rank)[:k]


def decide(
    committed: Sequence[int],
    keep_last: int | None,
    keep_every: int | None,
    *,
    keep_best: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    metrics: Mapping[int, Mapping[str, float]] | None = None,
    just_saved: int | None = None,
) -> list[Decision]:
    """One decision per committed step, newest first. With neither ``keep_last`` nor
    ``keep_best`` everything is kept; with only ``keep_best``, the newest step, the best k and
    ``keep_every`` multiples. ``metrics``: step -> its recorded metrics (for ``keep_best``).
    ``just_saved``: the step the caller (the manager, after its commit) has just saved, always
    kept: after a rollback (``restore(step=N)`` with newer steps committed) it is older than the
    newest, and the policy alone would delete the save it has just reported done."""
    if keep_last is not None and keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    if keep_every is not None and keep_every < 1:
        raise ValueError("keep_every must be >= 1")
    check_best(keep_best, best_metric, best_mode)
    steps = sorted(set(committed), reverse=True)
    best: set[int] = set()
    if keep_best is not None and best_metric is not None:
        best = set(best_steps(steps, metrics or {}, keep_best, best_metric, best_mode))
    out = []
    for i, s in enumerate(steps):
        if i == 0:
            out.append(Decision(s, True, "newest committed step"))
        elif s == just_saved:
            out.append(Decision(s, True, "the step just saved (older than the newest: a rollback)"))
        elif keep_last is None and keep_best is None:
            out.append(Decision(s, True, "no keep_last policy"))
        elif s in best:
            out.append(Decision(s, True, f"among the best {keep_best} by {best_metric} ({best_mode})"))
        elif keep_last is not None and i < keep_last:
            out.append(Decision(s, True, f"among the newest {keep_last}"))
        elif keep_every is not None and s % keep_every == 0:
            out.append(Decision(s, True, f"divisible by keep_every={keep_every}"))
        else:
            why = [f"older than the newest {keep_last}"] if keep_last is not None else []
            if keep_best is not None:
                why.append(f"not among the best {keep_best} by {best_metric}")
            out.append(Decision(s, False, ", ".join(why)))
    return out
