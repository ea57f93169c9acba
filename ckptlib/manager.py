"""CheckpointManager: schedule saves, restore the newest consistent step, apply retention.

Threads: ``save()`` runs on the training thread. With ``async_save=True`` it flattens the
state and snapshots it into reused buffers (:class:`~ckptlib.engine.snapshot.Stager`), then
hands the persist + commit + retention to one background thread and returns a
:class:`SaveHandle`. Only one save is in flight at a time: a new ``save()`` first waits for
the previous one (``in_flight="wait"``) or skips itself with a warning (``"skip"``).

Errors: a background failure is raised exactly once, on the caller's thread, by the first of
``handle.wait()``, the next ``save()``, ``wait()`` or ``close()`` to see it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import warnings
import weakref
from typing import Any

from ckptlib.backends import Storage, open_storage
from ckptlib.dist.coordinator import Coordinator, default_coordinator
from ckptlib.engine import load as load_flow
from ckptlib.engine import retire
from ckptlib.engine import save as save_flow
from ckptlib.engine.scan import StepInfo, scan
from ckptlib.engine.snapshot import Stager
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitTimeoutError,
    CorruptCheckpointError,
)
from ckptlib.format import layout
from ckptlib.plan import retention

log = logging.getLogger("ckptlib")


class SaveHandle:
    """The result of ``CheckpointManager.save``: poll with :meth:`done`, block with :meth:`wait`."""

    def __init__(self, step: int, timeout: float) -> None:
        self.step = step
        self.skipped = False
        self._timeout = timeout
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._raised = False

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()

    def done(self) -> bool:
        """True once the save committed or failed (or was skipped)."""
        return self._event.is_set()

    def _take_error(self) -> BaseException | None:
        with self._lock:
            if self._error is not None and not self._raised:
                self._raised = True
                return self._error
            return None

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed; raise the failure if this is the first to see it.

        ``timeout=None`` waits up to the save's own deadline (plus a margin).
        """
        limit = self._timeout + 30.0 if timeout is None else timeout
        if not self._event.wait(limit):
            raise CommitTimeoutError(f"save of step {self.step} still running after {limit:.0f}s")
        err = self._take_error()
        if err is not None:
            raise err


class CheckpointManager:
    """Save steps under one root folder and resume from the newest consistent one."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = True,
        compression: str | None = None,
        storage_options: dict[str, Any] | None = None,
        in_flight: str = "wait",
        save_timeout: float = 600.0,
        coordinator: Coordinator | None = None,
    ) -> None:
        if in_flight not in ("wait", "skip"):
            raise ValueError("in_flight must be 'wait' or 'skip'")
        retention.decide([], keep_last, keep_every)  # validates the policy
        self.url = os.fspath(url)
        self.storage: Storage = open_storage(self.url, storage_options)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.compression = compression
        self.in_flight = in_flight
        self.save_timeout = save_timeout
        self.coordinator = coordinator or default_coordinator()
        self._stager = Stager()
        self._handles: list[SaveHandle] = []
        self._thread: threading.Thread | None = None
        self._active_ids: set[str] = set()
        self._closed = False
        self._root_ready = False
        self._finalizer = weakref.finalize(self, _drain, self._handles)
        atexit.register(self._finalizer)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Any, *, metadata: Any = None) -> SaveHandle:
        """Save ``state`` as ``step``. Async by default: returns once the snapshot is taken."""
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._raise_pending()
        handle = SaveHandle(step, self.save_timeout)
        if self._thread is not None and self._thread.is_alive():
            if self.in_flight == "skip":
                warnings.warn(
                    f"ckptlib: skipping save of step {step}: the previous save is still persisting",
                    RuntimeWarning,
                    stacklevel=2,
                )
                handle.skipped = True
                handle._finish()
                return handle
            self._join_thread()
            self._raise_pending()
        flat = save_flow.prepare(state, self.coordinator.rank)
        self._ensure_root()
        save_id = save_flow.new_save_id()
        created = time.time()
        if not self.async_save:
            self._handles.append(handle)
            self._persist(handle, flat, step, metadata, save_id, created)
            self._raise_pending()
            return handle
        flat = self._stager.snapshot(flat)
        self._handles.append(handle)
        self._active_ids.add(save_id)
        self._thread = threading.Thread(
            target=self._persist,
            args=(handle, flat, step, metadata, save_id, created),
            name=f"ckptlib-save-{step}",
            daemon=True,
        )
        self._thread.start()
        return handle

    def _ensure_root(self) -> None:
        if not self._root_ready:
            self.storage.makedirs("")
            self._root_ready = True

    def _persist(self, handle: SaveHandle, flat, step: int, metadata: Any, save_id: str, created: float) -> None:
        error: BaseException | None = None
        try:
            opts = save_flow.SaveOptions(compression=self.compression, timeout=self.save_timeout)
            save_flow.persist(
                self.storage, layout.step_dir(step), flat, step=step, metadata=metadata,
                options=opts, coordinator=self.coordinator, save_id=save_id, created=created,
            )
            if self.coordinator.is_coordinator:
                self._after_commit(save_id)
        except Exception as e:
            error = e
        finally:
            self._active_ids.discard(save_id)
            handle._finish(error)

    def _after_commit(self, save_id: str) -> None:
        """Retention and cleanup; their failures are logged, never fail the committed save."""
        try:
            retire.clean_debris(self.storage, self._active_ids | {save_id})
            if self.keep_last is not None:
                committed = [i.step for i in scan(self.storage) if i.status == "committed"]
                for d in retention.decide(committed, self.keep_last, self.keep_every):
                    if not d.keep:
                        log.info("ckptlib: deleting step %d (%s)", d.step, d.why)
                        retire.delete_step(self.storage, layout.step_dir(d.step))
        except Exception as e:
            log.warning("ckptlib: retention/cleanup failed (will retry after the next save): %s", e)

    def _join_thread(self, timeout: float | None = None) -> None:
        t = self._thread
        if t is not None:
            limit = self.save_timeout + 30.0 if timeout is None else timeout
            t.join(limit)
            if t.is_alive():
                raise CommitTimeoutError(f"background save still running after {limit:.0f}s")
            self._thread = None

    def _raise_pending(self) -> None:
        for h in list(self._handles):
            if h.done():
                self._handles.remove(h)
                err = h._take_error()
                if err is not None:
                    raise err

    def wait(self, timeout: float | None = None) -> None:
        """Wait for all pending saves; raise the first failure not yet raised."""
        self._join_thread(timeout)
        self._raise_pending()

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending saves, then release staging memory. Also via ``with``."""
        if self._closed:
            return
        try:
            self.wait(timeout)
        finally:
            self._closed = True
            self._stager.release()
            self._finalizer.detach()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ inspecting
    def steps(self, *, deep: bool = False) -> list[StepInfo]:
        """Every step under the root, oldest first, with status and reason."""
        try:
            infos = scan(self.storage, deep=deep)
        except CheckpointNotFoundError:
            return []
        return sorted(infos, key=lambda i: (i.step, i.status == "committed"))

    def latest_step(self) -> int | None:
        """The newest committed step (quick check: manifest and sizes), or None."""
        for info in reversed(self.steps()):
            if info.status == "committed":
                return info.step
        return None

    # ------------------------------------------------------------------ restoring
    def restore(self, state: Any, *, step: int | None = None, verify: bool = True) -> int | None:
        """Load the newest consistent step into ``state`` in place; return it, or None.

        Checksums are verified while loading; a step that turns out corrupt is skipped (logged)
        and the next older committed step is tried. Returns None only when no step was ever
        committed; raises ``CorruptCheckpointError`` if steps exist but none is usable.
        """
        self.wait()
        infos = self.steps()
        if step is not None:
            infos = [i for i in infos if i.step == step]
            if not infos:
                raise CheckpointNotFoundError(f"no step {step} under {self.url}")
        problems = []
        for info in reversed(infos):
            if info.status != "committed":
                if info.status == "corrupt":
                    problems.append(f"step {info.step}: {info.reason}")
                log.warning("ckptlib: skipping step %d (%s): %s", info.step, info.status, info.reason)
                continue
            try:
                load_flow.load_checkpoint(self.storage, info.path, state, verify=verify, manifest=info.manifest)
            except CorruptCheckpointError as e:
                problems.append(f"step {info.step}: {e}")
                log.warning("ckptlib: step %d is corrupt, trying an older one: %s", info.step, e)
                continue
            log.info("ckptlib: restored step %d from %s", info.step, self.url)
            return info.step
        if problems:
            raise CorruptCheckpointError(
                "no usable checkpoint under " + self.url + ": " + "; ".join(problems)
            )
        return None


def _drain(handles: list[SaveHandle]) -> None:
    """At interpreter exit: give an in-flight save the chance to commit (bounded)."""
    for h in list(handles):
        h._event.wait(h._timeout)
