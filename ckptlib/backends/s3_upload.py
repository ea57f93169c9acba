"""The multipart upload stream of :mod:`ckptlib.backends.s3`, split off by concern.

:class:`S3Write` buffers ``part_size`` bytes, then uploads parts in parallel (at most
``parts_in_flight``); ``close()`` completes the upload, ``abort()`` (or any failure) aborts it.
One writer thread per stream; requests go through the storage's retrying ``_request``/``_submit``.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ckptlib.backends.base import WriteStream
from ckptlib.backends.retry import error_code
from ckptlib.errors import StorageError

if TYPE_CHECKING:
    from ckptlib.backends.s3 import S3Storage

log = logging.getLogger("ckptlib.storage")

T = TypeVar("T")

CLEANUP_DEADLINE = 10.0
"""Abort/cleanup calls after a failure get their own short budget (the save's may be spent);
what they cannot remove in time is left to ``retire.clean_debris``."""
CLEANUP_ATTEMPT = 5.0


def missing(e: BaseException) -> bool:
    code, status = error_code(e)
    return status == 404 or code in ("404", "NoSuchKey", "NotFound", "NoSuchUpload")


def numbered(fn: Callable[[int], Awaitable[T]]) -> Callable[[], Awaitable[T]]:
    """``fn(attempt number)`` as a request to retry: an attempt after the first one must check
    whether an earlier one landed and only its answer was lost."""
    count = itertools.count(1)
    return lambda: fn(next(count))


class S3Write(WriteStream):
    """A payload object being written (see the module docstring). One writer thread."""

    def __init__(self, store: S3Storage, path: str) -> None:
        self.store = store
        self.path = path
        self.key = store._key(path)
        self.buf = bytearray()
        self.size = 0
        self.upload_id: str | None = None
        self.parts: dict[int, str] = {}
        self.inflight: deque[tuple[int, cf.Future[Any]]] = deque()
        self.next_part = 1
        self.state = "open"
        self.put_tried = False

    def _check(self) -> None:
        if self.state != "open":
            raise StorageError(f"write to {self.store.url}/{self.path} after it was {self.state}")

    def write(self, data) -> None:
        self._check()
        mv = memoryview(data).cast("B")
        part = self.store.part_size
        try:
            while mv:
                take = min(len(mv), part - len(self.buf))
                self.buf += mv[:take]
                mv = mv[take:]
                self.size += take
                if len(self.buf) >= part:
                    self._send_part()
        except BaseException:
            self.state = "failed"
            raise

    def _send_part(self) -> None:
        s = self.store
        if self.upload_id is None:
            self.upload_id = s._request("create_multipart_upload", self.path, f"start upload of {self.path}")["UploadId"]
        body, self.buf = bytes(self.buf), bytearray()
        num = self.next_part
        self.next_part += 1
        upload_id = self.upload_id

        async def put() -> Any:
            return await s.client.upload_part(
                Bucket=s.bucket, Key=self.key, UploadId=upload_id, PartNumber=num, Body=io.BytesIO(body)
            )

        self.inflight.append((num, s._submit(s._call(put, self.path), f"upload part {num} of {self.path}")))
        while len(self.inflight) >= s.parts_in_flight:
            self._wait_one()

    def _wait_one(self) -> None:
        num, fut = self.inflight.popleft()
        resp = self.store._result(fut, f"upload part {num} of {self.path}")
        self.parts[num] = resp["ETag"]

    def close(self) -> None:
        if self.state == "closed":
            return
        self._check()
        s = self.store
        try:
            if self.upload_id is None:
                self.put_tried = True
                s._request("put_object", self.path, f"put {self.path}", body=bytes(self.buf))
            else:
                if self.buf:
                    self._send_part()
                while self.inflight:
                    self._wait_one()
                self._complete()
        except BaseException:
            self.state = "failed"
            raise
        self.buf = bytearray()
        self.state = "closed"

    def _complete(self) -> None:
        s = self.store
        parts = [{"PartNumber": n, "ETag": self.parts[n]} for n in sorted(self.parts)]

        async def complete(tries: int) -> Any:
            try:
                return await s.client.complete_multipart_upload(
                    Bucket=s.bucket, Key=self.key, UploadId=self.upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except Exception as e:
                # A retry after a completion whose response was lost finds no upload: the
                # object is there if its size is ours.
                if tries > 1 and missing(e):
                    head = await s.client.head_object(Bucket=s.bucket, Key=self.key)
                    if int(head["ContentLength"]) == self.size:
                        return head
                raise

        s._run(numbered(complete), f"complete upload of {self.path}")

    def abort(self) -> None:
        if self.state in ("closed", "aborted"):
            return
        self.state = "aborted"
        s = self.store
        for _, fut in self.inflight:
            fut.cancel()
        for _, fut in self.inflight:
            try:
                fut.result(timeout=CLEANUP_DEADLINE)
            except BaseException:  # cancelled or failed parts are expected here
                pass
        self.inflight.clear()
        self.buf = bytearray()
        try:
            if self.upload_id is not None:
                s.abort_upload(self.path, self.upload_id)
            elif self.put_tried:  # a put whose answer was lost may still have landed
                s._run(
                    lambda: s.client.delete_object(Bucket=s.bucket, Key=self.key),
                    f"delete partial {self.path}", cleanup=True,
                )
        except Exception as e:
            log.warning("ckptlib: could not clean up %s/%s (a later cleanup will): %s", s.url, self.path, e)

