"""Fixtures for backend tests over the session's SeaweedFS and moto servers (tests/conftest.py).

Both listen on 127.0.0.1 only, on free ports, are waited for with a deadline, and are
stopped by PID when the session ends. S3 tests are skipped (with the reason) only when the
``weed`` binary is not installed.
"""

from __future__ import annotations

import uuid

import pytest

from backends.servers import S3_BUCKET
from ckptlib.backends import Storage, open_storage

S3_PART = 5 << 20  # the S3 minimum: small test states still exercise multipart uploads


def s3_root(server, **options) -> tuple[str, dict]:
    """A fresh, unique ``s3://`` root on ``server`` and its storage options."""
    url = f"s3://{S3_BUCKET}/t-{uuid.uuid4().hex[:12]}"
    opts = server.storage_options(ckptlib_part_size=S3_PART, **options)
    return url, opts


BACKENDS = ["memory", "posix", "s3", "s3-moto"]


def make_storage(kind: str, request, tmp_path) -> tuple[str, dict | None, Storage]:
    """``(url, storage_options, storage)`` for a fresh, empty root of backend ``kind``."""
    if kind == "memory":
        url, opts = f"memory://ckptlib-{uuid.uuid4().hex}", None
    elif kind == "posix":
        url, opts = str(tmp_path / "root"), None
    elif kind == "s3":
        url, opts = s3_root(request.getfixturevalue("seaweed"))
    elif kind == "s3-moto":
        url, opts = s3_root(request.getfixturevalue("moto_s3"))
    else:
        raise ValueError(kind)
    return url, opts, open_storage(url, opts)


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    """``(kind, url, storage_options, storage)`` for every backend in turn."""
    url, opts, storage = make_storage(request.param, request, tmp_path)
    storage.makedirs("")
    yield request.param, url, opts, storage
    storage.close()


@pytest.fixture
def storage(backend) -> Storage:
    return backend[3]
