"""Storage backends. :func:`open_storage` picks one by URL; everything above this package
works through :class:`~ckptlib.backends.base.Storage` and its capability flags only."""

from __future__ import annotations

import os
from typing import Any

from ckptlib.backends.base import Entry, ReadHandle, Storage, WriteStream, join
from ckptlib.backends.retry import deadline_scope

__all__ = [
    "Entry", "ReadHandle", "Storage", "WriteStream", "deadline_scope", "join", "open_storage",
]


def open_storage(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
    """A storage rooted at ``url``: a local path or ``file://`` URL (POSIX), ``s3://bucket/prefix``
    (:class:`~ckptlib.backends.s3.S3Storage`, ``storage_options`` go to s3fs), or any other
    fsspec URL (``memory://``, ...)."""
    url = os.fspath(url)
    if "://" not in url:
        from ckptlib.backends.posix import PosixStorage

        return PosixStorage(url, **(storage_options or {}))
    scheme, rest = url.split("://", 1)
    if scheme in ("file", "local"):
        from ckptlib.backends.posix import PosixStorage

        return PosixStorage(rest or "/", **(storage_options or {}))
    if scheme in ("s3", "s3a"):
        from ckptlib.backends.s3 import S3Storage

        return S3Storage(url, storage_options)
    from ckptlib.backends.fsspec_store import FsspecStorage

    return FsspecStorage(url, storage_options)
