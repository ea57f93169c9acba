"""Storage backends. :func:`open_storage` picks one by URL; everything above this package
works through :class:`~ckptlib.backends.base.Storage` and its capability flags only."""

from __future__ import annotations

import difflib
import os
import re
from typing import Any

from ckptlib.backends.base import Entry, ReadHandle, Storage, WriteStream, join, parent
from ckptlib.backends.retry import deadline_scope

__all__ = [
    "Entry", "ReadHandle", "Storage", "WriteStream", "check_url", "deadline_scope", "join",
    "open_storage", "parent", "split_url",
]


def open_storage(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
    """A storage rooted at ``url``: a local path (a leading ``~`` or ``~user`` is the home folder,
    as in fsspec and the shell) or ``file://`` URL (POSIX), ``s3://bucket/prefix``
    (:class:`~ckptlib.backends.s3.S3Storage`, ``storage_options`` go to s3fs), or any other
    fsspec URL (``memory://``, ...)."""
    url = os.fspath(url)
    _not_empty(url)
    check_url(url)
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


def split_url(url: str | os.PathLike[str]) -> tuple[str, str]:
    """``(parent URL, name)`` of a URL or local path (local paths made absolute, ``~`` expanded, a
    symlink replaced by what it points to): what
    ``ckptlib.load`` opens a storage on (the parent) and reads (the name). ``api.split_url``."""
    _not_empty(os.fspath(url))
    url = os.fspath(url).rstrip("/")
    check_url(url)  # "s3:/bucket" is a usage error, never a local folder named "s3:"
    if "://" in url:
        scheme, rest = url.split("://", 1)
        parent, _, name = rest.rpartition("/")
        return f"{scheme}://{parent}", name
    url = os.path.abspath(os.path.expanduser(url))  # "~/ckpt": the home folder, as PosixStorage
    if os.path.islink(url):  # a link naming a checkpoint folder stands for the folder, as a linked root does
        url = os.path.realpath(url)
    return os.path.dirname(url), os.path.basename(url)


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(.*)$", re.S)


def _not_empty(url: str) -> None:
    """Refuse an empty path (it would mean the current folder): :func:`open_storage`,
    :func:`split_url`."""
    if not url.strip():
        raise ValueError("empty path or URL: pass a checkpoint folder, a run root or a URL (use '.' for the "
                         "current folder)")


def _edits(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions) between two short names."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def check_url(url: str) -> None:
    """Refuse a URL whose scheme is unknown (``s4://b``) or malformed (``s3:/b``, ``s3:b``) with
    a ``ValueError`` that says what was probably meant, instead of writing to a local folder
    named ``s3:``. Called by :func:`open_storage` before anything is opened."""
    m = _SCHEME.match(url)
    if m is None or "::" in url:  # a plain path, or a chained fsspec URL (simplecache::s3://...)
        return
    import fsspec

    known = {*fsspec.available_protocols(), "local"}
    scheme, rest = m.group(1), m.group(2)
    if rest.startswith("//"):
        if scheme not in known:
            close = [k for k in difflib.get_close_matches(scheme, sorted(known), n=3, cutoff=0.5)
                     if _edits(scheme, k) <= max(1, len(scheme) // 3)][:1]  # "foo" is not "root"
            hint = f"; did you mean {close[0]}://{rest[2:]}?" if close else ""
            raise ValueError(f"unknown URL scheme {scheme!r} in {url!r}{hint}")
    elif scheme.lower() in known:
        # file:/abs means the absolute path: file:///abs (file://abs would be the relative "abs")
        local = scheme.lower() in ("file", "local") and rest.startswith("/")
        raise ValueError(f"{url!r} is not a valid URL (a scheme needs '://'); did you mean "
                         f"{scheme}://{rest if local else rest.lstrip('/')}?")
