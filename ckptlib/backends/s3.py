"""S3 storage (``s3://bucket/prefix``) over s3fs's aiobotocore client, with retries and deadlines.

Object-store semantics: no rename; whole-object puts are atomic; the manifest is published
with a create-only conditional put (``If-None-Match: *``) when ``supports_conditional_put``
(the default; set the storage option ``ckptlib_conditional_put=False`` for servers without
it, and the commit falls back to put + read-back, see ``ckptlib.engine.commit``).

Threads: every public method blocks the calling ckptlib thread; the requests run as coroutines
on fsspec's I/O event-loop thread, each wrapped by :func:`ckptlib.backends.retry.call_async`
(the retry rules and deadlines are there). Nothing that could block runs on the loop thread.
Writes: :meth:`S3Storage.open_write` returns a multipart upload stream (:mod:`.s3_upload`).
Reads: ranged GETs; a read larger than ``read_split`` is split into ranges fetched in
parallel. Listings go straight to ``ListObjectsV2`` (no listings cache: a stale cache must
never hide or resurrect a step).

Storage options (``ckptlib_*``; the rest go to ``s3fs.S3FileSystem``) and the botocore settings
ckptlib changes: docs/storage.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import errno
import functools
import io
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from fsspec.asyn import sync

from ckptlib.backends.base import Entry, RangeRead, ReadHandle, Storage, WriteStream, join
from ckptlib.backends.retry import (
    TRANSIENT_CODES,
    DeadlineScope,
    FatalStorageError,
    RetryPolicy,
    StorageTimeoutError,
    call_async,
    error_code,
)
from ckptlib.backends.s3_upload import CLEANUP_ATTEMPT, CLEANUP_DEADLINE, S3Write, missing, numbered
from ckptlib.errors import StorageError, require

T = TypeVar("T")

MIN_PART = 5 << 20
DEFAULT_PART = 16 << 20


class _ShortBody(ConnectionError):
    """A GET returned fewer bytes than asked (a cut connection): transient."""


class _PartialDelete(ConnectionError):
    """A DeleteObjects answer refused some keys with a transient code: send it again."""


def _fatal(e: BaseException, what: str) -> BaseException | None:
    """The ckptlib error for a fatal ClientError (``None``: let the retry policy decide)."""
    code, status = error_code(e)
    if code == "NoSuchBucket":
        return FatalStorageError(errno.ENOENT, f"{what}: the bucket does not exist")
    if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
        return FatalStorageError(errno.EACCES, f"{what or 'the root'}: access denied ({code or status}); check the "
                                 "credentials (storage options key/secret, or the AWS_* environment) and that they "
                                 "may read and write this bucket")
    if code in ("InvalidBucketName", "InvalidArgument", "EntityTooSmall", "InvalidPart", "MalformedXML"):
        return FatalStorageError(f"{what}: {code}: {e}")
    return None


def _flag(value: Any) -> bool:
    """A boolean storage option, also from the CLI's ``KEY=VALUE`` strings."""
    if isinstance(value, str):
        if value.strip().lower() in ("0", "false", "no", "off", ""):
            return False
        if value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        raise ValueError(f"not a boolean: {value!r}")
    return bool(value)


OWN_OPTIONS = ("ckptlib_conditional_put", "ckptlib_part_size", "ckptlib_parts_in_flight", "ckptlib_read_split",
               "ckptlib_retry")


def _refuse_unknown(opts: dict[str, Any], fs_class: type) -> None:
    """``S3Storage.__init__``, with ckptlib's own options already taken out: refuse a storage
    option neither ckptlib nor ``s3fs.S3FileSystem`` takes, by name, with the nearest known
    name (a typo would otherwise surface as a ``TypeError`` deep in aiobotocore, or be dropped).
    s3fs passes what it does not know on to its file system base class only when that class
    takes ``**kwargs``, which it does: so only names starting with ``ckptlib_``, or close to a
    known name, are refused; others pass as before."""
    import difflib
    import inspect

    init = fs_class.__init__  # type: ignore[misc]  # the class's own arguments (its metaclass hides them)
    known = [n for n in inspect.signature(init).parameters if n not in ("self", "args", "kwargs")]
    for name in opts:
        if name in known:
            continue
        near = difflib.get_close_matches(name, [*known, *OWN_OPTIONS], n=1, cutoff=0.75)
        if name.startswith("ckptlib_") or near:
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"unknown storage option {name!r} for s3://{hint} (ckptlib's own: "
                             f"{', '.join(OWN_OPTIONS)}; others go to s3fs.S3FileSystem)")


class S3Storage(Storage):
    supports_atomic_rename = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        s3fs = require("s3fs", "s3", "an s3:// URL")  # lazy: the s3 extra is optional

        opts = dict(storage_options or {})
        self.supports_conditional_put = _flag(opts.pop("ckptlib_conditional_put", True))
        self.part_size = max(MIN_PART, int(opts.pop("ckptlib_part_size", DEFAULT_PART)))
        self.parts_in_flight = max(1, int(opts.pop("ckptlib_parts_in_flight", 4)))
        self.read_split = max(1 << 20, int(opts.pop("ckptlib_read_split", DEFAULT_PART)))
        self.policy = RetryPolicy.from_options(opts.pop("ckptlib_retry", None))
        self._deadline = DeadlineScope()
        """``with storage.deadline(seconds):`` bounds every operation inside (a whole save)."""
        self.stats: Counter[str] = Counter()
        """Counts of retries (``retries``) and requests by kind, for tests and benchmarks."""

        rest = url.split("://", 1)[1] if "://" in url else url
        self.bucket, _, prefix = rest.partition("/")
        if not self.bucket:
            raise ValueError(f"no bucket in {url!r}")
        self.prefix = prefix.strip("/")
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")

        config = dict(opts.pop("config_kwargs", None) or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        config.setdefault("connect_timeout", min(10.0, self.policy.attempt_timeout))
        config.setdefault("read_timeout", self.policy.attempt_timeout)
        config.setdefault("max_pool_connections", max(32, 4 * self.parts_in_flight))
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        _refuse_unknown(opts, s3fs.S3FileSystem)
        opts.setdefault("skip_instance_cache", True)
        opts.setdefault("use_listings_cache", False)
        self.fs = s3fs.S3FileSystem(config_kwargs=config, **opts)
        self.loop = self.fs.loop
        self.client = sync(self.loop, self.fs.set_session)

    # ------------------------------------------------------------------ plumbing
    def _key(self, path: str) -> str:
        return join(self.prefix, path) if path else self.prefix

    def _folder_key(self, path: str) -> str:
        """The key prefix of everything under folder ``path`` ("" for the bucket's root)."""
        key = self._key(path)
        return key + "/" if key else ""

    def _submit(
        self, fn: Callable[[], Awaitable[T]], what: str, *, cleanup: bool = False
    ) -> cf.Future[T]:
        policy = self.policy
        if cleanup:
            policy = replace(policy, attempt_timeout=min(policy.attempt_timeout, CLEANUP_ATTEMPT),
                             deadline=min(policy.deadline, CLEANUP_DEADLINE), sleep=None, clock=time.monotonic)
        self.stats[what.split(" ", 1)[0]] += 1
        coro = call_async(
            fn, f"{what} ({self.url})", policy, scope=None if cleanup else self._deadline, stats=self.stats
        )
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _result(self, fut: cf.Future[T], what: str) -> T:
        # call_async bounds itself by its deadline; this outer wait is only a safety net.
        limit = self.policy.deadline + 30.0
        done, _ = cf.wait([fut], timeout=limit)
        if not done:
            fut.cancel()
            raise StorageTimeoutError(errno.ETIMEDOUT, f"{what} ({self.url}): no answer in {limit:.0f}s")
        return fut.result()

    def _run(self, fn: Callable[[], Awaitable[T]], what: str, *, cleanup: bool = False) -> T:
        return self._result(self._submit(fn, what, cleanup=cleanup), what)

    def _request(self, op: str, path: str, what: str, *, body: bytes | None = None, cleanup: bool = False,
                 **kw: Any) -> Any:
        """One client call ``op`` on ``path``'s object, with retries (a fresh ``Body`` per attempt)."""
        key = self._key(path)

        async def go() -> Any:
            extra = {} if body is None else {"Body": io.BytesIO(body)}
            return await getattr(self.client, op)(Bucket=self.bucket, Key=key, **kw, **extra)

        return self._run(self._call(go, path), what, cleanup=cleanup)

    def _call(self, fn: Callable[[], Awaitable[T]], what: str) -> Callable[[], Awaitable[T]]:
        """Wrap one request so fatal S3 answers become ckptlib errors inside the retry loop."""

        async def go() -> T:
            try:
                return await fn()
            except Exception as e:
                fatal = _fatal(e, what)
                if fatal is not None:
                    raise fatal from e
                if missing(e):
                    raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{what}") from None
                raise

        return go

    # ------------------------------------------------------------------ writing
    def open_write(self, path: str) -> WriteStream:
        return S3Write(self, path)

    def put_atomic(self, path: str, data: bytes) -> None:
        self._request("put_object", path, f"put {path}", body=bytes(data))

    def put_if_absent(self, path: str, data: bytes) -> None:
        if not self.supports_conditional_put:
            super().put_if_absent(path, data)
        key = self._key(path)
        body = bytes(data)

        async def put(tries: int) -> Any:
            try:
                return await self.client.put_object(
                    Bucket=self.bucket, Key=key, Body=io.BytesIO(body), IfNoneMatch="*"
                )
            except Exception as e:
                code, status = error_code(e)
                if status == 412 or code == "PreconditionFailed":
                    if tries > 1 and await self._same_bytes(key, body):
                        return None  # our own earlier attempt landed; its answer was lost
                    raise FileExistsError(errno.EEXIST, "already exists", f"{self.url}/{path}") from None
                raise

        self._run(self._call(numbered(put), path), f"create {path}")

    async def _same_bytes(self, key: str, body: bytes) -> bool:
        """Whether ``key`` holds ``body`` (:meth:`put_if_absent`'s retry, on the loop thread).
        Only a missing object is an answer (False); any other error, a transient one included,
        propagates, so the create is retried: a GET that fails must never turn a create whose
        first attempt landed into "someone else created it"."""
        try:
            return await self._get(key) == body
        except Exception as e:
            if missing(e):
                return False
            raise

    def makedirs(self, path: str) -> None:
        """No folders on S3; for the root, check that the bucket is there (fatal if not)."""
        if path:
            return

        async def head() -> Any:
            try:
                return await self.client.head_bucket(Bucket=self.bucket)
            except Exception as e:
                code, status = error_code(e)
                if status == 404 or code in ("NoSuchBucket", "404"):
                    raise FatalStorageError(errno.ENOENT, f"bucket {self.bucket!r} does not exist") from None
                raise

        self._run(self._call(head, f"bucket {self.bucket}"), "check bucket")

    # ------------------------------------------------------------------ reading
    def open_read(self, path: str) -> ReadHandle:
        size = self.size(path)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{path}")
        return RangeRead(self, path, size)

    def read(self, path: str) -> bytes:
        key = self._key(path)
        return self._run(self._call(lambda: self._get(key), path), f"get {path}")

    async def _get(self, key: str, **kw: Any) -> bytes:
        """One GET's body; one shorter than its ``ContentLength`` (a cut connection) is transient."""
        resp = await self.client.get_object(Bucket=self.bucket, Key=key, **kw)
        async with resp["Body"] as stream:
            data = await stream.read()
        if len(data) != int(resp["ContentLength"]):
            raise _ShortBody(f"got {len(data)} of {resp['ContentLength']} bytes")
        return data

    def read_small(self, path: str, limit: int) -> tuple[bytes | None, int]:
        """One GET of at most ``limit + 1`` bytes; the object's size comes from its
        ``Content-Range`` (the body of an object over ``limit`` is closed unread)."""
        key = self._key(path)

        async def get() -> tuple[bytes | None, int]:
            try:
                resp = await self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{limit}")
            except Exception as e:
                if error_code(e)[0] != "InvalidRange":
                    raise
                data = await self._get(key)  # an empty object: no byte 0 to range over
                return data, len(data)
            span = str(resp.get("ContentRange") or "")
            total = int(span.rpartition("/")[2]) if span.rpartition("/")[2].isdigit() else int(resp["ContentLength"])
            async with resp["Body"] as stream:
                if total > limit:
                    return None, total
                data = await stream.read()
            if len(data) != int(resp["ContentLength"]) or len(data) != total:
                raise _ShortBody(f"got {len(data)} of {total} bytes")
            return data, total

        return self._run(self._call(get, path), f"get {path}")

    def _read_range(self, path: str, start: int, out: memoryview) -> None:
        key = self._key(path)
        n = len(out)
        step = self.read_split
        ranges = [(a, min(a + step, n)) for a in range(0, n, step)]

        def one(a: int, b: int) -> Callable[[], Awaitable[None]]:
            async def get() -> None:
                data = await self._get(key, Range=f"bytes={start + a}-{start + b - 1}")
                if len(data) != b - a:
                    raise _ShortBody(f"got {len(data)} of {b - a} bytes")
                out[a:b] = data

            return self._call(get, path)

        futs = [self._submit(one(a, b), f"get {path} [{start + a}, {start + b})") for a, b in ranges]
        try:
            for f in futs:
                self._result(f, f"get {path}")
        except BaseException:
            for f in futs:
                f.cancel()
            cf.wait(futs, timeout=CLEANUP_DEADLINE)  # nothing may write into ``out`` after we return
            raise

    def _head(self, path: str) -> dict[str, Any] | None:
        """HEAD of one object, or None if there is none."""
        try:
            return self._request("head_object", path, f"head {path}")
        except FileNotFoundError:
            return None

    def size(self, path: str) -> int | None:
        head = self._head(path)
        return None if head is None else int(head["ContentLength"])

    async def _list(self, prefix: str, delimiter: str | None, limit: int | None = None) -> list[dict[str, Any]]:
        """Raw ListObjectsV2 pages' ``Contents`` and ``CommonPrefixes`` under ``prefix``."""
        out: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kw["Delimiter"] = delimiter
            if token:
                kw["ContinuationToken"] = token
                self.stats["list"] += 1  # every page is a request: counted like the first
            if limit:
                kw["MaxKeys"] = limit
            resp = await self.client.list_objects_v2(**kw)
            out.extend({"Key": c["Prefix"], "dir": True} for c in resp.get("CommonPrefixes", []))
            out.extend({**c, "dir": False} for c in resp.get("Contents", []))
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token or (limit and len(out) >= limit):
                return out

    def _list_sync(self, path: str, delimiter: str | None, limit: int | None = None) -> list[dict[str, Any]]:
        prefix = self._folder_key(path)
        return self._run(self._call(lambda: self._list(prefix, delimiter, limit), path or "/"), f"list {path or '/'}")

    def file_sizes(self, path: str) -> dict[str, int] | None:
        """One ListObjectsV2 of folder ``path`` (a page per 1,000 objects): every object's size
        directly under it; sub-folders are left out."""
        cut = len(self._folder_key(path))
        return {it["Key"][cut:]: int(it["Size"]) for it in self._list_sync(path, "/")
                if not it["dir"] and it["Key"][cut:]}

    def listdir(self, path: str = "") -> list[Entry]:
        """Entries under ``path``. A folder is listed only if some object is under it: servers
        such as SeaweedFS keep empty folder entries after their objects are deleted, and a
        deleted step must not come back as an empty "incomplete" one."""
        return self._listdir(path, check=True)

    def listdir_unchecked(self, path: str = "") -> list[Entry]:
        """One listing (a page per 1,000 entries): no request per folder."""
        return self._listdir(path, check=False)

    def _listdir(self, path: str, check: bool) -> list[Entry]:
        prefix = self._folder_key(path)

        async def go() -> list[dict[str, Any]]:
            items = await self._list(prefix, "/")
            dirs = [it for it in items if it["dir"]]
            if dirs and check:
                sem = asyncio.Semaphore(16)

                async def probe(it: dict[str, Any]) -> bool:
                    async with sem:
                        self.stats["list"] += 1  # one request per folder: counted like every other
                        return bool(await self._list(it["Key"], None, 1))

                alive = await asyncio.gather(*(probe(it) for it in dirs))
                dead = {it["Key"] for it, ok in zip(dirs, alive, strict=True) if not ok}
                items = [it for it in items if it["Key"] not in dead]
            return items

        items = self._run(self._call(go, path or "/"), f"list {path or '/'}")
        cut = len(prefix)
        out: dict[str, Entry] = {}
        for it in items:
            name = it["Key"][cut:].rstrip("/")
            if not name:
                continue  # a folder-marker object for ``path`` itself
            out.setdefault(name, Entry(name, it["dir"]))
        if not out:
            if not path:
                self.makedirs("")  # an empty root is fine; a missing bucket is not
                return []
            raise FileNotFoundError(errno.ENOENT, "no such folder", f"{self.url}/{path}")
        return list(out.values())

    def tree_modified(self, path: str) -> float | None:
        items = self._list_sync(path, None)
        times = [it["LastModified"].timestamp() for it in items if not it["dir"]]
        return max(times, default=None)

    def exists(self, path: str = "") -> bool:
        if not path:
            try:
                self.makedirs("")
            except FatalStorageError:
                return False
            return True
        return self.size(path) is not None or bool(self._list_sync(path, None, 1))

    # ------------------------------------------------------------------ deleting
    def delete(self, path: str) -> None:
        try:
            self._request("delete_object", path, f"delete {path}")
        except FileNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        if not path:
            raise ValueError("refusing to delete the storage root")
        for key, upload_id, _ in self.list_uploads(path):
            self.abort_upload(key, upload_id)
        keys = [it["Key"] for it in self._list_sync(path, None) if not it["dir"]]
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            errors = self._run(self._call(functools.partial(self._delete_batch, batch), path), f"delete {path}/")
            if errors:
                raise StorageError(f"delete {self.url}/{path}: {len(errors)} object(s) not deleted: {errors[0]}")

    async def _delete_batch(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """One DeleteObjects request (:meth:`delete_tree`, on the loop thread); returns the
        per-key errors that are final. A 200 answer may still refuse keys with a throttling or
        server error (``SlowDown``, ``InternalError``): those raise a transient error, so the
        retry policy sends the batch again (deleting a deleted key is a no-op)."""
        resp = await self.client.delete_objects(Bucket=self.bucket, Delete=batch)
        errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        again = [e for e in errors if e.get("Code") in TRANSIENT_CODES]
        if again:
            raise _PartialDelete(f"{len(again)} object(s) not deleted yet: {again[0]}")
        return errors

    # ------------------------------------------------------------------ multipart uploads
    def list_uploads(self, path: str = "") -> list[tuple[str, str, float]]:
        prefix = self._folder_key(path)
        cut = len(self.prefix) + 1 if self.prefix else 0

        async def go() -> list[tuple[str, str, float]]:
            out = []
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            while True:
                resp = await self.client.list_multipart_uploads(**kw)
                for u in resp.get("Uploads", []) or []:
                    out.append((u["Key"][cut:], u["UploadId"], u["Initiated"].timestamp()))
                if not resp.get("IsTruncated"):
                    return out
                kw["KeyMarker"] = resp.get("NextKeyMarker", "")
                kw["UploadIdMarker"] = resp.get("NextUploadIdMarker", "")

        return self._run(self._call(go, path or "/"), f"list uploads {path or '/'}")

    def abort_upload(self, path: str, upload_id: str) -> None:
        try:
            self._request("abort_multipart_upload", path, f"abort upload of {path}", cleanup=True, UploadId=upload_id)
        except FileNotFoundError:
            pass

    def deadline(self, seconds: float) -> contextlib.AbstractContextManager[Any]:
        return self._deadline(seconds)

    def close(self) -> None:
        """Nothing to release eagerly: s3fs closes its client when the storage is collected."""
