"""Preemption: turn SIGTERM (or any signal) into a final checkpoint and a clean exit.

``CheckpointManager.save_on_signal`` builds a :class:`FinalCheckpoint` (what to save, how to
exit) around a :class:`PreemptionWatcher` (signals and deadline). ``install``/``uninstall`` and
the handler run on the main thread; the handler only records the request, and the training
loop acts on it at a safe point (``mgr.maybe_save_on_preemption``) unless an ``on_signal``
callback saves inside the handler. A watchdog thread (``ckptlib-preempt-watchdog``) started by
the first signal ends the process with ``failure_exit_code`` (``os._exit``) at the deadline,
so a hung save does not become a silent SIGKILL; :meth:`disarm` stops it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn, Protocol

from ckptlib.errors import CheckpointError, StepExistsError

log = logging.getLogger("ckptlib")


class PreemptionWatcher:
    """Signal handlers that record a preemption request, plus a deadline watchdog."""

    def __init__(
        self,
        signals: Iterable[int],
        deadline: float,
        *,
        failure_exit_code: int = 1,
        on_signal: Callable[[int], None] | None = None,
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        self.signals = tuple(signals)
        self.deadline = float(deadline)
        self.failure_exit_code = failure_exit_code
        self.on_signal = on_signal
        self.requested = False
        self.signum: int | None = None
        self.received_at: float | None = None
        """``time.monotonic()`` when the first signal arrived."""
        self._exit_fn = exit_fn
        self._previous: dict[int, Any] = {}
        self._disarmed = threading.Event()
        self._watchdog: threading.Thread | None = None

    def install(self) -> None:
        """Install the handlers (main thread only; raises ValueError elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("save_on_signal must be called from the main thread")
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        """Restore the previous handlers (main thread) and stop the watchdog."""
        self.disarm()
        if threading.current_thread() is not threading.main_thread():
            return
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def time_left(self) -> float:
        """Seconds until the deadline (the full deadline before any signal)."""
        if self.received_at is None:
            return self.deadline
        return self.deadline - (time.monotonic() - self.received_at)

    def disarm(self) -> None:
        """Stop the watchdog: the process is exiting by itself."""
        self._disarmed.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            self.requested = True
            self.signum = signum
            self.received_at = time.monotonic()
            log.warning(
                "ckptlib: received signal %d; final checkpoint due within %.1fs", signum, self.deadline
            )
            self._watchdog = threading.Thread(
                target=self._watch, name="ckptlib-preempt-watchdog", daemon=True
            )
            self._watchdog.start()
            if self.on_signal is not None:
                self.on_signal(signum)

    def _watch(self) -> None:
        if self._disarmed.wait(max(0.0, self.time_left())):
            return
        log.error(
            "ckptlib: no final checkpoint within the %.1fs deadline; exiting with code %d",
            self.deadline, self.failure_exit_code,
        )
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        self._exit_fn(self.failure_exit_code)


class _Manager(Protocol):
    def wait(self, timeout: float | None = None) -> None: ...
    def save(self, step: int, state: Any, *, metadata: Any = None) -> Any: ...
    def close(self, timeout: float | None = None) -> None: ...


@dataclass
class FinalCheckpoint:
    """The manager's final save on preemption. Main/training thread; every method takes the
    manager (``wait``/``save``/``close``) so that this object holds no reference to it.

    ``busy`` is set by the manager while ``save()`` runs: a signal landing then is remembered
    (``deferred``) and handled by :meth:`after_save` once that call returns, so the handler
    never re-enters the manager.
    """

    watcher: PreemptionWatcher
    state_fn: Callable[[], tuple[int, Any]] | None
    exit_code: int
    busy: bool = False
    deferred: bool = False

    def poll(self, mgr: _Manager, step: int | None, state: Any) -> bool:
        """``maybe_save_on_preemption``: False without a signal, else save and exit."""
        if not self.watcher.requested:
            return False
        if step is None or state is None:
            if self.state_fn is None:
                raise ValueError("pass step and state, or give save_on_signal a state_fn")
            step, state = self.state_fn()
        self.save_and_exit(mgr, step, state)

    def on_signal(self, mgr: _Manager) -> None:
        """The signal handler's callback (``save_in_handler=True``)."""
        if self.busy:
            self.deferred = True
            return
        assert self.state_fn is not None
        self.save_and_exit(mgr, *self.state_fn())

    @staticmethod
    @contextmanager
    def holding(final: FinalCheckpoint | None) -> Iterator[None]:
        """``with FinalCheckpoint.holding(mgr._final):`` around a manager call the handler must not
        re-enter (``restore``): a ``save_in_handler`` signal landing inside is deferred."""
        if final is None:
            yield
            return
        final.busy = True
        try:
            yield
        finally:
            final.busy = False

    def after_restore(self, mgr: _Manager, step: int | None) -> None:
        """The manager's ``restore()`` returned ``step``: a signal deferred during it needs no new
        save when a step was restored (the state is that committed step): close and exit. With
        nothing restored, the deferred final save runs as after a save."""
        if self.deferred and step is not None:
            self.deferred = False
            self.save_and_exit(mgr, step, None)
        self.after_save(mgr)

    def after_save(self, mgr: _Manager) -> None:
        """The manager's ``save()`` returned: run a final save deferred during it."""
        if self.deferred:
            self.deferred = False
            assert self.state_fn is not None
            self.save_and_exit(mgr, *self.state_fn())

    def save_and_exit(self, mgr: _Manager, step: int, state: Any) -> NoReturn:
        """Wait for earlier saves, save ``(step, state)``, close, and raise ``SystemExit``:
        ``exit_code`` once committed, ``failure_exit_code`` if anything failed. Every wait
        gets what is left of the watcher's deadline. ``state`` None: ``step`` is committed
        already (:meth:`after_restore`), nothing is saved."""
        watcher = self.watcher
        code = watcher.failure_exit_code
        try:
            try:
                mgr.wait(max(0.1, watcher.time_left()))
            except CheckpointError as e:  # an earlier save failed: the final one may still work
                log.warning("ckptlib: an earlier save failed: %s", e)
            try:
                if state is not None:
                    mgr.save(step, state).wait(max(0.1, watcher.time_left()))
            except StepExistsError:
                pass  # this step is already committed
            mgr.close(max(0.1, watcher.time_left()))
            code = self.exit_code
            log.warning("ckptlib: final checkpoint of step %d committed; exiting", step)
        except Exception as e:
            log.error("ckptlib: final checkpoint of step %d failed: %s", step, e)
        watcher.disarm()
        raise SystemExit(code)
