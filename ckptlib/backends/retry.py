"""Retries with deadlines for storage operations (tenacity underneath); the rules, the policy's
defaults and the whole-save deadline are in docs/storage.md, "Retries and deadlines".

Who calls what: storage backends wrap every request in :func:`call_async` (object stores, on
fsspec's I/O event-loop thread) or :func:`call_sync` (POSIX visibility retries, on whichever
ckptlib thread does the read). Nothing above ``ckptlib.backends`` retries on its own.
:func:`is_transient` alone decides what is retried; each attempt is bounded by
``RetryPolicy.attempt_timeout``, each operation by ``RetryPolicy.deadline`` and by the earliest
active :class:`DeadlineScope` of its storage (:func:`deadline_scope`). Out of retries:
:class:`~ckptlib.errors.StorageError`; out of time: :class:`StorageTimeoutError`. Sleep and
clock are injectable (``RetryPolicy.sleep``/``clock``) so policy tests never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import tenacity

from ckptlib.errors import CheckpointError, FatalStorageError, StorageError, StorageTimeoutError

log = logging.getLogger("ckptlib.storage")

T = TypeVar("T")

_totals: Counter[str] = Counter()
_totals_lock = threading.Lock()


def _count(key: str) -> None:
    with _totals_lock:
        _totals[key] += 1


def stats() -> dict[str, int]:
    """Process-wide totals: ``retries`` (attempts that failed transiently and were tried again)
    and ``giveups`` (operations that still failed transiently when their attempts or deadline
    ran out). Any thread; a snapshot copy.

    Chaos tests and benchmarks read it at the end of a job; backends count through
    :func:`call_async`/:func:`call_sync`, so every storage instance is included."""
    with _totals_lock:
        return {"retries": _totals["retries"], "giveups": _totals["giveups"]}


TRANSIENT_CODES = frozenset({
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeoutException",
    "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
    "BandwidthLimitExceeded", "OperationAborted", "ConditionalRequestConflict",
    "500", "502", "503", "504", "429", "InternalServerError", "BadGateway", "GatewayTimeout",
})
"""S3 error codes worth another attempt (ConditionalRequestConflict: a concurrent conditional
write on the same key is still in flight; the retry then gets a definite answer)."""


def error_code(exc: BaseException) -> tuple[str, int]:
    """``(code, http status)`` of a botocore ``ClientError``; ``("", 0)`` for anything else."""
    resp = getattr(exc, "response", None)
    if not isinstance(resp, dict):
        return "", 0
    code = str(resp.get("Error", {}).get("Code", ""))
    status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth another attempt (see the module docstring for the rules)."""
    if isinstance(exc, FatalStorageError | FileNotFoundError | FileExistsError | PermissionError):
        return False
    code, status = error_code(exc)
    if code or status:
        return code in TRANSIENT_CODES or status in (429, 500, 502, 503, 504)
    if _tls_misconfigured(exc):
        return False
    if isinstance(exc, TimeoutError | ConnectionError | asyncio.IncompleteReadError):
        return True
    name = type(exc).__name__
    for cls in type(exc).__mro__:
        if cls.__module__.startswith(("aiohttp", "botocore", "urllib3")) and any(
            word in cls.__name__
            for word in ("Connection", "Timeout", "Disconnected", "Payload", "Streaming", "ReadError")
        ):
            return True
    if name in ("ServerDisconnectedError", "ClientPayloadError", "ClientOSError", "HTTPClientError"):
        return True
    return isinstance(exc, OSError) and exc.errno in (
        errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
        errno.EHOSTUNREACH, errno.ENETUNREACH,
    )


TLS_SETUP_ERRORS = ("wrong version number", "certificate verify failed", "unknown protocol",
                    "tlsv1 alert protocol version")
"""TLS failures that another attempt cannot mend (an ``https://`` endpoint that speaks plain HTTP,
a certificate the client does not trust), found in the error or its causes."""


def _tls_misconfigured(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(5):  # the error and the few causes botocore/aiohttp chain under it
        if seen is None:
            return False
        if any(w in str(seen).lower() for w in TLS_SETUP_ERRORS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How hard one storage operation tries. All times in seconds."""

    attempts: int = 10
    """At most this many attempts per operation (the first one included)."""
    attempt_timeout: float = 60.0
    """One attempt (one request and its response) at most; a stalled request is abandoned."""
    deadline: float = 300.0
    """One operation, every attempt and backoff sleep included."""
    backoff: float = 0.1
    """First backoff ceiling; it doubles per attempt (full jitter: a random sleep below it)."""
    backoff_max: float = 5.0
    """Largest backoff ceiling."""
    sleep: Callable[[float], Any] | None = field(default=None, compare=False)
    """Injectable sleep (sync callers); ``None`` is ``time.sleep`` / ``asyncio.sleep``."""
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)
    """Injectable monotonic clock."""

    @classmethod
    def from_options(cls, options: dict[str, Any] | RetryPolicy | None) -> RetryPolicy:
        if options is None:
            return cls()
        if isinstance(options, RetryPolicy):
            return options
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown retry option(s): {sorted(unknown)}")
        return replace(cls(), **options)


class DeadlineScope:
    """Deadlines that bound every operation of one storage while a scope is active.

    ``with scope(seconds): ...`` adds a deadline; operations started by *any* thread while it is
    active must finish by the earliest active deadline. Thread-safe. A storage shared by a
    background save and a foreground scan bounds both by the save's deadline, which is never
    wrong (the save's deadline is the longest anyone may wait on this storage anyway).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[int, float] = {}
        self._ids = itertools.count()

    @contextlib.contextmanager
    def __call__(self, seconds: float | None = None, *, at: float | None = None) -> Iterator[float]:
        if (seconds is None) == (at is None):
            raise ValueError("give exactly one of seconds or at")
        end = at if at is not None else time.monotonic() + float(seconds)  # type: ignore[arg-type]
        key = next(self._ids)
        with self._lock:
            self._active[key] = end
        try:
            yield end
        finally:
            with self._lock:
                self._active.pop(key, None)

    def current(self) -> float | None:
        with self._lock:
            return min(self._active.values(), default=None)


def deadline_scope(storage: Any, seconds: float) -> contextlib.AbstractContextManager[Any]:
    """``with deadline_scope(storage, seconds):`` bounds every operation of ``storage`` inside
    the block (a no-op context for backends without deadlines)."""
    return storage.deadline(seconds)  # Storage.deadline: a null context unless overridden


def _end(policy: RetryPolicy, scope: DeadlineScope | None, now: float) -> tuple[float, bool]:
    """The operation's deadline, and whether it comes from the enclosing scope."""
    end = now + policy.deadline
    outer = scope.current() if scope is not None else None
    if outer is not None and outer < end:
        return outer, True
    return end, False


class _Stop(tenacity.stop.stop_base):
    def __init__(self, policy: RetryPolicy, end: float) -> None:
        self.policy = policy
        self.end = end

        self.by_deadline = False
        """Set when retrying stopped because the next sleep would pass the deadline."""

    def __call__(self, rs: tenacity.RetryCallState) -> bool:
        if rs.attempt_number >= self.policy.attempts:
            return True
        self.by_deadline = self.policy.clock() + (rs.upcoming_sleep or 0.0) >= self.end
        return self.by_deadline


def _retrying(
    policy: RetryPolicy, end: float, transient: Callable[[BaseException], bool], stats: Counter[str] | None,
    log_what: str | None = None,
) -> tuple[_Stop, dict[str, Any]]:
    """tenacity's arguments for :func:`call_async` and :func:`call_sync`: each retry is counted
    (and logged, given ``log_what``); the stop reports whether the deadline ended the retries."""

    def before_sleep(rs: tenacity.RetryCallState) -> None:
        _count("retries")
        if stats is not None:
            stats["retries"] += 1
        if log_what is not None:
            exc = rs.outcome.exception() if rs.outcome else None
            log.info("ckptlib: %s: attempt %d failed (%r); retrying", log_what, rs.attempt_number, exc)

    stop = _Stop(policy, end)
    wait = tenacity.wait_random_exponential(multiplier=policy.backoff, max=policy.backoff_max)
    return stop, {"stop": stop, "wait": wait, "retry": tenacity.retry_if_exception(transient), "reraise": True,
                  "before_sleep": before_sleep}


def _final_error(
    what: str, exc: BaseException, attempts: int, elapsed: float, end_hit: bool, scoped: bool
) -> BaseException:
    if isinstance(exc, FileNotFoundError | FileExistsError | PermissionError) or (
        isinstance(exc, CheckpointError) and not is_transient(exc)
    ):
        return exc  # already typed (a missing object, a corrupt file, a fatal storage error)
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if end_hit or isinstance(exc, TimeoutError):
        whose = "the save's deadline" if scoped else "its deadline"
        return StorageTimeoutError(
            errno.ETIMEDOUT,
            f"{what}: gave up after {attempts} attempt(s) in {elapsed:.1f}s, at {whose}; last error: {detail}",
        )
    if not is_transient(exc):
        return FatalStorageError(f"{what}: {detail} (not retried)")
    return StorageError(f"{what}: failed after {attempts} attempt(s) in {elapsed:.1f}s; last error: {detail}")


async def call_async(
    fn: Callable[[], Awaitable[T]],
    what: str,
    policy: RetryPolicy,
    *,
    scope: DeadlineScope | None = None,
    stats: Counter[str] | None = None,
    transient: Callable[[BaseException], bool] = is_transient,
) -> T:
    """Run ``await fn()`` with retries; each attempt gets a fresh coroutine from ``fn``.

    Runs on the event loop thread. Raises the fatal error as is (``FileNotFoundError``,
    ``FileExistsError``) or a translated ``StorageError``/``StorageTimeoutError``.
    """
    start = policy.clock()
    end, scoped = _end(policy, scope, start)
    attempts = 0

    async def attempt() -> T:
        nonlocal attempts
        attempts += 1
        left = end - policy.clock()
        if left <= 0:
            raise StorageTimeoutError(errno.ETIMEDOUT, "no time left")
        return await asyncio.wait_for(fn(), min(policy.attempt_timeout, left))

    stop, kw = _retrying(policy, end, transient, stats, what)
    if policy.sleep is not None:
        kw["sleep"] = policy.sleep
    try:
        return await tenacity.AsyncRetrying(**kw)(attempt)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        now = policy.clock()
        if transient(e):
            _count("giveups")
        raise _final_error(what, e, attempts, now - start, now >= end or stop.by_deadline, scoped) from e


def call_sync(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy,
    *,
    scope: DeadlineScope | None = None,
    transient: Callable[[BaseException], bool] = is_transient,
    stats: Counter[str] | None = None,
) -> T:
    """Run ``fn()`` with retries on the calling thread (no per-attempt timeout: ``fn`` must
    bound itself). Errors that were not retried, and the caller's own retried conditions
    (``transient`` beyond :func:`is_transient`, e.g. POSIX visibility), are raised as they
    are; exhausted transient errors are translated as in :func:`call_async`."""
    start = policy.clock()
    end, scoped = _end(policy, scope, start)
    attempts = 0

    def attempt() -> T:
        nonlocal attempts
        attempts += 1
        return fn()

    stop, kw = _retrying(policy, end, transient, stats)
    try:
        return tenacity.Retrying(**kw, sleep=policy.sleep or time.sleep)(attempt)
    except (FileNotFoundError, FileExistsError, CheckpointError):
        raise
    except Exception as e:
        if not transient(e) or not is_transient(e):
            raise  # not retried, or the caller's own condition (e.g. a short file): it decides
        _count("giveups")
        now = policy.clock()
        raise _final_error(what, e, attempts, now - start, now >= end or stop.by_deadline, scoped) from e
