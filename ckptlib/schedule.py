"""When to save: checkpoint-interval formulas and the online interval estimator.

Pure (no I/O, no torch, no threads), so it is cheap to import: the manager's
``should_save`` and the ``ckptlib plan`` simulator (:mod:`ckptlib.simulate`) share it.

The model (docs/scale.md). Training computes for ``T`` seconds, then a save blocks the loop for
the *stall* ``C`` (the snapshot), and the save becomes durable ``L`` seconds after it started
(``L >= C``; async saves persist in the background). A new save waits for the previous one, so
one cycle takes ``P = max(T + C, L)``. Failures arrive at random (exponential, mean time between
failures ``M``); each costs the restart time ``R`` plus the work since the newest durable save.

- :func:`young_interval`: ``sqrt(2 C M)``, Young's first-order optimum of ``T``.
- :func:`daly_interval`: Daly's higher-order optimum, better when ``C`` is not << ``M``.
- :func:`optimal_interval`: Daly's, raised so that saves never queue (``T + C >= L``).
- :func:`first_order_goodput`: the predicted fraction of wall time that is useful work.

:class:`IntervalEstimator` is what ``CheckpointManager(save_interval="auto")`` feeds (training
thread only): the time between ``should_save`` calls (the step time) and the measured cost of
each save (the stall and the time to durable). It proposes the interval in steps from the
recent measurements, clamped to the bounds (CheckFreq's idea: re-evaluate online as saves
complete). :class:`SaveSchedule` turns a fixed or proposed interval into ``should_save``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

HOUR = 3600.0


def check_positive(name: str, value: float, *, zero_ok: bool = False) -> float:
    """``value`` as a float if it is a finite number > 0 (>= 0 with ``zero_ok``); otherwise a
    ValueError naming the argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not zero_ok) or math.isinf(value):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return float(value)


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): compute time between saves ``sqrt(2 * cost * mtbf)`` (seconds)."""
    check_positive("cost_s", cost_s, zero_ok=True)
    check_positive("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher-order optimum of the compute time between saves (seconds).

    ``sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` when ``C < 2M``, else ``M``. Equals
    Young's within a fraction of a percent when ``C << M``; never negative.
    """
    check_positive("cost_s", cost_s, zero_ok=True)
    check_positive("mtbf_s", mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return max(0.0, math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s)


def optimal_interval(stall_s: float, durable_s: float, mtbf_s: float) -> float:
    """The recommended compute time between saves: Daly's for the stall, but at least
    ``durable_s - stall_s`` so that a save never waits for the previous one to persist.

    Only the stall is paid per save; the time to durable adds to the work lost per failure
    (:func:`first_order_goodput`) but does not move the first-order optimum.
    """
    check_positive("durable_s", durable_s, zero_ok=True)
    return max(daly_interval(stall_s, mtbf_s), durable_s - stall_s)


def expected_lost_work(interval_s: float, stall_s: float, durable_s: float) -> float:
    """Mean compute seconds redone after a failure in steady state (failure time uniform in a
    cycle): ``T^2 / 2P + T * min(L, P) / P`` with ``P = max(T + C, L)``."""
    t = check_positive("interval_s", interval_s)
    c = check_positive("stall_s", stall_s, zero_ok=True)
    lat = max(c, check_positive("durable_s", durable_s, zero_ok=True))
    period = max(t + c, lat)
    return t * t / (2.0 * period) + t * min(lat, period) / period


def first_order_goodput(
    interval_s: float, stall_s: float, durable_s: float, mtbf_s: float, restart_s: float = 0.0
) -> float:
    """Predicted useful fraction of wall time, first order in ``P / M`` (docs/scale.md):
    ``(T / P) * (1 - R / M) - lost / M``, clipped at 0. :mod:`ckptlib.simulate` measures the
    same quantity without the approximation."""
    t = check_positive("interval_s", interval_s)
    c = check_positive("stall_s", stall_s, zero_ok=True)
    m = check_positive("mtbf_s", mtbf_s)
    r = check_positive("restart_s", restart_s, zero_ok=True)
    period = max(t + c, max(c, durable_s))
    good = (t / period) * (1.0 - r / m) - expected_lost_work(t, c, durable_s) / m
    return max(0.0, good)


@dataclass(frozen=True)
class SaveCost:
    """One completed save as the manager measured it."""

    stall_s: float
    """Seconds the training loop was blocked by the save (``save()`` plus snapshot waits)."""
    durable_s: float | None
    """Seconds from the start of ``save()`` to committed; None if it failed or is unknown."""


class IntervalEstimator:
    """Online estimate of the best interval in steps from measured step times and save costs.

    Fed on the training thread only: :meth:`observe_step` with each step's compute seconds,
    :meth:`observe_save` with each finished save. :meth:`propose` reads the means of the last
    ``window`` saves and the median of the last ``step_window`` steps.
    """

    def __init__(
        self, mtbf_s: float, *, min_steps: int = 1, max_steps: int | None = None,
        window: int = 5, step_window: int = 50,
    ) -> None:
        self.mtbf_s = check_positive("mtbf_s", mtbf_s)
        check_bounds(min_steps, max_steps)
        self.min_steps = min_steps
        self.max_steps = max_steps
        self._saves: deque[SaveCost] = deque(maxlen=window)
        self._steps: deque[float] = deque(maxlen=step_window)

    def observe_step(self, seconds: float) -> None:
        """One training step took ``seconds`` of compute (stalls already subtracted)."""
        if seconds > 0 and math.isfinite(seconds):
            self._steps.append(seconds)

    def observe_save(self, cost: SaveCost) -> None:
        self._saves.append(cost)

    @property
    def step_s(self) -> float | None:
        """Median recent step time, or None before the first step was measured."""
        if not self._steps:
            return None
        ordered = sorted(self._steps)
        return ordered[len(ordered) // 2]

    def cost(self) -> tuple[float, float] | None:
        """(mean stall, mean time to durable) of the recent saves, or None before the first."""
        if not self._saves:
            return None
        stall = sum(s.stall_s for s in self._saves) / len(self._saves)
        durable = [s.durable_s for s in self._saves if s.durable_s is not None]
        lat = sum(durable) / len(durable) if durable else stall
        return stall, max(stall, lat)

    def interval_s(self) -> float | None:
        """The recommended compute seconds between saves (:func:`optimal_interval`), or None."""
        cost = self.cost()
        return None if cost is None else optimal_interval(cost[0], cost[1], self.mtbf_s)

    def propose(self) -> int:
        """The interval in steps: ``interval_s / step_s`` rounded, clamped to the bounds;
        ``min_steps`` while nothing is measured yet (the first saves measure the cost)."""
        seconds, step = self.interval_s(), self.step_s
        if seconds is None or step is None:
            return self.min_steps
        return clamp_steps(round(seconds / step), self.min_steps, self.max_steps)


def check_bounds(min_steps: int, max_steps: int | None) -> None:
    """Validate ``save_interval_min_steps`` / ``save_interval_max_steps``."""
    if type(min_steps) is not int or min_steps < 1:
        raise ValueError(f"save_interval_min_steps must be an int >= 1, got {min_steps!r}")
    if max_steps is not None and (type(max_steps) is not int or max_steps < min_steps):
        raise ValueError(
            f"save_interval_max_steps must be None or an int >= save_interval_min_steps "
            f"({min_steps}), got {max_steps!r}"
        )


def clamp_steps(steps: int, min_steps: int, max_steps: int | None) -> int:
    steps = max(min_steps, steps)
    return steps if max_steps is None else min(max_steps, steps)


class SaveSchedule:
    """``should_save`` for ``save_interval_steps=N`` (fixed) or ``save_interval="auto"``.

    Fixed: a step is due when it is a multiple of N (the same answer on every rank).
    Auto: the next save is due ``interval`` steps after the last one; the manager sets the
    interval at each save from a value all ranks agreed on (:meth:`begin_save` proposes it,
    :meth:`saved` applies the agreed one), so every rank decides alike although each measures
    its own times. Training thread only; ``clock`` is injectable for tests.
    """

    def __init__(
        self, every: int | None = None, estimator: IntervalEstimator | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (every is None) == (estimator is None):
            raise ValueError("SaveSchedule needs exactly one of every= or estimator=")
        self.every = every
        self.estimator = estimator
        self.clock = clock
        self.interval = every if every is not None else estimator.min_steps  # type: ignore[union-attr]
        self._last_call: float | None = None
        self._stalled = 0.0  # stall seconds since the last should_save call
        self._last_saved: int | None = None
        self._next: int | None = None
        self._pending: tuple[float, float] | None = None  # (start, stall) of the last save

    def should_save(self, step: int) -> bool:
        """True when ``step`` is due for a save. Call once per step, on every rank."""
        now = self.clock()
        if self._last_call is not None and self.estimator is not None:
            self.estimator.observe_step(now - self._last_call - self._stalled)
        self._last_call, self._stalled = now, 0.0
        if self._last_saved is not None and step <= self._last_saved:
            return False
        if self.every is not None:
            return step % self.every == 0
        if self._next is None:
            self._next = step + self.interval
        return step >= self._next

    def add_stall(self, seconds: float) -> None:
        """The loop was blocked ``seconds`` outside ``save()`` (overlap-mode snapshot waits)."""
        self._stalled += seconds
        if self._pending is not None:
            self._pending = (self._pending[0], self._pending[1] + seconds)

    def begin_save(self, previous_durable_at: float | None) -> int:
        """Before a save (after the previous one finished): record the previous save's cost
        (``previous_durable_at``: when it committed, None if it failed) and return this rank's
        proposed interval in steps."""
        if self.estimator is None:
            return self.interval
        if self._pending is not None:
            start, stall = self._pending
            durable = None if previous_durable_at is None else previous_durable_at - start
            self.estimator.observe_save(SaveCost(stall, durable))
            self._pending = None
        return self.estimator.propose()

    def resumed(self, step: int) -> None:
        """After ``restore()`` loaded ``step`` (the manager, training thread): that step is
        committed, so ``should_save(step)`` is False (a loop that starts at the step it restored
        does not save it again: that save would raise ``StepExistsError`` and end the relaunched
        job), and an automatic interval counts from it."""
        self._last_saved = step
        if self.estimator is not None:
            self._next = step + self.interval

    def saved(self, step: int, interval: int, start: float, stall_s: float, queued_s: float = 0.0) -> None:
        """After ``save(step)`` returned: ``interval`` is the agreed next interval, ``start``
        the clock when the save started, ``stall_s`` how long it then blocked the loop, and
        ``queued_s`` how long ``save()`` first waited for the previous save (not part of
        this save's cost: the model accounts for it through the time to durable)."""
        self._last_saved = step
        self._stalled += stall_s + queued_s
        if self.estimator is not None:
            self.interval = interval
            self._next = step + interval
            self._pending = (start, stall_s)
