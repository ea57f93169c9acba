"""Runs doc examples for ``tests/test_docs_examples.py``.

Called by the test as ``python docs_runner.py JOBS.json``: a list of pages, each
``{"blocks": [{"id", "code", "dir"}], "results": PATH, "s3": bool, "timeout": seconds}``.
This process imports torch and ckptlib once, then forks one child per page, in order, so
every page runs in a fresh process without paying for those imports again; the child runs
the page's blocks in order, each in its own globals and its own folder, and writes ``results``
(a JSON list of ``{"id", "ok", "error"}``; a block that raises, or exits with a code other
than 0, is recorded with its traceback and the next block still runs), then exits as a script
does (so a thread a block left running shows as a page that never ends). A child still alive
``timeout`` seconds after its start is killed by PID and its page recorded as timed out.
Before a page marked ``s3``, the moto server at ``AWS_ENDPOINT_URL`` is emptied and given the
buckets in ``CKPTLIB_DOCS_BUCKETS``. The parent writes ``JOBS.json.exits``: each page's exit.

A multi-rank block runs as ``python docs_runner.py BLOCKS.json RESULTS`` on every rank
(started through tests/launcher.py), writing ``RESULTS.<rank>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path


def run_block(block: dict) -> dict:
    """Run one block (``{"id", "code", "dir"}``) in ``dir``; say whether it raised."""
    here = os.getcwd()
    folder = Path(block["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)
    print(f"--- {block['id']}", flush=True)
    try:
        exec(compile(block["code"], block["id"], "exec"), {"__name__": "__main__"})
    except SystemExit as e:  # a script's normal end (a preemption exit): ok when its code is 0
        print(f"[exit {e.code}]", flush=True)
        if e.code not in (0, None):
            return {"id": block["id"], "ok": False, "error": f"SystemExit({e.code!r})"}
    except BaseException:
        return {"id": block["id"], "ok": False, "error": traceback.format_exc(limit=-8)}
    finally:
        sys.stdout.flush()
        os.chdir(here)
    return {"id": block["id"], "ok": True, "error": ""}


def run_blocks(blocks: list[dict], out: Path) -> None:
    """Run ``blocks`` in order; write their results to ``out``."""
    results = [run_block(b) for b in blocks]
    with contextlib.suppress(Exception):  # a block that left a process group behind
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    out.write_text(json.dumps(results))


def empty_s3() -> None:
    """Empty (or create) the buckets ``CKPTLIB_DOCS_BUCKETS`` on the moto server at
    ``AWS_ENDPOINT_URL``, and nothing else: every moto server in the pytest process shares one
    store, so a reset (``/moto-api/reset``) also deleted the session's own test bucket, and the
    S3 tests that ran after this one failed with "bucket does not exist"."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    have = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    for name in os.environ["CKPTLIB_DOCS_BUCKETS"].split(","):
        if name not in have:
            s3.create_bucket(Bucket=name)
            continue
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=name, Delete={"Objects": keys})
        for up in s3.list_multipart_uploads(Bucket=name).get("Uploads", []):
            s3.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])


def wait_child(pid: int, timeout: float) -> int | str:
    """The child's exit code (negative: killed by that signal), or ``"timeout"`` once it was
    still running ``timeout`` seconds after this call (it is then killed)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "timeout"


def run_pages(jobs_path: Path) -> None:
    """Fork one child per page of ``jobs_path``, one at a time; record each child's exit."""
    import torch  # noqa: F401  (imported once, before the forks)

    import ckptlib  # noqa: F401

    exits = {}
    for job in json.loads(jobs_path.read_text()):
        if job["s3"]:
            empty_s3()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the page's own process: ends as a script ends
            code = 0
            try:
                run_blocks(job["blocks"], Path(job["results"]))
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.exit(code)
        began = time.monotonic()
        exits[job["results"]] = wait_child(pid, job["timeout"])
        print(f"[page {job['results']}: {time.monotonic() - began:.1f}s]", flush=True)
    Path(f"{jobs_path}.exits").write_text(json.dumps(exits))


def main(argv: list[str]) -> int:
    if len(argv) == 1:
        run_pages(Path(argv[0]))
        return 0
    rank = os.environ["RANK"]
    run_blocks(json.loads(Path(argv[0]).read_text()), Path(f"{argv[1]}.{rank}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
