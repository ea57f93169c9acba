"""Preemption: turn SIGTERM (or any signal) into a final checkpoint and a clean exit.

Used by ``CheckpointManager.save_on_signal``. Threads:

- :meth:`PreemptionWatcher.install` / :meth:`uninstall` run on the main thread (Python only
  lets the main thread set signal handlers).
- The handler runs on the main thread, between two bytecodes of whatever it was doing. By
  default it only records the request (``requested``, ``signum``, ``received_at``) -- the
  robust pattern: the training loop notices it at a safe point (``mgr.preempted`` or
  ``mgr.maybe_save_on_preemption(...)``), where the state is consistent. An optional
  ``on_signal`` callback runs inside the handler for loops that cannot check a flag.
- A watchdog thread (``ckptlib-preempt-watchdog``), started by the first signal, ends the
  process with ``failure_exit_code`` via ``os._exit`` if it is still alive at the deadline:
  a scheduler's grace period is short, and a hung save must not turn into a SIGKILL with no
  message. :meth:`disarm` stops it once the process is about to exit on its own.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

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
