"""Fault tests: injected S3 errors at a steady rate, stalls, a server killed mid-upload, and
fsspec/POSIX faults (failed, truncated and slow calls, stale listings, delayed visibility).

Every fault is checked to have fired (the fault wrappers' ``verify`` and the proxy's
``injected`` counters). Every wait has a deadline; no test asserts on timing.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import fsspec
import pytest
import torch

import ckptlib
from backends.conftest import S3_BUCKET, s3_root
from backends.servers import SeaweedServer, weed_binary
from backends.test_s3 import assert_state_equal, make_state, zeros_like_state
from ckptlib.backends import open_storage
from ckptlib.backends.fsspec_store import FsspecStorage
from ckptlib.backends.posix import PosixStorage
from ckptlib.backends.retry import (
    RetryPolicy,
    StorageTimeoutError,
    call_sync,
    deadline_scope,
    is_transient,
)
from ckptlib.engine import retire
from ckptlib.engine.scan import read_manifest
from ckptlib.errors import (
    CheckpointNotFoundError,
    CommitError,
    CorruptCheckpointError,
    StorageError,
)
from ckptlib.format import layout
from ckptlib.testing.faults import Fault, FaultyFileSystem, FaultyStorage
from ckptlib.testing.proxy import FaultProxy

FAST_RETRY = {"backoff": 0.02, "backoff_max": 0.3}


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f}s")
        time.sleep(0.02)


# --------------------------------------------------------------------------- retry policy


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_retry_policy_transient_then_success():
    clock = FakeClock()
    policy = RetryPolicy(attempts=5, deadline=100, sleep=clock.sleep, clock=clock)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(104, "reset")
        return "ok"

    assert call_sync(flaky, "op", policy) == "ok"
    assert len(calls) == 3


def test_retry_policy_fatal_is_not_retried():
    clock = FakeClock()
    policy = RetryPolicy(attempts=5, deadline=100, sleep=clock.sleep, clock=clock)
    calls = []

    def denied():
        calls.append(1)
        raise PermissionError(13, "denied")

    with pytest.raises(PermissionError):
        call_sync(denied, "op", policy)
    assert len(calls) == 1


def test_retry_policy_deadline_and_attempts():
    clock = FakeClock()
    policy = RetryPolicy(attempts=1000, deadline=10, backoff=1, backoff_max=4, sleep=clock.sleep, clock=clock)

    def down():
        clock.now += 0.5
        raise ConnectionRefusedError(111, "refused")

    with pytest.raises(StorageTimeoutError, match="gave up after"):
        call_sync(down, "op", policy)
    assert clock.now <= 10 + 0.5
    policy = RetryPolicy(attempts=3, deadline=1000, sleep=clock.sleep, clock=clock)
    with pytest.raises(StorageError, match="after 3 attempt"):
        call_sync(down, "op", policy)


def test_error_classification():
    class Client(Exception):
        def __init__(self, code, status):
            self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}

    assert is_transient(Client("SlowDown", 503)) and is_transient(Client("InternalError", 500))
    assert is_transient(ConnectionResetError()) and is_transient(TimeoutError())
    assert not is_transient(Client("AccessDenied", 403)) and not is_transient(Client("NoSuchBucket", 404))
    assert not is_transient(Client("PreconditionFailed", 412)) and not is_transient(ValueError())


def test_storage_doc_states_the_cleanup_budget_the_code_uses():
    """docs/storage.md said aborts get 30 s; the code gives them ``CLEANUP_DEADLINE``."""
    from pathlib import Path

    from ckptlib.backends.s3_upload import CLEANUP_ATTEMPT, CLEANUP_DEADLINE

    doc = " ".join((Path(__file__).parents[2] / "docs" / "storage.md").read_text().split())
    assert f"short budget ({CLEANUP_DEADLINE:.0f} s, {CLEANUP_ATTEMPT:.0f} s an attempt)" in doc


# --------------------------------------------------------------------------- S3 through the proxy


def test_s3_steady_errors_and_resets_saves_succeed(seaweed):
    """503 SlowDown, 500 and connection resets at a steady rate: every save commits within its
    retry budget and loads back exactly; no multipart upload is left behind."""
    url, _ = s3_root(seaweed)
    with FaultProxy(int(seaweed.endpoint.rsplit(":", 1)[1]), http=True) as proxy:
        proxy.add_http_fault("503", every=7)
        proxy.add_http_fault("500", every=11)
        proxy.add_http_fault("reset", every=13)
        opts = seaweed.storage_options(proxy.endpoint, ckptlib_part_size=5 << 20, ckptlib_retry=FAST_RETRY)
        with ckptlib.CheckpointManager(url, storage_options=opts, keep_last=2) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, make_state(step)).wait()
            target = zeros_like_state(make_state(0))
            assert mgr.restore(target) == 3
            assert_state_equal(target, make_state(3))
            assert mgr.storage.stats["retries"] > 0
        assert proxy.injected["503"] > 0 and proxy.injected["500"] > 0 and proxy.injected["reset"] > 0
    direct = open_storage(url, seaweed.storage_options())
    assert direct.list_uploads("") == []
    assert sorted(e.name for e in direct.listdir("")) == [layout.step_dir(2), layout.step_dir(3)]


def test_s3_failed_save_aborts_its_uploads(seaweed):
    """A part that keeps failing fails the save, and the save aborts its multipart uploads
    itself: nothing is left for a later cleanup."""
    url, _ = s3_root(seaweed)
    with FaultProxy(int(seaweed.endpoint.rsplit(":", 1)[1]), http=True) as proxy:
        proxy.add_http_fault("500", every=1, match=r"^PUT .*partNumber=2\b")
        retry = {**FAST_RETRY, "attempts": 3}
        opts = seaweed.storage_options(proxy.endpoint, ckptlib_part_size=5 << 20, ckptlib_retry=retry)
        with ckptlib.CheckpointManager(url, storage_options=opts, async_save=False) as mgr:
            with pytest.raises(CommitError, match="after 3 attempt"):
                mgr.save(1, make_state(1))
            assert mgr.latest_step() is None
        assert proxy.injected["500"] >= 3
    direct = open_storage(url, seaweed.storage_options())
    assert direct.list_uploads("") == []
    assert direct.listdir("") == []


def test_s3_stalled_upload_fails_in_bounded_time(seaweed):
    """A server that stops answering mid-upload fails the save with a timeout error; the
    previous checkpoint stays intact and the stale upload is cleaned up afterwards."""
    url, _ = s3_root(seaweed)
    retry = {**FAST_RETRY, "attempt_timeout": 1.0, "deadline": 3.0}
    with FaultProxy(int(seaweed.endpoint.rsplit(":", 1)[1])) as proxy:
        opts = seaweed.storage_options(proxy.endpoint, ckptlib_part_size=5 << 20, ckptlib_retry=retry)
        mgr = ckptlib.CheckpointManager(url, storage_options=opts, save_timeout=120)
        mgr.save(1, make_state(1)).wait()
        proxy.set_rate(8 << 20)
        start = proxy.bytes_up
        handle = mgr.save(2, make_state(2))
        wait_for(lambda: proxy.bytes_up - start > (3 << 20) or handle.done(), 60, "the upload to start")
        proxy.stall()
        with pytest.raises(CommitError) as info:
            handle.wait(timeout=150)
        assert "StorageTimeoutError" in str(info.value), info.value
        proxy.unstall()
        proxy.set_rate(None)
        target = zeros_like_state(make_state(0))
        assert mgr.restore(target) == 1
        assert_state_equal(target, make_state(1))
        mgr.close()
    direct = open_storage(url, seaweed.storage_options())
    retire.clean_debris(direct, now=time.time() + retire.DEFAULT_GRACE + 60)
    assert direct.list_uploads("") == []
    assert [e.name for e in direct.listdir("")] == [layout.step_dir(1)]


def test_s3_save_deadline_bounds_a_stalled_save(seaweed):
    """With generous per-operation budgets, the save's own deadline (a storage deadline scope
    around the save) still ends a stalled save, on every thread the save uses."""
    url, _ = s3_root(seaweed)
    retry = {**FAST_RETRY, "attempt_timeout": 120.0, "deadline": 240.0}
    with FaultProxy(int(seaweed.endpoint.rsplit(":", 1)[1])) as proxy:
        opts = seaweed.storage_options(proxy.endpoint, ckptlib_part_size=5 << 20, ckptlib_retry=retry)
        with ckptlib.CheckpointManager(url, storage_options=opts, async_save=False) as mgr:
            mgr.save(1, make_state(1))
            proxy.stall()
            with deadline_scope(mgr.storage, 3.0), pytest.raises(CommitError, match="save's deadline"):
                mgr.save(2, make_state(2))
            proxy.unstall()
            target = zeros_like_state(make_state(0))
            assert mgr.restore(target) == 1
            assert_state_equal(target, make_state(1))


def test_s3_create_whose_answer_was_lost_and_whose_check_failed_once_commits(seaweed):
    """The manifest's create-only put lands but its answer is lost (a reset after the server
    wrote it); the retry gets 412, and the GET comparing the bytes is reset once too. The save
    commits and restores bitwise (the failed GET counted as "not our bytes": the save failed
    with StepExistsError "committed by another save", its abort deleted its payloads, and the
    step it had committed was left corrupt)."""
    url, opts = s3_root(seaweed, ckptlib_retry=FAST_RETRY)
    manifest = f"{layout.step_dir(1)}/manifest.json"
    fired = {"put": 0, "get": 0}
    with ckptlib.CheckpointManager(url, storage_options=opts, async_save=False) as mgr:
        events = mgr.storage.client.meta.events
        sent: dict = {}

        def note_put(params, **_):
            sent.update(key=params.get("Key", ""), create=params.get("IfNoneMatch") == "*")

        def lose_answer(**_):  # after the server answered: the object is there
            if sent["create"] and sent["key"].endswith(manifest) and not fired["put"]:
                fired["put"] += 1
                raise ConnectionResetError("connection reset after the server wrote the object")

        def reset_get(params, **_):
            if fired["put"] and params.get("Key", "").endswith(manifest) and not fired["get"]:
                fired["get"] += 1
                raise ConnectionResetError("connection reset before the GET was sent")

        events.register("provide-client-params.s3.PutObject", note_put)
        events.register("after-call.s3.PutObject", lose_answer)
        events.register("provide-client-params.s3.GetObject", reset_get)
        state = make_state(1)
        mgr.save(1, state)
        assert fired == {"put": 1, "get": 1}
        assert [(i.step, i.status) for i in mgr.steps()] == [(1, "committed")]
        target = zeros_like_state(make_state(0))
        assert mgr.restore(target) == 1
        assert_state_equal(target, state)


def test_s3_create_that_landed_but_ran_out_of_attempts_never_leaves_a_corrupt_step(seaweed):
    """The manifest's create-only put lands but its answer is lost, and every retry is reset
    until the attempts run out. Step 1: the manifest is read back, so the save commits (it was
    reported failed, its abort deleted its payloads, and the step left was corrupt). Step 2:
    the read-back fails too: the save raises CommitUnknownError (never "failed" for a step that
    may be committed), its payloads are kept, and the step the landed manifest commits restores
    bitwise (never a manifest without its payloads)."""
    url, opts = s3_root(seaweed, ckptlib_retry={**FAST_RETRY, "attempts": 3})
    with ckptlib.CheckpointManager(url, storage_options=opts, async_save=False) as mgr:
        events = mgr.storage.client.meta.events
        fault = {"manifest": "", "puts": 0, "gets": False, "reads_fail": False}
        sent: dict = {}

        def reset_put(params, **_):
            sent.update(key=params.get("Key", ""), create=params.get("IfNoneMatch") == "*")
            if fault["puts"] and sent["create"] and sent["key"].endswith(fault["manifest"]):
                fault["puts"] += 1
                raise ConnectionResetError("connection reset")

        def lose_answer(**_):  # the first create lands; its answer is lost
            if not fault["puts"] and sent["create"] and sent["key"].endswith(fault["manifest"]):
                fault["puts"] += 1
                fault["gets"] = fault["reads_fail"]  # from now on, reads of the manifest fail too
                raise ConnectionResetError("connection reset after the server wrote the object")

        def reset_get(params, **_):
            if fault["gets"] and params.get("Key", "").endswith(fault["manifest"]):
                raise ConnectionResetError("connection reset")

        events.register("provide-client-params.s3.PutObject", reset_put)
        events.register("after-call.s3.PutObject", lose_answer)
        events.register("provide-client-params.s3.GetObject", reset_get)
        events.register("provide-client-params.s3.HeadObject", reset_get)
        fault["manifest"] = f"{layout.step_dir(1)}/manifest.json"
        mgr.save(1, make_state(1))
        assert fault["puts"] == 3
        fault.update(manifest=f"{layout.step_dir(2)}/manifest.json", puts=0, reads_fail=True)
        with pytest.raises(ckptlib.CommitUnknownError, match="after 3 attempt") as err:
            mgr.save(2, make_state(2))  # not "failed": the step it may have committed is restored below
        assert "may or may not be committed" in str(err.value), err.value
        assert fault["puts"] == 3
        fault.update(manifest="-", gets=False)
        assert [(i.step, i.status) for i in mgr.steps()] == [(1, "committed"), (2, "committed")]
        for step in (2, 1):
            target = zeros_like_state(make_state(0))
            assert mgr.restore(target, step=step) == step
            assert_state_equal(target, make_state(step))


def test_s3_put_verify_manifest_put_that_landed_but_ran_out_of_attempts_commits(moto_s3):
    """``ckptlib_conditional_put=False``: the manifest's plain put lands but its answer is
    lost, and every retry is reset until the attempts run out. The manifest is read back and the
    save commits (it was reported failed, its abort deleted its payloads, and the step that
    the landed manifest made visible was corrupt)."""
    url, opts = s3_root(moto_s3, ckptlib_conditional_put=False, ckptlib_retry={**FAST_RETRY, "attempts": 3})
    manifest = f"{layout.step_dir(1)}/manifest.json"
    puts = [0]
    with ckptlib.CheckpointManager(url, storage_options=opts, async_save=False) as mgr:
        events = mgr.storage.client.meta.events
        sent: dict = {}

        def reset_put(params, **_):
            sent["key"] = params.get("Key", "")
            if puts[0] and sent["key"].endswith(manifest):
                puts[0] += 1
                raise ConnectionResetError("connection reset")

        def lose_answer(**_):
            if not puts[0] and sent["key"].endswith(manifest):
                puts[0] += 1
                raise ConnectionResetError("connection reset after the server wrote the object")

        events.register("provide-client-params.s3.PutObject", reset_put)
        events.register("after-call.s3.PutObject", lose_answer)
        mgr.save(1, make_state(1))
        assert puts[0] == 3
        assert [(i.step, i.status) for i in mgr.steps()] == [(1, "committed")]
        target = zeros_like_state(make_state(0))
        assert mgr.restore(target) == 1
        assert_state_equal(target, make_state(1))


def test_s3_batch_delete_refusing_keys_with_slowdown_is_retried(moto_s3):
    """DeleteObjects answers 200 but refuses some keys with ``SlowDown`` (S3 does under load):
    the batch is sent again and the step is gone (retention and debris clean-up failed with
    "object(s) not deleted" and left the objects until a later save)."""
    url, opts = s3_root(moto_s3, ckptlib_retry=FAST_RETRY)
    with ckptlib.CheckpointManager(url, storage_options=opts, async_save=False) as mgr:
        mgr.save(1, {f"t{i}": torch.full((8,), float(i)) for i in range(3)})
    storage = open_storage(url, opts)
    step = layout.step_dir(1)
    refused = [0]

    def slow_down(parsed, **_):  # the server deleted every key; the answer says some were refused
        if not refused[0]:
            parsed["Errors"] = [{"Key": f"{step}/manifest.json", "Code": "SlowDown",
                                 "Message": "Please reduce your request rate."}]
            refused[0] += 1

    storage.client.meta.events.register("after-call.s3.DeleteObjects", slow_down)
    storage.delete_tree(step)
    assert refused[0] == 1 and storage.stats["retries"] >= 1
    assert not storage.exists(step)


@pytest.mark.skipif(weed_binary() is None, reason="SeaweedFS `weed` binary not installed")
def test_s3_server_killed_mid_upload(tmp_path):
    """SIGKILL the S3 server while a save uploads: the save fails within its deadline, the
    previous checkpoint restores exactly once the server is back, and cleanup leaves no
    incomplete multipart upload."""
    server = SeaweedServer(tmp_path / "weed").start()
    try:
        server.create_bucket(S3_BUCKET)
        url = f"s3://{S3_BUCKET}/killed-{uuid.uuid4().hex[:8]}"
        retry = {**FAST_RETRY, "attempt_timeout": 2.0, "deadline": 5.0}
        with FaultProxy(server.ports["s3.port"]) as proxy:
            opts = server.storage_options(proxy.endpoint, ckptlib_part_size=5 << 20, ckptlib_retry=retry)
            mgr = ckptlib.CheckpointManager(url, storage_options=opts, save_timeout=120)
            mgr.save(1, make_state(1)).wait()
            proxy.set_rate(6 << 20)  # slow enough that the kill lands mid-upload
            start = proxy.bytes_up
            handle = mgr.save(2, make_state(2, big=6 << 20))
            wait_for(lambda: proxy.bytes_up - start > (6 << 20) or handle.done(), 60, "the upload to start")
            assert not handle.done()
            server.kill()
            with pytest.raises(CommitError):
                handle.wait(timeout=150)
            mgr.close()
        server.start()
        opts = server.storage_options(ckptlib_part_size=5 << 20)
        with ckptlib.CheckpointManager(url, storage_options=opts) as mgr:
            target = zeros_like_state(make_state(0))
            assert mgr.restore(target) == 1
            assert_state_equal(target, make_state(1))
            assert [i.step for i in mgr.steps() if i.status == "committed"] == [1]
            storage = mgr.storage
            retire.clean_debris(storage, now=time.time() + retire.DEFAULT_GRACE + 60)
            assert storage.list_uploads("") == []
            assert [e.name for e in storage.listdir("")] == [layout.step_dir(1)]
    finally:
        server.kill()


# --------------------------------------------------------------------------- fsspec wrapper


def faulty_memory(faults) -> tuple[FsspecStorage, FaultyFileSystem]:
    ffs = FaultyFileSystem(fsspec.filesystem("memory"), faults)
    root = f"memory://faulty-{uuid.uuid4().hex}"
    return FsspecStorage(root, fs=ffs), ffs


def manager_on(storage, **kw) -> ckptlib.CheckpointManager:
    mgr = ckptlib.CheckpointManager(storage.url, async_save=False, **kw)
    mgr.storage = storage  # the same root, seen through the fault wrapper
    return mgr


def test_fsspec_failed_put_keeps_previous():
    storage, ffs = faulty_memory([Fault("pipe_file", "*/step-000000000002/*.bin", kind="error", calls=(1,))])
    with ffs, manager_on(storage) as mgr:
        mgr.save(1, make_state(1, big=1 << 16))
        with pytest.raises(CommitError, match="injected fault"):
            mgr.save(2, make_state(2, big=1 << 16))
        target = zeros_like_state(make_state(0, big=1 << 16))
        assert mgr.restore(target) == 1
        assert_state_equal(target, make_state(1, big=1 << 16))


def test_fsspec_truncated_write_is_detected():
    storage, ffs = faulty_memory([Fault("pipe_file", "*/step-000000000002/*-0.bin", kind="truncate", keep=100)])
    with ffs, manager_on(storage) as mgr:
        mgr.save(1, make_state(1, big=1 << 16))
        mgr.save(2, make_state(2, big=1 << 16))  # the store said yes, but kept 100 bytes
        status = {i.step: i.status for i in mgr.steps()}
        assert status == {1: "committed", 2: "corrupt"}
        target = zeros_like_state(make_state(0, big=1 << 16))
        assert mgr.restore(target) == 1
        assert_state_equal(target, make_state(1, big=1 << 16))


def test_fsspec_slow_reads_still_exact():
    storage, ffs = faulty_memory([Fault("cat_file", "*.bin", kind="slow", delay=0.01, every=2)])
    with ffs, manager_on(storage) as mgr:
        mgr.save(1, make_state(1, big=1 << 16))
        target = zeros_like_state(make_state(0, big=1 << 16))
        assert mgr.restore(target) == 1
        assert_state_equal(target, make_state(1, big=1 << 16))


def test_fsspec_stale_listing_gives_an_older_consistent_step():
    storage, ffs = faulty_memory([])
    with ffs, manager_on(storage) as mgr:
        mgr.save(1, make_state(1, big=1 << 16))
        root = storage.base
        ffs.injector.add(Fault("ls", root, kind="stale_listing", calls=None))
        assert mgr.latest_step() == 1  # the listing is captured here
        mgr.save(2, make_state(2, big=1 << 16))
        assert mgr.latest_step() == 1  # step 2 is committed, but the listing does not show it
        target = zeros_like_state(make_state(0, big=1 << 16))
        assert mgr.restore(target) == 1
        assert_state_equal(target, make_state(1, big=1 << 16))


def test_fsspec_delayed_visibility_never_half_a_step():
    storage, ffs = faulty_memory([Fault("pipe_file", "*/step-000000000002/manifest.json",
                                        kind="delay_visibility", hidden_for=10_000)])
    with ffs, manager_on(storage) as mgr:
        mgr.save(1, make_state(1, big=1 << 16))
        mgr.save(2, make_state(2, big=1 << 16))
        status = {i.step: i.status for i in mgr.steps()}
        assert status == {1: "committed", 2: "incomplete"}
        target = zeros_like_state(make_state(0, big=1 << 16))
        assert mgr.restore(target) == 1
        assert_state_equal(target, make_state(1, big=1 << 16))


def test_unfired_fault_fails_the_test():
    storage, ffs = faulty_memory([Fault("rm_file", "never/*", kind="error")])
    storage.put_atomic("x", b"1")
    with pytest.raises(AssertionError, match="never fired"):
        ffs.verify()
    wrapped = FaultyStorage(storage, [Fault("rename", "*", kind="error")])
    with pytest.raises(AssertionError, match="never fired"), wrapped:
        wrapped.put_atomic("y", b"2")
    # A fault for another rank never fires in this (rank 0) process.
    other = FaultyStorage(storage, [Fault("put_atomic", "*", kind="error", rank=1)])
    other.put_atomic("z", b"3")
    with pytest.raises(AssertionError, match="never fired"):
        other.verify()
    mine = FaultyStorage(storage, [Fault("put_atomic", "*", kind="error", rank=0)])
    with mine, pytest.raises(StorageError, match="injected fault"):
        mine.put_atomic("z", b"3")


# --------------------------------------------------------------------------- POSIX (PFS behaviour)


def _posix_ckpt(tmp_path, steps=(1, 2)) -> str:
    root = str(tmp_path / "ckpt")
    with ckptlib.CheckpointManager(root, async_save=False) as mgr:
        for s in steps:
            mgr.save(s, make_state(s, big=1 << 16))
    return root


def test_posix_manifest_appears_late(tmp_path):
    """A manifest that another node's write makes visible only later is waited for (bounded)."""
    root = _posix_ckpt(tmp_path, steps=(1,))
    folder = layout.step_dir(1)
    real = os.path.join(root, folder, "manifest.json")
    hidden = real + ".not-yet"
    os.rename(real, hidden)
    with pytest.raises(CheckpointNotFoundError):
        read_manifest(PosixStorage(root, visibility_timeout=0), folder)
    timer = threading.Timer(0.3, os.rename, (hidden, real))
    timer.start()
    try:
        m = read_manifest(PosixStorage(root, visibility_timeout=30), folder)
    finally:
        timer.join(30)
    assert m.step == 1


def test_posix_short_read_is_retried_until_complete(tmp_path):
    path = tmp_path / "f.bin"
    data = os.urandom(1 << 20)
    path.write_bytes(data[:1000])
    s = PosixStorage(str(tmp_path), visibility_timeout=30)
    with s.open_read("f.bin") as h:
        def finish():
            with open(path, "ab") as f:
                f.write(data[1000:])

        timer = threading.Timer(0.3, finish)
        timer.start()
        try:
            buf = bytearray(len(data))
            h.read_into(0, memoryview(buf))
        finally:
            timer.join(30)
    assert bytes(buf) == data
    with PosixStorage(str(tmp_path), visibility_timeout=0.2).open_read("f.bin") as h2, pytest.raises(
        CorruptCheckpointError, match="shorter"
    ):
        h2.read(len(data) - 10, 20)


def test_posix_stale_listing(tmp_path):
    """Listings that lag (miss a new step, or still show a deleted one) never yield a bad step."""
    root = _posix_ckpt(tmp_path, steps=(1, 2))
    inner = PosixStorage(root)
    storage = FaultyStorage(inner, [Fault("listdir", "", kind="stale_listing", calls=None)])
    with storage, manager_on(storage) as mgr:
        assert mgr.latest_step() == 2  # listing captured: steps 1 and 2
        mgr.save(3, make_state(3, big=1 << 16))
        inner.delete_tree(layout.step_dir(2))  # retention elsewhere removed step 2
        status = {i.step: i.status for i in mgr.steps()}
        assert status == {1: "committed", 2: "incomplete"}  # 3 unseen, 2 is a ghost
        target = zeros_like_state(make_state(0, big=1 << 16))
        assert mgr.restore(target) == 1
        assert_state_equal(target, make_state(1, big=1 << 16))


def test_posix_waiting_keeps_typed_errors(tmp_path):
    """With visibility retries on, a refused symlink is still CorruptCheckpointError at once,
    and a file that never appears is FileNotFoundError after the bounded wait."""
    (tmp_path / "real").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    s = PosixStorage(str(tmp_path), visibility_timeout=0.3)
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        s.open_read("link")
    with pytest.raises(FileNotFoundError):
        s.open_read("never")


def test_posix_visibility_default_by_mount_type(tmp_path):
    assert PosixStorage(str(tmp_path)).visibility_timeout in (0.0, 10.0)
    assert PosixStorage(str(tmp_path), visibility_timeout=3).visibility_timeout == 3.0
    assert open_storage(str(tmp_path), {"visibility_timeout": 2}).visibility_timeout == 2.0


