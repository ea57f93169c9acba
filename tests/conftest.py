"""Shared fixtures."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def memory_url() -> str:
    """A fresh, unique memory:// root (the memory backend is process-global)."""
    return f"memory://ckptlib-test-{uuid.uuid4().hex}"
